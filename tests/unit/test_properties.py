"""Properties that hold for every input, searched by hypothesis: psflow's native kernels against
their references (a batch's ids grouped by shard, rows gathered and scattered, the row-wise
optimizers at every width), a table's shards saved and loaded into any other number of them,
FarmHash and CRC32C against their references, the wire format's round trip and its refusal of
a message whose framing lies, and TFRecord files read in any chunk size, on both paths of the
compiled modules where they have two.

The searches are derandomized (the same examples every run: a suite that passes once passes
again) and keep no example database in the checkout; a failure prints the smallest input found.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import google_crc32c
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from psflow.data import hashing, native
from psflow.data.tfrecord_reader import TFRecordReader
from psflow.data.tfrecord_writer import write_records
from psflow.protocol import ROW_OPTIMIZERS, Key, RowOptimizerSpec, TableSpec
from psflow.sparse import Partition, RowOptimizer, kernels, make_rows
from psflow.transport import wire
from tests.kernels import kernels_then_torch, need_kernels

pytestmark = pytest.mark.unit

SEARCH = settings(
    max_examples=200,
    deadline=None,  # a loaded machine is no failure
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
INT64 = st.integers(-(2**63), 2**63 - 1)


# -- a batch's ids grouped by shard --------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[int], Partition, int | None]:
    """Ids, a partition and the limit a worker checks them against: a fixed table's ids
    (mostly in range, a few outside), or a hashed table's (any int64)."""
    shards = draw(st.integers(1, 8))
    if draw(st.booleans()):
        n = draw(st.integers(1, 300))
        inside = st.integers(0, n - 1)
        ids = draw(st.lists(st.one_of(inside, inside, inside, INT64), max_size=200))
        return ids, Partition(draw(st.sampled_from(["mod", "div"])), n, shards), n
    few = st.integers(-3, 40)  # repeats
    return draw(st.lists(st.one_of(few, INT64), max_size=200)), Partition("mod", None, shards), None


def grouped_reference(
    ids: list[int], partition: Partition, limit: int | None
) -> tuple[list[int], list[int], list[int]] | int:
    """The grouping :func:`kernels.group_ids` promises, one id at a time."""
    if limit is not None:
        outside = [i for i in ids if not 0 <= i < limit]
        if outside:
            return outside[0]
    shard_of = partition.shard_of(torch.tensor(ids, dtype=torch.int64)).tolist() if ids else []
    per_shard: list[list[int]] = [[] for _ in range(partition.num_shards)]
    seen: set[int] = set()
    for i, s in zip(ids, shard_of, strict=True):
        if i not in seen:
            seen.add(i)
            per_shard[s].append(i)
    unique = [i for shard in per_shard for i in shard]
    where = {i: k for k, i in enumerate(unique)}
    return unique, [where[i] for i in ids], [len(shard) for shard in per_shard]


@SEARCH
@given(batch=batches())
def test_group_ids_is_the_grouping_one_id_at_a_time(
    batch: tuple[list[int], Partition, int | None],
) -> None:
    need_kernels()
    ids, partition, limit = batch
    got = kernels.group_ids(torch.tensor(ids, dtype=torch.int64), partition, limit)
    want = grouped_reference(ids, partition, limit)
    if isinstance(want, int):
        assert got == want
        return
    assert isinstance(got, tuple)
    unique, positions, counts = got
    assert (unique.tolist(), positions.tolist(), counts) == want


@SEARCH
@given(
    kind=st.sampled_from(["mod", "div"]),
    n=st.integers(1, 1000),
    shards=st.integers(1, 9),
    data=st.data(),
)
def test_local_index_is_the_partitions(kind: str, n: int, shards: int, data: st.DataObject) -> None:
    need_kernels()
    partition = Partition(kind, n, shards)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), max_size=300)), dtype=torch.int64)
    assert torch.equal(kernels.local_index(ids, partition), partition.local_index(ids))


# -- rows gathered and scattered -----------------------------------------------------------


