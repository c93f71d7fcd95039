"""A ``POST /predict`` request's contents, checked and turned into what the model computes with.

A request comes over the network, so nothing in it is trusted: :func:`feature_ids` and
:func:`numeric_feeds` check every name, count, type and range before use, and refuse a request
with a :class:`BadRequest` that says in one line what is wrong; the server answers it and keeps
serving. They read only what they are given: the feature names and limits of
:class:`~psflow.serve.server.ServerConfig`, the numeric inputs' dtypes of the ONNX graph.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["BadRequest", "feature_ids", "numeric_feeds"]

_INT64 = (-(1 << 63), (1 << 63) - 1)


class BadRequest(ValueError):
    """A request that is refused (its status and one line saying why)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def feature_ids(
    features: Any, names: Collection[str], max_batch: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each of ``names``' bags of ids in ``features`` (``{"users": [[7, 12], [3]], ...}``), as
    the flat ids and each example's offset into them, by name in the order of ``names``.

    Raises:
        BadRequest: for an unknown or missing feature, a number of examples not in
            ``1..max_batch`` or not the same for every feature, an id that is not an int64.
    """
    if not isinstance(features, dict):
        raise BadRequest("'features' must be an object: feature name to a list of bags")
    unknown = sorted(set(features) - set(names))
    if unknown:
        raise BadRequest(f"unknown feature(s) {unknown}; this model takes "
                         f"{sorted(names)}")  # fmt: skip
    out = {}
    batch = None
    for name in names:
        bags = features.get(name)
        if not isinstance(bags, list):
            raise BadRequest(f"feature {name!r}: expected a list of bags of ids, got "
                             f"{type(bags).__name__}")  # fmt: skip
        if batch is None:
            batch = len(bags)
            if not 1 <= batch <= max_batch:
                raise BadRequest(f"a request holds 1..{max_batch} examples, "
                                 f"got {batch}")  # fmt: skip
        elif len(bags) != batch:
            raise BadRequest(f"feature {name!r} has {len(bags)} examples, "
                             f"the others {batch}")  # fmt: skip
        lengths, flat = [0], []
        for i, bag in enumerate(bags):
            if not isinstance(bag, list):
                raise BadRequest(f"feature {name!r}, example {i}: expected a list of ids")
            for v in bag:
                if type(v) is not int or not _INT64[0] <= v <= _INT64[1]:
                    raise BadRequest(f"feature {name!r}, example {i}: {repr(v)[:40]} is "
                                     "not an int64 id")  # fmt: skip
            flat.extend(bag)
            lengths.append(len(bag))
        offsets = torch.tensor(lengths[:-1], dtype=torch.int64).cumsum(0)
        out[name] = (torch.tensor(flat, dtype=torch.int64), offsets)
    return out


def numeric_feeds(
    numeric: Any, widths: Mapping[str, int], dtypes: Mapping[str, np.dtype[Any]], batch: int
) -> dict[str, np.ndarray]:
    """Each numeric input of ``widths`` in ``numeric`` (``{"counts": [[0.5, 3.0], ...]}``, or
    ``None`` when there are none), as a ``[batch, width]`` array of its ``dtypes`` entry.

    Raises:
        BadRequest: for an unknown or missing input, a number of rows other than ``batch``
            (the features' examples), a row of the wrong width or not of numbers, a value that
            is not finite in the input's dtype.
    """
    if numeric is None:
        numeric = {}
    if not isinstance(numeric, dict):
        raise BadRequest("'numeric' must be an object: input name to a list of rows")
    unknown = sorted(set(numeric) - set(widths))
    missing = sorted(set(widths) - set(numeric))
    if unknown or missing:
        raise BadRequest(f"numeric inputs: unknown {unknown}, missing {missing}; this model "
                         f"takes {sorted(widths)}")  # fmt: skip
    out = {}
    for name, width in widths.items():
        rows = numeric[name]
        if not isinstance(rows, list) or len(rows) != batch:
            got = len(rows) if isinstance(rows, list) else type(rows).__name__
            raise BadRequest(f"numeric input {name!r}: expected {batch} rows (the "
                             f"features' examples), got {got}")  # fmt: skip
        for i, row in enumerate(rows):
            if (
                not isinstance(row, list)
                or len(row) != width
                or not all(type(v) in (int, float) for v in row)
            ):
                raise BadRequest(f"numeric input {name!r}, example {i}: expected {width} "
                                 f"numbers, got {repr(row)[:60]}")  # fmt: skip
        with np.errstate(over="ignore"):  # refused just below, by name
            array = np.asarray(rows, dtype=dtypes[name])
        if not np.isfinite(array).all():
            raise BadRequest(f"numeric input {name!r}: a value is not finite (or out of "
                             f"the input's range)")  # fmt: skip
        out[name] = array
    return out
