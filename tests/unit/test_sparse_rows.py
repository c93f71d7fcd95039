"""Sparse tables: specs, initial rows, partitions, and one shard's rows (fixed and hashed)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse import FixedRows, HashedRows, Partition, Rows, initial_rows, kernels, make_rows
from psflow.sparse import init as init_module
from psflow.sparse.admission import Admission

pytestmark = pytest.mark.unit

F64 = torch.float64


def fixed(n: int = 20, dim: int = 4, **kwargs: object) -> TableSpec:
    return TableSpec(name="emb", embedding_dim=dim, num_embeddings=n, dtype="float64", **kwargs)


def hashed(dim: int = 4, **kwargs: object) -> TableSpec:
    return TableSpec(name="ids", embedding_dim=dim, num_embeddings=None, dtype="float64", **kwargs)


# -- TableSpec -----------------------------------------------------------------------------


def test_table_spec_wire_round_trip() -> None:
    for spec in (
        fixed(partition="div", padding_idx=3, seed=7, init_std=0.1),
        hashed(min_count=3, max_rows=100, optimizer=RowOptimizerSpec.of("Adam", betas=(0.5, 0.9))),
        fixed(optimizer=RowOptimizerSpec.of("SGD", lr=0.5), scheduled=True),
    ):
        assert TableSpec.from_wire(spec.to_wire()) == spec
    # A spec from before ``scheduled`` existed (a checkpoint's manifest) reads as not scheduled.
    old = fixed().to_wire()
    del old["scheduled"]
    assert TableSpec.from_wire(old) == fixed()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"embedding_dim": 0}, "table 'emb': embedding_dim must be an integer >= 1"),
        ({"num_embeddings": 0}, "num_embeddings"),
        ({"partition": "range"}, "partition"),
        ({"num_embeddings": None, "partition": "div"}, "partition 'div' needs num_embeddings"),
        ({"dtype": "float16"}, "dtype"),
        ({"seed": 1.5}, "seed"),
        ({"init_std": -1.0}, "init_std"),
        ({"padding_idx": 10}, r"padding_idx must be in \[0, 10\)"),
        ({"padding_idx": -1}, "padding_idx"),
        ({"min_count": 2}, "min_count and max_rows are for hashed tables"),
        ({"max_rows": 5}, "hashed tables"),
        ({"num_embeddings": None, "max_rows": 0}, "max_rows"),
        ({"optimizer": "SGD"}, "RowOptimizerSpec"),
        ({"scheduled": 1}, "table 'emb': scheduled must be true or false, got 1"),
    ],
)
def test_table_spec_refuses(kwargs: dict, match: str) -> None:
    args = {"name": "emb", "embedding_dim": 4, "num_embeddings": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        TableSpec(**args)


def test_table_spec_refuses_bad_wire_data() -> None:
    with pytest.raises(ValueError, match="unknown keys"):
        TableSpec.from_wire({**fixed().to_wire(), "extra": 1})
    with pytest.raises(ValueError, match="lacks"):
        TableSpec.from_wire({"name": "emb"})
    with pytest.raises(ValueError, match="unknown row optimizer"):
        TableSpec.from_wire({**fixed().to_wire(), "optimizer": {"name": "Nope"}})


# -- initial rows --------------------------------------------------------------------------


def test_initial_rows_depend_on_seed_id_and_column_only(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.tensor([5, 0, 123456789012, -3, 17])
    whole = initial_rows(3, ids, 7, std=1.0, dtype=F64)
    for i, row in zip(ids.tolist(), whole, strict=True):
        assert torch.equal(initial_rows(3, torch.tensor([i]), 7, std=1.0, dtype=F64)[0], row)
    perm = torch.tensor([4, 2, 0, 1, 3])
    assert torch.equal(initial_rows(3, ids[perm], 7, std=1.0, dtype=F64), whole[perm])
    monkeypatch.setattr(init_module, "CHUNK_VALUES", 8)  # one row per pass
    assert torch.equal(initial_rows(3, ids, 7, std=1.0, dtype=F64), whole)
    # A column depends on its index, not on the row's width.
    assert torch.equal(initial_rows(3, ids, 4, std=1.0, dtype=F64), whole[:, :4])
    assert not torch.equal(initial_rows(4, ids, 7, std=1.0, dtype=F64), whole)
    half = initial_rows(3, ids, 7, std=0.5, dtype=torch.float32)
    assert torch.equal(half, (whole * 0.5).float())
    # Written into a given tensor, the same rows.
    out = torch.full((5, 7), float("nan"), dtype=F64)
    assert initial_rows(3, ids, 7, std=1.0, dtype=F64, out=out) is out
    assert torch.equal(out, whole)


def _splitmix64(x: int) -> int:
    """splitmix64's finaliser in Python's integers: the reference for both paths."""
    z = (x + 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return z ^ (z >> 31)


def test_initial_rows_hashes_as_the_reference_on_both_paths(path: str) -> None:
    ids = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789012345])
    got = init_module.splitmix64(ids)
    want = [_splitmix64(i & (2**64 - 1)) for i in ids.tolist()]
    assert [v & (2**64 - 1) for v in got.tolist()] == want
    # Row 0's first pair, Box-Muller by hand from the reference's bits.
    seed_key = _splitmix64(3)
    key = _splitmix64((5 ^ seed_key) & (2**64 - 1))
    h = _splitmix64((key + 0xD1B54A32D192ED03) & (2**64 - 1))
    u1 = torch.tensor([((h >> 32) + 1) * 2.0**-32], dtype=F64)
    u2 = torch.tensor([(h & 0xFFFFFFFF) * (2.0 * math.pi * 2.0**-32)], dtype=F64)
    r = u1.log_().mul_(-2.0).sqrt_().mul_(0.5)
    row = initial_rows(3, torch.tensor([5]), 3, std=0.5, dtype=F64)[0]
    assert torch.equal(row[:2], torch.cat([u2.cos() * r, u2.sin() * r]))


def test_initial_rows_are_the_same_bits_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.kernels import need_kernels

    need_kernels()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(-(2**62), 2**62, (3000,), generator=gen)
    for dim in (1, 2, 5, 16, 33):
        for dtype in (torch.float32, F64, torch.bfloat16):
            monkeypatch.setattr(init_module, "CHUNK_VALUES", 4096)  # several passes
            native = initial_rows(11, ids, dim, std=0.1, dtype=dtype, padding_idx=int(ids[9]))
            with monkeypatch.context() as m:
                m.setattr(kernels, "KERNELS", None)
                fallback = initial_rows(11, ids, dim, std=0.1, dtype=dtype, padding_idx=int(ids[9]))
            assert torch.equal(native.view(torch.int8), fallback.view(torch.int8)), (dim, dtype)


def test_initial_rows_are_standard_normal_and_padding_is_zero() -> None:
    rows = initial_rows(0, torch.arange(4000), 50, std=2.0, dtype=F64, padding_idx=7)
    assert torch.equal(rows[7], torch.zeros(50, dtype=F64))
    assert abs(rows.mean().item()) < 0.02
    assert abs(rows.std().item() - 2.0) < 0.02
    # Neighbouring ids and columns are unrelated.
    corr = torch.corrcoef(torch.stack([rows[:-1, 0], rows[1:, 0], rows[:-1, 1]]))
    assert corr.sub(torch.eye(3, dtype=F64)).abs().max() < 0.06


def test_initial_rows_refuses_bad_ids() -> None:
    with pytest.raises(ValueError, match="1-D int64"):
        initial_rows(0, torch.tensor([1.0]), 2, std=1.0, dtype=F64)
    with pytest.raises(ValueError, match=r"out is torch.float32 of shape \[2, 2\]"):
        initial_rows(0, torch.tensor([1, 2]), 2, std=1.0, dtype=F64, out=torch.empty(2, 2))


# -- partitions ----------------------------------------------------------------------------


def tf_div_shard(i: int, n: int, shards: int) -> int:
    """TensorFlow's embedding_lookup, partition_strategy="div"."""
    q, r = divmod(n, shards)
    return i // (q + 1) if i < r * (q + 1) else r + (i - r * (q + 1)) // q