@SEARCH
@given(
    rows=st.integers(1, 64),
    dim=st.integers(1, 70),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    data=st.data(),
)
def test_gather_and_scatter_add_are_torchs_at_every_width(
    rows: int, dim: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    need_kernels()
    index = torch.tensor(
        data.draw(st.lists(st.integers(0, rows - 1), max_size=120)), dtype=torch.int64
    )
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    src = torch.randn(rows, dim, generator=g, dtype=dtype)
    assert torch.equal(kernels.gather(src, index), src.index_select(0, index))
    grads = torch.randn(index.numel(), dim, generator=g, dtype=dtype)
    want = torch.zeros(rows, dim, dtype=dtype).index_add_(0, index, grads)
    torch.testing.assert_close(kernels.scatter_add(rows, grads, index), want)
    parts = [src[a:b] for a, b in _cuts(rows, data)]
    joined = torch.cat(parts)
    assert torch.equal(kernels.gather_parts(parts, index), joined.index_select(0, index))


def _cuts(rows: int, data: st.DataObject) -> list[tuple[int, int]]:
    """``[0, rows)`` cut into consecutive non-empty ranges."""
    inner = (
        sorted(set(data.draw(st.lists(st.integers(1, rows - 1), max_size=4)))) if rows > 1 else []
    )
    bounds = [0, *inner, rows]
    return list(itertools.pairwise(bounds))


# -- the row-wise optimizers ---------------------------------------------------------------

GRADIENTS = st.floats(-50.0, 50.0, width=32)  # zeros, subnormals and signs among them


@SEARCH
@given(
    name=st.sampled_from(sorted(ROW_OPTIMIZERS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    dim=st.integers(1, 70),
    rows=st.integers(1, 40),
    data=st.data(),
)
def test_the_kernels_take_the_references_steps_at_every_width(
    name: str, dtype: torch.dtype, dim: int, rows: int, data: st.DataObject
) -> None:
    """Each row-wise optimizer through the kernels and through torch's ops, on the same rows
    and gradients: the same values and state (float32: to the kernels' correctly rounded
    square root, where torch's vectorised one is not, as in test_sparse_optim)."""
    need_kernels()
    spec = RowOptimizerSpec.of(name, lr=data.draw(st.floats(1e-3, 1.0)))
    w0 = torch.tensor(
        data.draw(arrays(np.float32, (rows, dim), elements=st.floats(-3.0, 3.0, width=32)))
    ).to(dtype)
    steps = []
    for _ in range(data.draw(st.integers(1, 3))):
        ids = data.draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=rows, unique=True))
        g = data.draw(arrays(np.float32, (len(ids), dim), elements=GRADIENTS))
        steps.append((torch.tensor(ids), torch.tensor(g).to(dtype)))

    def run() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        opt = RowOptimizer(spec)
        w, state = w0.clone(), opt.new_state(rows, dim, dtype)
        for ids, g in steps:
            opt.apply(w, state, ids, g)
        return w, state

    (wk, sk), (wt, st_) = kernels_then_torch(run)
    tol = {"atol": 5e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-12, "rtol": 0}
    torch.testing.assert_close(wk, wt, **tol)
    assert sk.keys() == st_.keys()
    for key in sk:
        torch.testing.assert_close(sk[key], st_[key], **tol)


@SEARCH
@given(
    name=st.sampled_from(sorted(ROW_OPTIMIZERS)),
    table=st.one_of(
        st.just(("hashed", 0)), st.tuples(st.sampled_from(["mod", "div"]), st.integers(1, 60))
    ),
    before=st.integers(1, 6),
    after=st.integers(1, 6),
    data=st.data(),
)
def test_a_table_saved_from_any_number_of_shards_loads_into_any_other(
    name: str, table: tuple[str, int], before: int, after: int, data: st.DataObject
) -> None:
    """Each shard's snapshot (rows, ids, optimizer state), every one loaded by each shard of
    another count, as a restore re-shards a checkpoint: the same row for every id, and the same
    rows after the same further steps (the state came along)."""
    kind, n = table
    spec = TableSpec(
        name="t",
        embedding_dim=data.draw(st.integers(1, 9)),
        num_embeddings=None if kind == "hashed" else n,
        partition="mod" if kind == "hashed" else kind,
        dtype="float64",
        optimizer=RowOptimizerSpec.of(name),
    )
    if kind == "hashed":  # any int64 ids, negative ones too
        ids = torch.tensor(data.draw(st.lists(INT64, min_size=1, max_size=40, unique=True)))
    else:
        ids = torch.arange(n)
    grads = [
        (
            torch.tensor(
                data.draw(st.lists(st.sampled_from(ids.tolist()), min_size=1, unique=True))
            ),
            data.draw(st.integers(0, 2**31)),
        )
        for _ in range(2)
    ]

    def train(parts: list, step: int) -> None:
        touched, seed = grads[step]
        g = torch.randn(touched.numel(), spec.embedding_dim, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(seed))  # fmt: skip
        for s, (sub, at) in parts[0].partition.split(touched).items():
            parts[s].apply(sub, g[at])

    def rows(parts: list) -> torch.Tensor:
        out = torch.empty(ids.numel(), spec.embedding_dim, dtype=torch.float64)
        for s, (sub, at) in parts[0].partition.split(ids).items():
            out[at] = parts[s].lookup(sub)
        return out

    old = [make_rows(spec, s, before) for s in range(before)]
    train(old, 0)
    snapshots = [part.snapshot() for part in old]
    new = [make_rows(spec, s, after) for s in range(after)]
    for part in new:
        for snap in snapshots:
            state = {k: v for k, v in snap.items() if k.startswith("opt/")}
            part.load(snap["ids"], snap["values"], state)
    assert torch.equal(rows(new), rows(old))
    train(old, 1)
    train(new, 1)
    assert torch.equal(rows(new), rows(old))


@SEARCH
@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=300),
)
def test_all_finite_is_isfinite(dtype: torch.dtype, values: list[float]) -> None:
    t = torch.tensor(values, dtype=torch.float32).to(dtype)  # large ones become inf in 16 bits
    assert kernels.all_finite(t) == bool(torch.isfinite(t).all())


