"""Worker liveness with real processes: a worker hung (SIGSTOP) or killed is noticed within
PSFLOW_WORKER_TIMEOUT, set small here through the environment (the fault as data)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import psflow
from psflow.protocol import Key, Op
from psflow.protocol.messages import HEARTBEATS_PER_TIMEOUT
from psflow.transport import PeerError, TransportConfig
from psflow.worker.client import ShardedClient

from .forked import Forked
from .support import ROOT, freeze, local_cluster, start_ps, stop, worker_ctx
from .sync_support import batch, loss_fn, make_model

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

SCRIPT = str(ROOT / "tests" / "multiproc" / "scripts" / "sync_worker.py")
TIMEOUT = 3.0
"""PSFLOW_WORKER_TIMEOUT of every task here: heartbeats every 0.6 s."""
BOUND = TIMEOUT + 30.0
"""An upper bound on noticing, generous for a loaded machine: what is asserted is the error."""


def _worker1(cluster: psflow.ClusterSpec, *args: str) -> Forked:
    """``SCRIPT`` as worker:1, forked from the server that imported torch."""
    task = psflow.TaskSpec(job="worker", index=1)
    env = dict(
        os.environ,
        TF_CONFIG=cluster.to_tf_config(task),
        PYTHONUNBUFFERED="1",
        PSFLOW_WORKER_TIMEOUT=str(TIMEOUT),
    )
    return Forked([SCRIPT, "1000000000", *args], env=env)


def _train(opt: psflow.DistributedOptimizer, model: object, until: int) -> None:
    while opt.global_step < until:
        x, y = batch(opt.global_step, 0, 4)
        opt.zero_grad()
        loss_fn(model, x, y).backward()  # type: ignore[arg-type]
        opt.step()


def _status(cluster: psflow.ClusterSpec) -> dict[str, object]:
    probe = ShardedClient(worker_ctx(cluster, 0), TransportConfig(timeout=10))
    try:
        return probe.sync_status()
    finally:
        probe.close()


def test_sync_without_backups_fails_the_waiting_worker_naming_the_hung_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PSFLOW_WORKER_TIMEOUT", str(TIMEOUT))
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster, env={"PSFLOW_WORKER_TIMEOUT": str(TIMEOUT)})
    other = _worker1(cluster, "mode=sync")
    model = make_model("mlp")
    try:
        with psflow.DistributedOptimizer(model, worker_ctx(cluster, 0), lr=0.1, mode="sync") as opt:
            _train(opt, model, 5)  # both workers push every step
            freeze(other.pid)
            start = time.monotonic()
            with pytest.raises(PeerError) as failed:
                _train(opt, model, 10**9)
            noticed = time.monotonic() - start
            assert "worker:1 is dead: ps:0 has not heard from it" in str(failed.value)
            assert "needs 2 gradients but only 1 worker(s) are alive" in str(failed.value)
            # The ps counts the silence from worker:1's last message, which came before the
            # freeze (by up to one heartbeat's interval): noticed that much before TIMEOUT at most.
            assert TIMEOUT - TIMEOUT / HEARTBEATS_PER_TIMEOUT <= noticed < BOUND, noticed
            assert _status(cluster)["finished"] == []
    finally:
        other.send_signal(signal.SIGCONT)
        other.kill()
        stop(other)
        ps.kill()
        stop(ps)


def test_bounded_staleness_goes_on_without_a_hung_or_dead_worker_and_the_ps_exits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PSFLOW_WORKER_TIMEOUT", str(TIMEOUT))
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster, env={"PSFLOW_WORKER_TIMEOUT": str(TIMEOUT)})
    other = _worker1(cluster, "mode=async", "max_staleness=2")
    model = make_model("mlp")
    try:
        with psflow.DistributedOptimizer(
            model, worker_ctx(cluster, 0), lr=0.01, max_staleness=2
        ) as opt:
            _train(opt, model, 20)
            # Hung: worker:0 is held at most until the ps declares worker:1 dead.
            freeze(other.pid)
            start = time.monotonic()
            _train(opt, model, opt.global_step + 50)
            assert time.monotonic() - start < BOUND
            status = _status(cluster)
            assert status[Key.CLOCKS]["laggards"] == ["worker:0"]  # type: ignore[index]
            # Resumed: it rejoins level with worker:0, and nobody waits for it to catch up.
            os.kill(other.pid, signal.SIGCONT)
            clock = status[Key.CLOCKS]["clocks"]["worker:1"]  # type: ignore[index]
            deadline = time.monotonic() + BOUND
            while _status(cluster)[Key.CLOCKS]["clocks"]["worker:1"] <= clock + 40:  # type: ignore[index]
                assert time.monotonic() < deadline, "worker:1 did not rejoin"
                _train(opt, model, opt.global_step + 1)
            # Killed: worker:0 trains on, and the ps exits after it without waiting.
            other.kill()
            _train(opt, model, opt.global_step + 50)
        code, err = stop(ps, timeout=BOUND)
        assert code == 0, err[-3000:]
        assert "worker:1 is dead" in err
        assert "worker:1, declared dead, is back: it rejoins" in err
        assert "exiting without worker:1 (dead)" in err
    finally:
        other.send_signal(signal.SIGCONT)
        other.kill()
        stop(other)
        ps.kill()
        stop(ps)


HUNG = """
import json, os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
if name == "worker:1":
    (out / "pid.tmp").write_text(str(os.getpid()))
    os.replace(out / "pid.tmp", out / "pid")  # whole, or not there: never read half-written
    os.kill(os.getpid(), signal.SIGSTOP)  # hung, until the launcher's stop
    time.sleep(60)
