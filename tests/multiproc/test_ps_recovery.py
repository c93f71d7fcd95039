"""A ps killed mid-run and restarted by its cluster manager: training goes on from the last
checkpoint, restored by the chief into every shard."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import psflow
from psflow.protocol import Key, Op, OptimizerSpec
from psflow.train import CheckpointDir
from psflow.transport import PeerError, PeerLostError, TransportConfig
from psflow.worker import DistributedOptimizer
from psflow.worker.client import ShardedClient

from .forked import Forked
from .support import ROOT, local_cluster, quiet_session, start_ps, stop, task_env, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

EXAMPLE = str(ROOT / "examples" / "linear_regression.py")
STEPS = 1500
LR = 0.004
"""Four times the example's default for a quarter of its former 6,000 steps: W's error shrinks
as exp(-2/3 lr t), so the end values are as close as before, with the kill at the checkpoint of
step 750 (one every 250) and the restored rows still half the run from its end."""
KILL_AT = STEPS // 2
SAVE = STEPS // 6


def _worker(cluster: psflow.ClusterSpec, index: int, logdir: Path, mode: str) -> Forked:
    """The example as worker ``index``, forked from the server that imported torch
    (:mod:`tests.multiproc.forked`): its own process, environment and pipes."""
    env = task_env(
        cluster,
        psflow.TaskSpec(job="worker", index=index),
        {
            # The ps that is killed is named at once (its connection drops); this only bounds
            # a request to a ps that is alive, which a loaded machine can keep waiting seconds.
            "PSFLOW_TIMEOUT": "10",
            "PSFLOW_MODE": mode,
            # A synchronous step that lost a worker to the recovery cannot complete: its other
            # workers notice after this long.
            "PSFLOW_SYNC_TIMEOUT": "5",
        },
    )
    args = ["--train_steps", str(STEPS), "--lr", str(LR), "--save_checkpoint_steps", str(SAVE)]
    return Forked([EXAMPLE, *args, "--logdir", str(logdir)], env=env)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_restarted_ps_is_restored_from_the_last_checkpoint(tmp_path: Path, mode: str) -> None:
    logdir = tmp_path / "run"
    cluster = local_cluster(2, 2)  # W on one shard, b on the other
    ps = [start_ps(cluster, i) for i in range(2)]
    workers = [_worker(cluster, i, logdir, mode) for i in range(2)]
    restarted = None
    try:
        saved = CheckpointDir(str(logdir))
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            latest = saved.latest()
            if latest is not None and saved.manifest(latest).global_step >= KILL_AT:
                break
            if any(p.poll() is not None for p in [*ps, *workers]):
                break  # one ended before the kill: named below
            time.sleep(0.02)
        else:
            latest = None
        if latest is None or saved.manifest(latest).global_step < KILL_AT:
            tails = []
            for name, p in [
                ("ps:0", ps[0]),
                ("ps:1", ps[1]),
                *zip(("worker:0", "worker:1"), workers, strict=True),
            ]:
                code, err = stop(p, timeout=0.1)
                tails.append(f"--- {name} (exit {code}):\n{err[-1500:]}")
            pytest.fail(f"no checkpoint at step {KILL_AT} within 150 s:\n" + "\n".join(tails))
        ps[1].send_signal(signal.SIGKILL)
        ps[1].wait(10)
        restarted = start_ps(cluster, 1)  # what Kubernetes does with a failed pod
        outs = [w.communicate(timeout=200) for w in workers]
        for w, (_, err) in zip(workers, outs, strict=True):
            assert w.returncode == 0, err[-3000:]
        chief_err = outs[0][1]
        m = re.search(r"ps:1 came back empty: every shard restored from (ckpt-(\d+))", chief_err)
        assert m, chief_err[-3000:]
        assert int(m.group(2)) >= KILL_AT
        assert "training goes on at global step" in outs[1][1]  # the other worker, too
        w_b = re.fullmatch(r"W=(\S+) b=(\S+)", outs[0][0].strip().splitlines()[-1])
        # Still learning from the restored values (lr x steps = 6 brings both within 0.05).
        assert w_b and abs(float(w_b.group(1)) - 2.0) < 0.2, outs[0][0][-500:]
        assert abs(float(w_b.group(2)) - 0.3) < 0.1, outs[0][0][-500:]
        final = saved.latest()
        assert final is not None and saved.manifest(final).global_step >= STEPS
        for p in (ps[0], restarted):
            code, err = stop(p)
            assert code == 0, err[-3000:]  # both ps exit by themselves once the workers are done
    finally:
        for p in [*workers, *ps, *([restarted] if restarted else [])]:
            if p.poll() is None:
                p.kill()
            p.wait()


SPEC = OptimizerSpec(name="SGD", kwargs={"lr": 0.1})


@contextlib.contextmanager
def _chief_and_other(step: int) -> Iterator[tuple[ShardedClient, ShardedClient]]:
    """A ps holding ``w`` = zeros(4) at ``step``, set up by worker:0 (the chief), and a client
    for worker:1; both finish at the end, and the ps must then exit 0 by itself."""
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    clients = [ShardedClient(worker_ctx(cluster, i), TransportConfig(timeout=10)) for i in (0, 1)]
    try:
        chief, other = clients
        chief.wait_ready(30, initialized=False)
        assert chief.initialize({0: [("w", torch.zeros(4))]}, SPEC, step=step)
        yield chief, other
        for c in clients:
            c.done()
        code, err = stop(ps)
        assert code == 0, err[-3000:]
    finally:
        for c in clients:
            c.close()
        stop(ps, timeout=5)


def test_only_the_chief_may_replace_initialised_variables() -> None:
    with _chief_and_other(step=7) as (chief, other):
        with pytest.raises(PeerError, match=r"only the chief \(worker:0\) may ask for 'init'"):
            other.initialize_restored({0: [("w", torch.ones(4))]}, {}, SPEC, 0, replace=True)
        assert chief.pull()[0][0]["step"] == 7  # untouched
        assert chief.initialize_restored({0: [("w", torch.ones(4))]}, {}, SPEC, 3, replace=True)
        header, tensors = chief.pull()[0]
        assert header["step"] == 3 and torch.equal(tensors[0][1], torch.ones(4))


def _sync_push(step: int) -> dict[str, object]:
    """A synchronous push for ``step`` of a job that aggregates 2 of 2 workers."""
    return {
        Key.OP: Op.SYNC_PUSH,
        Key.STEP: step,
        Key.REPLICAS_TO_AGGREGATE: 2,
        Key.TOTAL_NUM_REPLICAS: 2,
    }


def test_a_restore_ends_the_synchronous_steps_in_progress() -> None:
    """A worker waiting for a synchronous step, or pushing one past the restored step, hears
    that the ps was restored (a lost peer: it recovers) instead of waiting out its timeout."""
    with _chief_and_other(step=0) as (chief, other):
        grad = [("w", torch.ones(4))]
        push = _sync_push(step=0)
        waiting = other.send({0: push}, {0: grad})  # held until the chief's gradient
        deadline = time.monotonic() + 10
        while chief.sync_status()["pending"] != ["worker:1"]:
            assert time.monotonic() < deadline, "worker:1's push never arrived"
            time.sleep(0.01)
        assert chief.initialize_restored(
            {0: [("w", torch.full((4,), 5.0))]}, {}, SPEC, 0, replace=True
        )
        with pytest.raises(PeerLostError, match="restored from a checkpoint by worker:0"):
            other.wait(waiting, 10)
        past = _sync_push(step=3)
        with pytest.raises(PeerLostError, match="was the ps restored from a checkpoint since"):
            other.call({0: past}, {0: grad})
        status = chief.sync_status()
        assert status["pending"] == [] and status["arrived"] == [] and status["step"] == 0
        # The step goes on from the restored values once both workers push for step 0.
        pushes = [c.send({0: _sync_push(step=0)}, {0: grad}) for c in (chief, other)]
        for c, rids in zip((chief, other), pushes, strict=True):
            header, tensors = c.wait(rids, 10)[0]
            assert header["accepted"] and header["step"] == 1
            assert torch.equal(tensors[0][1], torch.full((4,), 4.9))  # 5 - 0.1 * mean(1, 1)


def test_a_ps_restored_after_a_worker_finished_ends_the_job_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """worker:1 finished (it said ``done`` and went), then the ps crashed and came back empty.
    The chief restores it mid-job; worker:1 will never speak to it again. The restored ps
    declares it dead after the worker timeout, so the chief's end (which waits for the other
    workers) and the ps's exit follow, rather than both waiting for a ``done`` that never
    comes (the chief its ``end_timeout``, the ps until its launcher stopped it)."""
    # The chief beats every fifth of it: 1 s apart, well within it on a loaded machine.
    monkeypatch.setenv("PSFLOW_WORKER_TIMEOUT", "5")
    cluster = local_cluster(1, 2)
    env = {"PSFLOW_WORKER_TIMEOUT": "5"}
    ps = start_ps(cluster, env=env)
    restarted = None

    def step(opt: Any, model: torch.nn.Module) -> None:
        opt.zero_grad()
        model(torch.ones(2, 4)).pow(2).sum().backward()
        opt.step()

    try:
        model, other_model = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        with caplog.at_level(logging.INFO), quiet_session(
            model, cluster, str(tmp_path / "ckpt"), lr=0.1, end_timeout=120
        ) as sess:  # fmt: skip
            other = DistributedOptimizer(
                other_model, worker_ctx(cluster, 1), lr=0.1, transport=TransportConfig(timeout=20)
            )
            step(other, other_model)
            other.close()  # finished
            step(sess, model)
            assert sess.save() is not None
            ps.send_signal(signal.SIGKILL)
            ps.wait(10)
            restarted = start_ps(cluster, env=env)  # what Kubernetes does with a failed pod
            step(sess, model)  # the ps is lost: restored from the checkpoint, and on
            assert "ps:0 came back empty: every shard restored from ckpt-" in caplog.text
            step(sess, model)
        assert "still training after" not in caplog.text  # not the chief's end_timeout
        code, err = stop(restarted)
        assert code == 0, err[-3000:]
        assert "restored mid-job: worker:1 dead unless heard from within 5 s" in err, err[-3000:]
        assert "worker:1 is dead: ps:0 has not heard from it in the" in err, err[-3000:]
        assert "exiting without worker:1 (dead)" in err, err[-3000:]
    finally:
        for p in [ps, *([restarted] if restarted else [])]:
            stop(p, timeout=1)
