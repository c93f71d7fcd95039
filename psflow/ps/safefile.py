"""Reading a safetensors file that may be truncated, bit-flipped or forged.

A safetensors file is ``uint64 header length | JSON header | data``; the header maps each tensor
to its dtype, shape and ``data_offsets`` in the data. Everything in it is checked here before
anything is allocated from it: the header length against the file's size (before the rest of
the file is read, for a file on a filesystem) and :data:`MAX_HEADER_BYTES`, then each tensor's
dtype, shape and offsets against the data that is really there. Errors are ``ValueError``
naming the file and, where one applies, the byte offset; safetensors then decodes bytes known
to be consistent.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as st_load

from psflow.data.line_input import file_kind
from psflow.ps.files import url_to_fs

MAX_HEADER_BYTES = 100_000_000
"""The largest JSON header accepted (safetensors' own limit)."""

_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_MAX_EXTENT = 1 << 62  # product of a shape's non-zero dims: past it, torch's strides overflow


def _fail(source: str, reason: str) -> ValueError:
    return ValueError(f"{source} is not a readable psflow shard file: {reason}")


def check_header_length(head: bytes, size: int, source: str) -> int:
    """The header length in a file's first 8 bytes, checked against the file's ``size``."""
    if size < 8 or len(head) < 8:
        raise _fail(source, f"{size} bytes: too short for the 8-byte header length at offset 0")
    n = int.from_bytes(head[:8], "little")
    if n > size - 8:
        raise _fail(
            source,
            f"the header length {n} at byte offset 0 runs past the end of the file ({size} bytes)",
        )
    if n > MAX_HEADER_BYTES:
        raise _fail(source, f"the header length {n} at byte offset 0 is over {MAX_HEADER_BYTES}")
    return n


def read_header(data: bytes, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The tensors' entries and the metadata of a safetensors file's bytes, every entry checked.

    Raises:
        ValueError: naming ``source`` and the byte offset of what is wrong.
    """
    n = check_header_length(data[:8], len(data), source)
    header, meta = _header(data[8 : 8 + n], source)
    data_size = len(data) - 8 - n
    for name, entry in header.items():
        _check_entry(name, entry, data_size, 8 + n, source)
    return header, meta


def _header(raw: bytes, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The JSON header's tensor entries (unchecked) and its metadata (checked)."""
    try:
        header = json.loads(raw)
    except UnicodeDecodeError as e:
        raise _fail(source, f"the header at byte offset {8 + e.start} is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise _fail(source, f"bad JSON header at byte offset {8 + e.pos}: {e.msg}") from None
    except RecursionError:
        raise _fail(source, "the JSON header at byte offset 8 is nested too deeply") from None
    if not isinstance(header, dict):
        raise _fail(source, "the header at byte offset 8 is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(source, "__metadata__ is not a map of strings")
    return header, meta


def _check_entry(name: str, entry: Any, data_size: int, data_start: int, source: str) -> None:
    if not isinstance(entry, dict):
        raise _fail(source, f"tensor {name!r}: its entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise _fail(source, f"tensor {name!r}: unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _fail(source, f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if math.prod(max(d, 1) for d in shape) > _MAX_EXTENT:
        raise _fail(source, f"tensor {name!r}: shape {shape} is too large")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _fail(source, f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end]")
    begin, end = offsets
    if end > data_size:
        raise _fail(
            source,
            f"tensor {name!r}: its data [{data_start + begin}, {data_start + end}) runs past "
            f"the end of the file ({data_start + data_size} bytes)",
        )
    if end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise _fail(
            source,
            f"tensor {name!r}: {end - begin} bytes at byte offset {data_start + begin} for "
            f"{dtype}{shape}",
        )


def decode(data: bytes, source: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata, from bytes checked by :func:`read_header`."""
    _, meta = read_header(data, source)
    try:
        return st_load(data), meta
    except Exception as e:  # safetensors' own error types, for what the checks above let by
        raise _fail(source, str(e)) from None


def _inside(path: str, root: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def check_regular(url: str, root: str | None = None) -> None:
    """Refuses, before it is opened, anything at ``url`` but a regular file: a FIFO (whose
    ``open`` would block until a writer came), a device, a directory where a file belongs, and
    with ``root`` a symlink (or a path through one) that leads out of ``root``.

    Raises:
        FileNotFoundError: when there is nothing at ``url``.
        ValueError: naming ``url`` and what it is.
    """
    fs, path = url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        kind = fs.info(path).get("type")
        if kind != "file":
            raise ValueError(f"{url}: a {kind or 'non-file'} where a file belongs (not read)")
        return
    os.lstat(path)  # FileNotFoundError for nothing there
    if root is not None:
        _, root_path = url_to_fs(root)
        if not _inside(path, root_path):
            raise ValueError(
                f"{url}: a symlink to {os.path.realpath(path)}, outside {root} (not read)"
            )
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{url}: {file_kind(mode)} where a file belongs (not read)")


def open_regular(url: str, root: str | None = None) -> Any:
    """``url`` opened for reading (binary) once :func:`check_regular` passed it; a local file
    is opened without blocking and checked again on its descriptor, so that a FIFO put there
    since the check is refused, not waited on."""
    check_regular(url, root)
    fs, path = url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        return fs.open(path, "rb")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{url}: {file_kind(mode)} where a file belongs (not read)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(url: str, root: str | None = None) -> bytes:
    """A safetensors file's bytes, its header length checked before the rest is read; a
    special file (and with ``root``, a symlink out of it) refused before it is opened."""
    with open_regular(url, root) as f:
        size = _size(f)
        head = f.read(8)
        check_header_length(head, size, url)
        data: bytes = head + f.read(size - len(head))
    if len(data) != size:
        raise _fail(url, f"{len(data)} bytes read of {size}: it changed while it was read")
    return data


def read_metadata(url: str, root: str | None = None) -> dict[str, str]:
    """The metadata of the safetensors file at ``url``, reading its header alone (checked as
    :func:`read_bytes` checks it; the tensors' entries are not)."""
    with open_regular(url, root) as f:
        size = _size(f)
        head = f.read(8)
        n = check_header_length(head, size, url)
        raw = f.read(n)
    if len(raw) != n:
        raise _fail(url, f"{len(raw)} header bytes read of {n}: it changed while it was read")
    return _header(raw, url)[1]


def _size(f: Any) -> int:
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        return int(f.size)


def read(url: str, root: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of the safetensors file at ``url`` (local path or fsspec URL).

    Raises:
        ValueError: naming the file (and the byte offset) when it is not a consistent file, or
            not a regular file (see :func:`check_regular`; ``root`` as there).
    """
    return decode(read_bytes(url, root), url)
