"""The data layer's compiled byte work (``_native.c``), where the install built it.

Two concerns, each a plain-C file behind the one module: FarmHash's ``Fingerprint64``
(``_farmhash.c``, for :mod:`psflow.data.hashing`) and the plain wire form of Examples of
fixed-length numeric features (``_example.c``, for :func:`psflow.data.features.parse_examples`).
Each function here checks what it hands the C code (dtypes, contiguity, bounds) and answers
``None`` where the module is missing, for the caller to take its Python path: a pure-Python
transcription of the hash, the general vectorized decoder for Examples. Both paths give the
same output (``tests/unit/test_hashing.py``, ``tests/unit/test_data_example.py``).

No torch and no ``psflow.sparse`` here: reading and hashing records never loads the tensor
library. ``PSFLOW_KERNELS=0`` turns this module off too (one switch for all of psflow's C code,
:data:`psflow.env.PSFLOW_KERNELS`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from psflow import env as envvars
from psflow.data.fastparse import FLOAT, INT64

__all__ = ["NATIVE", "fingerprint64", "parse_fixed"]

log = logging.getLogger(__name__)

_OUT_DTYPES = {FLOAT: np.float32, INT64: np.int64}


def _load() -> ModuleType | None:
    if not envvars.flag(envvars.PSFLOW_KERNELS, True):
        return None
    try:
        # By name: the layer checks know no compiled module, and would take this import for
        # one of the package psflow.data.
        return importlib.import_module("psflow.data._native")
    except ImportError:
        log.debug("psflow.data._native was not built: hashing and parsing stay in Python")
        return None


NATIVE: ModuleType | None = _load()
"""The compiled module, or ``None`` (not built, or ``PSFLOW_KERNELS=0``)."""


def fingerprint64(strings: Sequence[bytes]) -> np.ndarray | None:
    """FarmHash's ``Fingerprint64`` of each string, as uint64; ``None`` without the module."""
    if NATIVE is None:
        return None
    out = np.empty(len(strings), dtype=np.uint64)
    if not strings:
        return out
    offsets = np.zeros(len(strings) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in strings], out=offsets[1:])
    data = np.frombuffer(b"".join(strings) or b"\0", dtype=np.uint8)
    NATIVE.fingerprint64(data.ctypes.data, offsets.ctypes.data, len(strings), out.ctypes.data)
    return out


def parse_fixed(
    buffer: bytes | bytearray | memoryview,
    starts: np.ndarray,
    lengths: np.ndarray,
    keys: Sequence[bytes],
    kinds: Sequence[int],
    outs: Sequence[np.ndarray],
) -> bool | None:
    """Decodes records ``buffer[starts[i] : starts[i] + lengths[i]]`` into ``outs`` (feature
    ``f``, named ``keys[f]``, a list of kind ``kinds[f]``, :data:`~psflow.data.fastparse.FLOAT`
    or :data:`~psflow.data.fastparse.INT64`, into ``outs[f]``: C-contiguous ``[records, size]``, float32 or int64 as
    the kind says). True when every record was in the plain wire form (``_example.c``), False
    when one was not or a record lies outside ``buffer`` (``outs`` then partly written: the
    general path decodes the batch and names what is wrong), ``None`` without the module.

    Raises:
        ValueError: for outputs that do not fit the records and kinds (an internal mistake).
    """
    if NATIVE is None:
        return None
    n = len(starts)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    raw = np.frombuffer(buffer, dtype=np.uint8)
    if len(lengths) != n or (starts < 0).any() or (lengths < 0).any():
        return False
    if (starts + lengths > len(raw)).any():
        return False
    if not len(keys) == len(kinds) == len(outs):
        raise ValueError(f"{len(keys)} keys, {len(kinds)} kinds and {len(outs)} outputs")
    for key, kind, out in zip(keys, kinds, outs, strict=True):
        want = _OUT_DTYPES.get(kind)
        if want is None or out.dtype != want or out.ndim != 2 or out.shape[0] != n:
            raise ValueError(f"feature {key!r}: kind {kind} into {out.dtype} {out.shape}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"feature {key!r}: the output must be C-contiguous and writeable")
    names = np.frombuffer(b"".join(keys) or b"\0", dtype=np.uint8)
    name_len = np.array([len(k) for k in keys], dtype=np.int64)
    name_off = np.zeros(len(keys), dtype=np.int64)
    np.cumsum(name_len[:-1], out=name_off[1:])
    kinds_arr = np.array(kinds, dtype=np.int64)
    sizes = np.array([out.shape[1] for out in outs], dtype=np.int64)
    out_ptrs = np.array([out.ctypes.data for out in outs], dtype=np.uintp)
    bad = NATIVE.parse_fixed(
        raw.ctypes.data,
        starts.ctypes.data,
        lengths.ctypes.data,
        n,
        names.ctypes.data,
        name_off.ctypes.data,
        name_len.ctypes.data,
        kinds_arr.ctypes.data,
        sizes.ctypes.data,
        len(keys),
        out_ptrs.ctypes.data,
    )
    return bool(bad < 0)
