"""The wire format: one msgpack header frame, then raw tensor bytes.

A message is ``[header, *frames]``. The header is a msgpack map keyed by
:class:`~psflow.protocol.Key`, with at least :attr:`~Key.VERSION` (:data:`PROTOCOL_VERSION`),
:attr:`~Key.OP` (str) and :attr:`~Key.ID` (int); its :attr:`~Key.TENSORS` entry describes the
tensors that follow as ``[name, dtype, shape]`` triples. Their bytes travel in one of three ways:

- inline (:attr:`~Key.INLINE`): up to :data:`INLINE_BYTES` in all, inside the header frame;
- framed (:attr:`~Key.CHUNK`): each tensor in ``ceil(nbytes / chunk)`` frames (at least one),
  where ``chunk`` is that entry: moderate frames (1 MiB by default) move faster through ZeroMQ
  than a few huge ones. Frames are sent straight from the tensor's memory, without a copy;
- in a shared-memory lane (:attr:`~Key.IN_LANE`): one after another from the start of the
  lane's area, each at a multiple of 64 bytes (see :mod:`psflow.transport.shm`); no data frames.

Nothing here is pickled: the header is plain msgpack data, validated field by field, and tensor
bytes are only ever reinterpreted as one of the dtypes in :data:`DTYPES`.

Its modules, each of one role:

- ``framing.py``: the limits (:data:`INLINE_BYTES`, :data:`MAX_HEADER_BYTES`, ...),
  :data:`DTYPES`, :class:`TensorMeta`, :class:`WireError`.
- ``encoding.py``: :func:`encode` (and :func:`encode_raw`, for bytes written without a tensor),
  :class:`Layout`, :class:`TensorSet`.
- ``decoding.py``: :func:`decode_header`, :func:`tensor_metas`, :func:`decode_tensors` (and
  :func:`tensor_buffers`: where they lie, for a native path).
- ``lanes.py``: where tensors lie in a lane's area: :class:`AreaViews`, :func:`lane_tensors`,
  :func:`placed_in`, :func:`lane_bytes`, :func:`lane_layout`.

Code outside this package takes every name from here (``wire.encode``, ``from
psflow.transport.wire import TensorSet``), never from the modules, which hold the code.
"""

from psflow.protocol.messages import PROTOCOL_VERSION
from psflow.transport.wire.decoding import (
    decode_header,
    decode_tensors,
    frame_buffer,
    frame_views,
    tensor_buffers,
    tensor_metas,
)
from psflow.transport.wire.encoding import Layout, TensorSet, encode, encode_raw, lane_bytes_of
from psflow.transport.wire.framing import (
    DEFAULT_CHUNK_BYTES,
    DTYPE_NAMES,
    DTYPES,
    INLINE_BYTES,
    ITEMSIZE,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_NAME_LEN,
    MAX_TENSOR_BYTES,
    MAX_TENSORS,
    NUMPY_DTYPES,
    WHOLE_TENSOR_CHUNK_BYTES,
    ZERO_COPY_ABOVE,
    TensorMeta,
    WireError,
    brief,
    dtype_name,
    num_frames,
)
from psflow.transport.wire.lanes import (
    LANE_ALIGN,
    AreaViews,
    lane_bytes,
    lane_layout,
    lane_tensors,
    placed_in,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DTYPES",
    "DTYPE_NAMES",
    "INLINE_BYTES",
    "ITEMSIZE",
    "LANE_ALIGN",
    "MAX_DEPTH",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "MAX_NAME_LEN",
    "MAX_TENSORS",
    "MAX_TENSOR_BYTES",
    "NUMPY_DTYPES",
    "PROTOCOL_VERSION",
    "WHOLE_TENSOR_CHUNK_BYTES",
    "ZERO_COPY_ABOVE",
    "AreaViews",
    "Layout",
    "TensorMeta",
    "TensorSet",
    "WireError",
    "brief",
    "decode_header",
    "decode_tensors",
    "dtype_name",
    "encode",
    "encode_raw",
    "frame_buffer",
    "frame_views",
    "lane_bytes",
    "lane_bytes_of",
    "lane_layout",
    "lane_tensors",
    "num_frames",
    "placed_in",
    "tensor_buffers",
    "tensor_metas",
]
