"""The fused row-wise updates (``_kernels.c``), where the install built them.

torch applies a row-wise update as a chain of index operations, each one a pass over rows that
lie scattered through a large table; the C kernels read and write each touched row once, its
optimizer state beside it, with torch's own arithmetic in torch's order (so the two agree to
the last bit or two of a float, and :class:`~psflow.sparse.RowOptimizer` is the reference).
Measured on 2,048 Zipf-distributed rows of a 1M x 64 float32 shard: Adagrad 0.50 ms with
torch's index operations (gather, compute, scatter), see ``benchmarks/results/embedding.md``
for the kernel's figure.

:func:`fused` answers whether a call can take the kernel: CPU tensors, float32 or float64,
contiguous, int64 index; anything else (CUDA, half precision, a strided view) goes through
torch. ``PSFLOW_KERNELS=0`` turns the kernels off.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch

from psflow import env as envvars

log = logging.getLogger(__name__)


def _load() -> ModuleType | None:
    if os.environ.get(envvars.PSFLOW_KERNELS, "1") == "0":
        return None
    try:
        from psflow.sparse import _kernels  # type: ignore[attr-defined]
    except ImportError:
        log.debug("psflow.sparse._kernels was not built: row-wise updates use torch's ops")
        return None
    return _kernels


KERNELS: ModuleType | None = _load()
"""The compiled module, or ``None`` (not built, or ``PSFLOW_KERNELS=0``)."""

_FLOATS = {torch.float32: False, torch.float64: True}


def fused(values: torch.Tensor, state: dict[str, torch.Tensor], grad: torch.Tensor) -> bool:
    """Whether the kernels can update ``values`` and ``state`` with ``grad`` (the index is
    int64 and contiguous wherever the rows come from; see the module docstring)."""
    if KERNELS is None or values.dtype not in _FLOATS or values.device.type != "cpu":
        return False
    if grad.dtype != values.dtype or grad.device.type != "cpu" or not grad.is_contiguous():
        return False
    if not values.is_contiguous() or values.dim() != 2:
        return False
    return all(t.is_contiguous() and t.device.type == "cpu" for t in state.values())


def is_double(values: torch.Tensor) -> bool:
    return _FLOATS[values.dtype]


def check(bad: int, index: torch.Tensor, rows: int) -> None:
    """Raises ``IndexError`` for a kernel's report of a bad index (``-1``: none)."""
    if bad >= 0:
        raise IndexError(f"row index {int(index[bad])} is out of range [0, {rows})")
