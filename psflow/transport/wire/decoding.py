"""The receiving side of the wire format: a message's header checked field by field
(:func:`decode_header`), then its tensors, from the header itself, from the frames or from a
lane's area (:func:`decode_tensors`)."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from psflow.protocol.messages import PROTOCOL_VERSION, Key
from psflow.transport.wire.framing import (
    _CLONE_BELOW,
    DTYPES,
    INLINE_BYTES,
    ITEMSIZE,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_NAME_LEN,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    NUMPY_DTYPES,
    TensorMeta,
    WireError,
    brief,
    num_frames,
)
from psflow.transport.wire.lanes import AreaViews, _lane_aligned, lane_bytes

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
    if type(raw) is list:  # anything else is refused below, in the words of its check
        for seen, metas in recent:
            # The last entry first: a push's lists differ there (its ids' count), so that a
            # new list costs one entry's comparison a recent one, not its dense entries' walk.
            if len(raw) == len(seen) and raw[-1] == seen[-1] and raw == seen:
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
        parts = [frame_buffer(f) for f in frames[i : i + n]]
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
    only: Container[str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a message whose header was decoded by :func:`decode_header` (with
    ``only``, those of these names alone: the rest are read by a native path, from
    :func:`tensor_buffers`; every one is still checked against the frames).

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
        return _decode_inline(metas, header[_INLINE], frames, only)
    if _IN_LANE in header:
        return _decode_lane(
            metas, area, frames, max_bytes=max_bytes, into=into, view=transient, keep=keep,
            only=only,
        )  # fmt: skip
    out = []
    for m, parts in frame_views(header, frames, max_bytes=max_bytes):
        if only is not None and m.name not in only:
            continue
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


def tensor_buffers(
    header: Mapping[str, Any],
    frames: Sequence[Any],
    *,
    max_bytes: int,
    area: AreaViews | None = None,
) -> list[tuple[Any, int]] | None:
    """Where each tensor of a message lies as it came, as ``(buffer, byte offset)``, without
    making a tensor: for a native path that reads the bytes itself. The buffers are the
    header's inline bytes, a lane's area (``area``) or the frames; ``None`` when a tensor lies
    in several frames, or the message does not match its header (:func:`decode_tensors` then
    says how).
    """
    metas = tensor_metas(header)
    if _INLINE in header:
        blob = header[_INLINE]
        if frames or not isinstance(blob, bytes):
            return None
        out: list[tuple[Any, int]] = []
        off = 0
        for m in metas:
            out.append((blob, off))
            off += _aligned(m.nbytes)
        return out if off == len(blob) else None
    if _IN_LANE in header:
        if area is None or frames:
            return None
        out = []
        off = 0
        for m in metas:
            out.append((area.area, off))
            off = _lane_aligned(off + m.nbytes)
        return out if off <= max_bytes and off <= len(area.area) else None
    chunk = header.get(_CHUNK)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        return None
    if len(frames) != len(metas) or sum(m.nbytes for m in metas) > max_bytes:
        return None
    out = []
    for m, frame in zip(metas, frames, strict=True):
        buf = frame_buffer(frame)
        if len(buf) != m.nbytes or m.nbytes > chunk:
            return None
        out.append((buf, 0))
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
    only: Container[str] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    if area is None:
        raise WireError("tensors in a shared-memory lane, but no lane is attached")
    if frames:
        raise WireError("a message with tensors in a lane carries no data frames")
    keep = keep and only is None  # a part of the tensors: not what the list describes
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
        if only is not None and m.name not in only:
            off = _lane_aligned(off + m.nbytes)
            continue
        if m.nbytes == 0:
            t = torch.empty(m.shape, dtype=m.dtype)
        else:
            # A native push's dense gradients (``only``): read by the shard's optimizer alone.
            t = area.tensor(m.dtype, m.shape, off, kept=view and only is not None)
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
    metas: list[TensorMeta], blob: Any, frames: Sequence[Any], only: Container[str] | None = None
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
        if only is not None and m.name not in only:
            off += _aligned(m.nbytes)
            continue
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


def _aligned(n: int) -> int:
    return (n + 7) & ~7


def frame_buffer(frame: Any) -> memoryview:
    """A received frame's bytes: a ZeroMQ frame's buffer, or the frame itself (an opened sealed
    frame, :mod:`psflow.transport.seal`)."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)
