"""Training modes with real worker processes: a killed worker, all-reduce vs synchronous ps."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import psflow
from psflow.transport import TransportConfig
from psflow.worker.client import ShardedClient

from .forked import Forked
from .support import PRELOAD, ROOT, local_cluster, start_ps, stop, worker_ctx

SCRIPT = str(ROOT / "tests" / "multiproc" / "scripts" / "sync_worker.py")


def _worker(
    cluster: psflow.ClusterSpec, index: int, args: list[str], env: dict[str, str]
) -> Forked:
    """``SCRIPT`` as worker ``index``, forked from the server that imported torch."""
    task = psflow.TaskSpec(job="worker", index=index)
    e = dict(os.environ, TF_CONFIG=cluster.to_tf_config(task), PYTHONUNBUFFERED="1", **env)
    return Forked([SCRIPT, *args], env=e)


def _result(out: str) -> dict:  # type: ignore[type-arg]
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, out[-2000:]
    return json.loads(lines[-1][len("RESULT ") :])  # type: ignore[no-any-return]


def test_one_backup_worker_killing_a_worker_mid_run_does_not_stop_training(tmp_path: Path) -> None:
    steps = 25
    cluster = local_cluster(1, 3)
    # Serving on after the others finished (probed below): worker:1 is not declared dead.
    ps = start_ps(cluster, env={"PSFLOW_WORKER_TIMEOUT": "600"})
    # The barrier keeps worker:1 from starting so late that the other two have finished without it.
    env = {"SYNC_WORKER_BARRIER": f"{tmp_path}:3"}
    args = [str(steps), "kill_at=worker:1@7", "mode=sync", "replicas_to_aggregate=2"]
    args.append("sync_timeout=20.0")
    procs = [_worker(cluster, i, args, env) for i in range(3)]
    try:
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=90)
            outs.append((p.returncode, out, err))
        assert outs[1][0] == -9, outs[1][2][-2000:]  # killed itself at step 7 or later
        killed_at = int(re.findall(r"KILLED AT (\d+)", outs[1][2])[-1])
        assert killed_at < steps - 1
        for code, out, err in (outs[0], outs[2]):
            assert code == 0, err[-3000:]
            r = _result(out)
            assert r["step"] == steps
            assert r["eval_last"] < 0.8 * r["eval_first"]  # still learning
        probe = ShardedClient(worker_ctx(cluster, 0), TransportConfig(timeout=10))
        try:
            status = probe.sync_status()
        finally:
            probe.close()
        assert status["step"] == steps
        late = [ws for s, ws in status["decisions"] if s >= killed_at + 1]
        assert late and all(sorted(ws) == ["worker:0", "worker:2"] for ws in late)
        assert "worker:1" not in status["finished"]
        assert ps.poll() is None  # still serving: worker:1 never said it finished
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        ps.kill()
        stop(ps)


def _launch(mode: str, workers: int, steps: int, extra: list[str]) -> list[dict]:  # type: ignore[type-arg]
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--workers", str(workers), "--mode", mode]
    cmd += ["--preload", PRELOAD]
    proc = subprocess.run(
        [*cmd, *extra, SCRIPT, str(steps)], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        task, _, rest = line.partition("] ")
        if rest.startswith("RESULT "):
            results[task.lstrip("[")] = json.loads(rest[len("RESULT ") :])
    assert sorted(results) == [f"worker:{i}" for i in range(workers)], proc.stdout[-2000:]
    return [results[f"worker:{i}"] for i in range(workers)]


def test_allreduce_equals_synchronous_ps_mode() -> None:
    steps = 20
    allreduce = _launch("allreduce", 2, steps, [])
    sync = _launch("sync", 2, steps, ["--ps", "1"])
    for r in allreduce:
        assert r["stats"]["mode"] == "allreduce" and r["stats"]["backend"] == "gloo"
        assert r["step"] == steps
        assert r["eval_last"] < r["eval_first"]
    assert allreduce[0]["params"] == allreduce[1]["params"]  # the ranks stay identical
    assert sync[0]["params"] == sync[1]["params"]
    for name, want in sync[0]["params"].items():
        got = allreduce[0]["params"][name]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-12 * max(
            1.0, max(abs(v) for v in want)
        ), name