@pytest.mark.parametrize("kind", ["mod", "div"])
@pytest.mark.parametrize(("n", "shards"), [(10, 1), (10, 3), (7, 2), (12, 4), (3, 5), (1003, 8)])
def test_partition_covers_every_id_once(kind: str, n: int, shards: int) -> None:
    p = Partition(kind, n, shards)
    ids = torch.arange(n)
    owner = p.shard_of(ids)
    if kind == "mod":
        assert owner.tolist() == [i % shards for i in range(n)]
    else:
        assert owner.tolist() == [tf_div_shard(i, n, shards) for i in range(n)]
        q, r = divmod(n, shards)
        assert [p.rows_on(s) for s in range(shards)] == [q + 1] * r + [q] * (shards - r)
    held = torch.cat([p.ids_on(s) for s in range(shards)])
    assert sorted(held.tolist()) == list(range(n))
    for s in range(shards):
        mine = p.ids_on(s)
        assert mine.numel() == p.rows_on(s)
        assert (p.shard_of(mine) == s).all()
        assert p.local_index(mine).tolist() == list(range(p.rows_on(s)))
        if kernels.KERNELS is not None:  # the kernel's one pass agrees
            assert kernels.local_index(mine, p).tolist() == list(range(p.rows_on(s)))
    order = torch.randperm(n)
    parts = p.split(ids[order])
    back = torch.empty(n, dtype=torch.int64)
    for s, (sub, positions) in parts.items():
        assert (p.shard_of(sub) == s).all()
        back[positions] = sub
    assert torch.equal(back, ids[order])
    assert all(sub.numel() for sub, _ in parts.values())