elif name == "worker:0":  # the chief ends the job once worker:1 hangs
    while not (out / "pid").exists():
        time.sleep(0.01)
    stat = Path(f"/proc/{(out / 'pid').read_text()}/stat")
    while stat.read_text().rsplit(") ", 1)[1][0] != "T":
        time.sleep(0.01)
"""


def test_the_launcher_stops_a_worker_still_hung_after_the_job_ended(tmp_path: Path) -> None:
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--insecure", "--ps-exit-timeout", "1"]
    proc = subprocess.run(
        [*cmd, "--grace", "5", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr  # the chief finished: the job succeeded
    assert (
        "worker:1 still running 1 s after the ps exited 0 (they declared it dead and ended the "
        "job without it): hung? stopping it; the job succeeded with its chief (worker:0 exited 0)"
    ) in proc.stderr
    assert "not gone" not in proc.stderr  # SIGCONT let it take SIGTERM: no SIGKILL needed


def test_the_heartbeat_goes_on_while_a_ps_is_down() -> None:
    from psflow.cluster.ports import free_ports
    from psflow.transport import Server
    from psflow.worker.heartbeat import Heartbeat

    live, down = (f"127.0.0.1:{p}" for p in free_ports(2))
    cluster = psflow.ClusterSpec(jobs={"ps": [down, live], "worker": ["127.0.0.1:1"]})
    config = TransportConfig(timeout=5)
    server = Server(live, config)
    beat = Heartbeat(worker_ctx(cluster, 0), config, interval=0.05).start()
    try:
        heard = 0
        deadline = time.monotonic() + BOUND
        while heard < 10:  # rounds go on past the ps that never answers
            assert time.monotonic() < deadline, f"{heard} heartbeats"
            request = server.recv(0.1)
            if request is not None:
                assert request.header[Key.OP] == "heartbeat"
                assert request.header[Key.TASK] == "worker:0"
                server.reply(request, {Key.OP: "ok"})
                heard += 1
    finally:
        beat.stop()
        server.close()


def test_a_finished_worker_that_speaks_again_rejoins() -> None:
    """A task that said done and is started again (``psflow launch --max-restarts``) asks
    again, and the ps must count it as live again: a synchronous step that needs its gradient
    failed otherwise ("only 1 worker(s) are alive and unfinished"), seen in a full run of the
    fault matrix. A heartbeat that its done overtook (heartbeats have sockets of their own)
    does not bring it back."""
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    config = TransportConfig(timeout=30)
    probe = ShardedClient(worker_ctx(cluster, 0), config)
    first = ShardedClient(worker_ctx(cluster, 1), config)
    again = None
    try:
        probe.wait_ready(60, initialized=False)
        first.wait_ready(60, initialized=False)
        first.done()
        assert probe.status()[0][Key.FINISHED] == ["worker:1"]
        first.call({0: {Key.OP: Op.HEARTBEAT}})  # late: still finished
        assert probe.status()[0][Key.FINISHED] == ["worker:1"]
        first.close()
        again = ShardedClient(worker_ctx(cluster, 1), config)  # the restarted task
        again.wait_ready(60, initialized=False)
        assert probe.status()[0][Key.FINISHED] == []
        probe.done()
        again.done()  # both finished: the ps exits by itself
        code, err = stop(ps, timeout=60)
        assert code == 0, err
        assert "ps:0: worker:1, finished, speaks again (restarted): it rejoins" in err
    finally:
        for c in (probe, first, again):
            if c is not None:
                c.close()
        ps.kill()
        stop(ps)


def test_a_worker_is_not_dead_while_the_ps_works_on_its_request() -> None:
    """The chief's init allocates the tables before the ps answers: seconds for a large one,
    longer than a short worker timeout. Meanwhile the chief waits for the answer and the other
    worker's requests wait in the queue: neither is silent. (A full run of the fault matrix saw
    both declared dead after an init on a loaded machine, and a synchronous step then fail.)"""
    import psflow.nn as pnn

    cluster = local_cluster(1, 2)
    ps = start_ps(cluster, env={"PSFLOW_WORKER_TIMEOUT": "1"})
    other = ShardedClient(worker_ctx(cluster, 1), TransportConfig(timeout=60))
    try:
        other.wait_ready(60, initialized=False)  # worker:1 has joined
        # ... and waits for the chief's init, asking (as a worker does before its heartbeat).
        waiting = threading.Thread(target=other.wait_ready, args=(60,))
        waiting.start()
        # 4M x 64 float32 rows (1 GB): making them takes the ps well over a second.
        table = pnn.Embedding(4_000_000, 64, optimizer="SGD", device="meta")
        start = time.monotonic()
        with psflow.DistributedOptimizer(table, worker_ctx(cluster, 0), lr=0.1) as opt:
            took = time.monotonic() - start
            waiting.join(60)
            assert not waiting.is_alive()
            # Done at once: from here on worker:1 (no heartbeat) is silent for real, and the
            # chief's step on a loaded machine can take longer than its 1 s timeout.
            other.done()
            opt.zero_grad()
            table(torch.tensor([1, 2, 3])).sum().backward()
            opt.step()
        code, err = stop(ps, timeout=60)
        assert code == 0, err
        assert took > 1.0, f"the init took {took:.2f} s: too short to show anything"
        assert "is dead" not in err, err
    finally:
        other.close()
        ps.kill()
        stop(ps)


def test_a_worker_waiting_for_a_lost_ps_keeps_its_heartbeat_to_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a session waits for ps:1 (hung, then back), ps:0 keeps hearing from it: it used to
    stop its heartbeat for the wait, and ps:0 declared it dead (in sync mode, failing the steps
    of workers that waited for it)."""
    from .lines import Lines
    from .support import quiet_session

    monkeypatch.setenv("PSFLOW_WORKER_TIMEOUT", str(TIMEOUT))
    cluster = local_cluster(2, 1)
    env = {"PSFLOW_WORKER_TIMEOUT": str(TIMEOUT)}
    ps = [start_ps(cluster, i, env=env) for i in range(2)]
    assert ps[0].stderr is not None
    err0 = Lines(ps[0].stderr)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 1))  # on both ps
    try:
        with quiet_session(model, cluster, str(tmp_path), timeout=1, recovery_timeout=60) as sess:
            for step in range(40):
                if step == 5:
                    freeze(ps[1].pid)
                    threading.Timer(2 * TIMEOUT, os.kill, (ps[1].pid, signal.SIGCONT)).start()
                sess.zero_grad()
                loss = model(torch.ones(1, 2)).sum()
                loss.backward()
                sess.step(loss=loss)
        for p in ps:
            code, _ = stop(p)
            assert code == 0
        assert "is dead" not in err0.rest(), err0.text()
    finally:
        for p in ps:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
            stop(p, timeout=1)
