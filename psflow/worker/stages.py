"""Stages: one model split across a worker's local devices, fed in micro-batches (GPipe).

Model parallelism, the other half of the multi-device tutorial: where towers copy the whole
model onto every device and split the batch, stages put *different layers* on different devices
and pass activations between them. Alone that leaves every device but one idle at any moment;
GPipe's answer is to cut the batch into micro-batches and run them through the stages as a
pipeline, so that stage 2 works on micro-batch ``i`` while stage 1 works on micro-batch ``i+1``.

:class:`Stages` is an ``nn.Module``: ``DistributedOptimizer`` and ``TrainingSession`` treat it
as one model, each parameter pulled onto the device it lives on and its gradient taken from
there. Gradients are those of the whole batch: the loss is computed on the concatenated
outputs and autograd accumulates every micro-batch's share into ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _device(d: str | torch.device) -> torch.device:
    device = torch.device(d)
    if device.type == "cuda":
        index = device.index if device.index is not None else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"device {device} is not available on this machine")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device {device}: stages run on cpu or cuda devices")
    return device


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        # Non-blocking only towards a GPU: a copy to the CPU must be complete before it is read.
        return value.to(device, non_blocking=device.type == "cuda")
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    return value


def _split(value: Any, chunks: int, count: int) -> list[Any]:
    """A tensor cut along dim 0 by ``torch.chunk`` (``count`` parts for every input of one
    batch size); a non-tensor repeated ``count`` times."""
    if isinstance(value, torch.Tensor):
        return list(torch.chunk(value, chunks)) if value.shape[0] else [value]
    return [value] * count


class Stages(nn.Module):
    """A model as a sequence of stages, each on its own device, run in micro-batches.

    Stage ``k`` receives what stage ``k - 1`` returned (a tensor, or a tuple of them, unpacked
    into its arguments), moved onto its device; the first stage receives the forward's
    arguments. The forward cuts every tensor argument along dim 0 into ``micro_batches`` parts
    and runs them in GPipe's order: at clock tick ``t`` stage ``k`` runs micro-batch
    ``t - k``, so stages on different CUDA devices work at once (their kernels are queued
    without waiting for each other). It returns the micro-batches' outputs concatenated on the
    last stage's device.

    Args:
        stages: the stage modules, in order; each is moved to its device.
        devices: one per stage: ``["cuda:0", "cuda:1"]``, ``["cuda:0", "cpu"]`` or
            ``["cpu", "cpu"]``.
        micro_batches: parts each batch is cut into (fewer when the batch is smaller).

    With a loss that is a mean over the examples, the gradients are those of the model run on
    the whole batch at once (layers that mix examples, such as batch norm, see micro-batches
    instead).

    Example:
        >>> net = Stages([nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 2)],
        ...              ["cpu", "cpu"], micro_batches=4)
        >>> net(torch.randn(16, 4)).shape
        torch.Size([16, 2])
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[str | torch.device],
        *,
        micro_batches: int = 4,
    ) -> None:
        super().__init__()
        if not stages:
            raise ValueError("stages need at least one module")
        if len(devices) != len(stages):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices: give one each")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.devices = [_device(d) for d in devices]
        self.stages = nn.ModuleList(s.to(d) for s, d in zip(stages, self.devices, strict=True))
        self.micro_batches = micro_batches

    def forward(self, *inputs: Any) -> torch.Tensor:
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        if not tensors:
            raise ValueError("Stages need at least one tensor input to cut into micro-batches")
        n = tensors[0].shape[0]
        if any(t.shape[0] != n for t in tensors):
            raise ValueError(f"inputs differ in batch size: {[t.shape[0] for t in tensors]}")
        count = len(torch.chunk(tensors[0], self.micro_batches)) if n else 1
        parts = [_split(x, self.micro_batches, count) for x in inputs]
        # carry[i]: micro-batch i's latest activation (arguments for its next stage).
        carry: list[tuple[Any, ...]] = [tuple(p[i] for p in parts) for i in range(count)]
        depth = len(self.stages)
        for tick in range(count + depth - 1):
            # Later stages first within a tick: their inputs were made in the previous tick.
            for k in reversed(range(depth)):
                i = tick - k
                if 0 <= i < count:
                    out = self.stages[k](*_to(carry[i], self.devices[k]))
                    carry[i] = out if isinstance(out, tuple) else (out,)
        outputs = [c[0] for c in carry if len(c) == 1 and isinstance(c[0], torch.Tensor)]
        if len(outputs) != count:
            raise TypeError("the last stage must return one tensor")
        return torch.cat(outputs) if count > 1 else outputs[0]