def test_hashed_partition_is_mod_for_any_id() -> None:
    p = Partition("mod", None, 3)
    ids = torch.tensor([-7, -1, 0, 5, 1 << 62])
    assert p.shard_of(ids).tolist() == [2, 2, 0, 2, (1 << 62) % 3]
    with pytest.raises(ValueError, match="hashed"):
        p.rows_on(0)


def test_partition_refuses() -> None:
    with pytest.raises(ValueError, match="partition"):
        Partition("range", 10, 2)
    with pytest.raises(ValueError, match="num_shards"):
        Partition("mod", 10, 0)


# -- FixedRows -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mod", "div"])
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_fixed_rows_start_as_initial_rows_whatever_the_shard_count(kind: str, shards: int) -> None:
    spec = fixed(n=11, partition=kind, seed=5, init_std=0.3, padding_idx=4)
    want = initial_rows(5, torch.arange(11), 4, std=0.3, dtype=F64, padding_idx=4)
    got = torch.empty_like(want)
    for s, part in enumerate(make_rows(spec, s, shards) for s in range(shards)):
        assert isinstance(part, FixedRows)
        ids = part.partition.ids_on(s)
        got[ids] = part.lookup(ids)
    assert torch.equal(got, want)


def test_fixed_rows_sharded_learn_as_one() -> None:
    spec = fixed(n=13, optimizer=RowOptimizerSpec.of("Adagrad", lr=0.5))
    one = make_rows(spec, 0, 1)
    parts = [make_rows(spec, s, 3) for s in range(3)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randperm(13, generator=gen)[:6]
        grads = torch.randn(6, 4, generator=gen, dtype=F64)
        one.apply(ids, grads)
        for s, (sub, positions) in parts[0].partition.split(ids).items():
            parts[s].check_ids(sub)
            parts[s].apply(sub, grads[positions])
    ids = torch.arange(13)
    merged = torch.empty(13, 4, dtype=F64)
    for s, (sub, positions) in parts[0].partition.split(ids).items():
        merged[positions] = parts[s].lookup(sub)
    assert torch.equal(merged, one.lookup(ids))


def test_fixed_rows_padding_row_is_never_updated() -> None:
    rows = make_rows(fixed(n=5, padding_idx=2, optimizer=RowOptimizerSpec.of("SGD")), 0, 1)
    rows.apply(torch.tensor([1, 2]), torch.ones(2, 4, dtype=F64))
    assert torch.equal(rows.lookup(torch.tensor([2])), torch.zeros(1, 4, dtype=F64))


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, 2], "table 'emb': ids must be a tensor"),
        (torch.tensor([1, 2], dtype=torch.int32), "table 'emb': ids must be int64"),
        (torch.tensor([[1, 3]]), "table 'emb': ids must be 1-D"),
        (torch.tensor([1, 21, 3]), r"table 'emb': id 21 is out of range \[0, 20\)"),
        (torch.tensor([3, -1]), r"table 'emb': id -1 is out of range"),
        (torch.tensor([3, 4]), "table 'emb': id 4 is not on shard 1 of 2 \\(it is on shard 0\\)"),
        (torch.tensor([3, 5, 3]), "table 'emb': id 3 appears more than once"),
    ],
)
@pytest.mark.usefixtures("path")
def test_check_ids_names_the_table_and_the_id(ids: object, match: str) -> None:
    rows = make_rows(fixed(), 1, 2)
    with pytest.raises(ValueError, match=match):
        rows.check_ids(ids)


@pytest.mark.usefixtures("path")
def test_check_ids_accepts_good_ids() -> None:
    make_rows(fixed(), 1, 2).check_ids(torch.tensor([19, 1, 5]))
    make_rows(fixed(), 1, 2).check_ids(torch.tensor([], dtype=torch.int64))
    make_rows(hashed(), 0, 2).check_ids(torch.tensor([-4, 1 << 40]))
    with pytest.raises(ValueError, match="table 'ids': id -3 is not on shard 0"):
        make_rows(hashed(), 0, 2).check_ids(torch.tensor([-4, -3]))


