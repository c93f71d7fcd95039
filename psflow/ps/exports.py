"""The ps side of incremental exports: :class:`ExportService` serves ``export`` and
``export_status``.

An export is what a model server needs of the shard, not what training needs: the dense
variables and each table's rows (no optimizer state). A **base** holds every row; a **delta**
the rows written since the previous export and the ids evicted since (tombstones), so that a
server that applied the previous export and this one holds exactly what the shard held at this
one's moment. Like a checkpoint's, the snapshot is taken between two requests without copying
the tables (:meth:`psflow.sparse.Rows.begin_export`: a row is copied before it next changes,
the rest by the writing thread), so each row is one the shard really held, and a background
thread writes the file (temporary name, fsync, rename: :func:`psflow.ps.files.atomic_write`)
as ``export-<n>/shard-<i>-of-<S>.safetensors``. The chief publishes the export's manifest once
every shard's file is written (:mod:`psflow.train.exports`); the file format is
:mod:`psflow.serve.delta`'s, which reads it.

A write that would leave less than the request's ``reserve_bytes`` free on a local disk is
refused before anything is written: the previous exports stay whole.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shutil
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from psflow.protocol import Key, Op, SaveState
from psflow.ps.errors import BusyError, RequestError
from psflow.ps.files import atomic_write, join, normal_url, url_to_fs
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.shard_file import safetensors_chunks
from psflow.serve.delta import (
    EXPORT_META,
    dense_tensor_name,
    export_shard_file_name,
    table_export_tensor_name,
)
from psflow.sparse.rows import ExportPart
from psflow.transport import Request, wire

log = logging.getLogger(__name__)

EXPORT_DIR_RE = re.compile(r"^export-(\d+)$")
"""An export directory's name: ``export-<n>``."""

_STATUS_KEPT = 16
"""Exports whose state ``export_status`` still answers (the chief asks about the last one)."""


