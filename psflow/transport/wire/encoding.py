"""The sending side of the wire format: a message's frames (:func:`encode`), and the tensors
that travel again and again described once (:class:`Layout`, :class:`TensorSet`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from psflow.protocol.messages import PROTOCOL_VERSION, Key
from psflow.transport.wire.framing import (
    DEFAULT_CHUNK_BYTES,
    INLINE_BYTES,
    ITEMSIZE,
    NUMPY_DTYPES,
    dtype_name,
)
from psflow.transport.wire.lanes import lane_bytes, lane_layout

# The framing keys as plain strings, bound once: ``header[Key.OP]`` costs five times
# ``header["op"]`` (a class attribute, then a key that is not a plain str), and each message
# makes a dozen such lookups.
_VERSION = Key.VERSION.value
_TENSORS = Key.TENSORS.value
_INLINE = Key.INLINE.value
_CHUNK = Key.CHUNK.value
_IN_LANE = Key.IN_LANE.value


def _raw(t: torch.Tensor) -> memoryview:
    if t.dtype in NUMPY_DTYPES and not t.requires_grad and t.numel():
        # One call instead of three: small steps pay torch's per-op cost many times over.
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


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
        self.offsets, self.lane_bytes = lane_layout(sizes)

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
                offsets, need = lane_layout([len(r) for r in raws])
            if need <= len(area):
                dst = area.data  # a memoryview: its copies are plain memcpy, faster than numpy's
        if dst is None:
            return _framed(header, raws, nbytes, chunk)
        if not placed:
            for off, raw in zip(offsets, raws, strict=True):
                dst[off : off + len(raw)] = raw
        header[_IN_LANE] = in_lane
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def encode_raw(
    header: dict[str, Any],
    metas: list[list[Any]],
    raws: Sequence[Any] = (),
    *,
    chunk: int = DEFAULT_CHUNK_BYTES,
    in_lane: int | None = None,
) -> list[Any]:
    """The frames of a message whose tensors are described by ``metas`` (``[name, dtype,
    shape]`` each) and held as bytes in ``raws`` (buffers, one a tensor), or, with
    ``in_lane``, already in that area of a lane (laid out by :func:`lane_layout`): what
    :func:`encode` sends, for a sender that wrote the bytes itself (a native path, no tensor
    made). ``header`` is completed in place."""
    header[_VERSION] = PROTOCOL_VERSION
    if metas:
        header[_TENSORS] = metas
        if in_lane is None:
            views = [memoryview(r).cast("B") for r in raws]
            return _framed(header, views, sum(len(v) for v in views), chunk)
        header[_IN_LANE] = in_lane
    return [msgpack.packb(header, use_bin_type=True)]


def _framed(
    header: dict[str, Any], raws: Sequence[memoryview], nbytes: int, chunk: int
) -> list[Any]:
    """The frames of a message whose tensors travel by socket: inline when small, else in
    chunks of ``chunk`` bytes."""
    frames: list[Any] = [b""]
    if nbytes <= INLINE_BYTES:
        # Each tensor starts 8-byte aligned, so the receiver can view it in place.
        header[_INLINE] = b"".join(bytes(r) + bytes(-len(r) % 8) if len(r) % 8 else r for r in raws)
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


def lane_bytes_of(tensors: Sequence[tuple[str, torch.Tensor]] | TensorSet) -> int:
    """Bytes a lane area needs for ``tensors``."""
    if isinstance(tensors, TensorSet):
        return tensors.layout.lane_bytes
    return lane_bytes(t.nbytes for _, t in tensors)
