"""One export as the server computes with it: the tables' lookups and the dense feeds, fixed.

:class:`Served` is built from an :class:`~psflow.serve.delta.ExportedModel` once per export
applied and never changes after: a request takes the current one and computes with it alone,
so a delta that lands meanwhile is applied between requests, never during one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from psflow.serve.delta import ExportedModel, ExportError

__all__ = ["MODES", "Feature", "Served"]

MODES = ("sum", "mean", "max")
"""A feature's combiners, ``torch.nn.EmbeddingBag``'s."""
ONNX_TYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
}


@dataclass(frozen=True, kw_only=True)
class Feature:
    """A request feature: bags of ids of one table, pooled into one row per example.

    The pooling is the table's in ``psflow.nn`` in eval mode: an id the table does not hold
    is a row of zeros (and counts in a ``"mean"``), the padding id is left out of its bag,
    an empty bag is zeros.
    """

    table: str
    """The exported table the ids are of."""
    mode: str = "mean"
    """``"sum"``, ``"mean"`` or ``"max"`` (the ``psflow.nn.EmbeddingBag``'s)."""
    padding_idx: int | None = None
    """The id left out of a bag (the ``EmbeddingBag``'s ``padding_idx``)."""

    def __post_init__(self) -> None:
        if not self.table:
            raise ValueError("Feature: table must be a table's name, got ''")
        if self.mode not in MODES:
            raise ValueError(f"Feature: mode must be one of {MODES}, got {self.mode!r}")


class _Table:
    """A table's rows as a sorted search over the export's own tensors (shared, not copied:
    an export applied after replaces them, it never writes into them)."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        self.ids, self.rows = ids, rows

    def pool(self, ids: torch.Tensor, offsets: torch.Tensor, feature: Feature) -> torch.Tensor:
        n, dim = self.ids.numel(), self.rows.shape[1]
        if n:
            pos = torch.searchsorted(self.ids, ids).clamp_(max=n - 1)
            hit = (self.ids[pos] == ids).unsqueeze(1)
            got = torch.where(hit, self.rows[pos], self.rows.new_zeros(()))
        else:
            got = self.rows.new_zeros(ids.numel(), dim)
        # The bags over the request's own rows, then a zero row for the padding id: what
        # psflow.nn's eval mode computes over its snapshot, in the same order.
        index = torch.arange(ids.numel())
        padding = None
        if feature.padding_idx is not None:
            padding = ids.numel()
            index = torch.where(ids == feature.padding_idx, padding, index)
        table = torch.cat([got, got.new_zeros(1, dim)])
        return F.embedding_bag(index, table, offsets, mode=feature.mode, padding_idx=padding)


class Served:
    """The tables and dense feeds of one export, checked against the ONNX graph's inputs.

    Args:
        model: the export applied (read here, not kept).
        features: the request features, by name.
        inputs: the ONNX graph's inputs: name to (shape, ORT type).

    Raises:
        ExportError: when the export lacks a feature's table, or its dense parameters or row
            widths do not fit the graph's inputs; naming which.
    """

    def __init__(
        self,
        model: ExportedModel,
        features: Mapping[str, Feature],
        inputs: Mapping[str, tuple[list[Any], str]],
    ) -> None:
        assert model.seq is not None
        self.seq, self.base, self.step = model.seq, model.base, model.step
        where = f"export-{model.seq}"
        self.tables: dict[str, _Table] = {}
        self.sizes: dict[str, int | None] = {}
        """A fixed-size table's number of rows; ``None`` for a hashed one."""
        for name, feature in features.items():
            if feature.table not in model.tables:
                raise ExportError(
                    f"{where} has no table {feature.table!r} (feature {name!r}); it has "
                    f"{sorted(model.tables)}"
                )
            ids, rows = model.tables[feature.table]
            shape, kind = inputs[name]
            dim = shape[1]  # [batch, dim]: the server checked
            if ONNX_TYPES.get(kind) != np.dtype(str(rows.dtype).removeprefix("torch.")) or (
                isinstance(dim, int) and dim != rows.shape[1]
            ):
                raise ExportError(
                    f"{where}: table {feature.table!r} has rows [{rows.shape[1]}] {rows.dtype}; "
                    f"the ONNX input {name!r} is {shape} {kind}"
                )
            if feature.table not in self.tables:
                self.tables[feature.table] = _Table(ids, rows)
                size = model.specs[feature.table].get("num_embeddings")
                self.sizes[feature.table] = size if isinstance(size, int) else None
        self.feeds: dict[str, np.ndarray] = {}
        for name, (shape, kind) in inputs.items():
            if name in features:
                continue
            value = model.dense.get(name)
            if value is None:
                raise ExportError(
                    f"{where}: the ONNX input {name!r} is neither a feature "
                    f"({', '.join(features)}) nor a dense parameter of the export "
                    f"({', '.join(model.dense) or 'none'})"
                )
            array = value.detach().contiguous().numpy()
            if ONNX_TYPES.get(kind) != array.dtype or list(array.shape) != list(shape):
                raise ExportError(
                    f"{where}: dense parameter {name!r} is {list(array.shape)} {array.dtype}; "
                    f"the ONNX input is {shape} {kind}"
                )
            self.feeds[name] = array

    def pool(self, name: str, feature: Feature, flat: torch.Tensor, offsets: torch.Tensor) -> Any:
        """One feature's pooled rows (``[len(offsets), dim]``) of the bags of ids ``flat``
        starting at ``offsets``.

        Raises:
            ValueError: for an id out of a fixed-size table's range (``psflow.nn`` refuses it
                too), naming the feature.
        """
        size = self.sizes[feature.table]
        if size is not None and flat.numel():
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"feature {name!r}: id {bad} is out of range for table {feature.table!r} "
                    f"of {size} rows"
                )
        return self.tables[feature.table].pool(flat, offsets, feature).numpy()
