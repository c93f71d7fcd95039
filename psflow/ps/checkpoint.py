"""The ps side of a checkpoint: :class:`ShardCheckpointer` saves a shard, :class:`CheckpointService`
serves it as the ``save`` and ``save_status`` ops.

Saving happens in two parts, so that serving pauses only for an in-memory copy: the serving
thread takes a :class:`~psflow.ps.shard_file.ShardSnapshot` between two requests, and a
background thread writes it (temporary name, fsync, rename) into a ``ckpt-<step>`` directory,
one of the job's checkpoint directory when the ps is given it (:func:`is_checkpoint_of`). The
file's format is :mod:`psflow.ps.shard_file`'s, the optimizer state's
:mod:`psflow.ps.optimizer_state`'s; their names that :mod:`psflow.ps` and :mod:`psflow.train`
import from here are re-exported.
"""

from __future__ import annotations

import logging
import posixpath
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from psflow.env import PSFLOW_CHECKPOINT_DIR
from psflow.metrics import PsMetrics
from psflow.protocol import Key, Op, SaveState
from psflow.ps.errors import BusyError
from psflow.ps.files import (  # psflow.train imports them from here
    atomic_write,
    join,
    normal_url,
    url_to_fs,
)
from psflow.ps.optimizer_state import load_optimizer_state as load_optimizer_state
from psflow.ps.optimizer_state import split_init_tensors as split_init_tensors
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.shard_file import ShardFile as ShardFile
from psflow.ps.shard_file import ShardSnapshot, safetensors_chunks, shard_file_name, snapshot
from psflow.ps.shard_file import decode_shard as decode_shard
from psflow.ps.shard_file import encode_shard as encode_shard
from psflow.ps.shard_file import read_shard as read_shard
from psflow.ps.store import ShardStore
from psflow.ps.tables import finish_table_snapshots
from psflow.transport import Request, wire

log = logging.getLogger(__name__)

CKPT_DIR_RE = re.compile(r"^ckpt-(\d+)$")
"""A checkpoint directory's name: ``ckpt-<global step>``."""


