"""Failures at the edges of recovery: a hung rank in all-reduce mode is named by the rank that
waited for it, and a ps lost before the first checkpoint is initialised again by the chief
from its own model (no restart of the job)."""

from __future__ import annotations

import logging
import re
import signal
import time
from pathlib import Path

import pytest
import torch

import psflow
from psflow.train import CheckpointDir, load_checkpoint
from psflow.transport import TransportConfig
from psflow.worker.client import ShardedClient

from .support import freeze, local_cluster, quiet_session, start_ps, stop, worker_ctx
from .test_sigterm import job, wait_for_a_checkpoint

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

TIMEOUT = 6
"""PSFLOW_TIMEOUT in the all-reduce job: the group's timeout, gloo's for a collective."""


@pytest.mark.parametrize("hung", [1, 0], ids=["worker1", "chief"])
def test_a_hung_rank_is_named_by_the_rank_whose_all_reduce_timed_out(
    tmp_path: Path, hung: int
) -> None:
    """SIGSTOP to one rank of two: the other's collective times out, and its error names the
    stopped rank (not just gloo's "Timed out waiting ... for recv"), within the timeout and a
    few heartbeats. Rank 0 hosts the rendezvous store: stopped, it is named all the same."""
    logdir = tmp_path / "run"
    env = {"PSFLOW_MODE": "allreduce", "PSFLOW_TIMEOUT": str(TIMEOUT)}
    stopped, survivor = f"worker:{hung}", f"worker:{1 - hung}"
    with job(local_cluster(0, 2), logdir, env) as tasks:
        wait_for_a_checkpoint(logdir, tasks)
        freeze(tasks[stopped].proc.pid)
        start = time.monotonic()
        code = tasks[survivor].exit_code(TIMEOUT + 30)
        took = time.monotonic() - start
        err = tasks[survivor].stderr
        assert code not in (None, 0), f"{survivor} exit code {code}\n{err[-3000:]}"
        assert took < TIMEOUT + 25, took
        m = re.search(r"PeerTimeoutError: (.*)", err)
        assert m, err[-3000:]
        message = m.group(1)
        assert message.startswith(f"{stopped} (rank {hung}): did not take part"), message
        assert "hung or dead" in message, message
        # Which collective, and where it failed.
        assert re.search(
            rf"all-reduce of step \d+ failed on {survivor} \(rank {1 - hung}\)", message
        )
        tasks[stopped].proc.kill()  # SIGKILL ends a stopped process too


