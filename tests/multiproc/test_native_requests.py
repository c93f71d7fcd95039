"""The native request paths (:mod:`psflow.ps.native`): a fixed table's lookups served and
its row gradients applied from the request's bytes, through a lane and through the socket, to
the bits of the Python path, and every bad request refused with the Python path's own words."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import psflow
import psflow.nn as pnn
import psflow.sparse.kernels as kernels
from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import TaskContext, TaskSpec
from psflow.protocol import Key, Op, RowOptimizerSpec
from psflow.protocol.messages import prefetch_tensor_names, row_tensor_names
from psflow.ps.exchange import ExchangeService
from psflow.ps.tables import TableService
from psflow.sparse import HashedRows, stripes
from psflow.transport import PeerError, TransportConfig, wire
from psflow.worker import DistributedOptimizer
from psflow.worker.engine import ExchangeEngine

from .support import worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

VOCAB, DIM = 40_000, 16
"""Rows of 64 bytes: a lookup of 300 ids travels inline, one of 20,000 in a frame of its own."""


@contextlib.contextmanager
def started(
    path: str,
    optimizer: RowOptimizerSpec | str = "Adagrad",
    vocab: int | None = VOCAB,
    *,
    config: pnn.TableConfig | None = None,
    model: torch.nn.Module | None = None,
    dense: str = "SGD",
    lr: float = 0.1,
    **settings: Any,
) -> Iterator[tuple[DistributedOptimizer, list[Any]]]:
    """Two in-process ps shards and a worker's optimizer attached to them, through lanes or
    the socket alone: for ``model`` (with ``dense`` for its dense layers), or one table
    (``config``, else ``mod``: fixed, or hashed with ``vocab`` ``None``)."""
    cluster = local_cluster(2, 1)
    transport = TransportConfig(timeout=30, shared_memory=path == "shm")
    servers = [
        psflow.ParameterServer(
            TaskContext(cluster=cluster, task=TaskSpec(job="ps", index=i)), transport=transport
        ).start()
        for i in range(2)
    ]
    if model is None:
        model = (
            pnn.Embedding(config=config)
            if config is not None
            else pnn.Embedding(vocab, DIM, seed=3, optimizer=optimizer)
        )
    opt = DistributedOptimizer(
        model, worker_ctx(cluster), optimizer=dense, lr=lr, transport=transport, **settings
    )
    try:
        yield opt, servers
    finally:
        opt.close()
        for s in servers:
            s.stop()


@pytest.fixture(params=["shm", "socket"])
def job(request: pytest.FixtureRequest) -> Iterator[tuple[DistributedOptimizer, list[Any]]]:
    with started(request.param) as out:
        yield out


def client_of(opt: DistributedOptimizer) -> Any:
    engine = opt.engine
    assert isinstance(engine, ExchangeEngine)
    return engine.exchange.tables.client


def native_of(server: psflow.ParameterServer) -> Any:
    (service,) = [s for s in server.services if isinstance(s, TableService)]
    return service.native


def native_push_of(server: psflow.ParameterServer) -> Any:
    (service,) = [s for s in server.services if isinstance(s, ExchangeService)]
    return service.native


def only_table(
    opt: DistributedOptimizer, servers: list[Any], *, native: bool
) -> tuple[Any, psflow.ParameterServer, str, Any]:
    """The worker's table client, shard 0 with its native pushes on or off, and its one table's
    name and rows."""
    server = servers[0]
    native_push_of(server).on = native
    ((name, table),) = server.store.tables.items()
    return client_of(opt), server, name, table


def push_rows(
    client: Any,
    name: str,
    ids: torch.Tensor,
    grads: torch.Tensor,
    shard: int = 0,
    dense: tuple[tuple[str, torch.Tensor], ...] = (),
):
    ids_name, grads_name = row_tensor_names(name)
    header = {Key.OP: Op.PUSH, Key.ROWS: [name]}
    return client.call({shard: header}, {shard: [*dense, (ids_name, ids), (grads_name, grads)]})


def table_state(server: psflow.ParameterServer) -> dict[str, torch.Tensor]:
    (table,) = server.store.tables.values()
    return {"values": table.values.clone(), **{k: t.clone() for k, t in table.state.items()}}


def set_table_state(server: psflow.ParameterServer, state: dict[str, torch.Tensor]) -> None:
    (table,) = server.store.tables.values()
    table.values.copy_(state["values"])
    for k, t in table.state.items():
        t.copy_(state[k])


def held_rows(server: psflow.ParameterServer, ids: torch.Tensor) -> torch.Tensor:
    """The rows of ``ids`` as the shard holds them (``mod``: id // 2 is the row)."""
    (table,) = server.store.tables.values()
    return table.values[ids // 2].clone()


@pytest.mark.parametrize("count", [0, 1, 300, 20_000])
def test_native_lookups_are_the_shards_rows(
    job: tuple[DistributedOptimizer, list[Any]], count: int
) -> None:
    opt, servers = job
    client = client_of(opt)
    ids = torch.randperm(VOCAB // 2, generator=torch.Generator().manual_seed(count))[:count] * 2
    name = next(iter(servers[0].store.tables))
    before = native_of(servers[0]).served
    (header, tensors), = client.lookup({0: [(name, ids)]}).values()  # fmt: skip
    assert native_of(servers[0]).served == before + 1
    ((got_name, rows),) = tensors
    assert got_name == name and rows.dtype == torch.float32 and rows.shape == (count, DIM)
    assert torch.equal(rows, servers[0].store.tables[name].values[ids // 2])
    assert header[Key.STEP] == 0


def test_the_python_path_gives_the_same_rows(job: tuple[DistributedOptimizer, list[Any]]) -> None:
    opt, servers = job
    client = client_of(opt)
    name = next(iter(servers[1].store.tables))
    ids = torch.arange(1, 2001, 2)  # shard 1's
    native = client.lookup({1: [(name, ids)]})[1][1][0][1].clone()
    native_of(servers[1]).on = False
    served = native_of(servers[1]).served
    python = client.lookup({1: [(name, ids)]})[1][1][0][1].clone()
    assert native_of(servers[1]).served == served  # not served natively
    assert torch.equal(native, python)


BAD_LOOKUPS = {
    "out of range": lambda name: [(name, torch.tensor([2, VOCAB + 2]))],
    "negative": lambda name: [(name, torch.tensor([-2]))],
    "another shard's": lambda name: [(name, torch.tensor([2, 5]))],
    "twice": lambda name: [(name, torch.tensor([4, 6, 4]))],
    "not int64": lambda name: [(name, torch.tensor([2], dtype=torch.int32))],
    "floats": lambda name: [(name, torch.tensor([2.0]))],
    "2-D": lambda name: [(name, torch.tensor([[2, 4]]))],
    "unknown table": lambda name: [("nothing", torch.tensor([2]))],
    "one bad of two": lambda name: [(name, torch.tensor([2])), ("nothing", torch.tensor([2]))],
}


@pytest.mark.parametrize("case", sorted(BAD_LOOKUPS))
def test_bad_lookups_get_the_python_paths_refusal(
    job: tuple[DistributedOptimizer, list[Any]], case: str
) -> None:
    """Each refusal is word for word the Python path's, and the shard serves on."""
    opt, servers = job
    client = client_of(opt)
    name = next(iter(servers[0].store.tables))
    before = held_rows(servers[0], torch.arange(0, 20, 2))
    refusals = []
    for native in (True, False):
        native_of(servers[0]).on = native
        with pytest.raises(PeerError) as e:
            client.lookup({0: BAD_LOOKUPS[case](name)})
        refusals.append((str(e.value), e.value.code))
    assert refusals[0] == refusals[1]
    native_of(servers[0]).on = True
    assert torch.equal(held_rows(servers[0], torch.arange(0, 20, 2)), before)
    ok = client.lookup({0: [(name, torch.tensor([0, 2]))]})[0][1][0][1]
    assert torch.equal(ok, before[:2])


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_rows_in_another_dtype_are_native_and_the_python_paths(
    job: tuple[DistributedOptimizer, list[Any]], wire: str
) -> None:
    """Rows asked narrower than the table (``row_dtypes``): gathered by the kernels, cast as
    the Python path casts them, the same bits; a row beyond float16's range refused in the
    Python path's words, natively too."""
    opt, servers = job
    client = client_of(opt)
    server = servers[0]
    name = next(iter(server.store.tables))
    ids = torch.tensor([0, 2, 4])
    got = []
    for native in (True, False):
        native_of(server).on = native
        served = native_of(server).served
        rows = client.lookup({0: [(name, ids)]}, row_dtypes={name: wire})[0][1][0][1]
        assert native_of(server).served == served + native
        got.append(rows.clone())
    assert got[0].dtype == getattr(torch, wire)
    assert torch.equal(got[0].view(torch.int16), got[1].view(torch.int16))
    assert torch.equal(got[0], held_rows(server, ids).to(getattr(torch, wire)))
    (table,) = server.store.tables.values()
    table.values[1, 3] = 1e6  # id 2's row: beyond float16's 65,504
    refusals = []
    for native in (True, False):
        native_of(server).on = native
        try:
            client.lookup({0: [(name, ids)]}, row_dtypes={name: wire})
            refusals.append(None)
        except PeerError as e:
            refusals.append(str(e))
    native_of(server).on = True
    assert refusals[0] == refusals[1]
    if wire == "float16":
        assert refusals[0] is not None and "a row does not fit float16" in refusals[0]
    else:
        assert refusals[0] is None


def test_a_malformed_lookup_is_refused_as_malformed(
    job: tuple[DistributedOptimizer, list[Any]],
) -> None:
    """A header whose tensor list does not match its bytes: the Python path's WireError."""
    opt, servers = job
    client = client_of(opt)
    name = next(iter(servers[0].store.tables))
    header = {Key.OP: Op.LOOKUP, Key.TENSORS: [[name, "int64", [3]]], Key.INLINE: bytes(16)}
    with pytest.raises(PeerError, match="inline data holds 16 bytes"):
        client.call({0: header})
    assert isinstance(wire.WireError("x"), ValueError)


OPTIMIZERS = {
    "SGD": RowOptimizerSpec.of("SGD", lr=0.05),
    "Adagrad": RowOptimizerSpec.of("Adagrad", lr=0.05, initial_accumulator_value=0.1),
    "RowWiseAdagrad": RowOptimizerSpec.of("RowWiseAdagrad", lr=0.05),
    "Adam": RowOptimizerSpec.of("Adam", lr=0.01),
    "Ftrl": RowOptimizerSpec.of("Ftrl", lr=0.05, l1=0.001, l2=0.01),
}


@pytest.mark.parametrize("path", ["shm", "socket"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_native_pushes_give_the_python_paths_bits(path: str, optimizer: str) -> None:
    """Three pushes (small, inline; large, in frames or the lane) applied natively, then the
    same three through the Python path from the same rows and state: the same bits."""
    with started(path, OPTIMIZERS[optimizer]) as (opt, servers):
        client = client_of(opt)
        server = servers[0]
        name = next(iter(server.store.tables))
        g = torch.Generator().manual_seed(7)
        pushes = []
        for count in (3, 5000, 12_000):
            ids = torch.randperm(VOCAB // 2, generator=g)[:count] * 2
            pushes.append((ids, torch.randn(count, DIM, generator=g)))
        start = table_state(server)
        results = []
        for native in (True, False):
            set_table_state(server, start)
            native_push_of(server).on = native
            served = native_push_of(server).served
            steps = [push_rows(client, name, ids, grads)[0][0][Key.STEP] for ids, grads in pushes]
            assert native_push_of(server).served == served + (3 if native else 0)
            assert steps == sorted(steps) and len(set(steps)) == 3
            results.append(table_state(server))
        assert results[0].keys() == results[1].keys()
        for key in results[0]:
            assert torch.equal(results[0][key], results[1][key]), key
        assert not torch.equal(results[0]["values"], start["values"])


def test_striped_native_pushes_give_one_threads_bits() -> None:
    """With row threads (PSFLOW_PS_THREADS), the native path applies in stripes: the bits of
    one thread."""
    with started("shm") as (opt, servers):
        client = client_of(opt)
        server = servers[0]
        name = next(iter(server.store.tables))
        ids = torch.arange(0, 2 * 6000, 2)
        grads = torch.randn(6000, DIM, generator=torch.Generator().manual_seed(1))
        start = table_state(server)
        results = []
        for threads in (1, 3):
            stripes.set_threads(threads)
            try:
                set_table_state(server, start)
                served = native_push_of(server).served
                push_rows(client, name, ids, grads)
                assert native_push_of(server).served == served + 1
                results.append(table_state(server))
            finally:
                stripes.set_threads(1)
        for key in results[0]:
            assert torch.equal(results[0][key], results[1][key]), key


BAD_PUSHES = {
    "out of range": lambda: (torch.tensor([2, VOCAB + 2]), torch.ones(2, DIM)),
    "another shard's": lambda: (torch.tensor([2, 5]), torch.ones(2, DIM)),
    "twice": lambda: (torch.tensor([4, 6, 4]), torch.ones(3, DIM)),
    "narrow gradients": lambda: (torch.tensor([2]), torch.ones(1, DIM - 1)),
    "float64 gradients": lambda: (torch.tensor([2]), torch.ones(1, DIM, dtype=torch.float64)),
    "int32 ids": lambda: (torch.tensor([2], dtype=torch.int32), torch.ones(1, DIM)),
    "fewer gradients": lambda: (torch.tensor([2, 4]), torch.ones(1, DIM)),
    "an unknown dense gradient": lambda: (
        torch.tensor([2]),
        torch.ones(1, DIM),
        0,
        (("bias", torch.ones(3)),),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_bad_pushes_get_the_python_paths_refusal_and_change_nothing(
    job: tuple[DistributedOptimizer, list[Any]], case: str
) -> None:
    opt, servers = job
    client = client_of(opt)
    server = servers[0]
    name = next(iter(server.store.tables))
    start = table_state(server)
    step = server.store.step
    refusals = []
    for native in (True, False):
        native_push_of(server).on = native
        with pytest.raises(PeerError) as e:
            push_rows(client, name, *BAD_PUSHES[case]())
        refusals.append((str(e.value), e.value.code))
    native_push_of(server).on = True
    assert refusals[0] == refusals[1]
    assert server.store.step == step
    for key, t in table_state(server).items():
        assert torch.equal(t, start[key]), key
    push_rows(client, name, torch.tensor([2]), torch.ones(1, DIM))  # and it serves on
    assert server.store.step == step + 1


def hashed_state(server: psflow.ParameterServer) -> dict[str, torch.Tensor]:
    """A hashed shard's rows as it holds them, slot by slot."""
    (table,) = server.store.tables.values()
    n = table.num_rows
    held = {"values": table.values, "slot_ids": table.slot_ids, "last_update": table.last_update}
    return {k: t[:n].clone() for k, t in {**held, **table.state}.items()}


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_hashed_tables_are_native_once_their_ids_are_held(path: str) -> None:
    """The same requests against two hashed shards, one native and one not: the same replies
    and the same rows, slot by slot, every request native (ids the table does not hold yet
    get their rows made in a push, their initial rows in a lookup)."""
    g = torch.Generator().manual_seed(5)
    first = torch.randperm(5000, generator=g)[:3000] * 2
    more = torch.cat([first[:1000], torch.arange(20_000, 22_000, 2)])  # 1,000 of them new
    requests = [
        ("push", first), ("push", first), ("lookup", first), ("push", more),
        ("lookup", torch.cat([first[:10], torch.tensor([90_000])])), ("push", first.flip(0)),
        ("lookup", more), ("zeros", torch.cat([torch.tensor([90_002]), first[:10]])),
    ]  # fmt: skip
    grads = {i: torch.randn(len(ids), DIM, generator=g) for i, (_, ids) in enumerate(requests)}
    outcomes = []
    for native in (True, False):
        with started(path, vocab=None) as (opt, servers):
            client = client_of(opt)
            server = servers[0]
            native_of(server).on = native_push_of(server).on = native
            name = next(iter(server.store.tables))
            replies = []
            for i, (op, ids) in enumerate(requests):
                if op == "push":
                    replies.append(push_rows(client, name, ids, grads[i])[0][0][Key.STEP])
                else:  # "zeros": an evaluation's lookup, zeros where no row is held
                    reply = client.lookup({0: [(name, ids)]}, absent_zeros=op == "zeros")
                    replies.append(reply[0][1][0][1].clone())
            served = (native_push_of(server).served, native_of(server).served)
            outcomes.append((replies, hashed_state(server), served))
    (native_replies, native_rows, served), (python_replies, python_rows, none) = outcomes
    # Every push (the new ids' rows made by the table within it) and every lookup (5 and 8
    # ask for an id no one pushed: its initial row, or zeros, beside the held ones).
    assert served == (4, 4) and none == (0, 0)
    assert not native_replies[-1][0].any() and native_replies[-1][1:].all()
    for a, b in zip(native_replies, python_replies, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert native_rows.keys() == python_rows.keys()
    for key in native_rows:
        assert torch.equal(native_rows[key], python_rows[key]), key


@pytest.mark.parametrize("optimizer", ["Adagrad", "RowWiseAdagrad"])
@pytest.mark.parametrize("path", ["shm", "socket"])
def test_a_full_hashed_table_evicts_what_the_python_path_evicts(path: str, optimizer: str) -> None:
    """Room for 4 rows: a push that updates held rows and brings new ones evicts the least
    recently updated of the others, never a row it updates, and drops the new ids that do not
    fit (their gradients with them), as the Python path, push by push (the row-wise Adagrad's
    state one value a row: its slots move with the rows too)."""
    config = pnn.TableConfig(
        num_embeddings=None, embedding_dim=DIM, optimizer=optimizer, max_rows=4
    )
    # The third push updates 6 and brings three new ids: 2 and 4 go, then 8 (last updated
    # with 6, by the second push), never 6.
    pushes = [[2, 4], [8, 6], [6, 10, 12, 14], [4, 2, 18], [10, 20], [30, 32, 34, 36, 38]]
    g = torch.Generator().manual_seed(6)
    grads = [torch.randn(len(ids), DIM, generator=g) for ids in pushes]
    outcomes = []
    for native in (True, False):
        with started(path, config=config) as (opt, servers):
            client, server, name, table = only_table(opt, servers, native=native)
            states = []
            for ids, grad in zip(pushes, grads, strict=True):
                push_rows(client, name, torch.tensor(ids), grad)
                stats = torch.tensor(list(table.stats.values()))
                states.append({**hashed_state(server), "stats": stats})
            outcomes.append((states, native_push_of(server).served))
    (native_states, served), (python_states, none) = outcomes
    assert served == len(pushes) and none == 0
    evicted, _, dropped = native_states[-1]["stats"].tolist()[-3:]
    assert evicted > 0 and dropped == 1
    for native_rows, python_rows in zip(native_states, python_states, strict=True):
        assert native_rows.keys() == python_rows.keys()
        for key in native_rows:
            assert torch.equal(native_rows[key], python_rows[key]), key


@pytest.mark.parametrize("vocab", [VOCAB, None], ids=["fixed", "hashed"])
def test_a_padding_idx_is_native_and_its_row_never_changes(vocab: int | None) -> None:
    """Pushes with a table's padding id among their ids: natively, its gradient dropped once
    the ids are checked and the rest applied as the Python path applies them, the same rows;
    the padding row stays zeros; the padding id twice is refused in the Python path's words."""
    pad = 6
    config = pnn.TableConfig(
        num_embeddings=vocab, embedding_dim=DIM, optimizer="Adagrad", padding_idx=pad
    )
    g = torch.Generator().manual_seed(4)
    pushes = [torch.tensor([pad, 2, 4]), torch.tensor([8, 2, pad, 10]), torch.tensor([pad])]
    grads = [torch.randn(len(ids), DIM, generator=g) for ids in pushes]
    outcomes = []
    for native in (True, False):
        with started("shm", config=config) as (opt, servers):
            client = client_of(opt)
            server = servers[0]
            native_of(server).on = native_push_of(server).on = native
            name = next(iter(server.store.tables))
            for ids, grad in zip(pushes, grads, strict=True):
                push_rows(client, name, ids, grad)
            with pytest.raises(PeerError) as twice:
                push_rows(client, name, torch.tensor([pad, 2, pad]), torch.ones(3, DIM))
            rows = client.lookup({0: [(name, torch.tensor([pad, 2, 4, 8, 10]))]})[0][1][0][1]
            state = table_state(server) if vocab else hashed_state(server)
            outcomes.append((rows.clone(), state, str(twice.value), native_push_of(server).served))
    (rows, state, refusal, served), python = outcomes
    assert served == 3 and python[3] == 0
    assert not rows[0].any() and rows[1:].all()
    assert refusal == python[2] and "id 6 appears more than once" in refusal
    assert torch.equal(rows, python[0])
    for key in state:
        assert torch.equal(state[key], python[1][key]), key


@pytest.mark.parametrize("vocab", [VOCAB, None], ids=["fixed", "hashed"])
def test_pushes_while_a_snapshot_is_taken_are_native_and_keep_its_moment(
    vocab: int | None,
) -> None:
    """A snapshot begun (as a checkpoint begins it), then pushes (ids new to a hashed table
    among them): natively, the rows they change are kept first, so the snapshot holds the
    rows of its moment, bit for bit the Python path's, and the rows after them are its too."""
    g = torch.Generator().manual_seed(6)
    a = torch.randperm(2000, generator=g)[:800] * 2
    pushes = [a, a[:300], torch.cat([a[200:500], torch.arange(9000, 9200, 2)])]
    grads = [torch.randn(len(ids), DIM, generator=g) for ids in pushes]
    outcomes = []
    for native in (True, False):
        with started("shm", vocab=vocab) as (opt, servers):
            client, server, name, table = only_table(opt, servers, native=native)
            push_rows(client, name, pushes[0], grads[0])
            moment = table.values[: table.num_rows].clone()
            snapshot = table.begin_snapshot()
            for ids, grad in zip(pushes[1:], grads[1:], strict=True):
                push_rows(client, name, ids, grad)
            kept = snapshot.result()
            state = table_state(server) if vocab else hashed_state(server)
            outcomes.append((moment, kept, state, native_push_of(server).served))
    (moment, kept, state, served), python = outcomes
    assert served == 3 and python[3] == 0
    assert torch.equal(kept["values"], moment) and not torch.equal(
        state["values"][: len(moment)], moment
    )
    assert kept.keys() == python[1].keys()
    for key in kept:
        assert torch.equal(kept[key], python[1][key]), key
    for key in state:
        assert torch.equal(state[key], python[2][key]), key


class Clock:
    """A table's clock, moved by the test: no test waits for an expiry."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_a_time_to_live_is_native_and_expires_as_the_python_path(path: str) -> None:
    """A hashed table with a time to live, its clock moved by hand between requests: rows
    expire as a push, a lookup or a push's prefetch begins (the scan when due), natively as in
    the Python path: the same replies and the same rows, times and counts, slot by slot."""
    config = pnn.TableConfig(
        num_embeddings=None, embedding_dim=DIM, optimizer="Adagrad", ttl_seconds=10.0
    )
    g = torch.Generator().manual_seed(9)
    a = torch.randperm(3000, generator=g)[:1000] * 2
    b, c = a[:300], torch.arange(8000, 8400, 2)
    requests = [  # (seconds on, op, ids): a's rows not in b expire at 111 (updated at 100)
        (0, "push", a), (6, "push", b), (0, "lookup", a), (5, "lookup", a), (0, "push", c),
        (3, "prefetch", torch.cat([b, c])), (8, "push", b), (3, "lookup", torch.cat([a[:500], c])),
    ]  # fmt: skip
    grads = [torch.randn(len(ids), DIM, generator=g) for _, _, ids in requests]
    outcomes = []
    for native in (True, False):
        with started(path, config=config) as (opt, servers):
            client = client_of(opt)
            server = servers[0]
            (table,) = server.store.tables.values()
            clock = Clock()
            table._clock = clock
            native_of(server).on = native_push_of(server).on = native
            name = next(iter(server.store.tables))
            replies: list[Any] = []
            for (seconds, op, ids), grad in zip(requests, grads, strict=True):
                clock.now += seconds
                if op == "push":
                    replies.append(push_rows(client, name, ids, grad)[0][0][Key.STEP])
                elif op == "lookup":
                    replies.append(client.lookup({0: [(name, ids)]})[0][1][0][1].clone())
                else:  # a push that brings the rows of the same ids, read after its update
                    ids_name, grads_name = row_tensor_names(name)
                    header = {Key.OP: Op.PUSH, Key.ROWS: [name], Key.PREFETCH: [name]}
                    tensors = [(ids_name, ids), (grads_name, grad)]
                    tensors.append((prefetch_tensor_names(name)[0], ids))
                    reply = client.call({0: header}, {0: tensors})[0]
                    replies.append(dict(reply[1])[prefetch_tensor_names(name)[1]].clone())
            state = hashed_state(server)
            assert table.updated_at is not None
            state["updated_at"] = table.updated_at[: table.num_rows].clone()
            served = (native_push_of(server).served, native_of(server).served)
            outcomes.append((replies, state, table.stats, served))
    (native_replies, native_rows, native_stats, served), python = outcomes
    assert served == (5, 3) and python[3] == (0, 0)
    assert native_stats == python[2] and native_stats["expired"] == 700 + 200
    for x, y in zip(native_replies, python[0], strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert native_rows.keys() == python[1].keys()
    for key in native_rows:
        assert torch.equal(native_rows[key], python[1][key]), key


class Mixed(torch.nn.Module):
    """A fixed table (Adagrad), a hashed one (FTRL) and a dense head (Adam on the ps): each
    push carries dense gradients, both tables' rows and the next batch's ids."""

    def __init__(self, items_wire: torch.dtype | None = None, **users: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = pnn.Embedding(VOCAB, DIM, seed=1, optimizer="Adagrad", wire_dtype=items_wire)
        ftrl = RowOptimizerSpec.of("Ftrl", lr=0.05, l1=0.001)
        config = pnn.TableConfig(
            num_embeddings=None, embedding_dim=DIM, seed=2, optimizer=ftrl, **users
        )
        self.users = pnn.Embedding(config=config)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.items(items), self.users(users)], 1)).squeeze(1)


def train_mixed(
    path: str,
    native: bool,
    steps: int = 8,
    users: int = 6,
    items_wire: torch.dtype | None = None,
    **table: Any,
) -> dict[str, Any]:
    """Steps of :class:`Mixed` with the next batch's rows prefetched (its users' ids from
    ``[-users, users)``, its hashed table's settings ``table``, its fixed table's rows on the
    wire in ``items_wire``), against 2 in-process shards whose native paths are on or off: the
    losses, what the shards hold, and how many pushes the native path served."""
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randint(0, 64, (32,), generator=g), torch.randint(-users, users, (32,), generator=g))
        for _ in range(steps + 1)
    ]
    ys = [torch.randn(32, generator=g) for _ in range(steps)]
    model = Mixed(items_wire, **table)
    with started(path, model=model, dense="Adam", lr=0.01) as (opt, servers):
        for s in servers:
            native_of(s).on = native_push_of(s).on = native
        losses = []
        for step in range(steps):
            items, users = batches[step]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(items, users), ys[step])
            loss.backward()
            model.items.prefetch(batches[step + 1][0])
            model.users.prefetch(batches[step + 1][1])
            opt.step()
            losses.append(loss.item())
        held = {}
        for i, s in enumerate(servers):
            for name, t in s.store.variables.items():
                held[f"{i}/{name}"] = t.clone()
            for name, rows in s.store.tables.items():
                n = rows.num_rows
                kept = {"values": rows.values, **rows.state}
                for part in ("slot_ids", "last_update"):  # a hashed table's
                    if hasattr(rows, part):
                        kept[part] = getattr(rows, part)
                for key, t in kept.items():
                    held[f"{i}/{name}/{key}"] = t[:n].clone()
                held[f"{i}/{name}/stats"] = torch.tensor(list(rows.stats.values()))
        served = sum(native_push_of(s).served for s in servers)
        return {"losses": losses, "held": held, "served": served}


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_pushes_with_dense_gradients_and_a_prefetch_give_the_python_paths_bits(
    path: str,
) -> None:
    native, python = train_mixed(path, True), train_mixed(path, False)
    assert python["served"] == 0 and native["served"] >= 12  # of 16 pushes (2 shards): 14
    assert native["losses"] == python["losses"]
    assert native["held"].keys() == python["held"].keys()
    for key, t in native["held"].items():
        assert torch.equal(t, python["held"][key]), key


@pytest.mark.parametrize(
    "items, users", [(None, torch.bfloat16), (torch.float16, torch.float16)], ids=["bf16", "fp16"]
)
def test_rows_and_gradients_at_half_width_give_the_python_paths_bits(
    items: torch.dtype | None, users: torch.dtype
) -> None:
    """Rows and row gradients on the wire at half width (``wire_dtype``: the hashed table's,
    then both tables'): the gradients cast up and the prefetched rows cast down by the native
    path as by the Python path, the dense values beside them; the same losses and rows."""
    native = train_mixed("shm", True, items_wire=items, wire_dtype=users)
    python = train_mixed("shm", False, items_wire=items, wire_dtype=users)
    assert python["served"] == 0 and native["served"] >= 12
    assert native["losses"] == python["losses"]
    for key, t in native["held"].items():
        assert torch.equal(t, python["held"][key]), key


@pytest.mark.parametrize("vocab", [VOCAB, None])
def test_native_pushes_mark_the_rows_an_export_tracks(vocab: int | None) -> None:
    """After an export, the rows the native path updates are the next delta's, as the Python
    path's are: the same ids and values, fixed and hashed."""
    g = torch.Generator().manual_seed(9)
    first = torch.randperm(3000, generator=g)[:1000] * 2
    pushes = [first, first[:300], first[300:700]]  # held once the first push made them
    grads = [torch.randn(len(ids), DIM, generator=g) for ids in pushes]
    deltas = []
    for native in (True, False):
        with started("shm", vocab=vocab) as (opt, servers):
            client, server, name, table = only_table(opt, servers, native=native)
            push_rows(client, name, pushes[0], grads[0])  # hashed: makes the rows (Python)
            table.begin_export(base=True).rows.result()  # between requests: the client waits
            served = native_push_of(server).served
            for ids, g_ in zip(pushes[1:], grads[1:], strict=True):
                push_rows(client, name, ids, g_)
            assert native_push_of(server).served == served + (2 if native else 0)
            delta = table.begin_export(base=False).rows.result()
            order = delta["ids"].argsort()
            deltas.append({k: t[order] for k, t in delta.items()})
    assert deltas[0].keys() == deltas[1].keys()
    for key in deltas[0]:
        assert torch.equal(deltas[0][key], deltas[1][key]), key
    assert torch.equal(deltas[0]["ids"], first[:700].sort().values)


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_new_ids_admission_and_eviction_stay_the_python_paths(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New ids every step, admitted at their second push, the table capped at 60 rows (the
    least recently updated evicted): inside a native push a table with new ids makes their
    rows as the Python path's apply does (``HashedRows.make_rows``), the kernels update them,
    and the next ids not held get their initial rows (``lookup_mapped``); the shards end with
    the Python path's bits, slot by slot, and its counts."""
    applies = []
    apply = HashedRows.apply
    monkeypatch.setattr(HashedRows, "apply", lambda *a: applies.append(1) or apply(*a))
    table = {"min_count": 2, "max_rows": 60}
    native = train_mixed(path, True, steps=10, users=200, **table)
    assert not applies  # every row update was the kernels'
    python = train_mixed(path, False, steps=10, users=200, **table)
    assert applies
    assert python["served"] == 0 and native["served"] == 20
    assert native["losses"] == python["losses"]
    assert native["held"].keys() == python["held"].keys()
    for key, t in native["held"].items():
        assert torch.equal(t, python["held"][key]), key


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_tables_on_the_jobs_scheduled_optimizer_give_the_python_paths_bits(path: str) -> None:
    """Tables that take the job's optimizer follow its schedule on both shards (shard 1 learns
    the global step from the pushes): the Python path's bits, the pushes native."""
    outcomes = []
    for native in (True, False):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict(
            {
                "fixed": pnn.Embedding(VOCAB, DIM, seed=1),
                "hashed": pnn.Embedding(None, DIM, seed=2),
                "head": torch.nn.Linear(2 * DIM, 1),
            }
        )
        schedule = ("StepLR", {"step_size": 2, "gamma": 0.5})
        with started(path, model=model, dense="Adagrad", lr=0.3, lr_schedule=schedule) as (
            opt,
            servers,
        ):
            for s in servers:
                native_push_of(s).on = native
            g = torch.Generator().manual_seed(4)
            losses = []
            for _ in range(7):
                items = torch.randint(0, 64, (16,), generator=g)
                users = torch.randint(-5, 5, (16,), generator=g)
                opt.zero_grad()
                x = torch.cat([model["fixed"](items), model["hashed"](users)], 1)
                loss = model["head"](x).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            held = {
                f"{i}/{name}": t.values[: t.num_rows].clone()
                for i, s in enumerate(servers)
                for name, t in s.store.tables.items()
            }
            served = sum(native_push_of(s).served for s in servers)
            outcomes.append((losses, held, served))
    (losses, held, served), (python_losses, python_held, none) = outcomes
    assert served == 14 and none == 0
    assert losses == python_losses
    for key, t in held.items():
        assert torch.equal(t, python_held[key]), key


@pytest.mark.parametrize("native", [True, False])
def test_a_replayed_input_is_dropped_and_a_bad_position_refused_as_in_python(
    native: bool,
) -> None:
    """Pushes with input positions (exactly-once input): the first applied and recorded, its
    replay answered without an update, a malformed position refused before anything changes;
    native or not, the same."""
    with started("shm") as (opt, servers):
        client = client_of(opt)
        server = servers[0]
        native_push_of(server).on = native
        name = next(iter(server.store.tables))
        ids_name, grads_name = row_tensor_names(name)
        tensors = {0: [(ids_name, torch.tensor([2, 4])), (grads_name, torch.ones(2, DIM))]}

        def push(seq: Any, position: Any = None) -> Any:
            header = {
                Key.OP: Op.PUSH, Key.ROWS: [name], Key.INPUT_SEQ: seq,
                Key.INPUT_POSITION: position or {"offset": 7}, Key.INPUT_EPOCH:
                server.store.inputs.epoch,
            }  # fmt: skip
            return client.call({0: header}, tensors)[0][0][Key.STEP]

        step = server.store.step
        assert push([3]) == step + 1
        after = held_rows(server, torch.tensor([2, 4]))
        assert push([3]) == step + 1  # a replay: dropped
        assert torch.equal(held_rows(server, torch.tensor([2, 4])), after)
        assert server.store.inputs.of("worker:0") == [[3], {"offset": 7}]
        with pytest.raises(PeerError, match="input_position"):
            push([4], position=[1, 2])
        assert server.store.step == step + 1
        assert native_push_of(server).served == (2 if native else 0)  # the refused one: none


@pytest.mark.parametrize("path", ["shm", "socket"])
def test_a_push_takes_its_lookups_rows_while_the_table_keeps_them(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push of the ids its task just looked up takes the rows that lookup found instead of
    mapping them again (``MappedIds``) while no row held then has gone, the ids not held then
    found again (another task's push may have made their rows); after rows were evicted in
    between (a full hashed table moves its last rows into the holes), and for ids in another
    order, they are mapped again (that lookup kept: a task's last two are). The other task's pushes here are the Python path's (which
    leave the lookup kept). Every state is the Python path's, slot by slot."""
    mapped = []
    map_rows = kernels.map_rows
    monkeypatch.setattr(kernels, "map_rows", lambda *a, **k: mapped.append(1) or map_rows(*a, **k))
    config = pnn.TableConfig(
        num_embeddings=None, embedding_dim=DIM, optimizer="Adagrad", max_rows=8
    )
    steps = [
        ("push", [2, 4, 6, 8, 10, 12]),
        ("lookup", [12, 8, 6]), ("push", [12, 8, 6]),  # taken: nothing changed
        ("lookup", [10, 12, 20]), ("python", [20, 22]),  # rows made, none gone
        ("push", [10, 12, 20]),  # taken, 20's row found: held now
        ("lookup", [10, 12]), ("python", [14, 16, 18]),  # full: three go, rows move
        ("push", [10, 12]),  # the lookup's rows may be others' now: mapped again
        ("lookup", [16, 18]), ("push", [18, 16]),  # another order: mapped again
        ("lookup", [16, 18, 30]), ("push", [16, 18, 30]),  # 30 not held: taken as -1, made
    ]  # fmt: skip
    g = torch.Generator().manual_seed(8)
    grads = [torch.randn(len(ids), DIM, generator=g) for _, ids in steps]
    outcomes = []
    for native in (True, False):
        with started(path, config=config) as (opt, servers):
            client = client_of(opt)
            server = servers[0]
            native_of(server).on = native
            ((name, table),) = server.store.tables.items()
            mapped.clear()
            states, kept = [], []
            for (op, ids), grad in zip(steps, grads, strict=True):
                if op == "lookup":
                    client.lookup({0: [(name, torch.tensor(ids))]})
                else:
                    native_push_of(server).on = native and op == "push"
                    push_rows(client, name, torch.tensor(ids), grad)
                    states.append({**hashed_state(server), "mapped": torch.tensor(len(mapped))})
                kept.append(len(table.mapped))
            outcomes.append((states, kept, native_push_of(server).served, table.stats))
    (native_states, kept, served, stats), (python_states, _, none, python_stats) = outcomes
    assert served == 6 and none == 0
    # The kernels mapped the first push's ids and those after an eviction or in another order.
    assert [int(s.pop("mapped")) for s in native_states] == [1, 1, 1, 1, 1, 2, 3, 3]
    # Kept until its task's push of those ids: a push of others (the other order) leaves it,
    # as a push in flight while the next step computes has the lookup before the last.
    assert kept == [0, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1]
    assert stats == python_stats and stats["evicted"] >= 3
    for native_rows, python_rows in zip(native_states, python_states, strict=True):
        python_rows.pop("mapped")
        assert native_rows.keys() == python_rows.keys()
        for key in native_rows:
            assert torch.equal(native_rows[key], python_rows[key]), key
