"""``wire_dtype``: a table's setting (not the ps's table), the ps's reading of a lookup's
dtypes, its lookup in them, and its row gradients taken narrow and cast up (no sockets)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import psflow.nn as pnn
import psflow.sparse.kernels as kernels
from psflow.nn import TableConfig
from psflow.protocol import Key, OptimizerSpec, RowOptimizerSpec, TableSpec
from psflow.ps.store import ShardStore
from psflow.ps.tables import build_tables, lookup_rows, row_dtypes, row_specs, sum_rows
from psflow.sparse import FixedRows
from psflow.sparse.optim import RowOptimizer
from psflow.train.alone import LocalTables
from psflow.worker.tables import narrowed, table_specs

HALVES = [torch.bfloat16, torch.float16]


def test_the_setting_is_the_configs_not_the_tables_the_ps_holds() -> None:
    """Checked where the config is made; the spec (what the ps creates, checkpoints and
    exports record) is the same whatever the wire dtype."""
    plain = TableConfig(num_embeddings=10, embedding_dim=4)
    for wire in (*HALVES, torch.float32):
        config = dataclasses.replace(plain, wire_dtype=wire)
        assert config.spec("emb") == plain.spec("emb")
        assert TableConfig.from_spec(config.spec("emb")) == plain
    assert dataclasses.replace(plain, wire_dtype=torch.bfloat16).wire_name() == "bfloat16"
    assert dataclasses.replace(plain, wire_dtype=torch.float32).wire_name() is None
    wide = TableConfig(num_embeddings=10, embedding_dim=4, dtype=torch.float64)
    assert dataclasses.replace(wide, wire_dtype=torch.float32).wire_name() == "float32"
    for bad in (torch.float64, torch.int8, "bfloat16"):
        with pytest.raises(ValueError, match=rf"TableConfig: wire_dtype={bad!r} is not supported"):
            TableConfig(num_embeddings=10, embedding_dim=4, wire_dtype=bad)  # type: ignore[arg-type]
    bag = pnn.EmbeddingBag(10, 4, mode="sum", wire_dtype=torch.bfloat16)
    assert bag.config.wire_dtype is torch.bfloat16


@pytest.mark.parametrize("wire", HALVES)
def test_a_table_held_here_has_no_wire(wire: torch.dtype) -> None:
    """A local module, and a cluster of one's tables, compute with the rows as held: the
    setting is accepted and changes nothing (there is no wire to cast for)."""
    emb = pnn.Embedding(20, 4, seed=3, wire_dtype=wire)
    ref = torch.nn.Embedding(20, 4, _weight=emb.weight.detach().clone())
    ids = torch.tensor([[1, 5], [5, 19]])
    assert torch.equal(emb(ids), ref(ids))
    table = pnn.Embedding(20, 4, seed=3, optimizer="SGD", wire_dtype=wire)
    model = torch.nn.Sequential(table)
    specs = table_specs({"0": table}, OptimizerSpec(name="SGD", kwargs={"lr": 0.1}))
    local = LocalTables(model, specs)
    assert torch.equal(model(ids), ref(ids))
    assert local.tables["0"].dtype == torch.float32


def _tables(hashed: bool = False) -> dict:  # type: ignore[type-arg]
    spec = TableSpec(
        name="emb",
        embedding_dim=6,
        num_embeddings=None if hashed else 30,
        optimizer=RowOptimizerSpec.of("Adagrad", lr=0.5),
    )
    return build_tables([spec], 0, 1)


@pytest.mark.parametrize("hashed", [False, True], ids=["fixed", "hashed"])
@pytest.mark.parametrize("wire", HALVES)
def test_lookup_in_a_wire_dtype_is_the_rows_cast(wire: torch.dtype, hashed: bool) -> None:
    """Into a reply's place (a lane) or not: bit for bit ``rows.to(wire)``."""
    tables = _tables(hashed)
    ids = {"emb": torch.tensor([3, 0, 17])}
    held = tables["emb"].lookup(ids["emb"])
    dtypes = row_dtypes({Key.ROW_DTYPES: {"emb": str(wire)[6:]}}, tables, ids)
    assert dtypes == {"emb": wire}
    assert row_specs(tables, ids, dtypes) == [(wire, (3, 6))]
    ((_, got),) = lookup_rows(tables, ids, dtypes=dtypes)
    place = torch.empty(3, 6, dtype=wire)
    ((_, placed),) = lookup_rows(tables, ids, [place], dtypes=dtypes)
    assert placed is place
    for rows in (got, placed):
        assert rows.dtype == wire and torch.equal(rows, held.to(wire))


