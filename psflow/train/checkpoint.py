"""Sharded checkpoints from the chief's side: save through the ps, restore, export.

Saving (:class:`Checkpointer`): the chief asks every ps to snapshot its shard (the pause) and
goes on training; a background thread waits for every shard file, writes the chief's model's
buffers (:mod:`psflow.train.checkpoint_buffers`), then publishes the manifest and the
``latest`` pointer (:class:`~psflow.train.manifest.CheckpointDir`) and prunes. In
all-reduce mode the one "ps" is the chief's own model (:class:`~psflow.train.local_shard.LocalShard`).

Restoring (:func:`load_checkpoint`, :meth:`Checkpoint.place`; in
:mod:`psflow.train.checkpoint_read`): the shard files are read back and checked
(:mod:`psflow.train.checkpoint_check`), partitions are concatenated into whole parameters
(optimizer state tensors of the parameter's shape with them; scalars such as Adam's ``step``
copied), and the result is re-placed for the current number of ps tasks, which need not be the
number that saved it. Exporting (:func:`export_state_dict`): in
:mod:`psflow.train.checkpoint_export`. Both are re-exported here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from psflow.metrics import WorkerMetrics
from psflow.protocol import Code, Key, SaveState
from psflow.train.checkpoint_buffers import buffer_meta, write_buffers
from psflow.train.checkpoint_export import (
    export_state_dict,
    fixed_tables,
    hashed_tables,
    table_tensors,
)
from psflow.train.checkpoint_read import Checkpoint, load_checkpoint
from psflow.train.manifest import BUFFERS_FILE, CheckpointDir, Manifest, VariableEntry
from psflow.transport import PeerError
from psflow.transport.wire import dtype_name
from psflow.worker.placement import Piece

__all__ = [
    "Checkpoint",
    "Checkpointer",
    "ShardSaver",
    "export_state_dict",
    "fixed_tables",
    "hashed_tables",
    "load_checkpoint",
    "table_tensors",
]

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.02
_BUSY_RETRY_SECONDS = 0.5
"""How long a chief not waiting leaves the ps alone once one said it still writes a save."""


class ShardSaver(Protocol):
    """What a :class:`Checkpointer` asks of the shards: a
    :class:`~psflow.worker.ShardedClient` of the ps tasks, or in all-reduce mode the chief's
    own model (:class:`~psflow.train.local_shard.LocalShard`)."""

    @property
    def num_shards(self) -> int: ...

    def save(self, url_of: dict[int, str], *, by_step: bool = False) -> dict[int, dict[str, Any]]:
        """Snapshots each shard into its checkpoint directory; the replies, by shard. With
        ``by_step``, each writes into the ``ckpt-<step>`` beside it of its snapshot's step."""
        ...

    def save_status(self, url_of: dict[int, str]) -> dict[int, dict[str, Any]]: ...

    def close(self) -> None: ...