class ShardCheckpointer:
    """The ps side of a checkpoint: snapshot in the serving thread, write in the background.

    One save at a time: a second ``save`` while the first is still writing is refused.
    """

    def __init__(
        self,
        store: ShardStore,
        *,
        shard: int,
        num_shards: int,
        root: str | None = None,
        metrics: PsMetrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        """Where the snapshot's pause and the write's duration go."""
        self.shard = shard
        self.num_shards = num_shards
        self.root = root
        """The job's checkpoint directory: saves go only into its ``ckpt-<n>`` directories.
        ``None``: wherever the chief says (a warning, once)."""
        self._warned = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._status: dict[str, dict[str, Any]] = {}

    def save(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """Handles a ``save`` request: ``{"dir": URL of ckpt-<n>}`` (with ``"by_step"``, the
        ``ckpt-<step>`` beside it of the snapshot's step); returns the reply header."""
        if not self.store.initialized:
            raise ValueError("cannot save a shard that is not initialised")
        url = header.get(Key.DIR)
        if not isinstance(url, str) or not CKPT_DIR_RE.match(url.rstrip("/").rsplit("/", 1)[-1]):
            raise ValueError(
                f"'dir' must be a checkpoint directory .../ckpt-<step>, got {wire.brief(url)}"
            )
        if self.root is not None:
            if not is_checkpoint_of(self.root, url):
                raise ValueError(
                    f"refusing to save into {wire.brief(url)}: this ps saves only into "
                    f"{self.root}/ckpt-<step> (its checkpoint directory)"
                )
        elif not self._warned:
            self._warned = True
            log.warning(
                "shard %d: no checkpoint directory given to this ps (checkpoint_dir, or %s): "
                "any client may have it write its shard where it says, as %s now",
                self.shard,
                PSFLOW_CHECKPOINT_DIR,
                url,
            )
        by_step = header.get(Key.BY_STEP, False)
        if not isinstance(by_step, bool):
            raise ValueError(f"'{Key.BY_STEP}' must be true or false, got {wire.brief(by_step)}")
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise BusyError("a checkpoint of this shard is still being written")
        snap = snapshot(self.store, shard=self.shard, num_shards=self.num_shards)
        if by_step:  # the directory beside the one asked for, named by what the snapshot holds
            url = f"{url.rstrip('/').rsplit('/', 1)[0]}/ckpt-{snap.step}"
        if self.metrics is not None:
            self.metrics.checkpoint_pause.observe(snap.seconds)
        file_url = join(url.rstrip("/"), shard_file_name(self.shard, self.num_shards))
        with self._lock:
            self._status[url] = {Key.STATE: SaveState.WRITING, Key.FILE: file_url}
            self._thread = threading.Thread(
                target=self._write, args=(url, file_url, snap), name="psflow-ckpt", daemon=True
            )
            self._thread.start()
        log.info(
            "shard %d: snapshot at step %d in %.1f ms; writing %s",
            self.shard,
            snap.step,
            snap.seconds * 1e3,
            file_url,
        )
        spec = self.store.optimizer_spec
        schedule = self.store.schedule
        return {
            Key.SAVING: file_url,
            Key.SNAPSHOT_STEP: snap.step,
            Key.SNAPSHOT_SECONDS: snap.seconds,
            Key.OPTIMIZER: spec.to_wire() if spec else {},
            Key.LR_SCHEDULE: schedule.spec.to_wire() if schedule else None,
            Key.VARIABLES: {
                n: [wire.dtype_name(t.dtype), list(t.shape)]
                for n, t in self.store.variables.items()
            },
            Key.TABLES: {
                n: {"spec": t.spec.to_wire(), "rows": t.num_rows, "bytes": t.nbytes}
                for n, t in self.store.tables.items()
            },
        }

    def _write(self, url: str, file_url: str, snap: ShardSnapshot) -> None:
        start = time.perf_counter()
        status: dict[str, Any]
        try:
            snap.tensors.update(finish_table_snapshots(snap.tables))
            for name, t in snap.tensors.items():
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise ValueError(f"{name!r} is not finite: refusing to checkpoint it")
            chunks = safetensors_chunks(snap.tensors, snap.metadata)
            del snap
            fs, path = url_to_fs(file_url)
            atomic_write(fs, path, chunks)
            status = {
                Key.STATE: SaveState.DONE,
                Key.FILE: file_url,
                Key.SECONDS: time.perf_counter() - start,
            }
            if self.metrics is not None:
                self.metrics.checkpoint_write.observe(status[Key.SECONDS])
        except Exception as e:
            log.error("shard %d: writing %s failed: %s", self.shard, file_url, e)
            error = f"{type(e).__name__}: {e}"
            status = {Key.STATE: SaveState.ERROR, Key.FILE: file_url, Key.ERROR: error}
        with self._lock:
            self._status[url] = status

    def status(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """Handles ``save_status``: the state (``writing``, ``done``, ``error``) of one save."""
        url = header.get(Key.DIR)
        with self._lock:
            status = self._status.get(url) if isinstance(url, str) else None
        if status is None:
            return {Key.STATE: SaveState.UNKNOWN}
        return dict(status)

    def wait(self, timeout: float) -> None:
        """Waits for a write in progress (before the ps exits)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)


def is_checkpoint_of(root: str, url: str) -> bool:
    """Whether ``url`` is a ``ckpt-<step>`` directory right under ``root`` (same scheme, same
    normalised path; no ``..`` anywhere in ``url``)."""
    want, got = normal_url(root), normal_url(url)
    if want is None or got is None or want[0] != got[0]:
        return False
    parent, name = posixpath.split(got[1])
    return parent == want[1].rstrip("/") and CKPT_DIR_RE.match(name) is not None


class CheckpointService(Service):
    """The ``save`` and ``save_status`` ops: a :class:`ShardCheckpointer` on a ps server."""

    def __init__(self, host: ServiceHost, *, num_shards: int, root: str | None = None) -> None:
        self.host = host
        self.checkpointer = ShardCheckpointer(
            host.store, shard=host.shard, num_shards=num_shards, root=root, metrics=host.metrics
        )

    def handlers(self) -> Mapping[Op, Handler]:
        return {Op.SAVE: self._save, Op.SAVE_STATUS: self._save_status}

    def _save(self, request: Request) -> None:
        self.host.reply(request, self.checkpointer.save(request.header))

    def _save_status(self, request: Request) -> None:
        self.host.reply(request, self.checkpointer.status(request.header))

    def wait(self, timeout: float) -> None:
        self.checkpointer.wait(timeout)
