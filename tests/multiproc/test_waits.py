"""No silent waits: a task waiting for its ps says whom it waits for, and why, at a steady
interval; a ps logs the clients it refuses (issue 16, item 3)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from psflow.cluster.spec import ClusterSpec, TaskSpec
from psflow.transport import generate_keys

from .forked import Forked
from .lines import Lines
from .support import local_cluster, start_ps, stop

pytestmark = pytest.mark.timeout(180)

# A worker as a user writes it: no logging setup; its role from TF_CONFIG.
WORKER = """
import psflow, torch
ctx, _ = psflow.resolve([])
model = torch.nn.Linear(2, 1)
with psflow.DistributedOptimizer(model, ctx, lr=0.1) as opt:
    model(torch.ones(1, 2)).sum().backward()
    print("step", opt.step(), flush=True)
"""


def start_worker(cluster: ClusterSpec, index: int = 0, **env: str) -> tuple[Forked, Lines]:
    """``WORKER`` as its own process, forked from the server that imported torch
    (:mod:`tests.multiproc.forked`), with ``env`` over this process's environment."""
    task = TaskSpec(job="worker", index=index)
    proc = Forked(
        ["-c", WORKER], env={**os.environ, "TF_CONFIG": cluster.to_tf_config(task), **env}
    )
    return proc, Lines(proc.stderr)


def test_a_worker_started_before_its_ps_says_so_every_interval_then_goes_on() -> None:
    cluster = local_cluster(1, 1)
    address = cluster.addresses("ps")[0]
    worker, err = start_worker(cluster, PSFLOW_WAIT_LOG_SECONDS="1", PSFLOW_READY_TIMEOUT="120")
    ps = None
    try:
        waited = []
        for _ in range(3):
            m = err.wait_for(
                r"worker:0 is waiting for ps:0: (.*); waited (\d+) s, gives up in (\d+) s", 60
            )
            assert m.group(1) == f"nothing accepts connections at {address} (not started yet?)"
            waited.append(int(m.group(2)))
            assert int(m.group(2)) + int(m.group(3)) in (119, 120)
        assert waited == sorted(waited) and waited[-1] > waited[0]  # one a second, not a burst
        ps = start_ps(cluster)  # the wait ends as soon as the ps answers
        assert worker.wait(timeout=60) == 0, err.rest()
        assert worker.stdout is not None and worker.stdout.read().strip() == "step 1"
        # psflow's own INFO line, though the script configured no logging (item 11).
        assert "INFO psflow.worker.exchange: worker:0 initialised the ps" in err.rest()
        code, ps_err = stop(ps)
        assert code == 0, ps_err
    finally:
        worker.kill()
        worker.wait()
        if ps is not None:
            stop(ps, timeout=1)


def test_a_worker_gives_up_naming_the_ps_and_why() -> None:
    cluster = local_cluster(1, 2)
    address = cluster.addresses("ps")[0]
    worker, err = start_worker(cluster, 1, PSFLOW_WAIT_LOG_SECONDS="1", PSFLOW_READY_TIMEOUT="3")
    try:
        err.wait_for(r"worker:1 is waiting for ps:0: nothing accepts connections", 60)
        assert worker.wait(timeout=60) != 0
        assert (
            f"TimeoutError: ps:0 not ready within 3 s (the ready timeout, PSFLOW_READY_TIMEOUT): "
            f"ps:0: nothing accepts connections at {address} (not started yet?)"
        ) in err.rest()
    finally:
        worker.kill()
        worker.wait()