@pytest.mark.parametrize("kind", ["mod", "div", "hashed"])
def test_check_ids_kernel_agrees_with_torch(kind: str) -> None:
    """The kernel's one pass against torch's checks, on random ids of every kind of table,
    shard count and fault: the same verdict and the same message."""
    from psflow.sparse import kernels
    from tests.kernels import need_kernels

    need_kernels()
    gen = torch.Generator().manual_seed(3)
    seen: set[str] = set()
    for trial in range(300):
        shards = int(torch.randint(1, 5, (1,), generator=gen))
        shard = int(torch.randint(0, shards, (1,), generator=gen))
        n = int(torch.randint(shards, 60, (1,), generator=gen))
        if kind == "hashed":
            rows = make_rows(hashed(), shard, shards)
            ids = torch.randint(-(1 << 40), 1 << 40, (8,), generator=gen)
            ids = ids - ids % shards + shard  # on this shard
        else:
            rows = make_rows(fixed(n=n, partition=kind), shard, shards)
            ids = rows.partition.ids_on(shard)[torch.randperm(rows.num_rows, generator=gen)[:8]]
        fault = trial % 4  # none, out of range, another shard's, twice
        if fault == 1 and kind != "hashed":
            ids = torch.cat([ids, torch.tensor([n + trial % 3])])
        elif fault == 2 and shards > 1:
            ids = torch.cat([ids, torch.tensor([(shard + 1) % shards + 0])])
            if kind == "div":
                ids[-1] = rows.partition.start_of((shard + 1) % shards)
        elif fault == 3 and ids.numel():
            ids = torch.cat([ids, ids[:1]])
        verdicts = []
        for use in (kernels.KERNELS, None):
            saved, kernels.KERNELS = kernels.KERNELS, use
            try:
                rows.check_ids(ids)
                verdicts.append(None)
            except ValueError as e:
                verdicts.append(str(e))
            finally:
                kernels.KERNELS = saved
        assert verdicts[0] == verdicts[1], (kind, shards, shard, ids.tolist())
        seen.add(verdicts[0] or "good")
    faults = {"good", "more than once", "not on shard"} | (
        {"out of range"} if kind != "hashed" else set()
    )
    assert {f for f in faults if any(f in v for v in seen)} == faults, seen


def test_apply_refuses_bad_gradients() -> None:
    rows = make_rows(fixed(), 0, 1)
    with pytest.raises(ValueError, match=r"table .emb.: gradients are torch\.float32"):
        rows.apply(torch.tensor([1]), torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"expected \[1, 4\]"):
        rows.apply(torch.tensor([1]), torch.ones(2, 4, dtype=F64))


# -- HashedRows ----------------------------------------------------------------------------


def test_hashed_rows_are_made_on_first_apply() -> None:
    spec = hashed(seed=2, optimizer=RowOptimizerSpec.of("SGD", lr=0.5))
    rows = make_rows(spec, 0, 1)
    assert isinstance(rows, HashedRows)
    ids = torch.tensor([10, 1 << 50, -5])
    start = initial_rows(2, ids, 4, std=1.0, dtype=F64)
    assert torch.equal(rows.lookup(ids), start)
    assert rows.num_rows == 0  # a lookup stores nothing
    rows.apply(ids[:2], torch.ones(2, 4, dtype=F64))
    assert rows.num_rows == 2 and rows.stats["admitted"] == 2
    want = start.clone()
    want[:2] -= 0.5
    assert torch.equal(rows.lookup(ids), want)
    rows.apply(ids[1:], torch.ones(2, 4, dtype=F64))
    want[1:] -= 0.5
    assert torch.equal(rows.lookup(ids), want)
    assert rows.num_rows == 3
    # Held and new ids mixed, into a given tensor (a reply's lane): the same rows, or zeros.
    mixed = torch.tensor([7, 10, 99, -5])
    out = torch.full((4, 4), float("nan"), dtype=F64)
    assert rows.lookup(mixed, out) is out
    assert torch.equal(out, torch.cat([initial_rows(2, mixed[:1], 4, std=1.0, dtype=F64),
                                       want[:1], initial_rows(2, mixed[2:3], 4, std=1.0,
                                       dtype=F64), want[2:]]))  # fmt: skip
    zeros = rows.lookup(mixed, absent_zeros=True)
    assert torch.equal(zeros[[0, 2]], torch.zeros(2, 4, dtype=F64))
    assert torch.equal(zeros[[1, 3]], want[[0, 2]])
    with pytest.raises(ValueError, match=r"expected torch\.float64 \[4, 4\]"):
        rows.lookup(mixed, torch.empty(3, 4, dtype=F64))


