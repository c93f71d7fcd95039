"""Where tensors lie in a shared-memory lane's area (:mod:`psflow.transport.shm`): one after
another from its start, each at a multiple of :data:`LANE_ALIGN` bytes, and the views that
read and write them there."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from psflow.transport.wire.framing import TensorMeta

LANE_ALIGN = 64


def _lane_aligned(n: int) -> int:
    return (n + LANE_ALIGN - 1) & ~(LANE_ALIGN - 1)


def lane_layout(sizes: Iterable[int]) -> tuple[list[int], int]:
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
    (``as_strided``) instead of four (slice, ``from_numpy``, two ``view``), and one made at a
    dtype, shape and offset may be kept and handed out again (a native push's dense
    gradients, whose message's description changes every step with its ids' count). The views
    of the last few descriptions are kept too (:attr:`recent`, see :func:`decode_tensors`).
    """

    __slots__ = ("_made", "_typed", "address", "area", "recent")

    def __init__(self, area: np.ndarray[Any, Any]) -> None:
        self.area = area
        self.address: int = area.ctypes.data
        """Where the area starts in memory (numpy's ``ctypes`` costs a microsecond a call)."""
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._made: dict[tuple[torch.dtype, tuple[int, ...], int], torch.Tensor] = {}
        """Tensors made, by dtype, shape and offset: a push's dense gradients lie at the same
        places step after step while its ids' shapes change (a new description each step)."""
        self.recent: dict[int, tuple[list[TensorMeta], list[tuple[str, torch.Tensor]]]] = {}
        """Views by the ``id`` of the :func:`tensor_metas` list they were made for."""

    def tensor(
        self, dtype: torch.dtype, shape: Sequence[int], offset: int, *, kept: bool = False
    ) -> torch.Tensor:
        """A contiguous tensor of ``dtype`` and ``shape`` at byte ``offset`` of the area (a
        multiple of :data:`LANE_ALIGN`; the caller has checked that it fits). With ``kept``,
        the one made before at that dtype, shape and offset, if any (for a caller that only
        reads it or writes its values: never one that becomes an autograd leaf, whose
        ``.grad`` would stay on it)."""
        key = (dtype, shape if type(shape) is tuple else tuple(shape), offset)
        made = self._made.get(key) if kept else None
        if made is not None:
            return made
        typed = self._typed.get(dtype)
        if typed is None:
            area = self.area
            whole = len(area) - len(area) % dtype.itemsize
            typed = self._typed[dtype] = torch.from_numpy(area[:whole]).view(dtype)
        made = typed.as_strided(shape, _contiguous_strides(shape), offset // dtype.itemsize)
        if kept:
            if len(self._made) >= _MADE:
                self._made.clear()
            self._made[key] = made
        return made


_MADE = 256
"""Tensors an area keeps made (:meth:`AreaViews.tensor`); all dropped when it is full."""


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
    offsets, need = lane_layout(sizes)
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
    return lane_layout(sizes)[1]
