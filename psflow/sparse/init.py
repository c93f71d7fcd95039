"""Initial rows that depend on the table's seed, the row's id and the column alone.

A table split over any number of shards, or a row created the first time a hashed table sees
its id, starts exactly as the same row of a local ``psflow.nn.Embedding``: each value is a
counter-based hash (splitmix64) of ``(seed, id, column)``, made a normal by Box-Muller. Nothing
depends on which ids are asked together or in what order.

Where the row kernels are built (:mod:`psflow.sparse.kernels`), the hashes, the uniforms made of
them, and the normals' products and their placing into the rows run in C (``_init.c``), each
step exact or one correctly rounded IEEE operation; the logarithm, square root (MKL's in torch's
build, not always correctly rounded), sine and cosine stay torch's, so a row is the same bits on
either path.
A ps of a hashed table makes the rows of every id it first sees: a CTR shard's lookups spent
half their time here, mostly in torch's int64 operations (8,000 rows of 16 on one core: 2.9 ms
that way, 1.1 ms with the C half).
"""

from __future__ import annotations

import functools
import math

import torch

from psflow.sparse import kernels

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_PAIR_STEP = 0xD1B54A32D192ED03
_ANGLE = 2.0 * math.pi * 2.0**-32
"""A 32-bit hash's low half times this is an angle in [0, 2 pi)."""

CHUNK_VALUES = 1 << 20
"""Values made per pass: the temporaries stay a few tens of MiB whatever the table's size."""


def _signed(x: int) -> int:
    """``x`` modulo 2**64 as a signed int64 (torch's int64 arithmetic wraps the same way)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser of ``x + golden`` (int64 in, int64 out, bits as uint64).

    In place on one copy of ``x``: three times faster than the same expression out of place;
    the C kernel's loop where it is built.
    """
    k = kernels.KERNELS
    if k is not None and x.device.type == "cpu" and x.dtype == torch.int64:
        x = x.contiguous()
        out = torch.empty_like(x)
        k.splitmix64(x.data_ptr(), x.numel(), out.data_ptr())
        return out
    z = x + _signed(_GOLDEN)
    t = torch.empty_like(z)
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        t &= (1 << (64 - shift)) - 1
        z ^= t
        if mul is not None:
            z *= _signed(mul)
    return z


@functools.lru_cache(maxsize=256)
def _seed_key(seed: int) -> int:
    """The seed through the mixer first, so that distinct seeds give unrelated streams: the
    splitmix64 of ``seed`` in Python's integers (its int64 bits), as the tensor function's."""
    z = (seed + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return _signed(z ^ (z >> 31))


_NATIVE = (torch.float32, torch.float64)
"""Row dtypes the C kernel places normals in (others: torch's cast)."""


def _uniforms(chunk: torch.Tensor, seed_key: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk``'s ids' uniforms, ``[rows, pairs]`` each: u1 in (0, 1] (the logarithm never
    sees 0), u2 an angle in [0, 2 pi); torch's int64 ops (``_init.c`` does the same)."""
    # A distinct odd multiplier per pair index keeps (id, pair) -> counter one-to-one.
    pair_offsets = torch.arange(1, pairs + 1, dtype=torch.int64, device=chunk.device)
    pair_offsets *= _signed(_PAIR_STEP)
    key = splitmix64(chunk ^ seed_key)
    h = splitmix64(key[:, None] + pair_offsets[None, :])
    # Two 32-bit uniforms per hash.
    u1 = _shr(h, 32).add_(1).to(torch.float64).mul_(2.0**-32)
    u2 = h.bitwise_and_(0xFFFFFFFF).to(torch.float64).mul_(_ANGLE)
    return u1, u2


def initial_rows(
    seed: int,
    ids: torch.Tensor,
    dim: int,
    *,
    std: float,
    dtype: torch.dtype,
    padding_idx: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The initial rows of ``ids``: ``[len(ids), dim]`` values ``N(0, std^2)``.

    Row ``i`` is the same whatever else is asked with it, so every shard, and a local module,
    make the same table. Computed ``CHUNK_VALUES`` at a time into the result.

    Args:
        seed: the table's seed.
        ids: 1-D int64 global ids (any int64: hashed tables too).
        dim: columns.
        std: the standard deviation.
        dtype: the result's dtype (values are made in float64 and cast).
        padding_idx: that id's row is zero.
        out: written and returned instead of a new tensor (``[len(ids), dim]``, ``dtype``).

    Example:
        >>> a = initial_rows(0, torch.tensor([3, 7]), 4, std=1.0, dtype=torch.float64)
        >>> b = initial_rows(0, torch.tensor([7]), 4, std=1.0, dtype=torch.float64)
        >>> torch.equal(a[1], b[0])
        True
    """
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(
            f"ids must be a 1-D int64 tensor, got {ids.dtype} of shape {list(ids.shape)}"
        )
    if dim < 1:
        raise ValueError(f"dim must be >= 1, got {dim}")
    n = ids.numel()
    if out is None:
        out = torch.empty((n, dim), dtype=dtype, device=ids.device)
    elif out.shape != (n, dim) or out.dtype != dtype:
        raise ValueError(
            f"out is {out.dtype} of shape {list(out.shape)}, expected {dtype} of {[n, dim]}"
        )
    if n == 0:
        return out
    pairs = (dim + 1) // 2
    seed_key = _seed_key(seed)
    k = kernels.KERNELS
    native = k is not None and ids.device.type == out.device.type == "cpu" and dtype in _NATIVE
    native = native and out.is_contiguous()
    rows_per_chunk = max(1, CHUNK_VALUES // (2 * pairs))
    for start in range(0, n, rows_per_chunk):
        chunk = ids[start : start + rows_per_chunk].contiguous()
        m = chunk.numel()
        if native:
            assert k is not None
            u1 = torch.empty((m, pairs), dtype=torch.float64)
            u2 = torch.empty((m, pairs), dtype=torch.float64)
            args = (pairs, _ANGLE, u1.data_ptr(), u2.data_ptr())
            k.initial_uniforms(chunk.data_ptr(), m, seed_key, *args)
        else:
            u1, u2 = _uniforms(chunk, seed_key, pairs)
        block = out[start : start + m]
        if native:
            assert k is not None
            # torch's logarithm, square root (MKL's), cosine and sine; the kernel's products
            # and casts.
            root, cos, sin = u1.log_().mul_(-2.0).sqrt_(), u2.cos(), u2.sin_()
            k.normals(dtype == torch.float64, block.data_ptr(), root.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), m, pairs, dim, std)  # fmt: skip
        else:
            r = u1.log_().mul_(-2.0).sqrt_().mul_(std)
            cos = u2.cos().mul_(r)
            sin = u2.sin_().mul_(r)
            normals = torch.stack((cos, sin), dim=2)
            block.copy_(normals.view(m, -1)[:, :dim])
    if padding_idx is not None:
        out[ids == padding_idx] = 0
    return out
