"""An attached table's rows gathered by psflow's kernels, and their gradient scatter-added.

- :class:`GatherRows`: ``rows[index]`` as an autograd function over
  :func:`psflow.sparse.kernels.gather` and :func:`~psflow.sparse.kernels.scatter_add`.
- :func:`lookup`: ``F.embedding`` of a table whose rows come from a row source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

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
