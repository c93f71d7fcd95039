"""Incremental exports from the chief's side: :class:`Exporter` asks every ps for its part of
an export and publishes the export's manifest once all are written.

The first export of a session is a base (every row); each later one a delta (the rows changed
and the ids evicted since the previous export, and the dense parameters), until
``export_base_every`` deltas have followed a base, when the next is a base again; the chains
past ``export_keep_bases`` are then deleted. An export that fails (a ps refused it, a write
failed, no room on a disk) publishes no manifest, so a server never sees it, and the next one
is a base: a shard's changes since the failed one are no longer tracked against a published
export. A ps that restarted or was restored lost its tracking: the chief asks every shard which
export it tracks changes since (``export_status``) and exports a base when they disagree.

The format, and the loader a model server uses, are :mod:`psflow.serve.delta`'s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from psflow.protocol import Code, Key, Op, SaveState
from psflow.ps.files import atomic_write, join, url_to_fs
from psflow.serve.delta import (
    EXPORT_RE,
    FORMAT,
    MANIFEST,
    ExportError,
    damaged_exports,
    export_dir_name,
    export_shard_file_name,
    list_exports,
)
from psflow.train.session_config import ExportConfig
from psflow.transport import PeerError
from psflow.worker import ShardedClient
from psflow.worker.placement import Piece

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.02


class Exporter:
    """The chief's exports through the ps tasks (:class:`~psflow.train.TrainingSession` makes
    one when given an ``export_dir``).

    Args:
        config: where, how often, how many deltas per base, how many chains kept.
        make_client: a fresh connection to the ps (each export runs in its own thread).
        pieces: the placement: which ps variables make each dense parameter.
        params: the model's dense parameters (their shapes and dtypes, for the manifest).
        clock: seconds, for the schedule (``time.monotonic``).
    """

    def __init__(
        self,
        config: ExportConfig,
        *,
        make_client: Callable[[], ShardedClient],
        pieces: Sequence[Piece],
        params: dict[str, torch.Tensor],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.export_dir is None:
            raise ValueError("an Exporter needs an export_dir")
        self.config = config
        self.dir = config.export_dir.rstrip("/")
        self.make_client = make_client
        self.pieces = list(pieces)
        self.param_meta = {
            n: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for n, p in params.items()
        }
        self.clock = clock
        self._last_t = clock()
        self._last: tuple[int, int] | None = None
        """``(seq, base)`` of the last export published by this session."""
        self._deltas = 0
        self._seq = self._highest_seq()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_url: str | None = None
        """The last export published (its directory)."""

    def _highest_seq(self) -> int:
        """The highest ``export-<n>`` in the directory, complete or not (-1: none)."""
        fs, path = url_to_fs(self.dir)
        if not fs.exists(path):
            return -1
        seqs = [
            int(m.group(1))
            for entry in fs.ls(path, detail=False)
            if (m := EXPORT_RE.match(str(entry).rstrip("/").rsplit("/", 1)[-1]))
        ]
        return max(seqs, default=-1)

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def raise_pending(self) -> None:
        """Raises the error of an export that failed in the background (once)."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def due(self) -> bool:
        every = self.config.export_every
        return every is not None and self.clock() - self._last_t >= every

    def maybe_export(self) -> None:
        """Starts an export in the background when one is due and none is being written
        (the session's step calls it); raises a failed one's error."""
        self.raise_pending()
        if self.busy or not self.due():
            return
        self._last_t = self.clock()
        self._thread = threading.Thread(target=self._run, name="psflow-export", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._export()
        except BaseException as e:
            if _busy(e):  # a ps still writes the export a chief asked for before it restarted
                log.info("export skipped: %s", e.__cause__)
                return
            log.error("export failed: %s", e)
            self._error = e

    def wait(self, *, raise_error: bool = True) -> None:
        """Waits for the export in progress."""
        thread = self._thread
        if thread is not None:
            thread.join(self.config.export_timeout + 10)
        if raise_error:
            self.raise_pending()

    def export(self) -> str:
        """Exports now (after the one in progress) and waits; returns the export's directory.

        A ps may still write an export asked for before this chief restarted: then this one
        is asked again until the ps has written it (``export_timeout`` at most).

        Raises:
            ExportError: when a ps refused it or its write failed (nothing published).
        """
        self.wait()
        self._last_t = self.clock()
        deadline = time.monotonic() + self.config.export_timeout
        while True:
            try:
                return self._export()
            except ExportError as e:
                if not _busy(e) or time.monotonic() > deadline:
                    raise
                log.debug("export refused, asking again: %s", e.__cause__)
            time.sleep(_POLL_SECONDS)

    def _export(self) -> str:
        client = self.make_client()
        try:
            return self._export_with(client)
        except PeerError as e:
            self._last = None  # what the shards track since is no published export now
            raise ExportError(f"{self.dir}: an export failed: {e}") from e
        except BaseException:
            self._last = None
            raise
        finally:
            client.close()

    def _export_with(self, client: ShardedClient) -> str:
        shards = range(client.num_shards)
        since: int | None = None
        if self._last is not None and self._deltas < self.config.export_base_every:
            tracked = client.call({s: {Key.OP: Op.EXPORT_STATUS} for s in shards})
            if all(h.get(Key.SINCE) == self._last[0] for h, _ in tracked.values()):
                since = self._last[0]
        self._seq += 1
        seq = self._seq
        base = seq if since is None or self._last is None else self._last[1]
        url = join(self.dir, export_dir_name(seq))
        header: dict[str, Any] = {
            Key.OP: Op.EXPORT,
            Key.DIR: url,
            Key.EXPORT_SEQ: seq,
            Key.BASE: base,
            Key.RESERVE_BYTES: self.config.export_reserve_bytes,
        }
        if since is not None:
            header[Key.SINCE] = since
        start = time.monotonic()
        replies = {s: h for s, (h, _) in client.call({s: dict(header) for s in shards}).items()}
        step = max(int(h.get(Key.SNAPSHOT_STEP, 0)) for h in replies.values())
        self._await(client, url, start)
        tables: dict[str, Any] = {}
        for h in replies.values():
            tables.update(h.get(Key.TABLES) or {})
        manifest = {
            "format": FORMAT,
            "seq": seq,
            "kind": "base" if since is None else "delta",
            "base": base,
            "since": since,
            "step": step,
            "time": time.time(),
            "num_shards": client.num_shards,
            "files": [export_shard_file_name(s, client.num_shards) for s in shards],
            "dense": self._dense(),
            "tables": tables,
        }
        fs, path = url_to_fs(join(url, MANIFEST))
        atomic_write(fs, path, json.dumps(manifest, indent=1).encode())
        self._last = (seq, base)
        self._deltas = 0 if since is None else self._deltas + 1
        self.last_url = url
        what = "a base" if since is None else f"a delta after {export_dir_name(since)}"
        log.info("export %s (%s) at step %d", url, what, step)
        if since is None:
            try:
                self._prune(seq)
            except Exception as e:  # the export is published: an old one left is no failure
                log.warning("pruning the exports older than %s failed: %s", url, e)
        return url

    def _await(self, client: ShardedClient, url: str, start: float) -> None:
        shards = range(client.num_shards)
        pending = set(shards)
        while pending:
            replies = client.call(
                {s: {Key.OP: Op.EXPORT_STATUS, Key.DIR: url} for s in sorted(pending)}
            )
            for s, (h, _) in replies.items():
                state = h.get(Key.STATE)
                if state == SaveState.DONE:
                    pending.discard(s)
                elif state != SaveState.WRITING:
                    raise ExportError(
                        f"{export_dir_name(self._seq)}: ps:{s} did not write its file "
                        f"({state}): {h.get(Key.ERROR, 'no export of this directory')}"
                    )
            if pending and time.monotonic() - start > self.config.export_timeout:
                raise ExportError(
                    f"{url}: ps {sorted(pending)} still writing after "
                    f"{self.config.export_timeout:g} s"
                )
            if pending:
                time.sleep(_POLL_SECONDS)

    def _dense(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for piece in self.pieces:
            entry = out.setdefault(piece.param, {**self.param_meta[piece.param], "pieces": []})
            rows = None if piece.rows is None else list(piece.rows)
            entry["pieces"].append({"var": piece.var, "shard": piece.shard, "rows": rows})
        return out

    def _prune(self, newest_base: int) -> None:
        """Deletes the chains older than the newest ``export_keep_bases`` (complete bases),
        and abandoned exports (no manifest) older than the newest base. An export whose
        manifest cannot be read (logged by :func:`~psflow.serve.delta.list_exports`) counts
        as a base: it goes with the chains older than the oldest kept base."""
        keep = self.config.export_keep_bases
        fs, root = url_to_fs(self.dir)
        complete = {e.seq: e for e in list_exports(self.dir)}
        damaged = damaged_exports(self.dir)
        # A damaged one counts as a base: what is kept is never less for it.
        bases = sorted(
            {e.seq for e in complete.values() if e.since is None} | {newest_base} | set(damaged)
        )
        oldest_kept = bases[-keep] if keep is not None and len(bases) > keep else bases[0]
        for entry in fs.ls(root, detail=False):
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            match = EXPORT_RE.match(name)
            if match is None:
                continue
            seq = int(match.group(1))
            done = complete.get(seq)
            if done is not None:
                old = done.base < oldest_kept
            elif seq in damaged:
                old = seq < oldest_kept
            else:
                old = seq < newest_base
            if old:
                fs.rm(str(entry), recursive=True)


def _busy(error: BaseException) -> bool:
    """Whether ``error`` is a ps's refusal while it still writes an earlier export."""
    cause = error.__cause__
    return isinstance(cause, PeerError) and cause.code == Code.BUSY
