"""A ps lost while the workers are between two steps: the forward pass's lookup of an embedding
table meets it, and the training session recovers there (the chief restores the shard that came
back empty) before the table asks again; no worker fails or restarts."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

import psflow

from .forked import Forked
from .support import ROOT, local_cluster, start_ps, stop, task_env

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

SCRIPT = ROOT / "tests" / "multiproc" / "scripts" / "table_pause.py"
STEPS = 60
PAUSE_AT = 20


def _worker(cluster: psflow.ClusterSpec, index: int, tmp: Path) -> Forked:
    # The killed ps is named at once (its lane hangs up, or the new one has no tables); the
    # timeout only bounds a request to a ps that is alive on a loaded machine.
    env = task_env(cluster, psflow.TaskSpec(job="worker", index=index), {"PSFLOW_TIMEOUT": "10"})
    args = ["--logdir", str(tmp / "run"), "--steps", str(STEPS), "--pause_at", str(PAUSE_AT)]
    return Forked(
        [str(SCRIPT), *args, "--go", str(tmp / "go")], env=env, output=tmp / f"worker-{index}.log"
    )


def test_a_lookup_that_meets_a_lost_ps_recovers_and_asks_again(tmp_path: Path) -> None:
    cluster = local_cluster(2, 2)  # the table's rows on both shards
    ps = [start_ps(cluster, i) for i in range(2)]
    workers = [_worker(cluster, i, tmp_path) for i in range(2)]
    restarted = None
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    try:
        paused = [tmp_path / f"go.paused-{i}" for i in range(2)]
        deadline = time.monotonic() + 150
        while not all(p.exists() for p in paused):
            ended = [w for w in [*ps, *workers] if w.poll() is not None]
            assert not ended and time.monotonic() < deadline, "\n".join(
                f"--- worker:{i}:\n{log.read_text()[-1500:]}" for i, log in enumerate(logs)
            )
            time.sleep(0.02)
        # Both workers wait after step PAUSE_AT (the chief's checkpoint of it written): ps:1
        # dies and comes back empty, as a pod its cluster manager restarts.
        ps[1].send_signal(signal.SIGKILL)
        ps[1].wait(10)
        restarted = start_ps(cluster, 1)
        (tmp_path / "go").touch()
        for w in workers:
            w.wait(200)
        texts = [log.read_text() for log in logs]
        for i, (w, text) in enumerate(zip(workers, texts, strict=True)):
            assert w.returncode == 0, text[-3000:]
            last = text.strip().splitlines()[-1]
            assert last.startswith(f"worker:{i} done step="), text[-1500:]
            assert int(last.split("=")[1]) >= STEPS
        # The chief's first request after the pause is its forward pass's lookup, which finds
        # ps:1 empty (or its lane hung up): it recovers there, restoring the shard. The other
        # worker's lookup recovers too, or finds ps:1 restored already (through the socket,
        # which reconnects to the new ps) and trains on.
        assert "a table's lookup met a lost ps" in texts[0], texts[0][-3000:]
        assert "ps:1 came back empty: every shard restored from ckpt-" in texts[0], texts[0][-3000:]
        for p in (ps[0], restarted):
            code, err = stop(p)
            assert code == 0, err[-3000:]
    finally:
        for p in [*workers, *ps, *([restarted] if restarted else [])]:
            if p.poll() is None:
                p.kill()
            p.wait()
