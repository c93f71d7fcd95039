"""A TensorFlow V2 checkpoint's tensors, read without TensorFlow: :class:`BundleReader` (as
TensorFlow's own ``BundleReader`` of ``tensor_bundle.h``).

The V2 format that ``tf.compat.v1.train.Saver`` and ``tf.train.Checkpoint`` write is a prefix:

- ``<prefix>.index``, a sorted table in LevelDB's format (blocks of prefix-compressed keys, each
  block checked by a masked CRC32C, a footer naming the index block). The empty key holds a
  ``BundleHeaderProto`` (shard count, byte order); every other key a ``BundleEntryProto``: a
  tensor's dtype, shape, data shard, offset, size and CRC32C.
- ``<prefix>.data-<i>-of-<n>``: the tensors' bytes.

A partitioned variable (``partitioner=fixed_size_partitioner(S)``) is saved under its own name
with the slices it was saved in (``slices``), each slice an entry of its own under a key that
encodes the name and the slice (TensorFlow's ``OrderedCode``, order-preserving). Its slices
are read back in key order and placed where the whole entry says: :meth:`BundleReader.tensor`
is the variable whole, as ``tf.train.load_checkpoint(prefix).get_tensor(name)`` gives it.

A TensorFlow 2 checkpoint (``tf.train.Checkpoint``, Keras) keys its tensors by object-graph
paths; its graph (:mod:`psflow.train.tf_objects`) gives each variable's own name, which every
method here takes too (:meth:`BundleReader.variables`).

Everything read is checked (block and tensor CRC32Cs, bounds, shapes); a file that fails a
check raises ``ValueError`` naming it. Nothing is evaluated or unpickled; string tensors are
listed, not read as tensors (the object graph is parsed as the proto it is).

What TensorFlow meant by the tensors (a partitioned table's rows in id order, an optimizer's
slots as torch's state) is :class:`~psflow.train.tf_checkpoint.TFCheckpoint`'s, built on this.
"""

from __future__ import annotations

import math
import struct

import fsspec
import google_crc32c
import numpy as np
import torch

from psflow.ps import safefile
from psflow.train.tf_bundle import (
    Entry,
    index_entries,
    parse_entry,
    slice_name,
    slice_order,
    unmask,
)
from psflow.train.tf_objects import GRAPH_KEY, VALUE_SUFFIX, ObjectGraph
from psflow.train.tf_proto import as_int, fields, varint

__all__ = ["BundleReader"]


# TensorFlow's DataType enum (types.proto) for what a numeric tensor can be.
_DTYPES: dict[int, tuple[torch.dtype, str]] = {
    1: (torch.float32, "<f4"),
    2: (torch.float64, "<f8"),
    3: (torch.int32, "<i4"),
    4: (torch.uint8, "u1"),
    5: (torch.int16, "<i2"),
    6: (torch.int8, "i1"),
    9: (torch.int64, "<i8"),
    10: (torch.bool, "?"),
    14: (torch.bfloat16, "<u2"),
    19: (torch.float16, "<f2"),
}
_DT_STRING = 7


