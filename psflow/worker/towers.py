"""Towers: one worker, several local devices, one push.

Each batch is split along dim 0 (``torch.chunk``) into one part per device; a replica of the
model on each device computes its part's gradients, and their average, weighted by the part
sizes, lands in the main model's ``.grad``. With a loss that is a mean over the examples this
is exactly the full-batch gradient, so :meth:`DistributedOptimizer.step` pushes it once, as if
one device had done the whole batch. Buffers a forward changes in place (BatchNorm's running
statistics) are the first tower's, as torch's ``DataParallel`` keeps its first device's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from psflow.nn import TableModule

REDUCTIONS = ("mean", "sum")


class Towers:
    """Replicas of ``model`` on ``devices`` that share each batch.

    Args:
        model: the main model (the one :class:`DistributedOptimizer` trains); it keeps the
            averaged gradients and the parameters the ps sends.
        devices: one entry per tower: ``["cuda:0", "cuda:1"]``, or ``["cpu", "cpu"]`` for
            several CPU replicas.
        reduction: ``"mean"`` when the loss is a mean over the examples (gradients weighted by
            part size), ``"sum"`` when it is a sum (gradients added).

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> towers = Towers(model, ["cpu", "cpu"])
        >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
        >>> loss = towers.backward(lambda m, x, y: ((m(x) - y) ** 2).mean(), x, y)
        >>> model.weight.grad.shape
        torch.Size([1, 3])
    """

    def __init__(
        self, model: nn.Module, devices: Sequence[str | torch.device], *, reduction: str = "mean"
    ) -> None:
        if not devices:
            raise ValueError("towers need at least one device")
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}: expected one of {REDUCTIONS}")
        self.devices = [torch.device(d) for d in devices]
        for d in self.devices:
            if d.type == "cuda":
                index = d.index if d.index is not None else 0
                if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                    raise ValueError(f"device {d} is not available on this machine")
            elif d.type != "cpu":
                raise ValueError(f"device {d}: towers run on cpu or cuda devices")
        tables = [name for name, m in model.named_modules() if isinstance(m, TableModule)]
        if tables:  # a deepcopy of one attached to the ps failed on its sockets' memory
            raise ValueError(
                f"towers replicate the model, and {tables[0]!r} is a psflow.nn table: look its "
                "rows up once for the whole batch, outside the towers, and give them to "
                "backward as an input (docs/sync.md, Towers)"
            )
        self.model = model
        self.reduction = reduction
        self.replicas = [copy.deepcopy(model).to(d) for d in self.devices]
        self._main = dict(model.named_parameters())
        self._replica_params = [dict(r.named_parameters()) for r in self.replicas]

    def sync(self) -> None:
        """Copies the main model's parameters and buffers into every replica."""
        with torch.no_grad():
            for replica in self.replicas:
                for name, p in replica.named_parameters():
                    p.copy_(self._main[name], non_blocking=True)
                for (_, b), (_, mb) in zip(
                    replica.named_buffers(), self.model.named_buffers(), strict=True
                ):
                    b.copy_(mb, non_blocking=True)

    def backward(self, loss_fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """Splits ``inputs`` across the towers, backpropagates, and averages into ``.grad``.

        ``loss_fn(replica, *parts)`` computes one tower's loss. The main model's gradients are
        overwritten (not accumulated). An input that requires grad (the output of layers run
        once for the whole batch, outside the towers) gets the batch's gradient, accumulated
        by autograd as usual. Returns the batch's loss, combined like the gradients.
        """
        if not inputs:
            raise ValueError("backward needs at least one input tensor to split")
        n = inputs[0].shape[0]
        if any(t.shape[0] != n for t in inputs):
            raise ValueError(f"inputs differ in batch size: {[t.shape[0] for t in inputs]}")
        # An input that requires grad (vectors looked up once for the whole batch) is cut from
        # a leaf of its own: each tower's backward stops there, and one backward through what
        # made the input follows with the summed gradient.
        leaves = [t.detach().requires_grad_() if t.requires_grad else t for t in inputs]
        parts = [torch.chunk(t, len(self.devices)) for t in leaves]
        used = len(parts[0])  # fewer towers than devices when the batch is smaller
        self.sync()
        losses = []
        weights = []
        for i in range(used):
            replica, device = self.replicas[i], self.devices[i]
            replica.zero_grad(set_to_none=True)
            chunk = [p[i].to(device, non_blocking=True) for p in parts]
            weight = chunk[0].shape[0] / n if self.reduction == "mean" else 1.0
            loss = loss_fn(replica, *chunk)
            # Weighted before backward, so that an input computed before the towers (an
            # embedding looked up once for the whole batch) gets the batch's gradient too.
            (loss * weight).backward()
            losses.append(loss.detach())
            weights.append(weight)
        with torch.no_grad():
            # What the forward changed in place (BatchNorm's running statistics): the first
            # tower's, as torch's DataParallel keeps its first device's (else the main model,
            # and with it eval mode, the evaluator and the checkpoints' exports, kept the
            # initial statistics for good, and each batch reset the replicas' to them).
            for (_, b), (_, mb) in zip(
                self.replicas[0].named_buffers(), self.model.named_buffers(), strict=True
            ):
                mb.copy_(b)
            for name, p in self._main.items():
                grads = [self._replica_params[i][name].grad for i in range(used)]
                present = [g for g in grads if g is not None]
                if not present:
                    p.grad = None
                    continue
                total = torch.zeros_like(p)
                for g in present:
                    total.add_(g.to(p.device))
                p.grad = total
        made = [(t, leaf.grad) for t, leaf in zip(inputs, leaves, strict=True) if t.requires_grad]
        if any(g is not None for _, g in made):
            torch.autograd.backward(
                [t for t, g in made if g is not None], [g for _, g in made if g is not None]
            )
        with torch.no_grad():
            return sum(
                (w * loss.to("cpu") for w, loss in zip(weights, losses, strict=True)),
                torch.zeros((), dtype=losses[0].dtype),
            )