class Checkpointer:
    """Saves the job's checkpoints through the ps tasks (used by the chief's session).

    Args:
        checkpoint_dir: a local path or fsspec URL that every ps task can also write.
        client: the chief's connection to the ps (used from the calling thread only), or in
            all-reduce mode its own model as one shard.
        pieces: the placement, recorded in each manifest.
        params: the model's parameters (for their shapes and dtypes).
        make_client: a fresh client for the background thread (sockets are per thread).
        max_to_keep: complete checkpoints to keep (``None``: all).
        timeout: seconds a save may take before it fails, naming the shards not done.
        buffers: the chief's model's buffers now, copies on the CPU
            (:func:`~psflow.train.checkpoint_buffers.snapshot_buffers`), taken at each save and
            written with it; ``None``: none recorded (the manifest's ``buffers`` is ``null``).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        *,
        client: ShardSaver,
        pieces: Sequence[Piece],
        params: dict[str, torch.Tensor],
        make_client: Callable[[], ShardSaver],
        max_to_keep: int | None = 5,
        timeout: float = 300.0,
        metrics: WorkerMetrics | None = None,
        buffers: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.dir = CheckpointDir(checkpoint_dir)
        self.buffers = buffers
        self.metrics = metrics
        """Where each completed save's duration, step and time go (the chief's)."""
        self.client = client
        self.pieces = list(pieces)
        self.param_meta = {
            n: {"shape": list(p.shape), "dtype": dtype_name(p.dtype)} for n, p in params.items()
        }
        self.make_client = make_client
        self.max_to_keep = max_to_keep
        self.timeout = timeout
        self.last_saved_step: int | None = None
        self.last_pause: float = 0.0
        """Seconds the last save request took the caller (the ps snapshots, then replies)."""
        self.last_snapshot_seconds: float = 0.0
        """The longest time a ps paused serving to copy its shard for the last save."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._skipping = False
        self._busy_until = 0.0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, *, wait: bool = True, final: bool = False) -> str | None:
        """Saves the ps state as ``ckpt-<n>``, ``n`` the global step it holds (``step``, the
        caller's, unless other workers' updates came between); returns its name (``None`` if
        skipped).

        With ``wait=False`` only the snapshot happens now; the rest runs in the background
        and a failure is raised by the next call (or :meth:`wait`). ``final`` marks the
        manifest as the job's last checkpoint (an existing ``ckpt-<step>`` gets the mark).

        A ps may still write a checkpoint asked for before this chief restarted: then a save
        without ``wait`` is skipped, and one with it asks again until the ps has written it
        (``TimeoutError`` past ``timeout``).
        """
        self.wait(raise_error=True) if wait else self._raise_pending()
        deadline = time.monotonic() + self.timeout
        while True:
            if self.busy:
                self._skip(step, "the previous one is still being written")
                return None
            if not wait and time.monotonic() < self._busy_until:
                return None  # a ps said it still writes an earlier one: not asked every step
            try:
                return self._start(step, wait=wait, final=final)
            except PeerError as e:
                # A ps still writes the checkpoint a chief asked for before it restarted.
                if e.code != Code.BUSY:
                    self._skipping = False  # a skip after this failure is news again
                    raise
                if not wait:
                    self._busy_until = time.monotonic() + _BUSY_RETRY_SECONDS
                    self._skip(step, str(e))
                    return None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"checkpoint at step {step}: {e}, still after {self.timeout:g} s"
                    ) from e
                time.sleep(_POLL_SECONDS)

    def _skip(self, step: int, why: str) -> None:
        if not self._skipping:  # one line for the steps that find the same save in the way
            log.info("checkpoint at step %d skipped (and the next, until written): %s", step, why)
        self._skipping = True

    def _start(self, step: int, *, wait: bool, final: bool) -> str:
        name = f"ckpt-{step}"
        if any(c.name == name and c.complete for c in self.dir.checkpoints()):
            if final:
                self.dir.mark_final(name)
            return name
        start = time.perf_counter()
        # The chief's buffers as they are when the ps snapshot (copied: training goes on).
        buffers = None if self.buffers is None else self.buffers()
        # Shard 0 first, naming the directory by the global step its snapshot holds; the others
        # then write into that one.
        replies = self.client.save({0: self.dir.url_of(name)}, by_step=True)
        self._skipping = False
        held = f"ckpt-{int(replies[0][Key.SNAPSHOT_STEP])}"
        if held != name:
            name = held
            if any(c.name == name and c.complete for c in self.dir.checkpoints()):
                # Shard 0 writes the same state into it again: waited for, so that the next
                # save does not find it still writing; the other shards' files hold.
                self._await_shards(self.client, self.dir.url_of(name), shards=[0])
                return name
        url = self.dir.url_of(name)
        others = {s: url for s in range(1, self.client.num_shards)}
        if others:
            try:
                replies |= self.client.save(others)
            except PeerError as e:
                if e.code == Code.BUSY:
                    log.warning("checkpoint %s abandoned, shard 0's file unnamed: %s", name, e)
                raise
        self.last_pause = time.perf_counter() - start
        self.last_snapshot_seconds = max(
            float(h.get(Key.SNAPSHOT_SECONDS, 0)) for h in replies.values()
        )
        self._thread = threading.Thread(
            target=self._finish,
            args=(name, url, replies, final, start, buffers),
            name="psflow-ckpt",
            daemon=True,
        )
        self._thread.start()
        if wait:
            self.wait(raise_error=True)
        return name

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"saving a checkpoint failed: {error}") from error

    def wait(self, timeout: float | None = None, *, raise_error: bool = True) -> None:
        """Waits for the save in progress; raises its error (or, without ``raise_error``,
        forgets it: it was logged when it happened)."""
        if self._thread is not None:
            self._thread.join(self.timeout if timeout is None else timeout)
        if raise_error:
            self._raise_pending()
        else:
            self._error = None

    def _finish(
        self,
        name: str,
        url: str,
        replies: dict[int, dict[str, Any]],
        final: bool,
        start: float,
        buffers: dict[str, torch.Tensor] | None,
    ) -> None:
        try:
            client = self.make_client()
            try:
                self._await_shards(client, url)
            finally:
                client.close()
            manifest = self._manifest(replies)
            if buffers is not None:
                # Before the manifest that names it: a checkpoint is complete with its buffers.
                if buffers:
                    write_buffers(self.dir.url_of(f"{name}/{BUFFERS_FILE}"), buffers)
                    manifest.buffers_file = BUFFERS_FILE
                manifest.buffers = buffer_meta(buffers)
            manifest.final = final
            self.dir.publish(name, manifest)
            self.last_saved_step = manifest.global_step
            if self.metrics is not None:
                self.metrics.checkpoint_seconds.observe(time.perf_counter() - start)
                self.metrics.checkpoint_step.set(manifest.global_step)
                self.metrics.checkpoint_time.set(time.time())
            removed = self.dir.prune(self.max_to_keep, incomplete_below=manifest.global_step)
            log.info(
                "saved checkpoint %s (global step %d)%s",
                self.dir.url_of(name),
                manifest.global_step,
                f"; removed {', '.join(removed)}" if removed else "",
            )
        except BaseException as e:
            log.error("checkpoint %s failed: %s", name, e)
            self._error = e

    def _await_shards(
        self, client: ShardSaver, url: str, shards: Sequence[int] | None = None
    ) -> None:
        deadline = time.monotonic() + self.timeout
        pending = set(range(client.num_shards) if shards is None else shards)
        while pending:
            statuses = client.save_status({s: url for s in pending})
            for s, h in statuses.items():
                state = h.get(Key.STATE)
                if state == SaveState.DONE:
                    pending.discard(s)
                elif state == SaveState.ERROR:
                    raise RuntimeError(
                        f"ps:{s} could not write its shard of {url}: {h.get(Key.ERROR)}"
                    )
                elif state != SaveState.WRITING:
                    raise RuntimeError(f"ps:{s} knows of no save into {url} (restarted?)")
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"ps:{s}" for s in sorted(pending))
                raise TimeoutError(
                    f"{names} did not finish writing {url} within {self.timeout:g} s"
                )
            if pending:
                time.sleep(_POLL_SECONDS)

    def _manifest(self, replies: dict[int, dict[str, Any]]) -> Manifest:
        n = self.client.num_shards
        variables = []
        for p in self.pieces:
            held = replies[p.shard].get(Key.VARIABLES, {}).get(p.var)
            if held is None:
                raise RuntimeError(f"ps:{p.shard} does not hold {p.var!r}: placement mismatch")
            variables.append(
                VariableEntry(
                    var=p.var,
                    param=p.param,
                    shard=p.shard,
                    file=f"shard-{p.shard}-of-{n}.safetensors",
                    shape=list(held[1]),
                    dtype=str(held[0]),
                    rows=list(p.rows) if p.rows else None,
                )
            )
        tables: dict[str, dict[str, Any]] = {}
        for s in range(n):
            for name, held in (replies[s].get(Key.TABLES) or {}).items():
                entry = tables.setdefault(name, {"spec": held["spec"], "rows": 0, "bytes": 0})
                entry["rows"] += int(held["rows"])
                entry["bytes"] += int(held["bytes"])
        return Manifest(
            global_step=int(replies[0][Key.SNAPSHOT_STEP]),
            tables=tables,
            num_shards=n,
            optimizer=dict(replies[0].get(Key.OPTIMIZER) or {}),
            lr_schedule=replies[0].get(Key.LR_SCHEDULE),
            variables=variables,
            params=self.param_meta,
            shard_steps=[int(replies[s][Key.SNAPSHOT_STEP]) for s in range(n)],
            created=time.time(),
        )
