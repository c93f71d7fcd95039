"""``psflow launch`` is secure by default: each job gets fresh CurveZMQ keys, which no other
process on the host holds."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import psflow
from psflow.transport import CurveKeys, PeerTimeoutError, TransportConfig
from psflow.worker.client import ShardedClient

from .support import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

SCRIPT = ROOT / "tests" / "multiproc" / "scripts" / "keys_probe.py"


def _probe_line(proc: subprocess.Popen[str]) -> dict[str, str | None]:
    """The worker's PROBE line, read from the launcher's output as it comes."""
    assert proc.stdout is not None
    for line in proc.stdout:
        _, _, rest = line.partition("] ")
        if rest.startswith("PROBE "):
            return json.loads(rest[len("PROBE ") :])  # type: ignore[no-any-return]
    raise AssertionError(f"no PROBE line; the launcher exited with {proc.wait()}")


def _client(ps: str, keys: CurveKeys | None, *, timeout: float) -> ShardedClient:
    cluster = psflow.ClusterSpec(jobs={"ps": [ps], "worker": ["127.0.0.1:1"]})
    ctx = psflow.TaskContext(cluster=cluster, task=psflow.TaskSpec(job="worker", index=0))
    return ShardedClient(ctx, TransportConfig(timeout=timeout, keys=keys, shared_memory=False))


def test_a_default_launch_job_cannot_be_reached_without_its_keys(tmp_path: Path) -> None:
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if k != "PSFLOW_KEYS_DIR"}
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--workers", "1"]
    proc = subprocess.Popen(
        [*cmd, str(SCRIPT), str(go)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        probe = _probe_line(proc)
        ps = probe["ps"]
        assert ps is not None
        outsider = _client(ps, None, timeout=2)
        try:
            keys_dir = probe["keys"]
            assert keys_dir is not None
            assert stat.S_IMODE(os.stat(keys_dir).st_mode) == 0o700
            # The job's ps answers a holder of the job's keys (it is up, and serving)...
            insider = _client(ps, CurveKeys.load(keys_dir), timeout=30)
            try:
                assert insider.status()[0]["initialized"]
            finally:
                insider.close()
            # ... and never a process without them.
            with pytest.raises(PeerTimeoutError, match="ps:0"):
                outsider.status()
        finally:
            outsider.close()
    finally:
        go.touch()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert not os.path.exists(keys_dir), "the job's keys outlived it"
