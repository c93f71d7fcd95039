"""TensorFlow's hashed ids, the same in psflow: a table trained in TensorFlow on hashed strings
keeps its rows for the same strings.

``tf.strings.to_hash_bucket_fast(s, n)`` (what ``tf.feature_column``'s
``categorical_column_with_hash_bucket`` uses) is FarmHash's ``Fingerprint64`` of the string's
bytes, modulo ``n``; an int64 feature is hashed as its decimal string. :func:`fingerprint64`
computes it in C (``psflow/data/_farmhash.c``, through :mod:`psflow.data.native`; a pure-Python
transcription where that module was not built or ``PSFLOW_KERNELS=0``), both checked against
TensorFlow's output (``tests/unit/test_hashing.py``). Neither loads torch.

Example:
    >>> to_hash_bucket_fast(["user_17", "user_42"], 1000).tolist()  # as TensorFlow gives them
    [627, 217]
    >>> hash_bucket_of_ints([17, 42], 1000).tolist()                 # a hashed int64 column
    [838, 736]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from psflow.data import native

__all__ = ["fingerprint64", "hash_bucket_of_ints", "to_hash_bucket_fast"]

_MASK = (1 << 64) - 1
_K0 = 0xC3A5C85C97CB3127
_K1 = 0xB492B66FBE98F273
_K2 = 0x9AE16A3B2F90404F


def _as_bytes(values: Iterable[str | bytes] | np.ndarray) -> list[bytes]:
    """Each value as TensorFlow holds a string: its bytes (``str`` as UTF-8)."""
    if isinstance(values, np.ndarray) and values.dtype.kind == "S":
        return values.ravel().tolist()  # type: ignore[no-any-return]
    out = []
    for v in values.ravel().tolist() if isinstance(values, np.ndarray) else values:
        if isinstance(v, str):
            out.append(v.encode())
        elif isinstance(v, bytes | bytearray | memoryview):
            out.append(bytes(v))
        else:
            raise TypeError(f"a string to hash must be str or bytes, got {type(v).__name__}")
    return out


def fingerprint64(values: Iterable[str | bytes] | np.ndarray) -> np.ndarray:
    """FarmHash's ``Fingerprint64`` of each value (``str`` as UTF-8), as uint64: TensorFlow's
    string fingerprint (``tensorflow::Fingerprint64``)."""
    strings = _as_bytes(values)
    out = native.fingerprint64(strings)
    if out is None:
        out = np.empty(len(strings), dtype=np.uint64)
        out[:] = [_fingerprint64(s) for s in strings]
    return out


def to_hash_bucket_fast(values: Iterable[str | bytes] | np.ndarray, num_buckets: int) -> np.ndarray:
    """``tf.strings.to_hash_bucket_fast(values, num_buckets)``: each value's bucket in
    ``[0, num_buckets)`` as int64, the same as TensorFlow's."""
    if isinstance(num_buckets, bool) or not isinstance(num_buckets, int | np.integer):
        raise TypeError(f"num_buckets must be an int, got {num_buckets!r}")
    if not 1 <= num_buckets < 2**63:
        raise ValueError(f"num_buckets must be in [1, 2**63), got {num_buckets}")
    return (fingerprint64(values) % np.uint64(num_buckets)).astype(np.int64)


def hash_bucket_of_ints(ids: Sequence[int] | np.ndarray, num_buckets: int) -> np.ndarray:
    """``categorical_column_with_hash_bucket`` on an int64 feature: each id's decimal string
    hashed (``tf.strings.as_string``, then :func:`to_hash_bucket_fast`)."""
    as_ints = np.asarray(ids)
    if as_ints.dtype.kind not in "iu":
        raise TypeError(f"ids must be integers, got {as_ints.dtype}")
    return to_hash_bucket_fast([str(int(i)) for i in as_ints.ravel()], num_buckets).reshape(
        as_ints.shape
    )


# -- the transcription, where psflow.data._native was not built ---------------------------


def _u64(s: bytes, at: int) -> int:
    return int.from_bytes(s[at : at + 8], "little")


def _rotr(v: int, by: int) -> int:
    return ((v >> by) | (v << (64 - by))) & _MASK if by else v


def _mix(v: int) -> int:
    return v ^ (v >> 47)


def _pair(u: int, v: int, mul: int) -> int:
    a = _mix(((u ^ v) * mul) & _MASK)
    b = _mix(((v ^ a) * mul) & _MASK)
    return (b * mul) & _MASK