def _step(sess: object, model: torch.nn.Module) -> int:
    sess.zero_grad()  # type: ignore[attr-defined]
    model(torch.ones(2, 4)).pow(2).sum().backward()
    return int(sess.step())  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_ps_lost_before_the_first_checkpoint_is_initialised_again_from_the_chief(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """ps:0 (which holds the global step) killed and restarted empty before any checkpoint:
    the chief initialises it again from its own model's values at its last global step, ps:1
    keeps its values, and the job goes on and ends with the chief's values on the ps."""
    cluster = local_cluster(2, 1)  # the weight on one shard, the bias on the other
    ps = [start_ps(cluster, i) for i in range(2)]
    restarted = None
    ckpt_dir = tmp_path / "ckpt"
    try:
        model = torch.nn.Linear(4, 1)
        with caplog.at_level(logging.INFO), quiet_session(
            model, cluster, str(ckpt_dir), lr=0.1, timeout=10, mode=mode
        ) as sess:  # fmt: skip
            for _ in range(3):
                assert _step(sess, model) >= 1
            assert sess.global_step == 3
            assert CheckpointDir(str(ckpt_dir)).latest() is None
            pulled = {n: p.detach().clone() for n, p in model.named_parameters()}
            ps[0].send_signal(signal.SIGKILL)
            ps[0].wait(10)
            restarted = start_ps(cluster, 0)  # what Kubernetes does with a failed pod
            # The step meets the lost ps: the chief initialises it again; nothing moved.
            assert _step(sess, model) == 3
            assert "no checkpoint to restore it from" not in caplog.text
            assert re.search(
                r"ps:0 came back empty and there is no checkpoint in \S+ to restore from: "
                r"initialised again from worker:0's values \(its last pull\) at global step 3; "
                r"lost: their optimizer state since the job's start, and what other workers "
                r"pushed since that pull; nothing else \(the other shards keep theirs\)",
                caplog.text,
            ), caplog.text[-3000:]
            # Pulled again: ps:0's variables are what the chief had (ps:1's took the failed
            # step's gradient, which reached it: they keep it).
            lost = {piece.param for piece in sess.pieces if piece.shard == 0}
            assert lost and lost != set(pulled), sess.pieces
            for n, param in model.named_parameters():
                if n in lost:
                    assert torch.equal(param.detach(), pulled[n]), n
            assert _step(sess, model) == 4
            assert _step(sess, model) == 5
            last = {n: w.detach().clone() for n, w in model.named_parameters()}
            # What the ps hold now: the chief's values, at its step.
            config = TransportConfig(timeout=10, shared_memory=False)
            probe = ShardedClient(worker_ctx(cluster, 0), config)
            try:
                replies = probe.pull()
                held = {n: t.clone() for _, (_, ts) in replies.items() for n, t in ts}
                assert replies[0][0]["step"] == 5
            finally:
                probe.close()
            assert sorted(held) == sorted(last)
            for n, v in last.items():
                assert torch.equal(held[n].reshape(v.shape), v), n
        saved = load_checkpoint(str(ckpt_dir))  # the final one, at the end of the session
        assert saved is not None and saved.global_step == 5
        for n, v in last.items():
            assert torch.equal(saved.params[n], v), n
        code, err = stop(restarted)
        assert code == 0, err[-3000:]
        assert err.count("initialised by worker:0") == 1, err[-3000:]
        code, err = stop(ps[1])
        assert code == 0, err[-3000:]
        assert err.count("initialised by worker:0") == 1, err[-3000:]  # never again: kept
    finally:
        for proc in [*ps, *([restarted] if restarted else [])]:
            stop(proc, timeout=1)


class _WithTable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = psflow.nn.Embedding(64, 4)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.rows(ids))


def test_a_ps_lost_before_the_first_checkpoint_gets_its_tables_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The same with an embedding table whose rows lie on both shards: the lookup of the
    next forward pass meets the lost ps, the chief initialises it again (the table's rows of
    that shard from its seed, as at the start), the lookup asks again, and the job goes on."""
    cluster = local_cluster(2, 1)
    ps = [start_ps(cluster, i) for i in range(2)]
    restarted = None
    ids = torch.arange(64)

    def step(sess: object, model: torch.nn.Module) -> int:
        sess.zero_grad()  # type: ignore[attr-defined]
        model(ids).pow(2).mean().backward()
        return int(sess.step())  # type: ignore[attr-defined]

    try:
        model = _WithTable()
        with caplog.at_level(logging.INFO), quiet_session(
            model, cluster, str(tmp_path / "ckpt"), lr=0.1, timeout=10
        ) as sess:  # fmt: skip
            for _ in range(3):
                step(sess, model)
            ps[0].send_signal(signal.SIGKILL)
            ps[0].wait(10)
            restarted = start_ps(cluster, 0)
            assert step(sess, model) == 4  # recovered in the lookup, then stepped
            assert re.search(
                r"ps:0 came back empty and there is no checkpoint in \S+ to restore from: "
                r"initialised again from worker:0's values \(its last pull\) at global step 3; "
                r"lost: their optimizer state and their rows of tables rows since the job's "
                r"start",
                caplog.text,
            ), caplog.text[-3000:]
            assert step(sess, model) == 5
        code, err = stop(restarted)
        assert code == 0, err[-3000:]
        assert "ps:0 initialised by worker:0: 1 variables, 1 tables" in err, err[-3000:]
    finally:
        for proc in [*ps, *([restarted] if restarted else [])]:
            stop(proc, timeout=1)
