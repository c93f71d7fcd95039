"""``psflow launch --backend ray`` on a real Ray cluster of two nodes on this machine.

One module-scoped cluster serves every test: a head (``ray start --head --block``) and a second
node (``ray start --address --block``), each on its own loopback address (127.0.0.2, 127.0.0.3:
Ray turns 127.0.0.1 into the machine's outward address, which a second node would then dial, and
127.0.0.1 with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` refuses a second node), every port chosen
free and outside Ray's worker range 10002-19999. They are started detached (not this process's
children: Ray's worker processes come and go) and stopped by the pids of their ``--block``
processes, never ``ray stop`` (which ends every Ray process on the machine); whatever they had
started and left is then killed by pid.

Jobs run as real ``psflow launch`` (and Python) processes driving the cluster: the linear
regression example across both nodes through the socket path (``PSFLOW_SHM=0``), a worker and
a ps killed mid-run (``tests/faults.py``) and restarted by Ray as ``psflow launch
--max-restarts`` restarts them, a stop by SIGTERM and a failed task's exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from psflow.cluster.ports import free_ports
from psflow.train import CheckpointDir
from tests.faults import FAULTS

from .support import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150)]

RAY = str(Path(sys.executable).with_name("ray"))
EXAMPLE = ROOT / "examples" / "linear_regression.py"
HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"
START_TIMEOUT = 90.0


@dataclass
class RayCluster:
    address: str
    pids: list[int]


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                for child in map(int, Path(f"/proc/{pid}/task/{tid}/children").read_text().split()):
                    out += [child, *_descendants(child)]
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _detached(cmd: list[str], log: Path) -> int:
    """Starts ``cmd`` in its own session, reparented away from this process; its pid."""
    line = " ".join(f"'{c}'" for c in cmd)
    out = subprocess.run(
        ["sh", "-c", f"setsid {line} >'{log}' 2>&1 </dev/null & echo $!"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(out.stdout.strip())


def _wait_for(log: Path, text: str, pid: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while text not in (log.read_text() if log.exists() else ""):
        assert _alive(pid), f"{log.name}: ray start exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{log.name}: not up:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def _stop(pids: list[int]) -> None:
    """SIGTERM to each ``--block`` process (it stops what it started), then SIGKILL, by pid, to
    anything of theirs still there."""
    everything = {p: _descendants(p) for p in pids}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    for pid in [p for ps in everything.values() for p in ps] + pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    d = tmp_path_factory.mktemp("ray")
    # Ray's sockets live under its temp dir, and a Unix socket's path may not pass 107 bytes.
    short = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    port, client, dash, agent1, agent2 = free_ports(5, HEAD_IP)
    common = ["--num-cpus", "2", "--disable-usage-stats", "--object-store-memory", "100000000"]
    head = [
        RAY, "start", "--head", "--block", "--node-ip-address", HEAD_IP, "--port", str(port),
        "--include-dashboard=false", "--dashboard-port", str(dash), "--temp-dir", str(short),
        "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent1),
        *common,
    ]  # fmt: skip
    pids: list[int] = []
    try:
        pids.append(_detached(head, d / "head.log"))
        _wait_for(d / "head.log", "Ray runtime started", pids[0])
        node = [
            RAY, "start", "--block", "--address", f"{HEAD_IP}:{port}", "--node-ip-address",
            NODE_IP, "--dashboard-agent-listen-port", str(agent2), *common,
        ]  # fmt: skip
        pids.append(_detached(node, d / "node.log"))
        _wait_for(d / "node.log", "Ray runtime started", pids[1])
        yield RayCluster(address=f"{HEAD_IP}:{port}", pids=pids)
    finally:
        _stop(list(reversed(pids)))
        shutil.rmtree(short, ignore_errors=True)


def _launch(
    cluster: RayCluster, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--backend", "ray"]
    return subprocess.run(
        [*cmd, "--address", cluster.address, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PSFLOW_SHM": "0", **(env or {})},
        cwd=ROOT,
    )


def _result(stdout: str) -> tuple[float, float]:
    m = re.search(r"^\[worker:0\] W=(\S+) b=(\S+)$", stdout, re.M)
    assert m, stdout[-2000:]
    return float(m.group(1)), float(m.group(2))


def _hosts(err: str, tasks: int) -> set[str]:
    """The node addresses the job's tasks listen on, from the launcher's first line."""
    m = re.search(rf"{tasks} tasks as Ray actors \(SPREAD\): (.*)", err)
    assert m, err[-3000:]
    return set(re.findall(r"(\d+\.\d+\.\d+\.\d+):\d+", m.group(1)))


def test_linear_regression_across_both_nodes_survives_a_killed_ps_and_worker(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """The linear-regression example on both nodes through the socket path; its ps and a worker
    are SIGKILLed mid-run and Ray restarts them as psflow launch --max-restarts would."""
    faults = [
        *("--once", str(tmp_path / "faults")),
        # The ps after the checkpoint at 500 (the chief restores it), then a worker (it rejoins);
        # once that checkpoint is complete, however fast the steps run.
        *("--after-checkpoint", str(tmp_path / "run")),
        *("--kill-at", "ps:0@1000"),
        *("--kill-at", "worker:1@1500"),
    ]
    proc = _launch(
        ray_cluster,
        *("--ps", "1", "--workers", "2", "--max-restarts", "2", str(FAULTS), *faults),
        *(str(EXAMPLE), "--train_steps", "2500", "--lr", "0.01"),
        *("--save_checkpoint_steps", "500", "--logdir", str(tmp_path / "run")),
    )
    err = proc.stderr
    assert proc.returncode == 0, err[-5000:]
    assert _hosts(err, 3) == {HEAD_IP, NODE_IP}  # the tasks span both nodes
    # Each task's output comes back prefixed with its name, as psflow launch relays it.
    assert re.search(r"^\[ps:0\] INFO psflow.ps.server: ps:0 serving on ", err, re.M)
    restarted = re.findall(
        r"task (\S+) failed with signal 9; Ray restarts its actor with the same address and "
        r"TF_CONFIG \(restart (\d) of 2",
        err,
    )
    assert restarted == [("ps:0", "1"), ("worker:1", "2")], err[-5000:]
    assert re.search(r"ps:0 came back empty: every shard restored from ckpt-\d+\b", err), err[
        -4000:
    ]
    w, b = _result(proc.stdout)
    assert abs(w - 2.0) < 0.1 and abs(b - 0.3) < 0.1
    assert "job finished: 3 tasks exited 0" in err


def test_the_ctr_examples_smoke_run_across_both_nodes(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """examples/ctr.py (its hashed tables on the ps) on 2 ps and 2 workers, over both nodes."""
    data = tmp_path / "ctr"
    cmd = [sys.executable, "-m", "psflow.cli", "data", "synth-ctr", str(data)]
    cmd += ["--examples", "4000", "--test-examples", "1000", "--scale", "0.001"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    proc = _launch(
        ray_cluster,
        *("--ps", "2", "--workers", "2", str(ROOT / "examples" / "ctr.py")),
        *("--data", str(data), "--train_steps", "40", "--batch_size", "64"),
        *("--logdir", str(tmp_path / "run")),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _hosts(proc.stderr, 4) == {HEAD_IP, NODE_IP}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[worker:0] RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    result = json.loads(lines[0].split("RESULT ", 1)[1])
    assert result["global_step"] >= 40 and 0.0 <= result["test_auc"] <= 1.0, result
    saved = CheckpointDir(str(tmp_path / "run"))
    latest = saved.latest()
    assert latest is not None and int(latest.split("-")[1]) >= 40
    assert saved.manifest(latest).tables["embedding"]["rows"] > 0  # the table lived on the ps
    assert "job finished: 4 tasks exited 0" in proc.stderr


def test_python_call_stop_and_exit_status(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """The same launcher called from Python: SIGTERM stops every task, a second one kills them
    at once without waiting out the grace period (exit 143, as psflow launch gives), and a task
    failing with no restart left fails the job, named. Neither leaves the job's keys behind on a
    node (each actor's copy, in a private directory of its own: the driver once killed the
    actors before they removed them)."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it\n"
        "print('started', os.getpid(), os.environ['PSFLOW_KEYS_DIR'], flush=True)\n"
        "if len(sys.argv) > 1: sys.exit(int(sys.argv[1]))\n"
        "time.sleep(600)\n"
    )
    call = (
        "import sys\n"
        "from psflow.cluster.launch_config import LaunchConfig\n"
        "from psflow.cluster.ray_backend import RayLauncher, RayOptions\n"
        "config = LaunchConfig(script=sys.argv[1], args=sys.argv[3:], ps=1, workers=1)\n"
        "sys.exit(RayLauncher(config, RayOptions(address=sys.argv[2], strategy='PACK')).run())\n"
    )
    cmd = [sys.executable, "-c", call, str(script), ray_cluster.address]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    started: dict[str, int] = {}
    keys: list[str] = []
    while len(started) < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        m = re.fullmatch(r"\[(\S+)\] started (\d+) (\S+)\n", line)
        if m:
            started[m.group(1)] = int(m.group(2))
            keys.append(m.group(3))
    assert all(os.path.isdir(d) for d in keys), keys
    assert set(started) == {"ps:0", "worker:0"}
    proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    seen = ""
    while "received SIGTERM; stopping every task" not in seen:
        line = proc.stderr.readline()
        assert line, seen[-3000:]
        seen += line
    again = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the scripts ignore SIGTERM: the grace (30 s) would pass
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, (seen + err)[-3000:]
    assert "received SIGTERM again; killing every task now" in err
    assert time.monotonic() - again < 20
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in started.values()):  # the scripts themselves go too
        assert time.monotonic() < deadline, started
        time.sleep(0.05)
    assert not [d for d in keys if os.path.exists(d)], "the job's keys outlived it"

    failed = subprocess.run([*cmd, "3"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert re.search(
        r"task (ps:0|worker:0) failed with exit code 3; stopping the other tasks", failed.stderr
    )
    keys = re.findall(r"^\[\S+\] started \d+ (\S+)$", failed.stdout, re.M)
    assert keys and not [d for d in keys if os.path.exists(d)], (keys, failed.stdout[-3000:])


def test_an_address_that_does_not_answer_fails_within_the_ready_timeout() -> None:
    (port,) = free_ports(1)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "psflow.cli", "launch", "--backend", "ray", "--address",
         f"127.0.0.1:{port}", str(EXAMPLE)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PSFLOW_READY_TIMEOUT": "2"},
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"psflow launch: error: the Ray cluster at 127.0.0.1:{port} did not answer within 2 s "
        "(PSFLOW_READY_TIMEOUT): is its head running?"
    )
    assert time.monotonic() - started < 15


def test_a_job_the_cluster_cannot_place_fails_within_the_ready_timeout(
    ray_cluster: RayCluster,
) -> None:
    # Two nodes of 2 CPUs each: no bundle of 3 fits, whatever the strategy.
    proc = _launch(
        ray_cluster,
        *("--ps", "1", "--workers", "1", "--cpus-per-task", "3", str(EXAMPLE)),
        env={"PSFLOW_READY_TIMEOUT": "2"},
        timeout=60,
    )
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "psflow launch: error: Ray could not place the job's 2 tasks (CPU 3 each, SPREAD) "
        "within 2 s: the cluster has "
    ), line
