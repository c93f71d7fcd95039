"""The wire format's vocabulary: its size limits, the dtypes that travel, what describes a
tensor on the wire (:class:`TensorMeta`), and the error a malformed message raises."""

from __future__ import annotations

import reprlib
from typing import Any, NamedTuple

import numpy as np
import torch

DEFAULT_CHUNK_BYTES = 1 << 20
"""Bytes per frame for large tensors when the receiver's allocator is not tuned: ZeroMQ then
maps every frame above 32 MB afresh, and 1 MiB frames were measured fastest on loopback."""

WHOLE_TENSOR_CHUNK_BYTES = 1 << 30
"""Bytes per frame with the tuned allocator (:mod:`psflow.allocator`): a tensor up to 1 GiB
travels as one frame, which the receiver uses in place (a gradient is applied from it) instead
of assembling the tensor from pieces. Measured: 64 MB push and pull at 98-107% of the raw
socket, against 68-70% with 1 MiB frames."""

ZERO_COPY_ABOVE = 1 << 16
"""Messages with fewer tensor bytes than this are copied into ZeroMQ: cheaper than tracking
their frames until they have left."""

MAX_HEADER_BYTES = 1 << 20
"""A header larger than this is refused before msgpack looks at it."""

MAX_TENSORS = 1 << 16
_CLONE_BELOW = 1 << 12
INLINE_BYTES = 1 << 14
"""Tensor data up to this size travels inside the header frame."""
MAX_NAME_LEN = 512
MAX_DIMS = 16
MAX_TENSOR_BYTES = 1 << 48
"""Largest tensor a header may describe, counting a zero dimension as one: a bound on the
strides and sizes torch computes from a shape, checked in Python integers before torch sees
it (``[1048576, 2**62, 0, 3]`` holds no element, yet overflows torch's stride calculation)."""
MAX_DEPTH = 32
"""Deepest nesting of lists and maps a header may hold (psflow's own go four levels deep): a
deeper one could exhaust Python's recursion in a comparison, a ``repr`` or a JSON dump."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZE: dict[torch.dtype, int] = {v: v.itemsize for v in DTYPES.values()}
NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    t: np.dtype(name) for name, t in DTYPES.items() if name != "bfloat16"
}


class WireError(ValueError):
    """A message that does not follow the wire format (malformed, truncated, oversized)."""


_brief_repr = reprlib.Repr()
_brief_repr.maxlevel = 3
_brief_repr.maxstring = 80
_brief_repr.maxother = 80


def brief(value: Any) -> str:
    """A short ``repr`` of a value from the network, for messages: bounded in length and in
    depth, whatever the value holds."""
    return _brief_repr.repr(value)


class TensorMeta(NamedTuple):
    """Name, dtype, shape and size of one tensor on the wire (a tuple: made per message)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot travel: psflow sends {sorted(DTYPES)}") from None


def num_frames(nbytes: int, chunk: int) -> int:
    return max(1, -(-nbytes // chunk))
