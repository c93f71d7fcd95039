"""An attached table's rows gathered by psflow's kernels, and their gradient scatter-added.

- :class:`GatherRows`: ``rows[index]`` as an autograd function over
  :func:`psflow.sparse.kernels.gather` and :func:`~psflow.sparse.kernels.scatter_add`.
- :func:`lookup`: ``F.embedding`` of a table whose rows come from a row source.
- :class:`BagRows`: ``F.embedding_bag`` of bags of equal size over such rows, its gradient
  scatter-added by the kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

import psflow.sparse.kernels as kernels

if TYPE_CHECKING:
    from psflow.nn.table import TableModule


class GatherRows(torch.autograd.Function):
    """``rows[index]`` and its gradient, with :func:`psflow.sparse.kernels.gather` and
    :func:`~psflow.sparse.kernels.scatter_add`. With ``parts``, the values come from them
    (their concatenation is ``rows``' values, which ``rows`` need not hold), read here and
    never again: the gradient needs only ``index``."""

    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, index: torch.Tensor, parts: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = rows.shape[0]
        if parts is not None:
            return kernels.gather_parts(parts, index)
        return kernels.gather(rows.detach(), index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return kernels.scatter_add(ctx.rows, grad.contiguous(), index), None, None


class BagRows(torch.autograd.Function):
    """``F.embedding_bag(positions, rows, mode=mode)`` for bags of equal size (``positions``
    2-D, a bag a row), ``mode`` ``"sum"`` or ``"mean"``, no weights and no padding row: the
    forward is torch's, the gradient each id's bag's (over its size for ``"mean"``)
    scatter-added into its row by :func:`psflow.sparse.kernels.scatter_add`. torch's CPU
    backward sorts the ids first: for a CTR batch's 512 bags of 26 ids it took about 1 ms
    here, this about a tenth of it. The same sums, added in another order (the last bits)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, positions: torch.Tensor, mode: str) -> torch.Tensor:
        ctx.save_for_backward(positions)
        ctx.rows = rows.shape[0]
        ctx.mean = mode == "mean"
        return F.embedding_bag(positions, rows.detach(), mode=mode)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (positions,) = ctx.saved_tensors
        size = positions.shape[1]
        if ctx.mean and size:
            grad = grad / size
        each = grad.contiguous().repeat_interleave(size, dim=0)  # an id's its bag's
        return kernels.scatter_add(ctx.rows, each, positions.reshape(-1)), None, None


def lookup(table: TableModule, input: torch.Tensor) -> torch.Tensor:
    """``F.embedding(input, weight)`` of an attached table without a padding row or frequency
    scaling, ``[*input.shape, dim]``: the rows gathered by the kernels (from where the worker's
    rows came in, when its source keeps them there), the gradient scatter-added."""
    got = table._gather_parts(input)
    if got is not None:
        rows, parts, positions = got
        flat = GatherRows.apply(rows, positions.reshape(-1), parts)
    else:
        positions, rows, _ = table._gather(input)
        # The same values and gradients as F.embedding (whose CPU backward sorts the ids
        # first), on one thread (psflow.sparse.kernels says why).
        flat = GatherRows.apply(rows, positions.reshape(-1))
    return flat.view(*positions.shape, table.embedding_dim)
