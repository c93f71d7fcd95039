"""An attached table's rows gathered by psflow's kernels, and their gradient scatter-added.

- :class:`GatherRows`: ``rows[index]`` as an autograd function over
  :func:`psflow.sparse.kernels.gather` and :func:`~psflow.sparse.kernels.scatter_add`.
- :func:`lookup`: ``F.embedding`` of a table whose rows come from a row source.
- :class:`BagRows`: ``F.embedding_bag`` over such rows, its gradient scatter-added by the
  kernels (:func:`bag_sizes`: each bag's size).
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
    never again: the gradient needs only ``index``. With ``padding``, that row (the padding
    id's) gets no gradient, as ``F.embedding``'s ``padding_idx`` has it."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        index: torch.Tensor,
        parts: list[torch.Tensor] | None = None,
        padding: int | None = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = rows.shape[0]
        ctx.padding = padding
        if parts is not None:
            return kernels.gather_parts(parts, index)
        return kernels.gather(rows.detach(), index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (index,) = ctx.saved_tensors
        out = kernels.scatter_add(ctx.rows, grad.contiguous(), index)
        if ctx.padding is not None:
            out[ctx.padding] = 0
        return out, None, None, None


class BagRows(torch.autograd.Function):
    """``F.embedding_bag(positions, rows, offsets, mode=mode, per_sample_weights=weights,
    padding_idx=padding)`` with ``mode`` ``"sum"`` or ``"mean"`` (weights with ``"sum"``
    only, as torch takes them): the forward is torch's, the gradient each id's bag's (times its
    weight; over the bag's count of ids other than the padding one for ``"mean"``)
    scatter-added into its row by :func:`psflow.sparse.kernels.scatter_add`, and a weight's
    the dot product of its bag's gradient with its id's row. The padding id's row and weights
    get none, as torch has it. torch's CPU backward sorts the ids first: for a CTR batch's 512
    bags of 26 ids it took about 1 ms here, this about a tenth of it. The same sums, added in
    another order (the last bits).

    ``sizes`` are the bags' sizes in order and ``covered`` their sum (:func:`bag_sizes`): bag
    ``b`` holds the ids from the end of bag ``b - 1``, and the gradient goes to the first
    ``covered`` ids only. :class:`~psflow.nn.EmbeddingBag` gives every id (``covered`` is their
    number): with ``include_last_offset`` it refuses a last offset short of the ids, whose
    ids after it torch's forward leaves out without a ``padding_idx`` but adds to the last bag
    with one (and its CPU backward gives them uninitialised memory without one)."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        positions: torch.Tensor,
        offsets: torch.Tensor | None,
        sizes: torch.Tensor,
        covered: int,
        mode: str,
        include_last_offset: bool,
        weights: torch.Tensor | None = None,
        padding: int | None = None,
    ) -> torch.Tensor:
        values = rows.detach()
        given = None if weights is None else weights.detach()
        divisors = None
        if mode == "mean":
            divisors = sizes
            if padding is not None:  # a bag's mean is over its other ids
                counted = (positions.reshape(-1)[:covered] != padding).to(sizes.dtype)
                bag = torch.repeat_interleave(
                    torch.arange(len(sizes), device=sizes.device), sizes, output_size=covered
                )
                divisors = torch.zeros_like(sizes).index_add_(0, bag, counted)
        kept = values if weights is not None else None
        ctx.save_for_backward(positions, sizes, given, kept, divisors)
        ctx.rows = rows.shape[0]
        ctx.covered = covered
        ctx.padding = padding
        return F.embedding_bag(
            positions,
            values,
            offsets,
            mode=mode,
            per_sample_weights=given,
            include_last_offset=include_last_offset,
            padding_idx=padding,
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        positions, sizes, weights, values, divisors = ctx.saved_tensors
        if divisors is not None:
            grad = grad / divisors.clamp_min(1).unsqueeze(1).to(grad.dtype)
        covered, padding = ctx.covered, ctx.padding
        each = grad.contiguous().repeat_interleave(sizes, dim=0, output_size=covered)
        flat = positions.reshape(-1)[:covered]
        weights_grad = None
        if weights is not None:
            flat_weights = weights.reshape(-1)
            if ctx.needs_input_grad[7]:
                got = torch.zeros_like(flat_weights)
                dots = (each * values.index_select(0, flat)).sum(1)
                got[:covered] = dots if padding is None else dots.masked_fill(flat == padding, 0)
                weights_grad = got.view(weights.shape)
            each = each * flat_weights[:covered].unsqueeze(1)
        rows_grad = kernels.scatter_add(ctx.rows, each, flat)
        if padding is not None:
            rows_grad[padding] = 0
        return rows_grad, None, None, None, None, None, None, weights_grad, None


def bag_sizes(
    positions: torch.Tensor, offsets: torch.Tensor | None, include_last_offset: bool
) -> tuple[torch.Tensor, int] | None:
    """The sizes of the bags ``F.embedding_bag`` makes of ``positions`` (2-D: a bag a row;
    1-D: by ``offsets``, the last bag to the end unless ``include_last_offset``) and how many
    ids they hold, or ``None`` where the offsets are not ones its forward takes as bags in
    order (not starting at 0, decreasing, past the ids): torch's own path then says so, or does
    what it does. (:class:`~psflow.nn.EmbeddingBag` has refused an ``include_last_offset``
    last offset other than the number of ids before.)"""
    device = positions.device
    if positions.dim() == 2:
        bags, size = positions.shape
        return torch.full((bags,), size, dtype=torch.int64, device=device), bags * size
    if offsets is None or offsets.dim() != 1 or not len(offsets):
        return None
    n = positions.numel()
    bounds = offsets.to(device=device, dtype=torch.int64)
    if not include_last_offset:
        bounds = torch.cat([bounds, bounds.new_tensor([n])])
    if len(bounds) < 2 or int(bounds[0]) != 0 or int(bounds[-1]) > n:
        return None
    sizes = bounds[1:] - bounds[:-1]
    return (sizes, int(bounds[-1])) if bool((sizes >= 0).all()) else None


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
