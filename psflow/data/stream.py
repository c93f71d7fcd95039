"""Reading a growing set of TFRecord files: each file once, at an exact, saveable position.

:class:`FileStreamReader` watches a glob (a local path or any fsspec URL, ``s3://.../*.tfrecord``)
for files that land while it reads, as hourly drops do (what Monolith's and Paddle's streaming
training read). Each worker reads the files whose path hashes to it (a file keeps its worker as
others land: no listing order decides), oldest name first, each file once. Its
:meth:`~FileStreamReader.state` is the files it has read whole and the record it is at in the one
it is reading, plain data (``{"source": "files", "pattern": ..., "done": [...], "partial":
{path: next_record}}``) that a checkpoint can hold; :meth:`~FileStreamReader.restore` goes back
there, :meth:`~FileStreamReader.stop_at` makes reads stop exactly at positions saved before (a
replay), and the states of all workers merge into one (:func:`merge_file_states`) that any
number of workers can restore from. Given to a :class:`~psflow.train.TrainingSession`
(``input=``), the reader's position is kept by the ps with the updates it led to: each record
trained once across restarts (:mod:`psflow.train.input_position`).

A file must appear whole: written elsewhere and renamed (or moved) into the glob's reach, as
Spark and Hadoop commit their output; names starting with ``_`` or ``.`` are never read. Records
are ``tf.train.Example`` bytes (:meth:`~FileStreamReader.read_examples`, by
:func:`psflow.data.parse_examples`) or anything a parser makes of the bytes
(:meth:`~FileStreamReader.read`); one that does not parse (or a corrupt record) is counted and
skipped, or stops the reader naming the file and the record, as ``on_bad_record`` says.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from psflow.data import fs
from psflow.data.batches import ExampleStream, parse_batch
from psflow.data.features import FeatureSpec
from psflow.data.tfrecord_framing import DataLossError
from psflow.data.tfrecord_reader import TFRecordReader

log = logging.getLogger(__name__)

SOURCE = "files"
"""The ``source`` of a file stream reader's state."""


@dataclass(kw_only=True)
class FileStreamConfig:
    """A growing set of TFRecord files: where, this worker's place, how often to look."""

    pattern: str
    """A glob (``/data/hourly/*.tfrecord``, ``s3://bucket/clicks/*/part-*``) or a directory."""
    worker_index: int = 0
    """This worker's index among ``num_workers``: it reads the files whose path hashes to it."""
    num_workers: int = 1
    """Workers sharing the files."""
    compression: str | None = "auto"
    """``""``, ``"GZIP"``, ``"ZLIB"`` or ``"auto"`` (by each file's suffix)."""
    poll_interval_s: float = 1.0
    """How often the glob is listed again while there is no file to read."""
    on_bad_record: Literal["skip", "raise"] = "skip"
    """A record that does not parse or is corrupt: counted and skipped, or ``ValueError`` /
    :class:`~psflow.data.DataLossError` naming the file and the record (the position stays
    before it)."""

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ValueError("FileStreamConfig: pattern is empty")
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ValueError(
                f"FileStreamConfig: worker_index={self.worker_index} must be in "
                f"[0, num_workers={self.num_workers})"
            )
        if not self.poll_interval_s > 0:
            raise ValueError(
                f"FileStreamConfig: poll_interval_s must be > 0, got {self.poll_interval_s!r}"
            )
        if self.on_bad_record not in ("skip", "raise"):
            raise ValueError(
                "FileStreamConfig: on_bad_record must be 'skip' or 'raise', got "
                f"{self.on_bad_record!r}"
            )


class FileRecord(NamedTuple):
    """One record handed out: its file, its index there, its value (parsed, or the bytes)."""

    path: str
    record: int
    value: Any


def owner(path: str, num_workers: int) -> int:
    """The worker that reads ``path`` (a hash of the path: stable as other files land)."""
    return zlib.crc32(path.encode()) % num_workers


