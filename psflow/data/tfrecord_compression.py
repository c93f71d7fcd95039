"""TFRecord's stream compression: choosing it, and inflating a file chunk by chunk.

A file is optionally GZIP- or ZLIB-compressed as a whole (TensorFlow's
``ZlibCompressionOptions``). A compressed stream is inflated at most ``max(chunk_size,
record)`` bytes at a time, so a GZIP or ZLIB "zip bomb" costs time linear in what it expands
to, never memory.
"""

from __future__ import annotations

import os
import zlib
from typing import IO

from psflow.data.tfrecord_framing import DataLossError

COMPRESSIONS = ("", "GZIP", "ZLIB")


def resolve_compression(path: str, compression: str | None) -> str:
    """``"auto"`` picks by suffix (``.gz`` GZIP, ``.zlib``/``.zz`` ZLIB, else none)."""
    if compression is None:
        return ""
    c = compression.upper()
    if c == "AUTO":
        name = path.lower()
        if name.endswith((".gz", ".gzip")):
            return "GZIP"
        if name.endswith((".zlib", ".zz")):
            return "ZLIB"
        return ""
    if c == "NONE":
        return ""
    if c not in COMPRESSIONS:
        raise ValueError(f"compression must be '', 'GZIP', 'ZLIB' or 'auto', got {compression!r}")
    return c


def _wbits(compression: str) -> int:
    return zlib.MAX_WBITS | 16 if compression == "GZIP" else zlib.MAX_WBITS


class _Source:
    """Decompressed bytes of one file, in chunks, with the stream offset of each chunk."""

    def __init__(self, f: IO[bytes], compression: str, path: str, chunk_size: int):
        self.f = f
        self.path = path
        self.chunk_size = chunk_size
        self.compression = compression
        self.decomp = zlib.decompressobj(_wbits(compression)) if compression else None
        self.compressed_offset = 0
        self.eof = False
        self._pending = b""  # compressed bytes read but not inflated yet
        self.size = None if compression else _file_size(f)
        """The stream's length when it is known (an uncompressed file's size), else ``None``."""

    def read(self, at_least: int) -> bytes:
        """At least ``at_least`` bytes unless the stream ends first; b"" only at the end.

        Never more than ``max(at_least, chunk_size)`` bytes: what a compressed stream expands
        to is inflated only as far as it is asked for.
        """
        parts: list[bytes] = []
        got = 0
        want = max(at_least, self.chunk_size)
        while got < at_least and not self.eof:
            if self.decomp is not None and self._pending:
                raw = self._decompress(want - got)
            else:
                raw = self.f.read(want - got if self.decomp is None else 1 << 16)
                if not raw:
                    self.eof = True
                    if self.decomp is not None and not self.decomp.eof and self.compressed_offset:
                        raise DataLossError(
                            self.path,
                            self.compressed_offset,
                            -1,
                            f"{self.compression} stream ends early (offset is in the compressed "
                            "file)",
                        )
                    break
                if self.decomp is not None:
                    self._pending = raw
                    raw = self._decompress(want - got)
                else:
                    self.compressed_offset += len(raw)
            parts.append(raw)
            got += len(raw)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _decompress(self, limit: int) -> bytes:
        """Inflates pending input into at most ``limit`` bytes (``limit`` > 0)."""
        assert self.decomp is not None
        out = []
        got = 0
        while self._pending and got < limit:
            raw = self._pending
            try:
                piece = self.decomp.decompress(raw, limit - got)
            except zlib.error as e:
                raise DataLossError(
                    self.path,
                    self.compressed_offset,
                    -1,
                    f"bad {self.compression} data near this offset of the compressed file: {e}",
                ) from e
            rest = self.decomp.unused_data if self.decomp.eof else self.decomp.unconsumed_tail
            self.compressed_offset += len(raw) - len(rest)
            self._pending = rest
            if self.decomp.eof and rest:  # concatenated gzip members, as `cat a.gz b.gz` makes
                self.decomp = zlib.decompressobj(_wbits(self.compression))
            elif not piece and len(rest) == len(raw):
                break  # no progress: zlib wants more input
            out.append(piece)
            got += len(piece)
        return b"".join(out)


def _file_size(f: IO[bytes]) -> int | None:
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError):
        size = getattr(f, "size", None)  # fsspec's buffered files know it
        return size if isinstance(size, int) else None
