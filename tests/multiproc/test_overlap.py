"""``overlap``: an asynchronous push left in flight while the next step computes, its reply
taken at the next request. One worker's updates against a transcription of that schedule, a
table's prefetched rows two batches ahead, and every other request taking the reply first."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import psflow
import psflow.nn as pnn
from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import TaskContext, TaskSpec
from psflow.sparse import kernels
from psflow.transport import TransportConfig
from psflow.worker import DistributedOptimizer
from psflow.worker.modes import ModeConfig

from .support import lanes, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


@contextlib.contextmanager
def job(
    path: str, model: torch.nn.Module, **settings: Any
) -> Iterator[tuple[DistributedOptimizer, list[psflow.ParameterServer]]]:
    """One in-process ps shard and a worker's optimizer on it (SGD, lr 0.1)."""
    cluster = local_cluster(1, 1)
    transport = TransportConfig(timeout=30, shared_memory=path == "shm")
    server = psflow.ParameterServer(
        TaskContext(cluster=cluster, task=TaskSpec(job="ps", index=0)), transport=transport
    ).start()
    opt = DistributedOptimizer(
        model, worker_ctx(cluster), optimizer="SGD", lr=0.1, transport=transport, **settings
    )
    try:
        yield opt, [server]
    finally:
        opt.close()
        server.stop()


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 4, generator=g, dtype=torch.float64),
         torch.randn(8, 1, generator=g, dtype=torch.float64))
        for _ in range(n)
    ]  # fmt: skip


def linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1).double()


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_each_gradient_is_of_the_values_before_the_last_push(path: str) -> None:
    """Step ``k``'s forward runs on the values the ps held after push ``k - 2`` (the reply to
    push ``k - 1`` is taken at push ``k``): the ps's values are plain SGD on gradients one step
    staler than without overlap, push for push, and the last push is applied by ``close``."""
    data = batches(6)
    model = linear()
    with job(path, model, overlap=True) as (opt, servers):
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.pull()  # takes the last push's reply first, then the values
        got = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert servers[0].store.step == len(data)
    ref = linear()
    seen = [{n: p.detach().clone() for n, p in ref.named_parameters()}]  # each push's values
    held = dict(seen[0])
    for k, (x, y) in enumerate(data):
        at = seen[max(0, k - 1)]  # the values loaded when step k's forward ran
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(at[n])
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        held = {n: held[n] - 0.1 * p.grad for n, p in ref.named_parameters()}
        seen.append(held)
    for n, value in got.items():
        torch.testing.assert_close(value, held[n], rtol=0, atol=1e-12)


def test_a_reply_written_while_the_next_step_computes_leaves_its_values_alone() -> None:
    """The reply to a push in flight lands in the shard's lane while the next step computes:
    the parameters must not live there (a pull adopts them into the lane's reply area), or
    that step's forward sees the values a push fresher than the schedule, or half of them.
    Here each forward waits until the ps has answered the push before it, which made the
    race certain; every forward sees the values of two pushes before."""
    data = batches(5)
    model = linear()
    used = []
    with job("shm", model, overlap=True) as (opt, servers):
        for k, (x, y) in enumerate(data):
            if k:  # push k - 1 applied and answered into its lane, not yet taken
                lane = lanes(opt)["ps:0"]
                deadline = time.monotonic() + 30
                while not (servers[0].store.step == k and lane.has_reply()):
                    assert time.monotonic() < deadline, "the ps did not answer"
                    time.sleep(0.001)
            opt.zero_grad()
            used.append({n: p.detach().clone() for n, p in model.named_parameters()})
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    ref = linear()
    seen = [{n: p.detach().clone() for n, p in ref.named_parameters()}]
    for k, (x, y) in enumerate(data):
        at = seen[max(0, k - 1)]
        for n, value in used[k].items():
            torch.testing.assert_close(value, at[n], rtol=0, atol=1e-12, msg=f"step {k}: {n}")
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(at[n])
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        seen.append({n: seen[-1][n] - 0.1 * p.grad for n, p in ref.named_parameters()})


def test_overlap_is_for_plain_asynchronous_training() -> None:
    assert ModeConfig.of("async", overlap=True).overlap
    with pytest.raises(ValueError, match="overlap applies to mode='async'"):
        ModeConfig.of("sync", overlap=True)
    with pytest.raises(ValueError, match="max_staleness=2"):
        ModeConfig.of("async", max_staleness=2, overlap=True)
    with pytest.raises(TypeError, match="overlap must be a bool"):
        ModeConfig(overlap=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("vocab", [40, None], ids=["fixed", "hashed"])
@pytest.mark.parametrize("path", ["shm", "socket"])
def test_a_table_prefetched_two_batches_ahead_loses_no_push(
    path: str, vocab: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table's rows prefetched for the batch after next (the push in flight brings them):
    every forward after the first two takes them instead of a lookup, forward ``k`` sees the
    rows as the ps held them after push ``k - 2``, and the pushes all land, each once
    (row-wise SGD on a gradient of ones: a row ends 0.1 lower for every batch that held its
    id). A hashed table's pushes each take the rows their prefetch found (its last two
    lookups kept a task): none maps its ids again."""
    from .test_native_requests import native_of

    mapped = []
    map_rows = kernels.map_rows
    monkeypatch.setattr(kernels, "map_rows", lambda *a, **k: mapped.append(1) or map_rows(*a, **k))
    n, dim, steps = 40, 4, 7
    g = torch.Generator().manual_seed(5)
    ids = [torch.randperm(n, generator=g)[:12] for _ in range(steps + 2)]
    sgd = pnn.RowOptimizerSpec.of("SGD", lr=0.1)
    table = pnn.Embedding(vocab, dim, seed=1, optimizer=sgd)
    with job(path, table, overlap=True) as (opt, servers):
        (rows_of,) = servers[0].store.tables.values()
        initial = rows_of.lookup(torch.arange(n)).clone()
        lookups = native_of(servers[0]).served
        seen = []
        for k in range(steps):
            opt.zero_grad()
            rows = table(ids[k])
            seen.append(rows.detach().clone())
            rows.sum().backward()
            table.prefetch(ids[k + 2])
            opt.step()
        assert native_of(servers[0]).served - lookups == 2  # batches 0 and 1 alone
        opt.pull()  # takes the last push's reply first
        # A fixed table keeps no lookup (its map costs what keeping would): each push maps.
        assert len(mapped) == (0 if vocab is None else steps)
        held = rows_of.lookup(torch.arange(n))
    for k in range(steps):
        # Forward 1 looks its rows up, after push 0 (which the lookup's request settles);
        # forward k >= 2 takes those push k - 2 gathered after its update.
        applied = torch.zeros(n)
        for j in range(k if k < 2 else k - 1):
            applied[ids[j]] += 1
        torch.testing.assert_close(seen[k], initial[ids[k]] - 0.1 * applied[ids[k]][:, None])
    applied = torch.zeros(n)
    for k in range(steps):
        applied[ids[k]] += 1
    torch.testing.assert_close(held, initial - 0.1 * applied[:, None])
