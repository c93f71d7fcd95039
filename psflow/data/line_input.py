"""Text input files read as lines, for the converters (``psflow data criteo``, ``psflow data
text``): plain, GZIP or ZLIB, bounded and linear whatever the file holds.

- **Regular files only**: a FIFO (whose ``open`` blocks until a writer comes, and which a
  converter that counts lines first could not read twice), a device or a directory is refused
  before it is opened.
- **Bounded lines**: a line longer than ``max_line_bytes`` stops the read, naming the file, the
  line and its byte offset; so does a decompression bomb, which inflates to one endless line (or
  many), never to more than ``max_line_bytes`` plus one block in memory. The pieces of a line
  that spans blocks are joined once, when it ends: the time is linear in the input.
- **Compressed input** (by suffix: ``.gz`` GZIP, ``.zlib``/``.zz`` ZLIB): inflated a block at a
  time; damage anywhere (a bad header, corrupt deflate data, a CRC or length check that fails,
  a stream cut short) is an error naming the file and the compressed byte offset where the
  stream went wrong. Concatenated GZIP members (``cat a.gz b.gz``) are read as one stream.

Every error is a ``ValueError`` of one line.
"""

from __future__ import annotations

import os
import stat
import zlib
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from psflow.data import fs

__all__ = ["BLOCK_BYTES", "compression_of", "iter_lines", "line_blocks", "open_regular"]

BLOCK_BYTES = 8 << 20
"""Text inflated and scanned at a time."""

_NL = 10
_READ = 1 << 16  # compressed bytes fed to zlib at a time


def compression_of(path: str) -> str:
    """``"GZIP"``, ``"ZLIB"`` or ``""``, by the file's suffix."""
    name = path.lower()
    if name.endswith((".gz", ".gzip")):
        return "GZIP"
    if name.endswith((".zlib", ".zz")):
        return "ZLIB"
    return ""


