"""The wire format: round trips for every dtype, chunking, inline data, and malformed input."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
import torch

from psflow.transport import wire

pytestmark = pytest.mark.unit


def roundtrip(
    tensors: list[tuple[str, torch.Tensor]], chunk: int = 4096
) -> list[tuple[str, torch.Tensor]]:
    frames = wire.encode({"op": "push", "id": 7}, tensors, chunk=chunk)
    header = wire.decode_header(bytes(frames[0]))
    assert header["op"] == "push" and header["id"] == 7
    return wire.decode_tensors(header, [bytes(f) for f in frames[1:]], max_bytes=1 << 30)


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()))
@pytest.mark.parametrize("numel", [0, 1, 3, 5000, 70000])
def test_roundtrip_every_dtype_and_size(dtype: torch.dtype, numel: int) -> None:
    t = (
        (torch.arange(numel) % 7).to(dtype).reshape(-1, 1)
        if numel
        else torch.empty(0, 1, dtype=dtype)
    )
    ((name, back),) = roundtrip([("w", t)])
    assert name == "w" and back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_small_messages_are_one_frame_large_ones_are_chunked() -> None:
    small = wire.encode({"op": "x", "id": 1}, [("a", torch.ones(10)), ("b", torch.zeros(3))])
    assert len(small) == 1
    big = torch.randn(10_000)  # 40000 bytes > INLINE_BYTES
    frames = wire.encode({"op": "x", "id": 1}, [("a", big), ("b", torch.ones(2))], chunk=4096)
    assert len(frames) == 1 + 10 + 1
    assert all(len(f) <= 4096 for f in frames[1:])
    back = dict(wire.decode_tensors(wire.decode_header(frames[0]), frames[1:], max_bytes=1 << 20))
    assert torch.equal(back["a"], big) and torch.equal(back["b"], torch.ones(2))


def test_non_contiguous_tensors_travel() -> None:
    t = torch.arange(12.0).reshape(3, 4).t()
    ((_, back),) = roundtrip([("t", t)])
    assert torch.equal(back, t)


@pytest.mark.parametrize(
    "tensors",
    [
        [("w", torch.randn(2, 3)), ("b", torch.randn(3))],  # what the layout says
        [("w", torch.randn(2, 3).double()), ("b", torch.randn(3))],  # another dtype
        [("w", torch.randn(3, 2)), ("b", torch.randn(3))],  # another shape
        [("w", torch.randn(3, 2).t()), ("b", torch.randn(3))],  # not contiguous
        [("b", torch.randn(3)), ("w", torch.randn(2, 3))],  # another order
        [("w", torch.randn(2, 3))],  # fewer
    ],
)
def test_a_layout_describes_only_tensors_that_follow_it(
    tensors: list[tuple[str, torch.Tensor]],
) -> None:
    layout = wire.Layout([("w", torch.float32, (2, 3)), ("b", torch.float32, (3,))])
    with_layout = wire.encode({"op": "push", "id": 1}, tensors, layout=layout)
    without = wire.encode({"op": "push", "id": 1}, tensors)
    assert with_layout == without  # the same message either way
    header = wire.decode_header(with_layout[0])
    back = wire.decode_tensors(header, [], max_bytes=1 << 20)
    assert [n for n, _ in back] == [n for n, _ in tensors]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(back, tensors, strict=True))
    area = np.zeros(1024, dtype=np.uint8)  # and through a lane's area
    frames = wire.encode({"op": "push", "id": 2}, tensors, area=area, layout=layout)
    header = wire.decode_header(frames[0])
    assert header["s"] == 1
    back = wire.decode_tensors(header, [], max_bytes=1 << 20, area=wire.AreaViews(area))
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(back, tensors, strict=True))


def test_unsupported_dtype_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot travel"):
        wire.encode({"op": "x", "id": 1}, [("c", torch.zeros(2, dtype=torch.complex64))])


def pack(header: object) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1garbage", "not valid msgpack"),
        (pack([1, 2]), "must be a map"),
        (pack({"op": "pull", "id": 1}), "protocol version"),
        (pack({"v": wire.PROTOCOL_VERSION, "id": 1}), "no string 'op'"),
        (pack({"v": wire.PROTOCOL_VERSION, "op": "pull"}), "no integer 'id'"),
        (pack({"v": wire.PROTOCOL_VERSION, "op": "pull", "id": True}), "no integer 'id'"),
        (b"\x00" * (wire.MAX_HEADER_BYTES + 1), "exceeds"),
    ],
)
def test_bad_headers(raw: bytes, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode_header(raw)


def header(**fields: object) -> dict[str, object]:
    return {"v": wire.PROTOCOL_VERSION, "op": "push", "id": 1, **fields}


@pytest.mark.parametrize(
    ("h", "frames", "message"),
    [
        (header(t="x"), [], "must be a list"),
        (header(t=[["w", "float32"]]), [], "is not \\[name, dtype, shape\\]"),
        (header(t=[["", "float32", [1]]]), [], "tensor name"),
        (header(t=[["w", "complex64", [1]]]), [], "unknown dtype"),
        (header(t=[["w", "float32", [-1]]]), [], "bad shape"),
        (header(t=[["w", "float32", [1.5]]]), [], "bad shape"),
        (header(t=[["w", "float32", [2]]], c=4096), [], "expected 1 data frame"),
        (header(t=[["w", "float32", [2]]], c=4096), [b"\x00" * 4], "needs 8 bytes"),
        (header(t=[["w", "float32", [2]]], c=0), [b"\x00" * 8], "bad chunk size"),
        (header(t=[["w", "float32", [1 << 40]]], c=4096), [b""], "over the"),
        (header(t=[["w", "float32", [2]]], b=b"\x00" * 4), [], "inline data holds 4 bytes"),
        (header(t=[["w", "float32", [1]]], b="text"), [], "must be bytes"),
        (header(), [b"x"], "lists no tensors"),
    ],
)
def test_bad_tensor_frames(h: dict[str, object], frames: list[bytes], message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode_tensors(h, frames, max_bytes=1 << 30)


def test_pieces_are_assembled_only_into_cpu_destinations() -> None:
    """A tensor in several frames is assembled into the caller's buffer only when that is a CPU
    tensor (the bytes go through numpy): a GPU model's parameter (here on the meta device, which
    numpy cannot reach either) gets fresh memory, copied in by the caller."""
    value = torch.arange(8192, dtype=torch.float32)  # 32 KiB: over the inline limit
    frames = wire.encode({"op": "push", "id": 1}, [("w", value)], chunk=8192)
    assert len(frames) == 5  # header and 4 chunks: assembled, not viewed
    header = wire.decode_header(frames[0])
    cpu = torch.empty(8192)
    ((_, got),) = wire.decode_tensors(header, frames[1:], max_bytes=1 << 20, into={"w": cpu})
    assert got.data_ptr() == cpu.data_ptr() and torch.equal(cpu, value)
    elsewhere = torch.empty(8192, device="meta")
    ((_, got),) = wire.decode_tensors(header, frames[1:], max_bytes=1 << 20, into={"w": elsewhere})
    assert got.is_cpu and torch.equal(got, value)


def _push_header(shape: list[int], **fields: object) -> dict[str, object]:
    """A push header as decode_header gives it, without its checks of the tensor list (which
    decode_tensors makes again, for headers that did not come through decode_header)."""
    return {
        "v": wire.PROTOCOL_VERSION,
        "op": "push",
        "id": 1,
        "t": [["w", "float32", shape]],
        **fields,
    }


@pytest.mark.parametrize(
    "shape",
    [
        [1048576, 4611686018427387904, 0, 3],  # no element, yet torch's strides overflow
        [0, 2**62, 2**62],
        [2**40, 2**40],
        [2**63 - 1],
    ],
)
def test_shapes_past_the_bound_are_refused_before_torch_sees_them(shape: list[int]) -> None:
    for fields, frames in (({"c": 1 << 20}, [b""]), ({"b": b""}, []), ({"l": 1}, [])):
        header = _push_header(shape, **fields)
        with pytest.raises(wire.WireError, match="exceeds"):
            wire.decode_tensors(
                header, frames, max_bytes=1 << 33, area=wire.AreaViews(np.zeros(64, np.uint8))
            )
        with pytest.raises(wire.WireError, match="exceeds"):  # refused as it arrives, too
            wire.decode_header(msgpack.packb(header))


@pytest.mark.parametrize("depth", [33, 999, 1100, 100000])
def test_deeply_nested_headers_are_malformed(depth: int) -> None:
    base = msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": "status", "id": 1})
    frame = bytes([base[0] + 1]) + base[1:] + msgpack.packb("x") + b"\x91" * depth + b"\x01"
    with pytest.raises(wire.WireError):
        wire.decode_header(frame)


def test_errors_quote_hostile_values_briefly() -> None:
    nested: list[object] = [1]
    for _ in range(30):
        nested = [nested]
    header = {"v": wire.PROTOCOL_VERSION, "op": "push", "id": 1, "t": [nested] * 1000}
    with pytest.raises(wire.WireError) as e:
        wire.tensor_metas(header)
    assert len(str(e.value)) < 200
    with pytest.raises(wire.WireError) as e:
        wire.decode_header(msgpack.packb(header))
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("bad", [{"a": 1}, "x", 1, [["w", "float7", [1]], ["v", "float32", [2]]]])
def test_a_tensor_list_like_a_recent_one_is_still_checked(bad: object) -> None:
    """The recent lists are matched by equality alone: a value of the same length as one of
    them, or a list that shares its last entry, is checked and refused in its own words."""
    wire.tensor_metas({"t": [["v", "float32", [2]]]})  # recent: one entry, "v" last
    wire.tensor_metas({"t": [["u", "float32", [1]], ["v", "float32", [2]]]})
    with pytest.raises(wire.WireError, match=r"must be a list|unknown dtype"):
        wire.tensor_metas({"t": bad})


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float32, (5, 3)),
        (torch.float64, (7,)),
        (torch.int64, ()),
        (torch.bfloat16, (2, 3, 4)),
        (torch.bool, (9,)),
    ],
)
def test_area_views_lay_tensors_out_where_the_bytes_are(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """A tensor made by ``AreaViews`` at an offset is the area's bytes there, read as the dtype
    (an area whose length no itemsize divides, as a lane's may be)."""
    area = np.zeros(64 * 9 + 5, dtype=np.uint8)
    views = wire.AreaViews(area)
    value = torch.arange(math.prod(shape), dtype=torch.float64).to(dtype).view(shape)
    raw = value.reshape(-1).view(torch.uint8).numpy()
    area[128 : 128 + len(raw)] = raw
    got = views.tensor(dtype, shape, 128)
    assert got.shape == shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, value)
    assert got.data_ptr() == area.ctypes.data + 128  # a view: no copy
    area[128 : 128 + len(raw)] = 0
    assert not got.any() or not value.any()  # it sees the area change
    # Kept: the same tensor again at that dtype, shape and offset (a native push's dense
    # gradients); not kept (what may become an autograd leaf), a new one every time.
    kept = views.tensor(dtype, shape, 128, kept=True)
    assert views.tensor(dtype, list(shape), 128, kept=True) is kept
    assert views.tensor(dtype, shape, 192, kept=True) is not kept
    assert views.tensor(dtype, shape, 128) is not views.tensor(dtype, shape, 128)
    assert views.tensor(dtype, shape, 128) is not kept
