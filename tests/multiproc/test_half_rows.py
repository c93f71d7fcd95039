"""Rows and row gradients at half width on the wire (``wire_dtype``), through real ps processes,
both paths (shared memory and ``PSFLOW_SHM=0``): the worker gets exactly the ps's float32 rows
cast to the wire dtype, the ps applies exactly its row optimizer to the pushed gradient cast up,
and what does not fit (a bad dtype, a float16 overflow) is refused while the ps keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import psflow.nn as pnn
from psflow.cluster.spec import ClusterSpec
from psflow.protocol import Key, Op, RowOptimizerSpec
from psflow.protocol.messages import row_tensor_names
from psflow.sparse.optim import RowOptimizer
from psflow.transport import PeerError, TransportConfig
from psflow.worker import DistributedOptimizer
from psflow.worker.engine import ExchangeEngine
from psflow.worker.tables import TableClient

from .support import local_cluster, start_ps, stop, worker_ctx
from .sync_support import run_threads

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

VOCAB, DIM = 40, 8
USER_IDS = torch.tensor([-(2**40), -5, 3, 17, 2**35, 2**50 + 1])
"""The hashed table's ids (any int64)."""
ADAGRAD = RowOptimizerSpec.of("Adagrad", lr=0.3)


@pytest.fixture(params=["1", "0"], ids=["shm", "socket"])
def cluster(request: pytest.FixtureRequest) -> Iterator[ClusterSpec]:
    """2 ps and 1 worker, the ps taking shared-memory lanes or not (``PSFLOW_SHM``)."""
    spec = local_cluster(2, 1)
    procs = [start_ps(spec, i, env={"PSFLOW_SHM": request.param}) for i in range(2)]
    yield spec
    for p in procs:
        stop(p, timeout=5)


