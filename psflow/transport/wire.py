"""The wire format: one msgpack header frame, then raw tensor bytes.

A message is ``[header, *frames]``. The header is a msgpack map keyed by
:class:`~psflow.protocol.Key`, with at least :attr:`~Key.VERSION` (:data:`PROTOCOL_VERSION`),
:attr:`~Key.OP` (str) and :attr:`~Key.ID` (int); its :attr:`~Key.TENSORS` entry describes the
tensors that follow as ``[name, dtype, shape]`` triples. Their bytes travel in one of three ways:

- inline (:attr:`~Key.INLINE`): up to :data:`INLINE_BYTES` in all, inside the header frame;
- framed (:attr:`~Key.CHUNK`): each tensor in ``ceil(nbytes / chunk)`` frames (at least one),
  where ``chunk`` is that entry: moderate frames (1 MiB by default) move faster through ZeroMQ
  than a few huge ones. Frames are sent straight from the tensor's memory, without a copy;
- in a shared-memory lane (:attr:`~Key.IN_LANE`): one after another from the start of the
  lane's area, each at a multiple of 64 bytes (see :mod:`psflow.transport.shm`); no data frames.

Nothing here is pickled: the header is plain msgpack data, validated field by field, and tensor
bytes are only ever reinterpreted as one of the dtypes in :data:`DTYPES`.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import torch

from psflow.protocol.messages import PROTOCOL_VERSION, Key

# The framing keys as plain strings, bound once: ``header[Key.OP]`` costs five times
# ``header["op"]`` (a class attribute, then a key that is not a plain str), and each message
# makes a dozen such lookups.
_VERSION = Key.VERSION.value
_OP = Key.OP.value
_ID = Key.ID.value
_TENSORS = Key.TENSORS.value
_INLINE = Key.INLINE.value
_CHUNK = Key.CHUNK.value
_IN_LANE = Key.IN_LANE.value

DEFAULT_CHUNK_BYTES = 1 << 20
"""Bytes per frame for large tensors when the receiver's allocator is not tuned: ZeroMQ then
maps every frame above 32 MB afresh, and 1 MiB frames were measured fastest on loopback."""

WHOLE_TENSOR_CHUNK_BYTES = 1 << 30
"""Bytes per frame with the tuned allocator (:mod:`psflow.allocator`): a tensor up to 1 GiB
travels as one frame, which the receiver uses in place (a gradient is applied from it) instead
of assembling the tensor from pieces. Measured: 64 MB push and pull at 98-107% of the raw
socket, against 68-70% with 1 MiB frames."""

ZERO_COPY_ABOVE = 1 << 16
"""Messages with fewer tensor bytes than this are copied into ZeroMQ: cheaper than tracking
their frames until they have left."""

MAX_HEADER_BYTES = 1 << 20
"""A header larger than this is refused before msgpack looks at it."""

MAX_TENSORS = 1 << 16
_CLONE_BELOW = 1 << 12
INLINE_BYTES = 1 << 14
"""Tensor data up to this size travels inside the header frame."""
MAX_NAME_LEN = 512
MAX_DIMS = 16
MAX_TENSOR_BYTES = 1 << 48
"""Largest tensor a header may describe, counting a zero dimension as one: a bound on the
strides and sizes torch computes from a shape, checked in Python integers before torch sees
it (``[1048576, 2**62, 0, 3]`` holds no element, yet overflows torch's stride calculation)."""
MAX_DEPTH = 32
"""Deepest nesting of lists and maps a header may hold (psflow's own go four levels deep): a
deeper one could exhaust Python's recursion in a comparison, a ``repr`` or a JSON dump."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[torch.dtype, int] = {v: v.itemsize for v in DTYPES.values()}
NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    t: np.dtype(name) for name, t in DTYPES.items() if name != "bfloat16"
}


class WireError(ValueError):
    """A message that does not follow the wire format (malformed, truncated, oversized)."""


_brief_repr = reprlib.Repr()
_brief_repr.maxlevel = 3
_brief_repr.maxstring = 80
_brief_repr.maxother = 80


def brief(value: Any) -> str:
    """A short ``repr`` of a value from the network, for messages: bounded in length and in
    depth, whatever the value holds."""
    return _brief_repr.repr(value)


class TensorMeta(NamedTuple):
    """Name, dtype, shape and size of one tensor on the wire (a tuple: made per message)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel: psflow sends {sorted(DTYPES)}") from None


def num_frames(nbytes: int, chunk: int) -> int:
    return max(1, -(-nbytes // chunk))


def _raw(t: torch.Tensor) -> memoryview:
    if t.dtype in NUMPY_DTYPES and not t.requires_grad and t.numel():
        # One call instead of three: small steps pay torch's per-op cost many times over.
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _aligned(n: int) -> int:
    return (n + 7) & ~7


class Layout:
    """Names, dtypes and shapes of tensors that travel together again and again (a worker's
    gradients for one shard, a shard's variables): described for the wire, and placed in a
    lane area, once.

    Example:
        >>> layout = Layout([("w", torch.float32, (2, 3)), ("b", torch.float32, (3,))])
        >>> layout.offsets, layout.lane_bytes
        ([0, 64], 128)
    """

    def __init__(self, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> None:
        self.names = [name for name, _, _ in specs]
        self.dtypes = [dtype for _, dtype, _ in specs]
        self.shapes = [torch.Size(shape) for _, _, shape in specs]
        self.metas = [
            [name, dtype_name(dtype), list(shape)]
            for name, dtype, shape in zip(self.names, self.dtypes, self.shapes, strict=True)
        ]
        sizes = [
            math.prod(shape) * ITEMSIZE[dtype]
            for dtype, shape in zip(self.dtypes, self.shapes, strict=True)
        ]
        self.nbytes = sum(sizes)
        self.offsets, self.lane_bytes = _lane_layout(sizes)

    @classmethod
    def of(cls, tensors: Sequence[tuple[str, torch.Tensor]]) -> Layout:
        return cls([(name, t.dtype, t.shape) for name, t in tensors])

    def matches(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether ``tensors`` are contiguous CPU tensors with these names, dtypes and shapes."""
        if len(tensors) != len(self.names):
            return False
        for (name, t), want, dtype, shape in zip(
            tensors, self.names, self.dtypes, self.shapes, strict=True
        ):
            if not (
                t.dtype is dtype
                and t.shape == shape
                and name == want
                and t.is_cpu
                and t.is_contiguous()
            ):
                return False
        return True


class TensorSet:
    """Tensors that go out again and again (a ps shard's variables): described once.

    The tensors must stay the same objects, contiguous and on the CPU; their values may change.
    """

    def __init__(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"{name!r} must be a contiguous CPU tensor to join a TensorSet")
        self.layout = Layout.of(tensors)
        self.raws = [_raw(t) for _, t in tensors]


def encode(
    header: dict[str, Any],
    tensors: Sequence[tuple[str, torch.Tensor]] | TensorSet = (),
    *,
    chunk: int = DEFAULT_CHUNK_BYTES,
    area: np.ndarray[Any, Any] | None = None,
    layout: Layout | None = None,
    in_lane: int = 1,
    placed: bool = False,
) -> list[Any]:
    """The frames of one message: the packed header, then each tensor's bytes in chunks.

    With ``area`` (a lane's uint8 area), the tensors are copied into it when they fit, and the
    message is the header alone (its :attr:`~Key.IN_LANE` is then set, to ``in_lane``: which area
    it is). ``layout``, when the tensors follow it, spares describing them again. ``placed``:
    the tensors already lie in ``area`` where they go (:func:`placed_in`): nothing is copied.

    Small messages (at most :data:`INLINE_BYTES` of tensor data) travel as one frame, the
    bytes inside the header: each frame costs a wake-up of ZeroMQ's I/O thread, which is what
    bounds the latency of small steps. Large tensors travel as views of their own memory: the
    caller must keep them unchanged until ZeroMQ has sent them (see ``Server.flush``).
    ``header`` is completed in place (version, tensor list): pass a fresh dict per message.
    """
    if isinstance(tensors, TensorSet):
        layout = tensors.layout
        raws = tensors.raws
    elif layout is not None and layout.matches(tensors):
        raws = [_raw(t) for _, t in tensors]
    else:
        layout = None
        raws = []
        metas = []
        for name, t in tensors:
            if not t.is_cpu:
                t = t.cpu()
            if not t.is_contiguous():
                t = t.contiguous()
            metas.append([name, dtype_name(t.dtype), list(t.shape)])
            raws.append(_raw(t))
    if layout is not None:
        metas = layout.metas
        nbytes = layout.nbytes
    else:
        nbytes = sum(len(r) for r in raws)
    header[_VERSION] = PROTOCOL_VERSION
    frames: list[Any] = [b""]
    if metas:
        header[_TENSORS] = metas
        dst = None
        if area is not None:
            if layout is not None:
                offsets, need = layout.offsets, layout.lane_bytes
            else:
                offsets, need = _lane_layout([len(r) for r in raws])
            if need <= len(area):
                dst = area.data  # a memoryview: its copies are plain memcpy, faster than numpy's
        if dst is not None:
            if not placed:
                for off, raw in zip(offsets, raws, strict=True):
                    dst[off : off + len(raw)] = raw
            header[_IN_LANE] = in_lane
        elif nbytes <= INLINE_BYTES:
            # Each tensor starts 8-byte aligned, so the receiver can view it in place.
            header[_INLINE] = b"".join(
                bytes(r) + bytes(-len(r) % 8) if len(r) % 8 else r for r in raws
            )
        else:
            header[_CHUNK] = chunk
            for raw in raws:
                n = len(raw)
                if n <= chunk:
                    frames.append(raw)
                else:
                    frames.extend(raw[i : i + chunk] for i in range(0, n, chunk))
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


LANE_ALIGN = 64


def _lane_aligned(n: int) -> int:
    return (n + LANE_ALIGN - 1) & ~(LANE_ALIGN - 1)


def _lane_layout(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Where tensors of these sizes start in a lane area (each 64-byte aligned), and the bytes
    the area needs."""
    offsets = []
    off = 0
    for n in sizes:
        offsets.append(off)
        off = _lane_aligned(off + n)
    return offsets, off


class AreaViews:
    """Tensors laid out in one lane area (a uint8 array), cheaply.

    A view of the area as each dtype is made once: a tensor at an offset is then one call
    (``as_strided``) instead of four (slice, ``from_numpy``, two ``view``), and a message's
    tensors are made anew every time their shapes change (a lookup's ids, each step). The
    views of the last few descriptions are kept too (:attr:`recent`, see
    :func:`decode_tensors`).
    """

    __slots__ = ("_typed", "address", "area", "recent")

    def __init__(self, area: np.ndarray[Any, Any]) -> None:
        self.area = area
        self.address: int = area.ctypes.data
        """Where the area starts in memory (numpy's ``ctypes`` costs a microsecond a call)."""
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.recent: dict[int, tuple[list[TensorMeta], list[tuple[str, torch.Tensor]]]] = {}
        """Views by the ``id`` of the :func:`tensor_metas` list they were made for."""

    def tensor(self, dtype: torch.dtype, shape: Sequence[int], offset: int) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` at byte ``offset`` of the area (a
        multiple of :data:`LANE_ALIGN`; the caller has checked that it fits)."""
        typed = self._typed.get(dtype)
        if typed is None:
            area = self.area
            whole = len(area) - len(area) % dtype.itemsize
            typed = self._typed[dtype] = torch.from_numpy(area[:whole]).view(dtype)
        return typed.as_strided(shape, _contiguous_strides(shape), offset // dtype.itemsize)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    if len(shape) == 1:
        return (1,)
    if len(shape) == 2:
        return (max(shape[1], 1), 1)
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def lane_tensors(
    views: AreaViews, specs: Sequence[tuple[torch.dtype, Sequence[int]]]
) -> list[torch.Tensor] | None:
    """Tensors of these dtypes and shapes laid out in a lane's area (``views``) as
    :func:`encode` lays them out (a sender that fills them spares encode's copy), or ``None``
    when they do not fit."""
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in specs]
    offsets, need = _lane_layout(sizes)
    if need > len(views.area):
        return None
    return [
        views.tensor(dtype, shape, off) for off, (dtype, shape) in zip(offsets, specs, strict=True)
    ]


def placed_in(tensors: Sequence[tuple[str, torch.Tensor]], area: AreaViews) -> bool:
    """Whether ``tensors`` lie in the lane ``area`` exactly where :func:`encode` would copy
    them (as :func:`lane_tensors` made them), so ``encode(..., placed=True)`` may skip the
    copy."""
    if not tensors:
        return False
    base = area.address
    off = 0
    for _, t in tensors:
        if t.data_ptr() != base + off or not t.is_contiguous() or not t.is_cpu:
            return False
        off = _lane_aligned(off + t.nbytes)
    return off <= len(area.area)


def lane_bytes(sizes: Iterable[int]) -> int:
    """Bytes a lane area needs for tensors of these sizes (each starts 64-byte aligned)."""
    return _lane_layout(sizes)[1]


def lane_bytes_of(tensors: Sequence[tuple[str, torch.Tensor]] | TensorSet) -> int:
    """Bytes a lane area needs for ``tensors``."""
    if isinstance(tensors, TensorSet):
        return tensors.layout.lane_bytes
    return lane_bytes(t.nbytes for _, t in tensors)


def decode_header(frame: bytes | memoryview) -> dict[str, Any]:
    """The header of a received message, checked for shape but not yet for meaning.

    Raises:
        WireError: for anything that is not a header: oversized, not msgpack, nested deeper
            than :data:`MAX_DEPTH`, without the framing keys.
    """
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(frame)} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    try:
        header = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=INLINE_BYTES,
            max_array_len=MAX_TENSORS,
            max_map_len=MAX_TENSORS,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise WireError(f"header is not valid msgpack: {brief(e)}") from None
    if not isinstance(header, dict):
        raise WireError(f"header must be a map, got {type(header).__name__}")
    version = header.get(_VERSION)
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {brief(version)}, expected {PROTOCOL_VERSION}")
    if not isinstance(header.get(_OP), str):
        raise WireError(f"header has no string {_OP!r}")
    rid = header.get(_ID)
    if isinstance(rid, bool) or not isinstance(rid, int):
        raise WireError(f"header has no integer {_ID!r}")
    if len(frame) > MAX_DEPTH:  # a shorter frame cannot nest deeper
        for key, value in header.items():
            if isinstance(value, (list, dict)) and key != _INLINE and key != _TENSORS:
                _check_depth(value, key)
        if _TENSORS in header:
            # Checked entry by entry (three levels at most), and the check is kept for the
            # decoding of the tensors: cheaper than walking it here.
            tensor_metas(header)
    return header


def _check_depth(value: list[Any] | dict[Any, Any], key: str) -> None:
    """Raises :class:`WireError` when ``value`` nests lists and maps deeper than
    :data:`MAX_DEPTH` (walked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise WireError(f"header entry {brief(key)} nests deeper than {MAX_DEPTH} levels")
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))


_RECENT = 8
_recent_metas: tuple[tuple[Any, list[TensorMeta]], ...] = ()


def tensor_metas(header: Mapping[str, Any]) -> list[TensorMeta]:
    """The validated tensor descriptions of a header (empty when it carries none).

    Training sends the same few descriptions every step (one per shard, one per direction):
    the last :data:`_RECENT` distinct ones are validated once and handed out as the same list
    object, which :func:`decode_tensors` also keys its lane views on.
    """
    global _recent_metas
    raw = header.get(_TENSORS, [])
    if not raw:
        return []
    # One tuple, read and replaced whole, so that threads sharing it see consistent pairs.
    recent = _recent_metas
    for seen, metas in recent:
        if raw == seen:
            return metas
    out = _validate_metas(raw)
    _recent_metas = ((raw, out), *recent[: _RECENT - 1])
    return out


def _validate_metas(raw: Any) -> list[TensorMeta]:
    # type() is, not isinstance: msgpack gives plain types, and a bool is no dimension.
    if type(raw) is not list or len(raw) > MAX_TENSORS:
        raise WireError(
            f"{_TENSORS!r} must be a list of at most {MAX_TENSORS} [name, dtype, shape] entries"
        )
    out = []
    for entry in raw:
        if type(entry) is not list or len(entry) != 3:
            raise WireError(f"tensor entry {brief(entry)} is not [name, dtype, shape]")
        name, dtype, shape = entry
        if type(name) is not str or not 0 < len(name) <= MAX_NAME_LEN:
            raise WireError(f"tensor name {brief(name)} is not a string of 1..{MAX_NAME_LEN} chars")
        t = DTYPES.get(dtype) if type(dtype) is str else None
        if t is None:
            raise WireError(f"tensor {name!r} has unknown dtype {brief(dtype)}")
        if type(shape) is not list or len(shape) > MAX_DIMS:
            raise WireError(f"tensor {name!r} has a bad shape {brief(shape)}")
        count = 1
        bound = 1  # a zero dimension counted as one
        for d in shape:
            if type(d) is not int or d < 0:
                raise WireError(f"tensor {name!r} has a bad shape {brief(shape)}")
            count *= d
            if d > 1:
                bound *= d
        itemsize = ITEMSIZE[t]
        # Python integers: no overflow here, whatever the dimensions.
        if bound * itemsize > MAX_TENSOR_BYTES:
            raise WireError(
                f"tensor {name!r} of shape {brief(shape)} exceeds {MAX_TENSOR_BYTES} bytes"
            )
        out.append(TensorMeta(name, t, tuple(shape), count * itemsize))
    return out


def frame_views(
    header: Mapping[str, Any], frames: Sequence[Any], *, max_bytes: int
) -> list[tuple[TensorMeta, list[memoryview]]]:
    """Each tensor of a framed message (not inline) with the frames that hold its bytes.

    Raises:
        WireError: when the frames do not match the header (count, sizes) or exceed ``max_bytes``.
    """
    metas = tensor_metas(header)
    chunk = header.get(_CHUNK)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise WireError(f"bad chunk size {brief(chunk)}")
    total = sum(m.nbytes for m in metas)
    if total > max_bytes:
        raise WireError(f"message carries {total} tensor bytes, over the {max_bytes}-byte limit")
    expected = sum(num_frames(m.nbytes, chunk) for m in metas)
    if len(frames) != expected:
        raise WireError(
            f"expected {expected} data frame(s) for the listed tensors, got {len(frames)}"
        )
    out = []
    i = 0
    for m in metas:
        n = num_frames(m.nbytes, chunk)
        parts = [_buffer(f) for f in frames[i : i + n]]
        i += n
        got = sum(len(p) for p in parts)
        if got != m.nbytes:
            raise WireError(f"tensor {m.name!r} needs {m.nbytes} bytes, its frames hold {got}")
        out.append((m, parts))
    return out


def decode_tensors(
    header: Mapping[str, Any],
    frames: Sequence[Any],
    *,
    max_bytes: int,
    into: Mapping[str, torch.Tensor] | None = None,
    area: AreaViews | None = None,
    transient: bool = False,
    keep: bool = True,
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a message whose header was decoded by :func:`decode_header`.

    A tensor that arrived in one frame is a zero-copy view of that frame; one that arrived in
    several is assembled into ``into[name]`` when that is a contiguous tensor of the same dtype
    and shape (the caller's own buffer: no allocation, no second copy), else into fresh memory.
    Tensors in a shared-memory lane (``area``, the views of the lane's area the message used)
    are copied into ``into[name]`` or fresh memory, or, with ``transient`` (the caller is done
    with them before it answers), are views of the lane, kept in ``area.recent`` with ``keep``.

    Raises:
        WireError: when the frames do not match the header (count, sizes) or exceed ``max_bytes``.
    """
    metas = tensor_metas(header)
    if not metas:
        if frames:
            raise WireError(f"{len(frames)} data frame(s) but the header lists no tensors")
        return []
    if _INLINE in header:
        return _decode_inline(metas, header[_INLINE], frames)
    if _IN_LANE in header:
        return _decode_lane(
            metas, area, frames, max_bytes=max_bytes, into=into, view=transient, keep=keep
        )
    out = []
    for m, parts in frame_views(header, frames, max_bytes=max_bytes):
        if m.nbytes == 0:
            t = torch.empty(0, dtype=m.dtype)
        elif len(parts) == 1 and not parts[0].readonly and m.nbytes >= _CLONE_BELOW:
            # Zero-copy: the tensor is the frame (tiny frames may sit unaligned inside
            # ZeroMQ's message struct, so those are copied below).
            t = torch.frombuffer(parts[0], dtype=m.dtype)
        else:
            t = _destination(m, into)
            dst = t.view(-1).view(torch.uint8).numpy()
            off = 0
            for p in parts:
                dst[off : off + len(p)] = np.frombuffer(p, dtype=np.uint8)
                off += len(p)
        out.append((m.name, t.view(m.shape)))
    return out


def _destination(m: TensorMeta, into: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    t = into.get(m.name) if into is not None else None
    if t is not None and _fits(t, m):
        return t
    return torch.empty(m.shape, dtype=m.dtype)


def _fits(t: torch.Tensor, m: TensorMeta) -> bool:
    """Whether ``t`` can take ``m``'s bytes as they are. Only a CPU tensor can: a GPU model's
    parameters are filled from the received copy by the caller."""
    return (
        t.dtype == m.dtype and t.shape == m.shape and t.is_contiguous() and t.device.type == "cpu"
    )


def _decode_lane(
    metas: list[TensorMeta],
    area: AreaViews | None,
    frames: Sequence[Any],
    *,
    max_bytes: int,
    into: Mapping[str, torch.Tensor] | None,
    view: bool,
    keep: bool,
) -> list[tuple[str, torch.Tensor]]:
    if area is None:
        raise WireError("tensors in a shared-memory lane, but no lane is attached")
    if frames:
        raise WireError("a message with tensors in a lane carries no data frames")
    if view and keep:
        hit = area.recent.get(id(metas))
        if hit is not None and hit[0] is metas:
            return list(hit[1])  # made, and checked against this area, before
    need = lane_bytes(m.nbytes for m in metas)
    if need > max_bytes:
        raise WireError(f"message carries {need} tensor bytes, over the {max_bytes}-byte limit")
    if need > len(area.area):
        raise WireError(f"tensors need {need} bytes of lane, it holds {len(area.area)}")
    out = []
    off = 0
    for m in metas:
        if m.nbytes == 0:
            t = torch.empty(m.shape, dtype=m.dtype)
        else:
            t = area.tensor(m.dtype, m.shape, off)
            if not view:
                dst = into.get(m.name) if into is not None else None
                t = dst.copy_(t) if dst is not None and _fits(dst, m) else t.clone()
        off = _lane_aligned(off + m.nbytes)
        out.append((m.name, t))
    if view and keep:
        # A lane carries the same tensors at the same places step after step, and
        # tensor_metas hands out the same list for the same description: an entry is used
        # only for the very list it was made for.
        recent = area.recent
        if len(recent) >= _LANE_VIEWS:
            recent.clear()
        recent[id(metas)] = (metas, out)
        return list(out)
    return out


_LANE_VIEWS = 16


def _decode_inline(
    metas: list[TensorMeta], blob: Any, frames: Sequence[Any]
) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(blob, bytes):
        raise WireError(f"inline tensor data {_INLINE!r} must be bytes")
    if frames:
        raise WireError("a message with inline tensor data carries no data frames")
    total = sum(_aligned(m.nbytes) for m in metas)
    if total != len(blob):
        raise WireError(f"inline data holds {len(blob)} bytes, the listed tensors need {total}")
    # One copy into fresh (aligned, writable) memory; every tensor is a view of it, made by
    # numpy where it can (one cheap call instead of three torch ops).
    src = bytearray(blob)
    out = []
    off = 0
    for m in metas:
        np_dtype = NUMPY_DTYPES.get(m.dtype)
        if m.nbytes == 0:
            t = torch.empty(m.shape, dtype=m.dtype)
        elif np_dtype is not None:
            count = m.nbytes // np_dtype.itemsize
            t = torch.from_numpy(np.frombuffer(src, np_dtype, count, off).reshape(m.shape))
        else:
            t = torch.frombuffer(src, dtype=m.dtype, count=m.nbytes // 2, offset=off)
            t = t.view(m.shape)
        off += _aligned(m.nbytes)
        out.append((m.name, t))
    return out


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)