def test_a_row_beyond_float16_is_refused_naming_its_table() -> None:
    tables = _tables()
    tables["emb"].values[4, 2] = -7e4
    ids = {"emb": torch.tensor([1, 4])}
    with pytest.raises(ValueError, match=r"table 'emb': a row does not fit float16.*7e\+04"):
        lookup_rows(tables, ids, dtypes={"emb": torch.float16})
    ((_, rows),) = lookup_rows(tables, ids, dtypes={"emb": torch.bfloat16})  # its range is wide
    assert torch.equal(rows, tables["emb"].values[[1, 4]].bfloat16())


def _store() -> ShardStore:
    store = ShardStore()
    store.initialize([], OptimizerSpec(name="SGD", kwargs={"lr": 0.1}), tables=_tables())
    return store


@pytest.mark.parametrize("wire", HALVES)
def test_a_narrow_gradient_is_applied_cast_up(wire: torch.dtype) -> None:
    """The rows after it are the row optimizer's over the gradient cast up, exactly; in a
    synchronous step the gradients are summed at float32."""
    store = _store()
    table = store.tables["emb"]
    assert isinstance(table, FixedRows)
    values = table.values.clone()
    state = {k: v.clone() for k, v in table.state.items()}
    ids = torch.tensor([2, 9, 11])
    grads = (torch.randn(3, 6, generator=torch.Generator().manual_seed(0)) * 1e-3).to(wire)
    store.apply([], rows={"emb": (ids, grads)})
    RowOptimizer(RowOptimizerSpec.of("Adagrad", lr=0.5)).apply(values, state, ids, grads.float())
    assert torch.equal(store.tables["emb"].values, values)
    (_, summed) = sum_rows([{"emb": (ids, grads)}, {"emb": (ids, grads)}])["emb"]
    assert summed.dtype == torch.float32 and torch.equal(summed, grads.float() * 2)


def test_a_gradient_that_is_not_finite_or_not_a_wire_dtype_changes_nothing() -> None:
    store = _store()
    before = store.tables["emb"].values.clone()
    ids = torch.tensor([2, 9])
    bad = torch.ones(2, 6, dtype=torch.float16)
    bad[1, 3] = float("inf")
    with pytest.raises(ValueError, match=r"table 'emb': a float16 row gradient is not finite"):
        store.apply([], rows={"emb": (ids, bad)})
    with pytest.raises(ValueError, match=r"table 'emb': gradient dtype int16 does not match"):
        store.apply([], rows={"emb": (ids, torch.ones(2, 6, dtype=torch.int16))})
    assert torch.equal(store.tables["emb"].values, before) and store.step == 0


def test_the_worker_refuses_a_gradient_that_does_not_fit() -> None:
    grads = torch.tensor([[1.0, -1e5]])
    assert torch.equal(narrowed("emb", grads, "bfloat16"), grads.bfloat16())
    with pytest.raises(
        ValueError, match=r"table 'emb': a row gradient does not fit float16.*1e\+05"
    ):
        narrowed("emb", grads, "float16")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"emb": "int8"}, r"table 'emb': rows travel as one of .*not 'int8'"),
        ({"emb": None}, r"table 'emb': rows travel as one of .*not None"),
        ({"other": "float16"}, r"names table 'other', whose rows the request does not ask"),
        (["emb"], r"'row_dtypes' must be a map"),
    ],
)
def test_a_bad_row_dtypes_is_refused_naming_it(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        row_dtypes({Key.ROW_DTYPES: value}, _tables(), ["emb"])


@pytest.mark.parametrize("dtype", [*HALVES, torch.float32, torch.float64])
def test_all_finite_finds_every_inf_and_nan(dtype: torch.dtype, path: str) -> None:
    """The bit test of a 16-bit float, and the kernels' of a float32 or float64 one (torch's
    ``isfinite`` on the fallback path), agree with ``torch.isfinite`` on their extremes."""
    info = torch.finfo(dtype)
    edges = [0.0, -0.0, info.max, -info.max, info.tiny, info.smallest_normal]
    finite = torch.cat([torch.randn(100), torch.tensor(edges, dtype=torch.float64)]).to(dtype)
    assert kernels.all_finite(finite) and kernels.all_finite(finite[:0])
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = finite.clone()
        t[57] = bad
        assert not kernels.all_finite(t), bad
        t = torch.cat([finite] * 40)  # past a vector's width, the bad value last
        t[-1] = bad
        assert not kernels.all_finite(t), bad
    native = kernels.native_finite(finite)
    if path == "native" and dtype in (torch.float32, torch.float64):
        assert native is True
        assert kernels.native_finite(torch.stack([finite, finite], 1)[:, 0]) is None  # strided
    else:
        assert native is None
