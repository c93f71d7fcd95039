"""Reading TFRecord files: :class:`TFRecordReader`, :class:`RecordBatch`, :func:`read_records`.

The reader reads large chunks and frames and verifies each chunk's records in one call of the
compiled framer (:func:`psflow.data.native.frame_records`). A chunk it refuses (a checksum that
fails), or every chunk where it was not built, is framed in Python with one cheap step per record,
the checksums of the 8-byte headers verified for the whole chunk at once in numpy and those of
the data by google-crc32c's C code; that path names or skips the bad record. A
:class:`RecordBatch` hands records out as one buffer plus offsets, so the hot path creates no
Python object per record.

Hostile files: a record's declared length is trusted only once its header checksum is good, and
even then never past :data:`MAX_RECORD_BYTES` (a reader argument) nor, in an uncompressed file,
past what the file still holds: such a length is reported as a corrupt record before anything is
allocated for it. A compressed stream is inflated at most ``max(chunk_size, record)`` bytes at a
time (:mod:`psflow.data.tfrecord_compression`), so a reader holds at most about ``chunk_size +
max_record_bytes`` bytes of the stream at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import google_crc32c
import numpy as np

from psflow.data import fs, native
from psflow.data.tfrecord_compression import _Source, resolve_compression
from psflow.data.tfrecord_framing import (
    _FOOTER,
    _HEADER,
    _U32,
    _U64,
    DataLossError,
    _crc32c_8,
    _crc32c_8_every,
    _mask_np,
    _u32_at,
    _u32_every,
    _u64_at,
    masked_crc32c,
)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 4 << 20
MAX_RECORD_BYTES = 1 << 30
"""The longest record a reader accepts by default (1 GiB; ``max_record_bytes`` raises it). A
``tf.train.Example`` cannot exceed 2 GiB (protobuf's limit); a longer declared length is taken as
a corrupt length field, never as a size to allocate."""
_RESYNC_SPAN = 1 << 20  # header checksums computed at once while resynchronising


@dataclass(frozen=True, eq=False)
class RecordBatch:
    """Records of one file that lie in one buffer: ``buffer[starts[i] : starts[i] + lengths[i]]``.

    Attributes:
        buffer: the bytes the records live in (kept alive as long as the batch is).
        starts: int64 offsets of each record's data in ``buffer``.
        lengths: int64 length of each record.
        indices: int64 index of each record in its file (gaps where records were skipped).
        path: the file the records came from ("" for batches built from a list).
    """

    buffer: bytes | bytearray | memoryview
    starts: np.ndarray
    lengths: np.ndarray
    indices: np.ndarray
    path: str = ""

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> bytes:
        s = int(self.starts[i])
        return bytes(self.buffer[s : s + int(self.lengths[i])])

    def __iter__(self) -> Iterator[bytes]:
        mv = memoryview(self.buffer)
        for s, n in zip(self.starts.tolist(), self.lengths.tolist(), strict=True):
            yield bytes(mv[s : s + n])

    def tolist(self) -> list[bytes]:
        return list(self)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def from_records(cls, records: Iterable[bytes], path: str = "") -> RecordBatch:
        """Packs records into one buffer (one copy), e.g. after a shuffle."""
        recs = list(records)
        lengths = np.fromiter(map(len, recs), dtype=np.int64, count=len(recs))
        starts = np.zeros(len(recs), dtype=np.int64)
        if len(recs) > 1:
            np.cumsum(lengths[:-1], out=starts[1:])
        return cls(b"".join(recs), starts, lengths, np.arange(len(recs), dtype=np.int64), path)


class TFRecordReader:
    """Reads the records of one TFRecord file (local path or fsspec URL).

    Args:
        path: the file.
        compression: ``""``, ``"GZIP"``, ``"ZLIB"`` or ``"auto"`` (by file suffix).
        verify: check both checksums of every record (off only for trusted, hot re-reads).
        skip_corrupt: skip a record with a bad checksum, or the rest of a truncated file, log it
            and count it in :attr:`skipped`, instead of raising :class:`DataLossError`. After a
            corrupt length the reader resynchronises on the next valid record.
        chunk_size: bytes read at a time.
        max_record_bytes: the longest record accepted (:data:`MAX_RECORD_BYTES`): a longer
            declared length is a corrupt record, reported (or skipped) before any allocation.
        shard: ``(index, count, offset)`` to keep only records whose
            ``(record_index + offset) % count == index``; the others are framed (their lengths are
            still verified) but their data checksums are left to the shard that owns them.

    Example:
        >>> with TFRecordReader("train.tfrecord") as reader:  # doctest: +SKIP
        ...     for batch in reader.iter_batches():
        ...         print(len(batch), batch[0][:10])
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        compression: str | None = "auto",
        verify: bool = True,
        skip_corrupt: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        shard: tuple[int, int, int] | None = None,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ):
        self.path = os.fspath(path)
        self.compression = resolve_compression(self.path, compression)
        if chunk_size < 64:
            raise ValueError(f"chunk_size must be at least 64 bytes, got {chunk_size}")
        if shard is not None and not (0 <= shard[0] < shard[1]):
            raise ValueError(f"shard (index, count, offset) needs 0 <= index < count, got {shard}")
        if max_record_bytes < 0:
            raise ValueError(f"max_record_bytes must be >= 0, got {max_record_bytes}")
        self.max_record_bytes = max_record_bytes
        self.verify = verify
        self.skip_corrupt = skip_corrupt
        self.chunk_size = chunk_size
        self.shard = shard
        self.skipped = 0
        """How many records were skipped as corrupt (with ``skip_corrupt``)."""
        self._f: IO[bytes] | None = None
        self._size: int | None = None  # the stream's length, when known

    def __enter__(self) -> TFRecordReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __iter__(self) -> Iterator[bytes]:
        for batch in self.iter_batches():
            yield from batch

    def iter_batches(self) -> Iterator[RecordBatch]:
        """The file's records, one :class:`RecordBatch` per chunk read."""
        self._f = fs.open_read(self.path)
        try:
            src = _Source(self._f, self.compression, self.path, self.chunk_size)
            self._size = src.size
            yield from self._batches(src)
        finally:
            self.close()

    def _error(self, offset: int, index: int, reason: str) -> DataLossError:
        return DataLossError(self.path, offset, index, reason, compressed=bool(self.compression))

    def _bad_length(self, offset: int, length: int) -> str | None:
        """Why the record at stream ``offset`` cannot have data of ``length`` bytes, if so."""
        if length > self.max_record_bytes:
            return (
                f"record length {length} is over max_record_bytes={self.max_record_bytes} "
                "(a corrupt length field, or raise max_record_bytes)"
            )
        if self._size is not None and offset + _HEADER + length + _FOOTER > self._size:
            return (
                f"truncated record: its length {length} runs past the end of the file "
                f"({self._size - offset - _HEADER} bytes left after its header)"
            )
        return None

    def _skip(self, err: DataLossError) -> None:
        if not self.skip_corrupt:
            raise err
        self.skipped += 1
        log.warning("skipping corrupt record: %s", err)

    def _batches(self, src: _Source) -> Iterator[RecordBatch]:
        buf: bytes = b""
        pos = 0  # next unread byte of buf
        base = 0  # stream offset of buf[0]
        index = 0  # index of the record at pos
        need = 1
        resync_from: int | None = None  # stream offset where a corrupt header was found
        while True:
            chunk = src.read(max(need - (len(buf) - pos), 1))
            final = not chunk
            tail = len(buf) - pos
            if chunk and resync_from is None and tail >= _HEADER and need <= len(chunk):
                # The record that straddles the two chunks gets a buffer of its own: a copy of
                # one record, where joining the old tail to the new chunk would copy the chunk.
                # Its header was verified when `need` was taken from it.
                batch, _, index, _, _ = self._scan(buf[pos:] + chunk[:need], 0, base + pos, index)
                if batch is not None and len(batch):
                    yield batch
                base += len(buf)
                buf, pos = chunk, need
            elif chunk:
                base += pos
                buf = buf[pos:] + chunk if tail else chunk
                pos = 0
            if resync_from is not None:
                pos, found = self._resync(buf, pos, base, final)
                if not found:
                    if final:
                        log.warning(
                            "%s: no valid record after stream offset %d; skipped %d bytes to the end",
                            self.path,
                            resync_from,
                            base + len(buf) - resync_from,
                        )
                        return
                    need = len(buf) - pos + 1
                    continue
                log.warning(
                    "%s: resynchronised at stream offset %d after skipping %d bytes",
                    self.path,
                    base + pos,
                    base + pos - resync_from,
                )
                resync_from = None
            batch, pos, index, need, bad_header = self._scan(buf, pos, base, index)
            if batch is not None and len(batch):
                yield batch
            if bad_header:
                resync_from = base + pos
                pos += 1
                index += 1
                continue
            if final:
                if pos < len(buf):
                    self._skip(
                        self._error(
                            base + pos,
                            index,
                            f"truncated record ({len(buf) - pos} bytes left at the end of the file)",
                        )
                    )
                return

    def _scan(
        self, buf: bytes, pos: int, base: int, index: int
    ) -> tuple[RecordBatch | None, int, int, int, bool]:
        """Frames the complete records in ``buf[pos:]``, verifies them, returns a batch.

        Returns (batch, new pos, new index, bytes needed past the end to go on, bad header).
        The compiled framer (:func:`psflow.data.native.frame_records`) takes the chunks whose
        checksums all hold; any other, or every chunk without it, is framed here in Python
        and numpy, which names or skips the bad record.
        """
        framed = native.frame_records(buf, pos, verify=self.verify, index=index, shard=self.shard)
        if framed is None:
            return self._scan_python(buf, pos, base, index)
        s, n, pos = framed
        count = len(s)
        need, pending_bad = self._pending(buf, pos, base)
        if pending_bad is not None:
            self._skip(self._error(base + pos, index + count, pending_bad))
        batch = None
        if count:
            idx = np.arange(index, index + count, dtype=np.int64)
            if self.shard is not None:
                sh, shards, off = self.shard
                keep = (idx + off) % shards == sh
                s, n, idx = s[keep], n[keep], idx[keep]
            batch = RecordBatch(buf, s, n, idx, self.path)
        return batch, pos, index + count, need, pending_bad is not None

    def _pending(self, buf: bytes, pos: int, base: int) -> tuple[int, str | None]:
        """The bytes past the end of ``buf`` that the incomplete record at ``pos`` needs, and
        why it is corrupt, if it is."""
        end = len(buf)
        if pos + _HEADER > end:
            return 1, None
        # An incomplete record: trust its length only once its checksum is good, and then
        # only up to max_record_bytes and the end of the file, so that a corrupt length
        # never makes the reader wait for, or allocate, gigabytes.
        if self.verify and masked_crc32c(buf[pos : pos + 8]) != _U32.unpack_from(buf, pos + 8)[0]:
            return 1, "length checksum mismatch"
        length = _U64.unpack_from(buf, pos)[0]
        bad = self._bad_length(base + pos, length)
        if bad is not None:
            return 1, bad
        return _HEADER + length + _FOOTER - (end - pos), None

    def _scan_python(
        self, buf: bytes, pos: int, base: int, index: int
    ) -> tuple[RecordBatch | None, int, int, int, bool]:
        """:meth:`_scan` in Python and numpy."""
        end = len(buf)
        u64 = _U64.unpack_from
        heads: list[int] = []
        append = heads.append
        last = end - _HEADER - _FOOTER  # the last offset where a whole empty record fits
        # The one step per record that stays in Python (each offset depends on the length
        # before it); lengths are re-read below from the buffer in one numpy call.
        while pos <= last:
            nxt = pos + _HEADER + _FOOTER + u64(buf, pos)[0]
            if nxt > end:
                break
            append(pos)
            pos = nxt
        need, pending_bad = self._pending(buf, pos, base)
        arr = np.frombuffer(buf, dtype=np.uint8)
        h = np.asarray(heads, dtype=np.int64)
        s = h + _HEADER
        n = _u64_at(arr, h).astype(np.int64)
        idx = np.arange(index, index + len(s), dtype=np.int64)
        keep = np.ones(len(s), dtype=bool)
        bad_header_at: int | None = None
        if self.shard is not None:
            sh, count, off = self.shard
            keep = (idx + off) % count == sh
        if self.verify and len(s):
            hdr_ok = _mask_np(_crc32c_8(arr, s - _HEADER)) == _u32_at(arr, s - 4)
            if not hdr_ok.all():
                bad_header_at = int(np.argmin(hdr_ok))
            check = np.flatnonzero(
                keep if bad_header_at is None else keep & (idx < idx[bad_header_at])
            )
            # google_crc32c takes bytes only (not memoryview): slicing copies, cheaply. The
            # chain of maps runs in C, with no Python frame per record.
            sl = s[check].tolist()
            el = (s[check] + n[check]).tolist()
            got = np.fromiter(
                map(google_crc32c.value, map(buf.__getitem__, map(slice, sl, el))),
                dtype=np.uint32,
                count=len(sl),
            )
            data_ok = _mask_np(got) == _u32_at(arr, s[check] + n[check])
            for j in check[~data_ok].tolist():
                self._skip(
                    self._error(base + int(s[j]) - _HEADER, int(idx[j]), "data checksum mismatch")
                )
                keep[j] = False
        if bad_header_at is not None:
            j = bad_header_at
            self._skip(
                self._error(base + int(s[j]) - _HEADER, int(idx[j]), "length checksum mismatch")
            )
            keep[j:] = False
            good = RecordBatch(buf, s[keep], n[keep], idx[keep], self.path)
            return good, int(s[j]) - _HEADER, int(idx[j]), 1, True
        if pending_bad is not None:
            self._skip(self._error(base + pos, index + len(s), pending_bad))
        batch = RecordBatch(buf, s[keep], n[keep], idx[keep], self.path) if len(s) else None
        return batch, pos, index + len(s), need, pending_bad is not None

    def _resync(self, buf: bytes, pos: int, base: int, final: bool) -> tuple[int, bool]:
        """Looks for the next offset holding a record whose both checksums are good.

        The header checksums of a whole span of offsets are computed at once in numpy: garbage
        is skipped at memory speed, not one Python step per byte.
        """
        end = len(buf)
        arr = np.frombuffer(buf, dtype=np.uint8)
        while pos + _HEADER <= end:
            stop = min(end - _HEADER + 1, pos + _RESYNC_SPAN)
            ok = _mask_np(_crc32c_8_every(arr, pos, stop)) == _u32_every(buf, pos + 8, stop + 8)
            for c in (np.flatnonzero(ok) + pos).tolist():
                length = _U64.unpack_from(buf, c)[0]
                if self._bad_length(base + c, length) is not None:
                    continue
                dend = c + _HEADER + length
                if dend + _FOOTER > end:
                    if not final:
                        return c, False
                elif masked_crc32c(buf[c + _HEADER : dend]) == _U32.unpack_from(buf, dend)[0]:
                    return c, True
            pos = stop
        return pos, False


def read_records(
    path: str | os.PathLike[str], *, compression: str | None = "auto", skip_corrupt: bool = False
) -> Iterator[bytes]:
    """Every record of one file, as ``bytes``.

    Example:
        >>> for record in read_records("data.tfrecord.gz"):  # doctest: +SKIP
        ...     example = Example.FromString(record)
    """
    with TFRecordReader(path, compression=compression, skip_corrupt=skip_corrupt) as reader:
        yield from reader