def _weak32(s: bytes, at: int, a: int, b: int) -> tuple[int, int]:
    w, x, y, z = (_u64(s, at + 8 * i) for i in range(4))
    a = (a + w) & _MASK
    b = _rotr((b + a + z) & _MASK, 21)
    c = a
    a = (a + x + y) & _MASK
    b = (b + _rotr(a, 44)) & _MASK
    return (a + z) & _MASK, (b + c) & _MASK


def _fingerprint64(s: bytes) -> int:
    n = len(s)
    mul = (_K2 + 2 * n) & _MASK
    if n <= 16:
        if n >= 8:
            a, b = (_u64(s, 0) + _K2) & _MASK, _u64(s, n - 8)
            return _pair((_rotr(b, 37) * mul + a) & _MASK, ((_rotr(a, 25) + b) * mul) & _MASK, mul)
        if n >= 4:
            lo = int.from_bytes(s[:4], "little")
            return _pair(n + (lo << 3), int.from_bytes(s[n - 4 :], "little"), mul)
        if n:
            y = s[0] + (s[n >> 1] << 8)
            z = n + (s[n - 1] << 2)
            return (_mix(((y * _K2) ^ (z * _K0)) & _MASK) * _K2) & _MASK
        return _K2
    a, b = (_u64(s, 0) * (_K1 if n <= 32 else _K2)) & _MASK, _u64(s, 8)
    c, d = (_u64(s, n - 8) * mul) & _MASK, (_u64(s, n - 16) * _K2) & _MASK
    y = (_rotr((a + b) & _MASK, 43) + _rotr(c, 30) + d) & _MASK
    z = _pair(y, (a + _rotr((b + _K2) & _MASK, 18) + c) & _MASK, mul)
    if n <= 32:
        return z
    if n <= 64:
        e, f = (_u64(s, 16) * mul) & _MASK, _u64(s, 24)
        g, h = ((y + _u64(s, n - 32)) * mul) & _MASK, ((z + _u64(s, n - 24)) * mul) & _MASK
        return _pair(
            (_rotr((e + f) & _MASK, 43) + _rotr(g, 30) + h) & _MASK,
            (e + _rotr((f + a) & _MASK, 18) + g) & _MASK,
            mul,
        )
    x, y = 81, (81 * _K1 + 113) & _MASK
    z = (_mix((y * _K2 + 113) & _MASK) * _K2) & _MASK
    v0 = v1 = w0 = w1 = 0
    x = (x * _K2 + _u64(s, 0)) & _MASK
    for at in range(0, ((n - 1) // 64) * 64, 64):
        x = (_rotr((x + y + v0 + _u64(s, at + 8)) & _MASK, 37) * _K1) & _MASK
        y = (_rotr((y + v1 + _u64(s, at + 48)) & _MASK, 42) * _K1) & _MASK
        x ^= w1
        y = (y + v0 + _u64(s, at + 40)) & _MASK
        z = (_rotr((z + w0) & _MASK, 33) * _K1) & _MASK
        v0, v1 = _weak32(s, at, (v1 * _K1) & _MASK, (x + w0) & _MASK)
        w0, w1 = _weak32(s, at + 32, (z + w1) & _MASK, (y + _u64(s, at + 16)) & _MASK)
        x, z = z, x
    mul = (_K1 + ((z & 0xFF) << 1)) & _MASK
    at = n - 64
    w0 = (w0 + ((n - 1) & 63)) & _MASK
    v0 = (v0 + w0) & _MASK
    w0 = (w0 + v0) & _MASK
    x = (_rotr((x + y + v0 + _u64(s, at + 8)) & _MASK, 37) * mul) & _MASK
    y = (_rotr((y + v1 + _u64(s, at + 48)) & _MASK, 42) * mul) & _MASK
    x ^= (w1 * 9) & _MASK
    y = (y + v0 * 9 + _u64(s, at + 40)) & _MASK
    z = (_rotr((z + w0) & _MASK, 33) * mul) & _MASK
    v0, v1 = _weak32(s, at, (v1 * mul) & _MASK, (x + w0) & _MASK)
    w0, w1 = _weak32(s, at + 32, (z + w1) & _MASK, (y + _u64(s, at + 16)) & _MASK)
    x, z = z, x
    return _pair(
        (_pair(v0, w0, mul) + _mix(y) * _K0 + z) & _MASK, (_pair(v1, w1, mul) + x) & _MASK, mul
    )