def _free_bytes(path: str) -> int:
    """Free bytes on the local filesystem that holds ``path`` (or would: its nearest
    existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return shutil.disk_usage(path).free


def export_root_of(url: str) -> tuple[str, str] | None:
    """The export directory (scheme, normalised path) that ``url``, an ``export-<n>``
    directory, is in; ``None`` for a ``url`` that is not one, or has a ``..`` component."""
    got = normal_url(url.rstrip("/"))
    if got is None:
        return None
    parent, name = posixpath.split(got[1])
    return (got[0], parent) if EXPORT_DIR_RE.match(name) else None


class ExportService(Service):
    """The ``export`` and ``export_status`` ops of one ps server (the chief's alone).

    The shard tracks changes since the export it last took (:attr:`since`); a delta asked
    after another export (or after a restart or restore, which lose the tracking) is
    refused, and the chief exports a base instead.

    Exports go only into ``export-<n>`` directories right under one export directory:
    ``root`` when the ps is given it, else the first one the chief names (a path with a
    ``..`` component is refused), as a checkpoint goes only into its checkpoint directory.
    """

    def __init__(
        self, host: ServiceHost, *, chief: str, num_shards: int, root: str | None = None
    ) -> None:
        self.host = host
        self.chief = chief
        self.num_shards = num_shards
        self.root = None if root is None else normal_url(root)
        """The export directory (scheme, normalised path) exports go into; ``None`` until
        the first export when the ps was given none."""
        if root is not None and self.root is None:
            raise ValueError(f"an export directory without '..', please: got {root!r}")
        self._given = root is not None
        self.since: int | None = None
        """The export whose changes the tables track since (``None``: none)."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._status: dict[str, dict[str, Any]] = {}

    def handlers(self) -> Mapping[Op, Handler]:
        return {Op.EXPORT: self._export, Op.EXPORT_STATUS: self._export_status}

    def _chief_only(self, request: Request) -> None:
        if self.host.sender(request) != self.chief:
            raise RequestError(f"only the chief ({self.chief}) may ask for an export")

    def on_restored(self, reason: str) -> None:
        self.since = None  # the tables were made anew: nothing is tracked

    def _export(self, request: Request) -> None:
        self._chief_only(request)
        self.host.require_initialized()
        header = request.header
        url = header.get(Key.DIR)
        name = url.rstrip("/").rsplit("/", 1)[-1] if isinstance(url, str) else ""
        match = EXPORT_DIR_RE.match(name)
        if not isinstance(url, str) or match is None:
            raise ValueError(
                f"'{Key.DIR}' must be an export directory .../export-<n>, got {wire.brief(url)}"
            )
        seq = _count(header, Key.EXPORT_SEQ)
        base = _count(header, Key.BASE)
        reserve = _count(header, Key.RESERVE_BYTES)
        since = header.get(Key.SINCE)
        if since is not None:
            since = _count(header, Key.SINCE)
        if seq != int(match.group(1)):
            raise ValueError(f"export {seq} cannot be written into {wire.brief(url)}")
        where = export_root_of(url)
        if where is None:
            raise ValueError(f"refusing to export into {wire.brief(url)}: a '..' in its path")
        if self.root is not None and where != self.root:
            first = "its export directory" if self._given else "where its first export went"
            raise ValueError(
                f"refusing to export into {wire.brief(url)}: this ps exports only into "
                f"{self.root[0]}://{self.root[1]}/export-<n> ({first})"
            )
        if since is None and base != seq:
            raise ValueError(f"a base export is its own base: export {seq}, base {base}")
        if since is not None and (since >= seq or base > since):
            raise ValueError(f"a delta export {seq} cannot follow {since} from base {base}")
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise BusyError("an export of this shard is still being written")
        if since is not None and since != self.since:
            tracked = "no changes" if self.since is None else f"changes since export {self.since}"
            raise ValueError(
                f"{self.host.name} tracks {tracked}, not since {since} (a restart, a restore, "
                "a failed or missed export): export a base"
            )
        store = self.host.store
        start = time.perf_counter()
        # Every table first, then none is left tracking from an older export.
        parts = {n: t.begin_export(base=since is None) for n, t in store.tables.items()}
        dense = {n: t.detach().clone() for n, t in store.variables.items()}
        step = store.step
        self.since = seq
        if self.root is None:
            self.root = where
            log.info(
                "shard %d: exports go into %s://%s from now on (the chief's first)",
                self.host.shard,
                *where,
            )
        pause = time.perf_counter() - start
        self.host.metrics.export_pause.observe(pause)
        meta = {
            "seq": seq,
            "base": base,
            "since": since,
            "shard": self.host.shard,
            "num_shards": self.num_shards,
            "step": step,
        }
        file_url = join(url.rstrip("/"), export_shard_file_name(self.host.shard, self.num_shards))
        with self._lock:
            for old in list(self._status)[:-_STATUS_KEPT]:  # a job may export for months
                del self._status[old]
            self._status[url] = {Key.STATE: SaveState.WRITING, Key.FILE: file_url}
            self._thread = threading.Thread(
                target=self._write,
                args=(url, file_url, dense, parts, meta, reserve),
                name="psflow-export",
                daemon=True,
            )
            self._thread.start()
        self.host.reply(
            request,
            {
                Key.SAVING: file_url,
                Key.SNAPSHOT_STEP: step,
                Key.SNAPSHOT_SECONDS: pause,
                Key.TABLES: {n: t.spec.to_wire() for n, t in store.tables.items()},
                Key.VARIABLES: {
                    n: [wire.dtype_name(t.dtype), list(t.shape)] for n, t in dense.items()
                },
            },
        )

    def _write(
        self,
        url: str,
        file_url: str,
        dense: dict[str, torch.Tensor],
        parts: dict[str, ExportPart],
        meta: dict[str, Any],
        reserve: int,
    ) -> None:
        start = time.perf_counter()
        status: dict[str, Any]
        try:
            tensors = {dense_tensor_name(n): t for n, t in dense.items()}
            for name, (rows, tombstones) in parts.items():
                got = rows.result()
                tensors[table_export_tensor_name(name, "ids")] = got["ids"]
                tensors[table_export_tensor_name(name, "values")] = got["values"]
                tensors[table_export_tensor_name(name, "tombstones")] = tombstones
            for name, t in tensors.items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{name!r} is not finite: refusing to export it")
            chunks = safetensors_chunks(tensors, {EXPORT_META: json.dumps(meta)})
            need = sum(len(c) for c in chunks)
            fs, path = url_to_fs(file_url)
            if isinstance(fs, LocalFileSystem):
                free = _free_bytes(path)
                if free - need < reserve:
                    raise OSError(
                        f"export {meta['seq']} of shard {meta['shard']} needs {need} bytes in "
                        f"{url}, and {free} are free of which {reserve} must stay free: "
                        "refused, nothing written (the previous exports stay whole)"
                    )
            atomic_write(fs, path, chunks)
            status = {
                Key.STATE: SaveState.DONE,
                Key.FILE: file_url,
                Key.SECONDS: time.perf_counter() - start,
            }
            self.host.metrics.export_write.observe(status[Key.SECONDS])
        except Exception as e:
            log.error("shard %d: export %s failed: %s", self.host.shard, file_url, e)
            self.host.metrics.exports_failed.inc()
            status = {
                Key.STATE: SaveState.ERROR,
                Key.FILE: file_url,
                Key.ERROR: f"{type(e).__name__}: {e}",
            }
            with self._lock:
                if self.since == meta["seq"]:
                    self.since = None  # a delta after a file never written would miss rows
        with self._lock:
            self._status[url] = status

    def _export_status(self, request: Request) -> None:
        """The state of the export into :attr:`Key.DIR`; without one, the export whose changes
        the shard tracks since (:attr:`Key.SINCE`)."""
        self._chief_only(request)
        url = request.header.get(Key.DIR)
        with self._lock:
            if url is None:
                self.host.reply(request, {Key.SINCE: self.since})
                return
            status = self._status.get(url) if isinstance(url, str) else None
        self.host.reply(request, dict(status) if status else {Key.STATE: SaveState.UNKNOWN})

    def wait(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)


def _count(header: Mapping[str, Any], key: Key) -> int:
    value = header.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"'{key}' must be an integer >= 0, got {wire.brief(value)}")
    return value