class Model(torch.nn.Module):
    def __init__(self, wire: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = pnn.Embedding(VOCAB, DIM, seed=1, optimizer=ADAGRAD, wire_dtype=wire)
        self.users = pnn.EmbeddingBag(
            None, DIM, mode="sum", seed=2, init_std=0.5, optimizer=ADAGRAD, wire_dtype=wire
        )
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.items(items).sum(1), self.users(users)], 1)).squeeze(1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    items = torch.randint(0, VOCAB, (16, 3), generator=g)
    users = USER_IDS[torch.randint(0, len(USER_IDS), (16, 2), generator=g)]
    return items, users, torch.randn(16, generator=g) * 3


def client_of(opt: DistributedOptimizer) -> TableClient:
    assert isinstance(opt.engine, ExchangeEngine)
    return opt.engine.exchange.tables


def held_rows(client: TableClient, name: str, ids: torch.Tensor) -> torch.Tensor:
    """The ps's rows of ``ids`` as it holds them (a lookup that asks no narrower dtype)."""
    split = client.layout.partitions[name].split(ids)
    replies = client.client.lookup({s: [(name, shard_ids)] for s, (shard_ids, _) in split.items()})
    out = torch.empty((ids.numel(), DIM))
    for s, (_, at) in split.items():
        ((got_name, rows),) = replies[s][1]
        assert got_name == name and rows.dtype == torch.float32
        out[at] = rows
    return out


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rows_come_cast_and_the_ps_applies_the_gradient_cast_up(
    cluster: ClusterSpec, wire: torch.dtype
) -> None:
    """Every row a forward gets (asked, prefetched with the push, or ``rows()``) is the ps's
    float32 row cast to ``wire`` and back, bit for bit; each push carries gradients in
    ``wire``, and the ps's rows after it are exactly the row optimizer applied to them cast
    up (a reference held here, stepped with the same pushes)."""
    model = Model(wire)
    opt = DistributedOptimizer(
        model, worker_ctx(cluster), optimizer="Adam", lr=0.01, transport=TransportConfig(timeout=30)
    )
    try:
        client = client_of(opt)
        name = str(wire).removeprefix("torch.")
        assert client.layout.wire == {"items": name, "users": name}
        all_items = torch.arange(VOCAB)
        ref = {
            "items": held_rows(client, "items", all_items),
            "users": held_rows(client, "users", USER_IDS),
        }
        rowopt = RowOptimizer(ADAGRAD)
        state = {n: rowopt.new_state(r.shape[0], DIM, torch.float32) for n, r in ref.items()}
        position = {
            "items": lambda ids: ids,
            "users": lambda ids: (ids[:, None] == USER_IDS).nonzero()[:, 1],
        }
        pushed: list[dict[int, list[tuple[str, torch.Tensor]]]] = []
        gradients = client.gradients

        def spy() -> tuple[dict[int, list[tuple[str, torch.Tensor]]], dict[int, list[str]]]:
            tensors, tables = gradients()
            pushed.append({s: [(n, t.clone()) for n, t in ts] for s, ts in tensors.items()})
            return tensors, tables

        client.gradients = spy  # type: ignore[method-assign]
        narrow = lambda rows: rows.to(wire).float()  # noqa: E731
        for step in range(5):
            items, users, y = batch(step)
            opt.zero_grad()
            want = narrow(ref["items"])[items]
            got = model.items(items)  # from step 1: the rows prefetched with the last push
            assert torch.equal(got, want), step
            assert torch.equal(client.rows(model.users, USER_IDS), narrow(ref["users"]))
            client.clear()
            F.mse_loss(model(items, users), y).backward()
            nxt = batch(step + 1)
            model.items.prefetch(nxt[0])
            opt.step()
            assert len(pushed) == 1
            for tensors in pushed.pop().values():
                named = dict(tensors)
                for table in ("items", "users"):
                    ids_name, grads_name = row_tensor_names(table)
                    if ids_name in named:
                        g = named[grads_name]
                        assert g.dtype == wire
                        at = position[table](named[ids_name])
                        rowopt.apply(ref[table], state[table], at, g.float())
            assert torch.equal(held_rows(client, "items", all_items), ref["items"]), step
            assert torch.equal(held_rows(client, "users", USER_IDS), ref["users"]), step
        assert not torch.equal(ref["items"], narrow(ref["items"]))  # the cast did round
    finally:
        opt.close()


def test_bad_dtypes_and_float16_overflow_are_refused_and_the_ps_serves_on(
    cluster: ClusterSpec,
) -> None:
    """A dtype that is not a wire dtype (float64 included), or one for a table not asked, is
    refused naming it; a row beyond float16's range is refused naming its table (the
    lookup, and the push whose prefetch would bring it); a gradient that overflows float16 is
    refused by the worker before it goes, and an inf float16 gradient sent anyway by the ps,
    which applies nothing of that push. After each, the ps answers the next request."""
    table = pnn.Embedding(VOCAB, DIM, seed=1, optimizer="SGD", wire_dtype=torch.float16)
    model = torch.nn.Sequential(table, torch.nn.Linear(DIM, 1))
    with torch.no_grad():
        table.weight[7] = 1e5  # held by the ps as float32; no float16 holds it
    opt = DistributedOptimizer(model, worker_ctx(cluster), lr=1.0)
    try:
        client = client_of(opt)
        ids = torch.tensor([2, 4])  # both on shard 0 ("mod" over 2)
        for dtypes, message in [
            ({"0": "int8"}, r"table '0': rows travel as one of .*not 'int8'"),
            ({"0": "float64"}, r"table '0': rows travel as one of .*not 'float64'"),
            ({"0": 16}, r"table '0': rows travel as one of .*not 16"),
            ({"emb": "float16"}, r"names table 'emb', whose rows the request does not ask"),
            ("float16", r"'row_dtypes' must be a map of table names to dtypes"),
        ]:
            header: dict[str, Any] = {
                Key.OP: Op.LOOKUP,
                Key.ROW_DTYPES: dtypes,
            }  # as a peer may send it
            with pytest.raises(PeerError, match=message):
                client.client.call({0: header}, {0: [("0", ids)]})
        with pytest.raises(PeerError, match=r"table '0': a row does not fit float16.*1e\+05"):
            table(torch.tensor([7, 9]))  # shard 1
        before = held_rows(client, "0", torch.arange(VOCAB))
        assert torch.equal(table(ids), before[ids].half().float())  # serving on
        # A gradient beyond float16's range: named by the worker, nothing sent.
        client.clear()
        (model(ids) * 1e6).sum().backward()
        with pytest.raises(ValueError, match=r"table '0': a row gradient does not fit float16"):
            opt.step()
        opt.zero_grad()
        # The same sent anyway: the ps refuses it whole (the dense part too).
        ids_name, grads_name = row_tensor_names("0")
        inf = torch.full((2, DIM), float("inf"), dtype=torch.float16)
        with pytest.raises(PeerError, match=r"table '0': a float16 row gradient is not finite"):
            client.client.push(
                {0: [(ids_name, ids), (grads_name, inf)]}, pull=False, rows={0: ["0"]}
            )
        assert torch.equal(held_rows(client, "0", torch.arange(VOCAB)), before)
        # A push whose prefetch would bring a row beyond float16: refused, naming it.
        table.prefetch(torch.tensor([7]))
        model(ids).sum().backward()
        with pytest.raises(PeerError, match=r"table '0': a row does not fit float16"):
            opt.step()
        assert table(ids).dtype == torch.float32  # and it goes on
    finally:
        opt.close()


def test_sync_workers_push_narrow_gradients_summed_at_float32() -> None:
    """Two synchronous workers with bfloat16 rows: each step the ps applies its row optimizer
    to the mean of their pushed gradients cast up and summed at float32 (a reference held
    here, stepped with what each worker pushed)."""
    spec = local_cluster(1, 2)
    procs = [start_ps(spec, 0)]
    opts: list[DistributedOptimizer] = []
    try:
        sgd = RowOptimizerSpec.of("SGD", lr=0.5)
        models = [
            pnn.Embedding(VOCAB, DIM, seed=1, optimizer=sgd, wire_dtype=torch.bfloat16)
            for _ in range(2)
        ]
        pushed: list[list[dict[str, torch.Tensor]]] = [[], []]

        def make(i: int) -> None:
            ctx = worker_ctx(spec, i)
            opt = DistributedOptimizer(models[i], ctx, lr=0.1, mode="sync")
            client = client_of(opt)
            gradients = client.gradients

            def spy() -> tuple[dict[int, list[tuple[str, torch.Tensor]]], dict[int, list[str]]]:
                tensors, tables = gradients()
                pushed[i].append({n: t.clone() for n, t in tensors[0]})
                return tensors, tables

            client.gradients = spy  # type: ignore[method-assign]
            opts.append(opt)

        run_threads([lambda: make(0), lambda: make(1)])
        client = client_of(opts[0])
        ref = held_rows(client, "table", torch.arange(VOCAB))
        steps = 3

        def train(i: int) -> None:
            opt = next(o for o in opts if o.model is models[i])
            for step in range(steps):
                items = batch(10 * step + i)[0]
                opt.zero_grad()
                models[i](items).square().sum().backward()
                opt.step()

        run_threads([lambda: train(0), lambda: train(1)])
        rowopt = RowOptimizer(sgd)
        for step in range(steps):
            mean = torch.zeros(VOCAB, DIM)
            for worker in pushed:
                ids_name, grads_name = row_tensor_names("table")
                grads = worker[step][grads_name]
                assert grads.dtype == torch.bfloat16
                mean.index_add_(0, worker[step][ids_name], grads.float())
            touched = torch.cat([w[step][ids_name] for w in pushed]).unique()
            rowopt.apply(ref, {}, touched, mean[touched] * 0.5)
        assert torch.equal(held_rows(client, "table", torch.arange(VOCAB)), ref)
    finally:
        for opt in opts:
            opt.close()
        for p in procs:
            stop(p, timeout=5)