def test_a_wait_for_a_lost_ps_names_the_recovery_timeout() -> None:
    """A session that lost a ps waits for it by PSFLOW_RECOVERY_TIMEOUT, and says so."""
    from psflow.env import PSFLOW_RECOVERY_TIMEOUT
    from psflow.transport import TransportConfig
    from psflow.worker.client import ShardedClient

    from .support import worker_ctx

    cluster = local_cluster(1, 1)
    client = ShardedClient(worker_ctx(cluster), TransportConfig(timeout=1))
    try:
        with pytest.raises(TimeoutError) as caught:
            client.wait_ready(2, initialized=False, setting=PSFLOW_RECOVERY_TIMEOUT)
    finally:
        client.close()
    # Why ps:0 is silent (nothing listening, as its connection tells) follows.
    assert str(caught.value).startswith(
        "ps:0 not ready within 2 s (the recovery timeout, PSFLOW_RECOVERY_TIMEOUT): ps:0: "
    )


@pytest.mark.timeout(420)  # four workers
def test_a_ps_with_keys_logs_the_clients_it_refuses(tmp_path: Path) -> None:
    job, other = generate_keys(tmp_path / "job"), generate_keys(tmp_path / "other")
    # The job's server key, but a client key the ps does not know.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    shutil.copy(job / "server.key", stranger / "server.key")
    for name in ("client.key", "client.key_secret"):
        shutil.copy(other / name, stranger / name)
    cluster = local_cluster(1, 1)
    address = cluster.addresses("ps")[0]
    ps = start_ps(cluster, env={"PSFLOW_KEYS_DIR": str(job)})
    assert ps.stderr is not None
    ps_err = Lines(ps.stderr)
    workers = []
    try:
        ps_err.wait_for(r"ps:0 serving on", 60)
        # An unauthorised key: the ps names the client; the worker fails at once, saying so
        # (ZeroMQ does not try again after such a refusal: waiting would be in vain).
        worker, err = start_worker(
            cluster, PSFLOW_KEYS_DIR=str(stranger), PSFLOW_READY_TIMEOUT="120"
        )
        workers.append(worker)
        m = ps_err.wait_for(
            r"WARNING.*refused a client at (\S+): its CurveZMQ key (\S+)\.\.\. is not among the authorised keys",
            60,
        )
        assert m.group(1) == "127.0.0.1"
        assert (other / "client.key").read_text().find(m.group(2)) > 0
        assert worker.wait(timeout=60) != 0
        assert f"PeerError: ps:0 at {address}: refused this task's CurveZMQ key" in err.rest()
        # Another job's keys altogether: the handshake itself fails, again and again; the ps
        # says so (not once per retry), the worker too while it waits.
        worker, err = start_worker(
            cluster,
            PSFLOW_KEYS_DIR=str(other),
            PSFLOW_WAIT_LOG_SECONDS="1",
            PSFLOW_READY_TIMEOUT="120",
        )
        workers.append(worker)
        ps_err.wait_for(
            rf"WARNING.*a client failed its handshake on {address}: it does not hold this "
            r"server's public key",
            60,
        )
        err.wait_for(r"worker:0 is waiting for ps:0: the CurveZMQ handshake with .* failed", 60)
        worker.kill()
        # No keys at all: whichever side reads the other's greeting first drops the connection,
        # so the ps sees a protocol error on some attempts and a silent close on others (seen
        # in a full run: none of the attempts in 60 s). The worker names it every time.
        # Bounds, not guesses: a fresh task imports torch first, slow on a loaded machine
        # (this wait once ran out at 60 s in a full run of the suite).
        worker, err = start_worker(cluster, PSFLOW_WAIT_LOG_SECONDS="1", PSFLOW_READY_TIMEOUT="240")
        workers.append(worker)
        err.wait_for(
            r"worker:0 is waiting for ps:0: the ZeroMQ handshake with .* failed: what answers "
            r"there is no psflow task without keys \(one with PSFLOW_KEYS_DIR's CurveZMQ keys",
            180,
        )
        worker.kill()
        # The job's own keys: served as ever.
        worker, err = start_worker(cluster, PSFLOW_KEYS_DIR=str(job))
        workers.append(worker)
        assert worker.wait(timeout=60) == 0, err.rest()
        assert ps.wait(timeout=60) == 0, ps_err.rest()
    finally:
        for w in workers:
            w.kill()
            w.wait()
        stop(ps, timeout=1)