def test_hashed_rows_learn_as_a_fixed_table() -> None:
    opt = RowOptimizerSpec.of("Adam", lr=0.1)
    table = make_rows(hashed(optimizer=opt), 0, 1)
    dense = make_rows(fixed(n=3000, optimizer=opt), 0, 1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randperm(3000, generator=gen)[:1500]  # grows past the first capacity
        grads = torch.randn(1500, 4, generator=gen, dtype=F64)
        table.apply(ids, grads)
        dense.apply(ids, grads)
    ids = torch.arange(3000)
    assert torch.equal(table.lookup(ids), dense.lookup(ids))


def test_min_count_admits_an_id_on_its_nth_push() -> None:
    rows = make_rows(hashed(min_count=3, optimizer=RowOptimizerSpec.of("SGD", lr=1.0)), 0, 1)
    start = rows.lookup(torch.tensor([7]))
    for _ in range(2):
        rows.apply(torch.tensor([7]), torch.ones(1, 4, dtype=F64))
        assert rows.num_rows == 0
    assert rows.stats["not_admitted"] == 2
    rows.apply(torch.tensor([7, 8]), torch.ones(2, 4, dtype=F64))
    assert rows.num_rows == 1 and rows.stats["admitted"] == 1 and rows.stats["not_admitted"] == 3
    # Only the admitting push's gradient is applied: the earlier ones were dropped.
    assert torch.equal(rows.lookup(torch.tensor([7])), start - 1.0)


def test_admission_counts_the_same_in_c_and_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.kernels import need_kernels

    need_kernels()
    gen = torch.Generator().manual_seed(3)
    native, fallback = Admission(3, max_rows=10), Admission(3, max_rows=10)
    assert native.width == 4096  # small: 20,000 ids share cells, and the counts age
    pushes = 0
    for _ in range(40):
        ids = torch.randint(-(2**62), 2**62, (300,), generator=gen)
        ids = torch.cat([ids, torch.randint(0, 200, (300,), generator=gen)]).unique()
        got = native.admit(ids)
        with monkeypatch.context() as m:
            m.setattr(kernels, "KERNELS", None)
            want = fallback.admit(ids)
        assert torch.equal(got, want)
        assert torch.equal(native.sketch, fallback.sketch)
        pushes += ids.numel()
    assert pushes > native.width  # the counts halved on the way
    assert int(native.sketch.max()) == 3 and 0 < int(got.sum()) < got.numel()


def test_max_rows_evicts_the_least_recently_updated() -> None:
    rows = make_rows(hashed(max_rows=3, optimizer=RowOptimizerSpec.of("SGD")), 0, 1)
    one = torch.ones(1, 4, dtype=F64)
    for i in (1, 2, 3):
        rows.apply(torch.tensor([i]), one)
    rows.apply(torch.tensor([1]), one)  # 2 is now the least recently updated
    rows.apply(torch.tensor([4]), one)
    assert sorted(rows.snapshot()["ids"].tolist()) == [1, 3, 4]
    assert rows.stats["evicted"] == 1
    # An evicted row starts again from its initial value.
    assert torch.equal(
        rows.lookup(torch.tensor([2])), initial_rows(0, torch.tensor([2]), 4, std=1.0, dtype=F64)
    )
    # A push never evicts a row it updates, and drops what does not fit (counted).
    rows.apply(torch.tensor([3, 5, 6, 7]), torch.ones(4, 4, dtype=F64))
    assert 3 in rows.snapshot()["ids"].tolist() and rows.num_rows == 3
    assert rows.stats["dropped_full"] == 1 and rows.stats["evicted"] == 3


@pytest.mark.parametrize("min_count", [0, 2])
def test_hashed_memory_stays_bounded(min_count: int) -> None:
    max_rows, dim, batch = 1000, 8, 1000
    rows = make_rows(hashed(dim=dim, max_rows=max_rows, min_count=min_count), 0, 1)
    # Values and Adagrad's sum, slot ids and last-update counts, the id map (its table at
    # up to 4x the entries, and two int objects an entry), and the count-min sketch.
    per_row = dim * 8 * 2 + 8 + 8 + 64
    sketch = 4 * 4 * 16384 if min_count > 1 else 0  # int32, depth 4, width >= 16 * max_rows
    bound = max_rows * per_row + sys.getsizeof({i: i for i in range(4 * max_rows)}) + sketch
    peak = 0
    for start in range(0, 100_000, batch):
        ids = torch.arange(start, start + batch) * 7919
        for _ in range(max(1, min_count)):
            rows.apply(ids, torch.ones(batch, dim, dtype=F64))
        peak = max(peak, rows.nbytes)
        assert rows.num_rows <= max_rows
    assert peak <= bound, (peak, bound)
    stats = rows.stats
    assert stats["evicted"] == stats["admitted"] - max_rows
    if min_count > 1:
        # Every id pushed twice: the first push is dropped but for the sketch's rare false
        # positives; the second admits it but where the counts halved in between (aging).
        assert stats["not_admitted"] >= 0.95 * 100_000
        assert stats["admitted"] >= 0.8 * 100_000
    else:
        assert stats["admitted"] == 100_000


# -- snapshot and load ---------------------------------------------------------------------


def train(parts: list[Rows], seed: int, n: int, steps: int = 4) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randperm(n, generator=gen)[: n // 2] * (
            1 if parts[0].spec.num_embeddings else 1009
        )
        grads = torch.randn(ids.numel(), parts[0].dim, generator=gen, dtype=F64)
        for s, (sub, positions) in parts[0].partition.split(ids).items():
            parts[s].apply(sub, grads[positions])


def gather(parts: list[Rows], ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty(ids.numel(), parts[0].dim, dtype=F64)
    for s, (sub, positions) in parts[0].partition.split(ids).items():
        out[positions] = parts[s].lookup(sub)
    return out


@pytest.mark.parametrize(
    "spec",
    [
        fixed(n=29, optimizer=RowOptimizerSpec.of("Adam")),
        fixed(n=29, partition="div", optimizer=RowOptimizerSpec.of("Ftrl", l1=0.01)),
        hashed(optimizer=RowOptimizerSpec.of("Adagrad")),
        fixed(n=29, optimizer=RowOptimizerSpec.of("RowWiseAdagrad")),
        hashed(optimizer=RowOptimizerSpec.of("RowWiseAdagrad")),
    ],
    ids=["fixed-mod", "fixed-div", "hashed", "fixed-rowwise", "hashed-rowwise"],
)
def test_snapshot_loads_into_another_shard_count(spec: TableSpec) -> None:
    old = [make_rows(spec, s, 2) for s in range(2)]
    train(old, 0, 29)
    snapshots = [part.snapshot() for part in old]
    new = [make_rows(spec, s, 3) for s in range(3)]
    for part in new:
        for snap in snapshots:
            part.load(
                snap["ids"], snap["values"], {k: v for k, v in snap.items() if k.startswith("opt/")}
            )
    ids = torch.arange(29) * (1 if spec.num_embeddings else 1009)
    assert torch.equal(gather(new, ids), gather(old, ids))
    if spec.hashed:
        held = sorted(i for part in new for i in part.snapshot()["ids"].tolist())
        assert held == sorted(i for part in old for i in part.snapshot()["ids"].tolist())
    # The optimizer state came along: the same further training gives the same rows.
    train(old, 1, 29)
    train(new, 1, 29)
    assert torch.equal(gather(new, ids), gather(old, ids))


def test_snapshot_is_a_copy_and_load_checks_it() -> None:
    rows = make_rows(fixed(optimizer=RowOptimizerSpec.of("Adagrad")), 0, 1)
    snap = rows.snapshot()
    rows.apply(torch.tensor([0]), torch.ones(1, 4, dtype=F64))
    assert not torch.equal(snap["values"][0], rows.lookup(torch.tensor([0]))[0])
    with pytest.raises(ValueError, match="snapshot state"):
        rows.load(snap["ids"], snap["values"], {})
    with pytest.raises(ValueError, match="snapshot values"):
        rows.load(snap["ids"], snap["values"].float(), {"sum": snap["opt/sum"]})
    with pytest.raises(ValueError, match="out of range"):
        rows.load(snap["ids"] + 1, snap["values"], {"sum": snap["opt/sum"]})


def test_make_rows_and_the_default_optimizer() -> None:
    assert isinstance(make_rows(fixed(), 0, 1), FixedRows)
    assert isinstance(make_rows(hashed(), 0, 1), HashedRows)
    assert make_rows(fixed(), 0, 1).optimizer.spec.name == "Adagrad"
    job_default = RowOptimizerSpec.of("SGD")
    assert make_rows(fixed(), 0, 1, optimizer=job_default).optimizer.spec is job_default
    own = RowOptimizerSpec.of("Ftrl")
    assert make_rows(fixed(optimizer=own), 0, 1, optimizer=job_default).optimizer.spec is own
    with pytest.raises(ValueError, match="shard must be in"):
        make_rows(fixed(), 2, 2)


@pytest.mark.parametrize(
    "case",
    [
        (fixed(n=300, optimizer=RowOptimizerSpec.of("Adam")), 300),
        (hashed(max_rows=40), 200),
        (hashed(), 3000),
    ],
    ids=["fixed", "hashed-evicting", "hashed-growing"],
)
def test_a_snapshot_keeps_its_moment_while_training_goes_on(
    case: tuple[TableSpec, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot taken between two updates is what a full copy at that moment would be,
    rows and optimizer state alike, whatever the updates, evictions and growth after it."""
    from psflow.sparse.snapshot import RowSnapshot

    spec, n = case
    monkeypatch.setattr(RowSnapshot, "CHUNK_ROWS", 7)  # several chunks, some half copied
    rows = make_rows(spec, 0, 1)
    train([rows], seed=1, n=n, steps=1)
    expected = {k: v.clone() for k, v in rows.snapshot().items()}
    snap = rows.begin_snapshot()
    capacity = rows.values.shape[0]
    train([rows], seed=2, n=n, steps=6)
    if spec.hashed and spec.max_rows is None:
        assert rows.values.shape[0] > capacity, "the table grew while the snapshot was open"
    half = snap.result()
    assert set(half) == set(expected)
    for key in expected:
        torch.testing.assert_close(half[key], expected[key], rtol=0, atol=0)
    assert not torch.equal(rows.snapshot()["values"], expected["values"]), "training went on"


@pytest.mark.parametrize(
    ("kind", "n", "shards"),
    [("mod", 50, 3), ("mod", 50, 2), ("div", 50, 3), ("mod", None, 4), ("div", 7, 1)],
)
def test_group_ids_groups_a_batch_by_shard(kind: str, n: int | None, shards: int) -> None:
    from psflow.sparse import kernels
    from tests.kernels import need_kernels

    need_kernels()
    partition = Partition(kind, n, shards)
    gen = torch.Generator().manual_seed(5)
    for size in (0, 1, 7, 300):
        high = n if n is not None else 1 << 40
        low = 0 if n is not None else -(1 << 40)
        ids = torch.randint(low, high, (size,), generator=gen)
        if size > 3:
            ids[3] = ids[0]  # a repeat
        grouped = kernels.group_ids(ids, partition, n)  # in range: checked, and grouped
        assert isinstance(grouped, tuple)
        unique, positions, counts = grouped
        assert torch.equal(unique[positions], ids)  # each id finds its row
        assert sorted(unique.tolist()) == torch.unique(ids).tolist()  # each id once
        shard = partition.shard_of(unique)
        assert counts == torch.bincount(shard, minlength=shards).tolist()
        assert torch.equal(shard, shard.sort().values)  # shard 0's first, and so on


@pytest.mark.parametrize("bad", [50, -1, 2**62])
def test_group_ids_gives_the_first_id_outside_the_limit(bad: int) -> None:
    import psflow.sparse.kernels as kernels
    from tests.kernels import need_kernels

    need_kernels()
    for kind in ("mod", "div"):
        ids = torch.tensor([3, 7, bad, 4, 99])
        assert kernels.group_ids(ids, Partition(kind, 50, 3), 50) == bad
        assert isinstance(kernels.group_ids(ids[:2], Partition(kind, 50, 3), 50), tuple)


def test_group_ids_refuses_an_id_no_shard_holds() -> None:
    import psflow.sparse.kernels as kernels
    from tests.kernels import need_kernels

    need_kernels()
    with pytest.raises(IndexError, match="id 60 is outside the table's shards"):
        kernels.group_ids(torch.tensor([3, 60, 4]), Partition("div", 50, 3))


# -- an init's first rows (the chief's model held them) ------------------------------------


def test_an_init_gives_a_fixed_table_its_first_rows() -> None:
    from psflow.protocol import Key
    from psflow.ps.tables import build_tables, set_initial_rows, split_initial_rows

    spec = fixed(n=7, optimizer=RowOptimizerSpec.of("Adagrad", lr=0.1))
    rows = torch.arange(7 * 4, dtype=F64).reshape(7, 4)
    tables = build_tables([spec], shard=1, num_shards=2)
    mine = rows[1::2]  # mod: ids 1, 3, 5
    tensors = [("w", torch.ones(2)), ("emb#rows", mine), ("emb#state/sum", mine + 100)]
    rest, first = split_initial_rows({Key.ROWS: ["emb"]}, tensors)
    assert [n for n, _ in rest] == ["w"] and list(first) == ["emb"]
    assert list(first["emb"].state) == ["sum"]
    set_initial_rows(tables, first)
    assert torch.equal(tables["emb"].lookup(torch.tensor([5, 1])), rows[[5, 1]])
    table = tables["emb"]
    assert isinstance(table, FixedRows) and torch.equal(table.state["sum"], mine + 100)
    # Without state the optimizer's starts fresh.
    fresh = build_tables([spec], shard=1, num_shards=2)
    set_initial_rows(fresh, split_initial_rows({Key.ROWS: ["emb"]}, tensors[:2])[1])
    assert isinstance(fresh["emb"], FixedRows)
    assert torch.equal(fresh["emb"].state["sum"], torch.full((3, 4), 0.1, dtype=F64))
    # An init that names no table's rows leaves the seeded ones (and state alone is refused).
    rest, first = split_initial_rows({}, tensors[:2])
    assert len(rest) == 2 and first == {}
    with pytest.raises(ValueError, match="'emb#state/sum' but not the first rows of 'emb'"):
        split_initial_rows({}, tensors)


def test_an_init_with_bad_first_rows_is_refused_and_changes_nothing() -> None:
    from psflow.protocol import Key
    from psflow.ps.tables import FirstRows, build_tables, set_initial_rows, split_initial_rows

    sgd = RowOptimizerSpec.of("SGD", lr=0.1)
    tables = build_tables(
        [fixed(n=6, optimizer=RowOptimizerSpec.of("Adagrad")), hashed(optimizer=sgd)],
        shard=0,
        num_shards=2,
    )
    seeded = tables["emb"].lookup(torch.tensor([0, 2, 4])).clone()
    with pytest.raises(ValueError, match=r"names tables \['emb'\] but lacks their rows"):
        split_initial_rows({Key.ROWS: ["emb"]}, [("w", torch.ones(1))])
    with pytest.raises(ValueError, match="'emb#rows' appears twice"):
        split_initial_rows({Key.ROWS: ["emb"]}, [("emb#rows", torch.ones(3, 4))] * 2)
    with pytest.raises(ValueError, match="'rows' must be a list of table names"):
        split_initial_rows({Key.ROWS: "emb"}, [])
    with pytest.raises(ValueError, match="carries 'ids#state/sum' but not the first rows of 'ids'"):
        split_initial_rows(
            {Key.ROWS: ["emb"]},
            [("emb#rows", torch.ones(3, 4)), ("ids#state/sum", torch.ones(3, 4))],
        )
    good = FirstRows(torch.zeros(3, 4, dtype=F64), {})
    bad = [
        ({"emb": good, "nothing": good}, "'nothing', which it does not create"),
        ({"emb": good, "ids": good}, "first rows of hashed table 'ids' without ids"),
        (
            {"emb": FirstRows(torch.zeros(3, 5, dtype=F64), {})},
            r"'emb' are \[3, 5\].*holds \[3, 4\]",
        ),
        (
            {"emb": FirstRows(torch.zeros(3, 4), {})},
            r"torch.float32; this shard holds \[3, 4\] torch.float64",
        ),
        (
            {"emb": FirstRows(good.values, {"exp_avg": good.values})},
            r"state \['exp_avg'\]; its Adagrad keeps \['sum'\]",
        ),
        (
            {"emb": FirstRows(good.values, {"sum": torch.zeros(3, 4)})},
            r"state 'sum' of table 'emb' is \[3, 4\] torch.float32",
        ),
    ]
    for first, match in bad:
        with pytest.raises(ValueError, match=match):
            set_initial_rows(tables, first)
        # Checked before anything changes: the good table's rows are still the seeded ones.
        assert torch.equal(tables["emb"].lookup(torch.tensor([0, 2, 4])), seeded)


@pytest.mark.parametrize("optimizer", ["Adagrad", "RowWiseAdagrad", "Adam", "Ftrl"])
def test_rows_a_hashed_table_grows_into_start_with_fresh_state(optimizer: str) -> None:
    """A table that outgrows its storage twice over: its new storage is not filled (the pages
    of slots not yet taken stay untouched), and every row it then takes starts with the state
    of a fresh row, as one trained in a table that never grew."""
    from psflow.sparse.hashed import INITIAL_CAPACITY

    extra = {"initial_accumulator_value": 0.25} if optimizer != "Adam" else {}
    spec = hashed(optimizer=RowOptimizerSpec.of(optimizer, **extra))
    rows = make_rows(spec, 0, 1)
    ids = torch.arange(3 * INITIAL_CAPACITY, dtype=torch.int64) * 7919
    rows.apply(ids, torch.zeros(ids.numel(), 4, dtype=F64))
    assert rows.stats["capacity"] >= 3 * INITIAL_CAPACITY > INITIAL_CAPACITY
    fresh = rows.optimizer.new_state(ids.numel(), 4, F64)
    snap = rows.snapshot()
    order = torch.argsort(snap["ids"])
    for key, want in fresh.items():
        got = snap["opt/" + key][order]
        if key == "step":  # Adam counts the step that created the row
            want = want + 1
        assert torch.equal(got, want), key


def test_an_inits_first_rows_of_a_hashed_table_come_by_id_and_are_checked() -> None:
    """A hashed table's first rows in an init (``load_rows`` on the chief's model): taken by
    id, with their state or fresh state; ids without rows, rows without ids, repeated ids, an
    id of another shard, or rows of the wrong shape are refused before anything changes."""
    from psflow.ps.tables import FirstRows, set_initial_rows

    spec = hashed(optimizer=RowOptimizerSpec.of("Adagrad", initial_accumulator_value=0.5))
    ids = torch.tensor([4, -6, 2**40])  # all even: shard 0 of 2
    values = torch.arange(12, dtype=F64).view(3, 4)
    tables = {"ids": make_rows(spec, 0, 2)}
    set_initial_rows(tables, {"ids": FirstRows(values, {}, ids)})
    snap = tables["ids"].snapshot()
    order = torch.argsort(snap["ids"])
    assert torch.equal(snap["ids"][order], ids.sort().values)
    assert torch.equal(snap["values"][order], values[torch.argsort(ids)])
    assert torch.equal(snap["opt/sum"], torch.full((3, 4), 0.5, dtype=F64))
    bad = [
        (FirstRows(values, {}), "without ids"),
        (FirstRows(values, {}, torch.tensor([4, 4, 8])), "appears more than once"),
        (FirstRows(values, {}, torch.tensor([4, 5, 8])), "shard"),
        (FirstRows(values[:2], {}, ids), r"are \[2, 4\]"),
        (FirstRows(values, {"sum": torch.ones(2, 4, dtype=F64)}, ids), "optimizer state 'sum'"),
    ]
    for first, match in bad:
        fresh = {"ids": make_rows(spec, 0, 2)}
        with pytest.raises(ValueError, match=match):
            set_initial_rows(fresh, {"ids": first})
        assert fresh["ids"].num_rows == 0
    fixed_table = {"emb": make_rows(fixed(), 0, 1)}
    with pytest.raises(ValueError, match="gives ids with the first rows of table 'emb'"):
        set_initial_rows(fixed_table, {"emb": FirstRows(torch.zeros(20, 4, dtype=F64), {}, ids)})
