"""The data layer's compiled byte work (``_native.c``), where the install built it.

Three concerns, each a plain-C file behind the one module: FarmHash's ``Fingerprint64``
(``_farmhash.c``, for :mod:`psflow.data.hashing`), the plain wire form of Examples of
fixed-length numeric features (``_example.c``, for :func:`psflow.data.features.parse_examples`),
and TFRecord's framing with its checksums and records packed into one buffer (``_tfrecord.c``,
for :mod:`psflow.data.tfrecord_reader` and :mod:`psflow.data.shuffle`).
Each function here checks what it hands the C code (dtypes, contiguity, bounds) and answers
``None`` where the module is missing, for the caller to take its Python path: a pure-Python
transcription of the hash, the general vectorized decoder for Examples, the reader's framing in
Python and numpy, a join. Both paths give the same output (``tests/unit/test_hashing.py``,
``tests/unit/test_data_example.py``, ``tests/unit/test_hostile_files.py``,
``tests/unit/test_data_shuffle.py``).

No torch and no ``psflow.sparse`` here: reading and hashing records never loads the tensor
library. ``PSFLOW_KERNELS=0`` turns this module off too (one switch for all of psflow's C code,
:data:`psflow.env.PSFLOW_KERNELS`).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from psflow import env as envvars
from psflow.data.fastparse import FLOAT, INT64

__all__ = ["NATIVE", "crc32c", "fingerprint64", "frame_records", "pack_records", "parse_fixed"]

log = logging.getLogger(__name__)

_OUT_DTYPES = {FLOAT: np.float32, INT64: np.int64}
_FRAME_CAP = 1 << 16


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


def crc32c(data: bytes | bytearray | memoryview, *, soft: bool = False) -> int | None:
    """CRC32C of ``data`` (google-crc32c's ``value``); ``soft``: the table path even where the
    CPU has the instruction. ``None`` without the module."""
    if NATIVE is None:
        return None
    raw = np.frombuffer(data, dtype=np.uint8) if len(data) else np.zeros(1, dtype=np.uint8)
    return int(NATIVE.crc32c(raw.ctypes.data, len(data), soft))


def frame_records(
    buffer: bytes | bytearray | memoryview,
    pos: int,
    *,
    verify: bool,
    index: int,
    shard: tuple[int, int, int] | None,
) -> tuple[np.ndarray, np.ndarray, int] | None:
    """TFRecord's complete records in ``buffer[pos:]``: their data's starts and lengths, and the
    offset after the last. With ``verify`` every header checksum and the data checksum of every
    record the ``shard`` keeps (``(index + k + offset) % count == shard_index`` for the
    ``k``-th record; all without a shard). ``None`` at the first checksum that fails, on a
    big-endian host, or without the module: the caller's Python path then frames the records
    and names the bad one.
    """
    if NATIVE is None or sys.byteorder != "little":
        return None
    raw = np.frombuffer(buffer, dtype=np.uint8)
    end = len(raw)
    if not 0 <= pos <= end:
        raise ValueError(f"pos {pos} outside a buffer of {end} bytes")
    sh, count, offset = shard if shard is not None else (0, 0, 0)
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    framed = 0
    while True:
        # A record takes at least its 16 framing bytes; at most _FRAME_CAP records a call, so
        # that a chunk of tiny records never asks for index arrays as large as itself.
        cap = min((end - pos) // 16 + 1, _FRAME_CAP)
        starts = np.empty(cap, dtype=np.int64)
        lengths = np.empty(cap, dtype=np.int64)
        n, pos = NATIVE.frame(
            raw.ctypes.data if end else 0,
            pos,
            end,
            verify,
            index + framed,
            sh,
            count,
            offset,
            starts.ctypes.data,
            lengths.ctypes.data,
            cap,
        )
        if n < 0:
            return None
        parts.append((starts[:n], lengths[:n]))
        framed += n
        if n < cap:
            break
    if len(parts) == 1:
        return parts[0][0], parts[0][1], int(pos)
    return (
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        int(pos),
    )


def pack_records(addrs: np.ndarray, lengths: np.ndarray) -> memoryview | None:
    """The records at ``addrs`` (int64 addresses of live buffers the caller holds) of
    ``lengths`` bytes, one after another in one new buffer; ``None`` without the module."""
    if NATIVE is None:
        return None
    addrs = np.ascontiguousarray(addrs, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if len(addrs) != len(lengths) or (lengths < 0).any():
        raise ValueError(f"{len(addrs)} addresses and {len(lengths)} lengths, none negative")
    out = np.empty(int(lengths.sum()), dtype=np.uint8)  # every byte written below
    if len(out):
        NATIVE.pack(addrs.ctypes.data, lengths.ctypes.data, len(addrs), out.ctypes.data)
    out.flags.writeable = False
    return out.data
