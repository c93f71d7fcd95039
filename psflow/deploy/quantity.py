"""Kubernetes resource quantities (``500m``, ``2``, ``512Mi``, ``1e9``) as numbers.

Its own module: the job's config and the settings' checks both read quantities, and neither may
import the other.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

# Kubernetes quantity syntax: a decimal number, then a binary suffix (Ki..Ei), a decimal suffix
# (n, u, m, k, M, G, T, P, E) or a decimal exponent (e3, E-2).
_QUANTITY_RE = re.compile(
    r"^(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


def parse_quantity(text: str, *, what: str) -> Decimal:
    """The value of a Kubernetes quantity (``500m``, ``2``, ``512Mi``, ``1e9``).

    Example:
        >>> parse_quantity("512Mi", what="memory")
        Decimal('536870912')

    Raises:
        ValueError: naming ``what`` and the text when it is not a positive quantity.
    """
    m = _QUANTITY_RE.match(text)
    if m is None:
        raise ValueError(
            f"{what} {text!r} is not a Kubernetes quantity: use e.g. 500m or 2 for cpu, "
            "512Mi or 4Gi for memory"
        )
    try:
        value = Decimal(m.group("num"))
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{what} {text!r} is not a number") from None
    suffix = m.group("suffix") or ""
    if suffix in _BINARY:
        value *= _BINARY[suffix]
    elif suffix in _DECIMAL:
        value *= _DECIMAL[suffix]
    elif suffix:
        value = value.scaleb(int(suffix[1:]))
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be greater than zero")
    return value


def quantity_setting(owner: Any, attr: str) -> None:
    """Checks ``owner.attr``, a resource quantity or ``None``, in place: a number (YAML reads
    ``cpu: 2`` and ``cpu: 0.5`` as numbers) becomes the quantity string Kubernetes wants; a
    memory in ``m`` is refused as the slip it is (millibytes).

    Raises:
        ValueError: naming ``attr`` and the value.
    """
    value = getattr(owner, attr)
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)
        setattr(owner, attr, value)
    if value is None:
        return
    if not isinstance(value, str):
        raise ValueError(f"{attr} must be a quantity string, got {value!r}")
    parse_quantity(value, what=attr)
    if attr.startswith("memory") and value.endswith("m"):
        raise ValueError(
            f"{attr} {value!r} means millibytes in Kubernetes: did you mean {value[:-1]}Mi?"
        )