# -- hashing and checksums -----------------------------------------------------------------


@SEARCH
@given(strings=st.lists(st.binary(max_size=200), max_size=30))
def test_farmhash_native_is_the_reference(strings: list[bytes]) -> None:
    need_kernels()
    got = native.fingerprint64(strings)
    assert got is not None
    assert got.tolist() == [hashing._fingerprint64(s) for s in strings]


@SEARCH
@given(data=st.binary(max_size=3000), soft=st.booleans())
def test_crc32c_native_is_google_crc32c(data: bytes, soft: bool) -> None:
    need_kernels()
    assert native.crc32c(data, soft=soft) == google_crc32c.value(data)


# -- round trips ---------------------------------------------------------------------------

WIRE_DTYPES = sorted(wire.DTYPES.values(), key=str)


@st.composite
def messages(draw: st.DrawFn) -> list[tuple[str, torch.Tensor]]:
    """Tensors of any wire dtype and shape (empty ones too), of a few bytes to a few frames'."""
    names = draw(st.lists(st.text(min_size=1, max_size=12), max_size=5, unique=True))
    out = []
    for name in names:
        shape = draw(st.lists(st.integers(0, 40), max_size=3))
        raw = draw(st.binary(min_size=4096, max_size=4096))
        dtype = draw(st.sampled_from(WIRE_DTYPES))
        size = int(np.prod(shape)) * dtype.itemsize
        buf = torch.tensor(list((raw * (size // len(raw) + 1))[:size]), dtype=torch.uint8)
        if dtype == torch.bool:
            buf %= 2  # a bool's only bytes
        out.append((name, buf.view(dtype).reshape(shape)))
    return out


@SEARCH
@given(tensors=messages(), chunk=st.sampled_from([64, 4096, 1 << 20]))
def test_the_wire_gives_back_every_byte(
    tensors: list[tuple[str, torch.Tensor]], chunk: int
) -> None:
    frames = wire.encode({"op": "push", "id": 7}, tensors, chunk=chunk)
    header = wire.decode_header(bytes(frames[0]))
    back = wire.decode_tensors(header, [bytes(f) for f in frames[1:]], max_bytes=1 << 30)
    assert [name for name, _ in back] == [name for name, _ in tensors]
    for (_, got), (_, sent) in zip(back, tensors, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        # Bytes, not values: a NaN's payload travels too.
        assert (
            got.reshape(-1).view(torch.uint8).tolist()
            == sent.reshape(-1).view(torch.uint8).tolist()
        )


# What msgpack can carry: a hostile header's values.
PACKABLE = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
FRAMING = {Key.TENSORS.value, Key.CHUNK.value, Key.INLINE.value}


@SEARCH
@given(
    tensors=messages(),
    changes=st.dictionaries(st.sampled_from(sorted(FRAMING)), PACKABLE, max_size=3),
    cut=st.integers(0, 3),
    extra=st.lists(st.binary(max_size=64), max_size=2),
)
def test_a_message_whose_framing_lies_is_refused_as_a_wire_error(
    tensors: list[tuple[str, torch.Tensor]],
    changes: dict[str, object],
    cut: int,
    extra: list[bytes],
) -> None:
    """A real message with its tensor list, chunk size or inline bytes replaced by anything
    msgpack carries, frames dropped or added: decoded into exactly the bytes the header lists,
    or refused as a :class:`~psflow.transport.wire.WireError`, never another error."""
    frames = wire.encode({"op": "push", "id": 7}, tensors, chunk=64)
    header = msgpack.unpackb(bytes(frames[0]), raw=False)
    header.update(changes)
    data = [bytes(f) for f in frames[1:]]
    data = data[: max(0, len(data) - cut)] + extra
    try:
        decoded = wire.decode_header(msgpack.packb(header))
        back = wire.decode_tensors(decoded, data, max_bytes=1 << 20)
    except wire.WireError:
        return
    for (name, t), meta in zip(back, wire.tensor_metas(decoded), strict=True):
        assert name == meta.name and t.dtype == meta.dtype and tuple(t.shape) == meta.shape


@pytest.mark.usefixtures("path")
@SEARCH
@given(
    records=st.lists(st.binary(max_size=300), max_size=40),
    compression=st.sampled_from(["", "GZIP", "ZLIB"]),
    chunk_size=st.integers(64, 700),
)
def test_a_tfrecord_file_gives_back_every_record_in_any_chunk_size(
    tmp_path: Path, records: list[bytes], compression: str, chunk_size: int
) -> None:
    path = tmp_path / "data.tfrecord"
    write_records(path, records, compression=compression)
    with TFRecordReader(path, compression=compression, chunk_size=chunk_size) as reader:
        assert list(reader) == records