def file_kind(mode: int) -> str:
    """What a non-regular file is, for an error ("a FIFO", "a directory", ...)."""
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def open_regular(path: str) -> IO[bytes]:
    """``path`` opened for reading, once it is known to be a regular file (a local one is
    opened without blocking and checked on its descriptor: a FIFO is refused, never waited on).

    Raises:
        ValueError: naming ``path`` and what it is, for anything but a regular file.
        FileNotFoundError: when there is nothing there.
    """
    if fs.is_url(path):
        info = fs.file_system(path).info(path)
        if info.get("type") != "file":
            raise ValueError(f"{path}: a {info.get('type') or 'non-file'} where a file belongs")
        return fs.open_read(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: {file_kind(mode)} where a file belongs (not read)")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{path}: {file_kind(mode)} where a file belongs (not read)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


class _Inflated:
    """A file's bytes, inflated when it is compressed, at most ``block_bytes`` at a time."""

    def __init__(self, path: str, compression: str, block_bytes: int) -> None:
        self.path = path
        self.compression = compression
        self.block_bytes = block_bytes
        self.f = open_regular(path)
        self.offset = 0
        """Compressed bytes consumed so far."""
        self._wbits = zlib.MAX_WBITS | 16 if compression == "GZIP" else zlib.MAX_WBITS
        self._zlib = zlib.decompressobj(self._wbits) if compression else None
        self._pending = b""
        self._started = False  # whether any of the current stream was consumed

    def close(self) -> None:
        self.f.close()

    def read(self) -> bytes:
        """The next piece of the text; ``b""`` at its end."""
        if self._zlib is None:
            data: bytes = self.f.read(self.block_bytes)
            self.offset += len(data)
            return data
        while True:
            if not self._pending:
                self._pending = self.f.read(_READ)
                if not self._pending:
                    if self._started and not self._zlib.eof:
                        raise ValueError(
                            f"{self.path}: the {self.compression} stream ends early at "
                            f"compressed byte offset {self.offset} (truncated?)"
                        )
                    return b""
            out = self._inflate()
            if out:
                return out

    def _inflate(self) -> bytes:
        assert self._zlib is not None
        if self._zlib.eof:  # another GZIP member follows the last (``cat a.gz b.gz``)
            if self.compression != "GZIP":
                raise ValueError(
                    f"{self.path}: data after the end of the {self.compression} stream at "
                    f"compressed byte offset {self.offset}"
                )
            self._zlib = zlib.decompressobj(self._wbits)
            self._started = False
        before = self._zlib.copy()
        raw = self._pending
        try:
            out = self._zlib.decompress(raw, self.block_bytes)
        except zlib.error as e:
            at = self.offset + _where(before, raw, self.block_bytes)
            raise ValueError(
                f"{self.path}: bad {self.compression} data at compressed byte offset {at}: {e}"
            ) from None
        rest = self._zlib.unused_data if self._zlib.eof else self._zlib.unconsumed_tail
        self.offset += len(raw) - len(rest)
        self._started = True
        if self._zlib.eof and rest and not rest.strip(b"\0") and self.compression == "GZIP":
            self.offset += len(rest)  # zeros after a member: padding, as gzip's reader skips
            rest = b""
        self._pending = rest
        return out


def _where(zlib_state: Any, raw: bytes, limit: int) -> int:
    """How far into ``raw`` the stream goes wrong: ``raw`` fed again a byte at a time to a copy
    of the state before it (what each byte inflates to is dropped, ``limit`` at a time)."""
    for i in range(len(raw)):
        try:
            pending = raw[i : i + 1]
            while pending:
                zlib_state.decompress(pending, limit)
                pending = zlib_state.unconsumed_tail
        except zlib.error:
            return i
        if zlib_state.eof:
            return i + 1
    return len(raw)


def line_blocks(
    path: str,
    *,
    max_line_bytes: int,
    block_bytes: int = BLOCK_BYTES,
    compression: str | None = None,
) -> Iterator[tuple[int, bytes]]:
    """``path``'s text in pieces of whole lines, each ending in ``\\n`` (a last line without
    one gets it), with the number (from 1) of each piece's first line.

    Args:
        path: a local path or fsspec URL.
        max_line_bytes: the longest line accepted, its ``\\n`` not counted.
        block_bytes: text scanned at a time.
        compression: ``"GZIP"``, ``"ZLIB"`` or ``""``; ``None``: by the suffix.

    Raises:
        ValueError: a line over ``max_line_bytes`` (file, line, byte offset), a file that is
            not a regular one, or damaged compressed data (file, compressed byte offset).
    """
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    source = _Inflated(
        path, compression_of(path) if compression is None else compression, block_bytes
    )
    try:
        line = 1
        start = 0  # the byte offset (in the text) of the line that ``parts`` begins
        parts: list[bytes] = []  # an unfinished line's pieces, joined once it ends
        held = 0
        while True:
            chunk = source.read()
            if not chunk:
                break
            cut = chunk.rfind(b"\n") + 1
            if not cut:
                parts.append(chunk)
                held += len(chunk)
                if held > max_line_bytes:
                    raise _too_long(path, line, start, max_line_bytes, source)
                continue
            text = b"".join([*parts, chunk[:cut]]) if parts else chunk[:cut]
            rest = chunk[cut:]
            ends = np.flatnonzero(np.frombuffer(text, dtype=np.uint8) == _NL)
            lengths = np.diff(ends, prepend=-1) - 1
            over = np.flatnonzero(lengths > max_line_bytes)
            if len(over):
                k = int(over[0])
                at = start + (int(ends[k - 1]) + 1 if k else 0)
                raise _too_long(path, line + k, at, max_line_bytes, source)
            yield line, text
            line += len(ends)
            start += len(text)
            parts, held = ([rest], len(rest)) if rest else ([], 0)
            if held > max_line_bytes:
                raise _too_long(path, line, start, max_line_bytes, source)
        if parts:
            yield line, b"".join(parts) + b"\n"
    finally:
        source.close()


def _too_long(path: str, line: int, at: int, limit: int, source: _Inflated) -> ValueError:
    where = f"byte offset {at}"
    if source.compression:
        where += f" of the inflated text; compressed byte offset {source.offset}"
    return ValueError(
        f"{path}, line {line} ({where}): longer than {limit} bytes, the bound on a line "
        "(--max-line-bytes raises it; a decompression bomb or a file that is not text?)"
    )


def iter_lines(
    path: str, *, max_line_bytes: int, compression: str | None = None
) -> Iterator[tuple[int, str]]:
    """``(number, line)`` of each line of ``path`` as UTF-8 text, without its line ending
    (``\\n`` or ``\\r\\n``).

    Raises:
        ValueError: as :func:`line_blocks`, or for a line that is not UTF-8 (file, line, the
            byte offset of the bad byte in the file's text).
    """
    offset = 0
    for first, block in line_blocks(path, max_line_bytes=max_line_bytes, compression=compression):
        lines = block.split(b"\n")
        lines.pop()  # after the block's last \n
        for i, raw in enumerate(lines):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{first + i}: not UTF-8 text: byte {raw[e.start]:#04x} at byte "
                    f"offset {offset + e.start} ({e.reason})"
                ) from None
            offset += len(raw) + 1
            yield first + i, text[:-1] if text.endswith("\r") else text