class BundleReader:
    """A TensorFlow V2 checkpoint's tensors, by key or by a TensorFlow 2 variable's own name (see
    the module docstring).

    Args:
        prefix: the checkpoint's prefix, ``<dir>/model.ckpt-<step>`` (what
            ``tf.train.latest_checkpoint`` returns); a local path or an fsspec URL.

    Raises:
        FileNotFoundError: when the index is missing.
        ValueError: when the index is not a checkpoint's or fails a check.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._fs, self._path = fsspec.core.url_to_fs(prefix)
        self._root = prefix.rsplit("/", 1)[0] if "/" in prefix else "."
        """The checkpoint's directory: no file it reads may lead out of it."""
        what = f"{prefix}.index"
        # A FIFO, a device or a directory is refused before it is opened (an open would block,
        # a read never end), as is a symlink out of the checkpoint's directory.
        with safefile.open_regular(what, self._root) as f:
            data = f.read()
        self._sizes: dict[str, int] = {}
        self._entries: dict[str, Entry] = {}
        self._slices: dict[str, list[Entry]] = {}
        header = None
        try:
            for key, value in index_entries(data, what):
                if key == b"":
                    header = dict(fields(value))
                elif key[:1] == b"\x00":
                    self._slices.setdefault(slice_name(key), []).append(parse_entry(value))
                else:
                    self._entries[key.decode()] = parse_entry(value)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{what}: {e}" if not str(e).startswith(what) else str(e)) from None
        if header is None:
            raise ValueError(f"{what}: no bundle header (not a V2 checkpoint's index)")
        self._graph: ObjectGraph | None = None
        self.num_shards = as_int(header.get(1, 1))
        if as_int(header.get(2, 0)) != 0:
            raise ValueError(f"{what}: a big-endian checkpoint; only little-endian ones are read")
        if self.num_shards < 1:
            raise ValueError(f"{what}: {self.num_shards} data shards")

    def names(self) -> list[str]:
        """The tensors' names, sorted (slots such as ``<var>/Adagrad`` included): a TensorFlow
        2 checkpoint's keys (``model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE``);
        :meth:`variables` gives its variables' own names."""
        return sorted(self._entries)

    def variables(self) -> dict[str, str]:
        """A TensorFlow 2 checkpoint's variables by their own names (``head/kernel``, as Keras
        and ``tf.Variable.name`` give them, without ``:0``), each with its key; every method
        that takes a tensor's name takes these too, and a key without its
        ``/.ATTRIBUTES/VARIABLE_VALUE`` (the variable's path in the object graph:
        ``model/layer_with_weights-0/embeddings``). Empty for a TensorFlow 1.x checkpoint,
        whose keys are the names. A name two variables share is left out (use the keys).
        ``ParameterServerStrategy``'s ``ShardedVariable``, which TensorFlow saves with no name
        of its own, is here by its path."""
        graph = self._object_graph()
        if graph is None:
            return {}
        out = {name: keys[0] for name, keys in graph.variables().items() if len(keys) == 1}
        for key in graph.nameless():
            out.setdefault(key.removesuffix(VALUE_SUFFIX), key)
        return out

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self._key(name)
        except KeyError:
            return False
        return True

    def _key(self, name: str) -> str:
        """The key of the tensor ``name`` names: itself, or a TensorFlow 2 variable's key."""
        if name in self._entries:
            return name
        if name + VALUE_SUFFIX in self._entries:  # a TensorFlow 2 variable's object path
            return name + VALUE_SUFFIX
        graph = self._object_graph()
        keys = graph.keys_of(name) if graph is not None else []
        if len(keys) > 1:
            raise KeyError(f"{self.prefix}: {len(keys)} variables are named {name!r}: {keys}")
        if not keys:
            raise KeyError(f"{self.prefix} holds no tensor {name!r}")
        return keys[0]

    def _object_graph(self) -> ObjectGraph | None:
        if self._graph is None and GRAPH_KEY in self._entries:
            data = self._strings(GRAPH_KEY)
            if len(data) != 1:
                raise ValueError(f"{self.prefix}: {GRAPH_KEY} holds {len(data)} strings, not 1")
            try:
                graph = ObjectGraph(data[0])
            except ValueError as e:
                raise ValueError(f"{self.prefix}: {GRAPH_KEY}: {e}") from None
            # Every variable the graph names must be in the index: one it lacks was dropped.
            lacking = sorted(key for key in graph.saved_keys() if key not in self._entries)
            if lacking:
                raise ValueError(
                    f"{self.prefix}.index lacks {len(lacking)} tensor(s) its object graph names "
                    f"(first: {lacking[0]!r})"
                )
            self._graph = graph
        return self._graph

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry_of(name).shape

    def dtype(self, name: str) -> torch.dtype | None:
        """The tensor's dtype; ``None`` for a string tensor (listed, not read)."""
        kind = self._entry_of(name).dtype
        return _DTYPES[kind][0] if kind in _DTYPES else None

    def partitions(self, name: str) -> list[tuple[int, int]]:
        """``(start, rows)`` of each partition of a variable saved in slices along its first
        dimension, in order; ``[]`` for one saved whole."""
        entry = self._entry_of(name)
        if not entry.slices:
            return []
        out = []
        for extents in sorted(entry.slices, key=slice_order):
            if not entry.shape or len(extents) != len(entry.shape):
                raise ValueError(
                    f"{self.prefix}: a slice of {name!r} has {len(extents)} dimensions, the "
                    f"variable {len(entry.shape)}"
                )
            start, length = extents[0]
            whole = entry.shape[0]
            rest = zip(extents[1:], entry.shape[1:], strict=True)
            if any(e != (0, -1) and e != (0, d) for e, d in rest):
                raise ValueError(f"{self.prefix}: {name!r} is partitioned along another dimension")
            out.append((start, whole - start if length < 0 else length))
        return out

    def slices(self, name: str) -> list[tuple[tuple[int, int], ...]]:
        """``(start, stop)`` along every dimension of each slice a variable was saved in, in
        order; ``[]`` for one saved whole. Unlike :meth:`partitions`, slices along any
        dimension (``fixed_size_partitioner(S, axis=1)``)."""
        entry = self._entry_of(name)
        out = []
        for extents in sorted(entry.slices, key=slice_order):
            if len(extents) != len(entry.shape):
                raise ValueError(
                    f"{self.prefix}: a slice of {name!r} has {len(extents)} dimensions, the "
                    f"variable {len(entry.shape)}"
                )
            out.append(
                tuple(
                    (start, dim if length < 0 else start + length)
                    for (start, length), dim in zip(extents, entry.shape, strict=True)
                )
            )
        return out

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` whole (a partitioned variable's slices put together), as
        ``tf.train.load_checkpoint(prefix).get_tensor(name)`` gives it."""
        name = self._key(name)
        entry = self._entry_of(name)
        if not entry.slices:
            return self._read(name, entry)
        pieces = self._slices.get(name, [])
        wanted = sorted(entry.slices, key=slice_order)
        if len(pieces) != len(wanted):
            raise ValueError(
                f"{self.prefix}: {name!r} was saved in {len(wanted)} slices; the index holds "
                f"{len(pieces)}"
            )
        dtype = self._torch_dtype(name, entry)
        nbytes = math.prod(entry.shape) * dtype.itemsize
        if sum(piece.size for piece in pieces) != nbytes:
            raise ValueError(f"{self.prefix}: the slices of {name!r} do not add up to it")
        for piece in pieces:  # before the whole is allocated: a claim the files do not back
            self._data_file(name, piece)
        if nbytes > sum(self._sizes.values()):  # slices that repeat one region of a file
            raise ValueError(f"{self.prefix}: {name!r} claims more bytes than its data files hold")
        out = torch.zeros(entry.shape, dtype=dtype)
        # Coverage by place, not by count: slices that overlap can add up to the whole.
        covered = torch.zeros(entry.shape, dtype=torch.bool)
        for extents, piece in zip(wanted, pieces, strict=True):
            if len(extents) != len(entry.shape):
                raise ValueError(f"{self.prefix}: a slice of {name!r} of another rank")
            index = []
            for (start, length), dim in zip(extents, entry.shape, strict=True):
                stop = dim if length < 0 else start + length
                if not 0 <= start <= stop <= dim:
                    raise ValueError(f"{self.prefix}: a slice of {name!r} outside its shape")
                index.append(slice(start, stop))
            target = out[tuple(index)]
            if tuple(target.shape) != piece.shape or piece.dtype != entry.dtype:
                raise ValueError(
                    f"{self.prefix}: a slice of {name!r} holds {list(piece.shape)}, its place "
                    f"{list(target.shape)}"
                )
            place = covered[tuple(index)]
            if bool(place.any()):
                raise ValueError(
                    f"{self.prefix}: the slices of {name!r} overlap at "
                    f"{_box(extents, entry.shape)} (a part of it saved twice, another not at all)"
                )
            place.fill_(True)
            target.copy_(self._read(name, piece))
        if not bool(covered.all()):
            hole = [int(i) for i in (~covered).nonzero()[0]]
            raise ValueError(f"{self.prefix}: the slices of {name!r} leave {hole} unsaved")
        return out

    # -- reading --------------------------------------------------------------------------

    def _entry_of(self, name: str) -> Entry:
        return self._entries[self._key(name)]

    def _torch_dtype(self, name: str, entry: Entry) -> torch.dtype:
        if entry.dtype == _DT_STRING:
            raise ValueError(f"{self.prefix}: {name!r} is a string tensor; they are not read")
        if entry.dtype not in _DTYPES:
            raise ValueError(f"{self.prefix}: {name!r} has TensorFlow dtype {entry.dtype}")
        return _DTYPES[entry.dtype][0]

    def _data_url(self, path: str) -> str:
        """The URL of the data file at ``path`` (the prefix's own spelling, protocol kept)."""
        return self.prefix + path[len(self._path) :]

    def _data_file(self, name: str, entry: Entry) -> str:
        """The data file that holds ``entry``, checked to hold all of it."""
        if not 0 <= entry.shard < self.num_shards:
            raise ValueError(
                f"{self.prefix}: {name!r} is in data shard {entry.shard} of {self.num_shards}"
            )
        path = f"{self._path}.data-{entry.shard:05d}-of-{self.num_shards:05d}"
        size = self._sizes.get(path)
        if size is None:
            safefile.check_regular(self._data_url(path), self._root)
            size = self._sizes[path] = int(self._fs.size(path))
        if entry.offset < 0 or entry.size < 0 or entry.offset + entry.size > size:
            raise ValueError(
                f"{path}: {name!r} lies at bytes {entry.offset}..{entry.offset + entry.size}, "
                f"past the file's {size} (truncated?)"
            )
        return path

    def _bytes(self, name: str, entry: Entry) -> tuple[str, bytes]:
        """The data file that holds ``entry``, and its bytes there."""
        path = self._data_file(name, entry)
        with safefile.open_regular(self._data_url(path), self._root) as f:
            f.seek(entry.offset)
            raw = f.read(entry.size)
        if len(raw) != entry.size:
            raise ValueError(f"{path}: {name!r} runs past the end of the file (truncated?)")
        return path, raw

    def _strings(self, name: str) -> list[bytes]:
        """A string tensor's elements. TensorFlow writes each element's length as a varint,
        then a masked CRC32C of the lengths (taken as uint32s), then the bytes; the entry's
        CRC32C runs over the lengths as uint32s, that checksum and the bytes."""
        entry = self._entries[name]
        if entry.dtype != _DT_STRING or entry.slices:
            raise ValueError(f"{self.prefix}: {name!r} is not a string tensor saved whole")
        path, raw = self._bytes(name, entry)
        count = math.prod(entry.shape)
        lengths = []
        pos = 0
        try:
            for _ in range(count):
                length, pos = varint(raw, pos, len(raw))
                lengths.append(length)
        except ValueError:
            raise ValueError(f"{path}: the lengths of {name!r} run past it") from None
        if pos + 4 + sum(lengths) != len(raw) or any(n >= 1 << 32 for n in lengths):
            raise ValueError(f"{path}: the lengths of {name!r} do not add up to its entry")
        crc = google_crc32c.value(b"".join(struct.pack("<I", n) for n in lengths))
        crc = google_crc32c.extend(crc, raw[pos:])
        if crc != unmask(entry.crc32c):
            raise ValueError(f"{path}: the CRC32C of {name!r} does not match (corrupted)")
        out = []
        pos += 4
        for length in lengths:
            out.append(raw[pos : pos + length])
            pos += length
        return out

    def _read(self, name: str, entry: Entry) -> torch.Tensor:
        dtype = self._torch_dtype(name, entry)
        np_dtype = np.dtype(_DTYPES[entry.dtype][1])
        if entry.size != math.prod(entry.shape) * np_dtype.itemsize:
            raise ValueError(
                f"{self.prefix}: {name!r} is {list(entry.shape)} {dtype} but its entry says "
                f"{entry.size} bytes"
            )
        path, raw = self._bytes(name, entry)
        if google_crc32c.value(raw) != unmask(entry.crc32c):
            raise ValueError(f"{path}: the CRC32C of {name!r} does not match (corrupted)")
        values = np.frombuffer(raw, dtype=np_dtype).reshape(entry.shape)
        tensor = torch.from_numpy(values.copy())
        return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def _box(extents: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> str:
    """A slice as ``[0:4, 0:3]``."""
    spans = [
        f"{start}:{dim if length < 0 else start + length}"
        for (start, length), dim in zip(extents, shape, strict=True)
    ]
    return "[" + ", ".join(spans) + "]"
