"""A model's dense part as an ONNX file whose weights come from the exports, not the file.

:func:`export_dense` records a module (the layers above a model's embedding lookups) with
``torch.onnx.export``, its parameters turned into the graph's inputs: the file holds the
computation only, and :class:`~psflow.serve.server.ModelServer` feeds it each feature's pooled
rows and the dense parameters of the export it serves, so a delta that changes the dense layers
changes what the served model computes without a new ONNX file.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["export_dense"]


class _ParamsAsInputs(torch.nn.Module):
    """``module(*rows)`` with each named parameter read from an input instead. (The tracer
    refuses ``torch.func.functional_call``; putting the input where the parameter is, for the
    length of one call, records the same graph.)"""

    def __init__(self, module: torch.nn.Module, num_features: int, names: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.num_features = num_features
        self.names = list(names)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter | None]] = []
        try:
            for name, value in zip(self.names, inputs[self.num_features :], strict=True):
                owner, _, attr = name.rpartition(".")
                sub = self.module.get_submodule(owner)
                saved.append((sub, attr, sub._parameters[attr]))
                sub._parameters[attr] = value  # type: ignore[assignment]
            out: torch.Tensor = self.module(*inputs[: self.num_features])
            return out
        finally:
            for sub, attr, param in saved:
                sub._parameters[attr] = param


def export_dense(
    module: torch.nn.Module,
    features: Mapping[str, int],
    path: str | Path,
    *,
    prefix: str = "",
    output_names: Sequence[str] = ("output",),
    dtype: torch.dtype = torch.float32,
    dynamo: bool = False,
) -> list[str]:
    """Writes ``module``'s computation as ONNX for :class:`~psflow.serve.server.ModelServer`.

    ``module(*rows)`` takes one ``[batch, dim]`` tensor per feature, in the order of
    ``features``; the file's inputs are those, named after the features, then each of the
    module's parameters named ``prefix + name`` (its name in the exported model: ``"head."``
    for a model's ``self.head``). The batch dimension is dynamic. Buffers (a batch norm's
    running statistics) are recorded as constants: the ps holds parameters only.

    Args:
        module: the dense layers, in eval mode for what differs there (dropout).
        features: each request feature's pooled row width (its table's ``embedding_dim``),
            in the order ``module`` takes them.
        path: the ONNX file to write.
        prefix: what precedes the module's parameter names in the exported model.
        output_names: the graph's outputs, as the server answers them.
        dtype: the rows' dtype (the tables').
        dynamo: record with ``torch.export`` (the exporter torch now defaults to, seconds
            slower) instead of the TorchScript tracer (deprecated by torch, still fast).

    Returns:
        The file's input names.

    Example:
        >>> # export_dense(model.head, {"items": 8, "users": 8}, "head.onnx", prefix="head.")
    """
    if not features:
        raise ValueError("export_dense: name at least one feature")
    names = [n for n, _ in module.named_parameters()]
    example = [torch.zeros(2, dim, dtype=dtype) for dim in features.values()]
    params = [p.detach() for _, p in module.named_parameters()]
    inputs = [*features, *(prefix + n for n in names)]
    batch = {f: {0: "batch"} for f in features} | {o: {0: "batch"} for o in output_names}
    recorded = _ParamsAsInputs(module, len(features), names).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on shapes taken as constants
        if dynamo:
            dim = torch.export.Dim("batch")
            shapes = tuple({0: dim} for _ in features) + tuple(None for _ in names)
            torch.onnx.export(
                recorded, tuple(example + params), str(path), input_names=inputs,
                output_names=list(output_names), dynamic_shapes=(shapes,), dynamo=True,
            )  # fmt: skip
        else:
            torch.onnx.export(
                recorded, tuple(example + params), str(path), input_names=inputs,
                output_names=list(output_names), dynamic_axes=batch, dynamo=False,
            )  # fmt: skip
    return inputs
