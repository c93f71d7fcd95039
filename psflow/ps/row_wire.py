"""Rows on the wire at another width than the table's (:attr:`Key.ROW_DTYPES`): what a request
asks, and the rows cast to it, on the Python path (:mod:`psflow.ps.tables`) and the native one
(:mod:`psflow.ps.native`) alike. The ps keeps a table's rows and state in its own dtype; a
narrower row gradient is cast up before it is applied (:data:`~psflow.protocol.tables.
WIRE_DTYPES`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import psflow.sparse.kernels as kernels
from psflow.protocol import Key
from psflow.protocol.tables import check_wire_dtype
from psflow.sparse import Rows
from psflow.transport.wire import DTYPE_NAMES, DTYPES


def row_dtypes(
    header: Mapping[str, Any], tables: Mapping[str, Rows], asked: Iterable[str]
) -> dict[str, torch.dtype]:
    """The dtypes a request asks the rows of some of the ``asked`` tables in
    (:attr:`Key.ROW_DTYPES`; none when absent), checked: each one of
    :data:`~psflow.protocol.tables.WIRE_DTYPES`.

    Raises:
        ValueError: naming the table and the dtype, for one not asked for or not allowed.
    """
    raw = header.get(Key.ROW_DTYPES)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"'{Key.ROW_DTYPES}' must be a map of table names to dtypes")
    names = set(asked)
    out = {}
    for name, wire in raw.items():
        if name not in names:
            raise ValueError(
                f"'{Key.ROW_DTYPES}' names table {name!r:.60}, whose rows the request does not "
                "ask for"
            )
        out[name] = DTYPES[check_wire_dtype(name, wire)]
    return out


def narrowed(
    name: str, rows: torch.Tensor, wire: torch.dtype, place: torch.Tensor | None = None
) -> torch.Tensor:
    """Table ``name``'s ``rows`` cast to ``wire`` (into ``place`` when given).

    Raises:
        ValueError: naming the table when a row is not finite in ``wire`` (a value beyond
            float16's range): the rows would reach the worker as inf.
    """
    narrow = rows.to(wire) if place is None else place.copy_(rows)
    if not kernels.all_finite(narrow):
        worst = float(rows.abs().max())
        raise ValueError(
            f"table {name!r}: a row does not fit {DTYPE_NAMES[wire]} (largest magnitude "
            f"{worst:.4g}): it would reach the worker as inf or nan; carry the table's "
            "rows as bfloat16 or float32"
        )
    return narrow