def merge_file_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The states of the readers sharing one glob as one, which any number of readers can
    :meth:`~FileStreamReader.restore` from."""
    pattern: str | None = None
    done: set[str] = set()
    partial: dict[str, int] = {}
    for state in states:
        checked = _checked(state, pattern)
        pattern = checked["pattern"]
        done |= set(checked["done"])
        for path, index in checked["partial"].items():
            if path in partial:
                raise ValueError(f"file stream states: {path!r} is being read in two of them")
            partial[path] = index
    if pattern is None:
        raise ValueError("file stream states: none given")
    both = sorted(done & set(partial))
    if both:
        raise ValueError(f"file stream states: {both[0]!r} is both read whole and being read")
    return {"source": SOURCE, "pattern": pattern, "done": sorted(done), "partial": partial}


def _checked(state: Mapping[str, Any], pattern: str | None) -> dict[str, Any]:
    if not isinstance(state, Mapping) or state.get("source") != SOURCE:
        raise ValueError(f"not a file stream reader's state: {state!r:.200}")
    got = state.get("pattern")
    if not isinstance(got, str) or (pattern is not None and got != pattern):
        raise ValueError(f"file stream state: pattern {got!r}, expected {pattern!r}")
    done, partial = state.get("done"), state.get("partial")
    if not isinstance(done, list) or not all(isinstance(p, str) for p in done):
        raise ValueError(f"file stream state of {got!r}: done must be a list of paths")
    if not isinstance(partial, Mapping) or not all(
        isinstance(p, str) and isinstance(i, int) and not isinstance(i, bool) and i >= 0
        for p, i in partial.items()
    ):
        raise ValueError(
            f"file stream state of {got!r}: partial must map paths to record indices >= 0, "
            f"got {partial!r:.200}"
        )
    return {"pattern": got, "done": list(done), "partial": dict(partial)}


class FileStreamReader(ExampleStream):
    """Reads this worker's share of a growing set of TFRecord files, each file once.

    Args:
        config: the glob, the worker's place, how often to look.
        parser: turns a record's bytes into what :meth:`read` hands out (an exception: a bad
            record); ``None``: the bytes themselves.

    Example:
        >>> cfg = FileStreamConfig(pattern="/data/hourly/*.tfrecord")
        >>> reader = FileStreamReader(cfg)
        >>> batch = reader.read_examples(512, ctr_spec(), timeout_s=60)  # doctest: +SKIP
        >>> reader.state()["done"]  # the files read whole; "partial": the record reached
        []
    """

    def __init__(
        self, config: FileStreamConfig, *, parser: Callable[[bytes], Any] | None = None
    ) -> None:
        self.config = config
        self.parser = parser
        self.stats = {"records": 0, "bad_records": 0, "files": 0}
        self._done: set[str] = set()
        self._partial: dict[str, int] = {}
        """Files being read (restored from a state, or this one's current), at their next
        record."""
        self._current: str | None = None
        self._records: Iterator[bytes] | None = None
        self._reader: TFRecordReader | None = None
        self._listed_at = float("-inf")
        self._listed: list[str] = []
        self._before: tuple[set[str], dict[str, int], dict[str, int]] = (set(), {}, {})
        self._stops: list[tuple[set[str], dict[str, int]]] = []
        """:meth:`stop_at`'s positions still ahead: the files read whole there, and where
        those being read are."""

    # -- position ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The files read whole, and the next record of those being read: plain data."""
        return {
            "source": SOURCE,
            "pattern": self.config.pattern,
            "done": sorted(self._done),
            "partial": dict(self._partial),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Goes back to ``state`` (this reader's, or :func:`merge_file_states` of several):
        files read whole there are not read again, files being read go on at their record.

        Raises:
            ValueError: for a state that is not a file stream reader's, or of another glob.
        """
        checked = _checked(state, self.config.pattern)
        self._close_file()
        self._done = set(checked["done"])
        self._partial = dict(checked["partial"])
        self._listed_at = float("-inf")

    def stop_at(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Reads hand out no record past ``states[0]`` until the reader is there, then none
        past ``states[1]``, and so on: a replay that ends exactly where a position saved
        before did (:mod:`psflow.train.input_position`); meanwhile only files those positions
        name are read. ``[]``: no stop.

        Raises:
            ValueError: for a state that is not this reader's, or is behind the position before
                it.
        """
        stops = []
        done, partial = set(self._done), dict(self._partial)
        for state in states:
            checked = _checked(state, self.config.pattern)
            stop_done, stop_partial = set(checked["done"]), dict(checked["partial"])
            behind = sorted(done - stop_done) + sorted(
                p for p, i in partial.items() if p not in stop_done and stop_partial.get(p, -1) < i
            )
            if behind:
                raise ValueError(
                    f"file stream stop of {self.config.pattern!r}: behind the position before "
                    f"it at {behind[0]!r}"
                )
            stops.append((stop_done, stop_partial))
            done, partial = stop_done, stop_partial
        self._stops = stops
        self._passed_stops()

    def _at(self, stop: tuple[set[str], dict[str, int]]) -> bool:
        return self._done == stop[0] and self._partial == stop[1]

    def _passed_stops(self) -> None:
        while self._stops and self._at(self._stops[0]):
            self._stops.pop(0)

    def _short_of_stop(self, path: str) -> int | None:
        """How many of ``path``'s records the next stop lets be read (``None``: all)."""
        if not self._stops or path in self._stops[0][0]:
            return None
        return self._stops[0][1].get(path, 0)

    # -- files -------------------------------------------------------------------------------

    def pending(self) -> list[str]:
        """The files of this worker's share not read whole yet, those begun first (as listed
        last, at most every ``poll_interval_s``)."""
        now = time.monotonic()
        if now - self._listed_at >= self.config.poll_interval_s:
            self._listed_at = now
            if fs.is_url(self.config.pattern):  # fsspec caches listings: look again
                fs.file_system(self.config.pattern).invalidate_cache()
            try:
                self._listed = fs.expand_paths(self.config.pattern)
            except FileNotFoundError:
                self._listed = []
        n, me = self.config.num_workers, self.config.worker_index
        mine = [p for p in self._listed if owner(p, n) == me and p not in self._done]
        begun = sorted(p for p in self._partial if owner(p, n) == me and p not in self._done)
        files = begun + [p for p in mine if p not in self._partial]
        if not self._stops:
            return files
        # Up to the next stop: only the files it names, each to its record there.
        stop_done, stop_partial = self._stops[0]
        short = [
            p for p in files if p in stop_done or stop_partial.get(p, 0) > self._partial.get(p, 0)
        ]
        if not short and not self._at(self._stops[0]):
            gone = sorted((stop_done | set(stop_partial)) - self._done - set(files))
            raise ValueError(
                f"file stream of {self.config.pattern!r}: reading up to a saved position needs "
                f"{gone or 'files'} no longer there"
            )
        return short

    def _open_next(self, deadline: float) -> bool:
        """Opens the next file to read, waiting for one until ``deadline``; whether it did."""
        while True:
            files = self.pending()
            if files:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, self.config.poll_interval_s))
        path = files[0]
        skip = self._partial.get(path, 0)
        self._reader = TFRecordReader(
            path,
            compression=self.config.compression,
            skip_corrupt=self.config.on_bad_record == "skip",
        )
        records = iter(self._reader)
        for i in range(skip):  # the records handed out before: read again, not handed out
            if next(records, None) is None:
                # A file only grows: fewer records than were handed out is another file now.
                # Marked done instead, its records after the position were silently lost.
                self._close_file()
                raise ValueError(
                    f"file {path!r} has {i} records, but the position restored is at record "
                    f"{skip}: it was truncated or replaced since"
                )
        self._current, self._records = path, records
        self._partial[path] = skip
        return True

    def _close_file(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = self._records = self._current = None

    def _next_records(self, max_records: int, timeout_s: float | None) -> list[FileRecord]:
        """Up to ``max_records`` raw records, from the current file and the next ones, waiting
        at most ``timeout_s`` (``poll_interval_s`` by default) for a file to land. The position
        moves past them as they are read (:meth:`_fetch` puts it back on an error)."""
        wait = self.config.poll_interval_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        out: list[FileRecord] = []
        while len(out) < max_records:
            if self._records is None and not self._open_next(deadline if not out else 0):
                break
            path, records = self._current, self._records
            assert path is not None and records is not None
            stop = self._short_of_stop(path)
            while len(out) < max_records:
                i = self._partial[path]
                if stop is not None and i >= stop:  # not a record more, not even its end
                    self._close_file()  # opened again at its record after the stop
                    break
                raw = next(records, None)
                if raw is None:  # the file is read whole
                    if self._reader is not None and self._reader.skipped:
                        self.stats["bad_records"] += self._reader.skipped
                    self._done.add(path)
                    del self._partial[path]
                    self.stats["files"] += 1
                    self._close_file()
                    break
                out.append(FileRecord(path, i, raw))
                self._partial[path] = i + 1
        return out

    # -- reading -----------------------------------------------------------------------------

    def read(self, max_records: int = 500, timeout_s: float | None = None) -> list[FileRecord]:
        """Up to ``max_records`` records, each parsed by the reader's parser, waiting at most
        ``timeout_s`` (``config.poll_interval_s`` by default) for a file to land; ``[]`` if none
        came. The position moves past every record returned (and every bad record skipped)."""
        raw = self._fetch(max_records, timeout_s)
        out = []
        for r in raw:
            try:
                value = r.value if self.parser is None else self.parser(r.value)
            except Exception as e:  # the user's parser: any failure is this record's
                self._bad(r, f"{type(e).__name__}: {e}")
                continue
            out.append(FileRecord(r.path, r.record, value))
        self.stats["records"] += len(out)
        return out

    def read_examples(
        self, batch_size: int, spec: Mapping[str, FeatureSpec], timeout_s: float | None = None
    ) -> dict[str, Any] | None:
        """A batch of up to ``batch_size`` ``tf.train.Example`` records parsed by ``spec``
        (:func:`psflow.data.parse_examples`, numpy), across files; ``None`` if no record came
        within ``timeout_s`` (``config.poll_interval_s`` by default)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        records = self._fetch(batch_size, timeout_s)
        values = [r.value for r in records]
        parsed, good = parse_batch(values, spec, lambda i, why: self._bad(records[i], why))
        self.stats["records"] += good
        return parsed

    def _fetch(self, max_records: int, timeout_s: float | None) -> list[FileRecord]:
        """The next raw records; a corrupt one (``on_bad_record="raise"``) raised with the
        position left where it was."""
        self._before = (set(self._done), dict(self._partial), dict(self.stats))
        self._passed_stops()
        try:
            return self._next_records(max_records, timeout_s)
        except DataLossError:
            self._rewind()
            raise

    def _bad(self, r: FileRecord, reason: str) -> None:
        if self.config.on_bad_record == "raise":
            self._rewind()
            raise ValueError(
                f"file {r.path!r} record {r.record}: the record does not parse: {reason} "
                "(FileStreamConfig(on_bad_record='skip') counts and skips such records)"
            )
        self.stats["bad_records"] += 1
        log.warning(
            "file %r record %d: skipped a record that does not parse: %s", r.path, r.record, reason
        )

    def _rewind(self) -> None:
        """Back to where the last fetch began: its records are read again."""
        self._close_file()
        done, partial, stats = self._before
        self._done, self._partial, self.stats = set(done), dict(partial), dict(stats)

    def close(self) -> None:
        """Closes the file being read (the position is :meth:`state`'s)."""
        self._close_file()

    def __enter__(self) -> FileStreamReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
