"""Sharded checkpoints from the chief's side: save through the ps, restore, export.

Saving (:class:`Checkpointer`): the chief asks every ps to snapshot its shard (the pause) and
goes on training; a background thread waits for every shard file, then publishes the manifest
and the ``latest`` pointer (:class:`~psflow.train.manifest.CheckpointDir`) and prunes. In
all-reduce mode the one "ps" is the chief's own model (:class:`~psflow.train.local_shard.LocalShard`).

Restoring (:func:`load_checkpoint`, :meth:`Checkpoint.place`): the shard files are read back,
partitions are concatenated into whole parameters (optimizer state tensors of the parameter's
shape with them; scalars such as Adam's ``step`` copied), and the result is re-placed for the
current number of ps tasks, which need not be the number that saved it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from safetensors.torch import save as st_save

from psflow.metrics import WorkerMetrics
from psflow.protocol import Key, OptimizerSpec, SaveState, ScheduleSpec, TableSpec
from psflow.ps.checkpoint import (
    ShardFile,
    atomic_write,
    read_shard,
    url_to_fs,
)
from psflow.ps.tables import read_table_tensors
from psflow.train.manifest import CheckpointDir, Manifest, VariableEntry
from psflow.transport.wire import dtype_name
from psflow.worker.client import Tensors
from psflow.worker.opt_state import place_optimizer_state
from psflow.worker.placement import Piece

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.02


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


@dataclass(kw_only=True)
class Checkpoint:
    """A checkpoint reassembled into whole parameters, independent of any placement."""

    name: str
    manifest: Manifest
    params: dict[str, torch.Tensor]
    opt_tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    opt_plain: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def global_step(self) -> int:
        return self.manifest.global_step

    @property
    def optimizer(self) -> OptimizerSpec:
        return OptimizerSpec.from_wire(self.manifest.optimizer)

    @property
    def lr_schedule(self) -> ScheduleSpec | None:
        """The learning-rate schedule the job trained with (``None``: none).

        Raises:
            ValueError: when this torch cannot run it (``manifest.lr_schedule`` is the data).
        """
        wired = self.manifest.lr_schedule
        return None if wired is None else ScheduleSpec.from_wire(wired)

    def check_model(self, params: dict[str, torch.Tensor]) -> None:
        """Raises ``ValueError`` naming the first parameter that differs from the checkpoint."""
        missing = sorted(set(params) - set(self.params))
        extra = sorted(set(self.params) - set(params))
        if missing or extra:
            raise ValueError(
                f"checkpoint {self.name} does not match the model: missing {missing}, "
                f"not in the model {extra}"
            )
        for name, p in params.items():
            t = self.params[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise ValueError(
                    f"checkpoint {self.name}: {name!r} is {dtype_name(t.dtype)}{list(t.shape)}, "
                    f"the model has {dtype_name(p.dtype)}{list(p.shape)}"
                )

    def optimizer_state_refused(self, spec: OptimizerSpec) -> str | None:
        """Why the optimizer state saved here cannot go to ``spec``'s optimizer (``None`` when
        it can): another optimizer, or state without a key that ``spec`` keeps (saved by
        ``Adam``, restored into ``Adam(amsgrad=True)``, whose every step would fail on the ps
        for want of ``max_exp_avg_sq``). Keys ``spec`` does not keep are harmless: dropped."""
        if self.optimizer.name != spec.name:
            return f"it was saved with {self.optimizer.name}, the job uses {spec.name}"
        return spec.lacking(
            (
                var,
                self.params[var].dtype if var in self.params else torch.float32,
                {*self.opt_tensors.get(var, {}), *self.opt_plain.get(var, {})},
            )
            for var in sorted(set(self.opt_tensors) | set(self.opt_plain))
        )

    def place(
        self, pieces: Sequence[Piece]
    ) -> tuple[dict[int, Tensors], dict[int, dict[str, dict[str, Any]]]]:
        """Each shard's variables and optimizer-state tensors, and its non-tensor state."""
        values: dict[int, Tensors] = {}
        for p in pieces:
            values.setdefault(p.shard, []).append((p.var, _rows(self.params[p.param], p.rows)))
        state, plain = place_optimizer_state(pieces, self.opt_tensors, self.opt_plain)
        for shard, tensors in state.items():
            values.setdefault(shard, []).extend(tensors)
        return values, plain


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0] : rows[1]].contiguous()


def load_checkpoint(checkpoint_dir: str, name: str | None = None) -> Checkpoint | None:
    """Reads a checkpoint (the latest complete one by default); ``None`` when there is none.

    Example:
        >>> load_checkpoint("memory://nothing-here") is None
        True
    """
    d = CheckpointDir(checkpoint_dir)
    name = name or d.latest()
    if name is None:
        return None
    manifest = d.manifest(name)
    files: dict[str, ShardFile] = {}
    for entry in manifest.variables:
        if entry.file not in files:
            url = d.url_of(f"{name}/{entry.file}")
            try:
                files[entry.file] = read_shard(url)
            except FileNotFoundError:
                raise ValueError(f"{url}, named in {name}'s manifest, does not exist") from None
    by_param: dict[str, list[VariableEntry]] = {}
    for entry in manifest.variables:
        by_param.setdefault(entry.param, []).append(entry)
    params: dict[str, torch.Tensor] = {}
    opt_tensors: dict[str, dict[str, torch.Tensor]] = {}
    opt_plain: dict[str, dict[str, Any]] = {}
    for param, entries in by_param.items():
        entries.sort(key=lambda e: e.rows[0] if e.rows else 0)
        parts, states = [], []
        for e in entries:
            shard = files[e.file]
            value = shard.tensors.get(e.var)
            if value is None:
                raise ValueError(f"{name}/{e.file} lacks variable {e.var!r} named in the manifest")
            if list(value.shape) != list(e.shape):
                raise ValueError(
                    f"{name}/{e.file}: {e.var!r} has shape {list(value.shape)}, "
                    f"the manifest says {e.shape}"
                )
            parts.append(value)
            states.append(shard.optimizer_tensors().get(e.var, {}))
            if e.var in shard.opt_state:
                opt_plain.setdefault(param, shard.opt_state[e.var])
        where = f"{name}/{','.join(sorted({e.file for e in entries}))}"
        params[param] = _join(parts, where, repr(param))
        keys = set().union(*states)
        for key in sorted(keys):
            ts = [s[key] for s in states if key in s]
            if len(ts) != len(parts):
                raise ValueError(f"{where}: optimizer state {key!r} missing for part of {param!r}")
            joined = ts[0] if len(ts) == 1 or ts[0].dim() == 0 else _join(ts, where, key)
            opt_tensors.setdefault(param, {})[key] = joined
        expected = manifest.params.get(param, {}).get("shape")
        if expected is not None and list(params[param].shape) != list(expected):
            raise ValueError(
                f"{name}: {param!r} reassembles to {list(params[param].shape)}, "
                f"the manifest says {expected}"
            )
    return Checkpoint(
        name=name, manifest=manifest, params=params, opt_tensors=opt_tensors, opt_plain=opt_plain
    )


def _join(parts: list[torch.Tensor], where: str, what: str) -> torch.Tensor:
    """Row-partitioned parts concatenated; parts that do not fit together are the files' fault."""
    if len(parts) == 1:
        return parts[0]
    try:
        return torch.cat(parts)
    except RuntimeError as e:
        raise ValueError(f"{where}: the parts of {what} do not fit together: {e}") from None


def export_state_dict(checkpoint_dir: str, out: str, name: str | None = None) -> Checkpoint:
    """Writes the checkpoint's parameters as a plain safetensors state dict.

    ``model.load_state_dict(safetensors.torch.load_file(out))`` loads it with no cluster
    (use ``strict=False`` for a model with buffers: the ps holds parameters only). Each
    fixed-size embedding table is written whole as ``<table>.weight``, the name a
    ``torch.nn.Embedding`` (or ``psflow.nn.Embedding``) at that path loads; each hashed table
    as ``<table>.ids`` and ``<table>.rows`` (its rows in id order), which a hashed
    ``psflow.nn`` table at that path loads (optimizer state is not written, as for the
    fixed ones).
    """
    ckpt = load_checkpoint(checkpoint_dir, name)
    if ckpt is None:
        raise ValueError(f"no complete checkpoint in {checkpoint_dir}")
    tensors = {n: t.contiguous() for n, t in ckpt.params.items()}
    if ckpt.manifest.tables:
        saved = table_tensors(checkpoint_dir, ckpt)
        tensors.update(fixed_tables(checkpoint_dir, ckpt, saved))
        tensors.update(hashed_tables(ckpt, saved))
    data = st_save(tensors, metadata={"global_step": str(ckpt.global_step), "source": ckpt.name})
    fs, path = url_to_fs(out)
    atomic_write(fs, path, data)
    return ckpt


def fixed_tables(
    checkpoint_dir: str,
    ckpt: Checkpoint,
    saved: dict[str, list[dict[str, torch.Tensor]]] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's fixed-size embedding tables, each assembled whole from its shards'
    rows, as ``<table>.weight`` (from ``saved``, :func:`table_tensors`, when given)."""
    specs = _table_specs(ckpt, hashed=False)
    if not specs:
        return {}
    if saved is None:
        saved = table_tensors(checkpoint_dir, ckpt)
    out = {}
    for table, spec in specs.items():
        assert spec.num_embeddings is not None
        weight = torch.zeros(
            (spec.num_embeddings, spec.embedding_dim), dtype=getattr(torch, spec.dtype)
        )
        for part in saved.get(table, []):
            weight[part["ids"]] = part["values"]
        out[f"{table}.weight"] = weight
    return out


def hashed_tables(
    ckpt: Checkpoint, saved: dict[str, list[dict[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """The checkpoint's hashed tables (from ``saved``, :func:`table_tensors`), each as
    ``<table>.ids`` and ``<table>.rows``, its shards' rows together in id order."""
    out = {}
    for table, spec in _table_specs(ckpt, hashed=True).items():
        parts = saved.get(table, [])
        where = f"{ckpt.name}: table {table!r}"
        if parts:
            ids = _join([p["ids"] for p in parts], where, "ids")
            rows = _join([p["values"] for p in parts], where, "rows")
        else:
            ids = torch.empty(0, dtype=torch.int64)
            rows = torch.empty(0, spec.embedding_dim, dtype=getattr(torch, spec.dtype))
        order = torch.argsort(ids)
        out[f"{table}.ids"] = ids[order]
        out[f"{table}.rows"] = rows[order]
    return out


def _table_specs(ckpt: Checkpoint, *, hashed: bool) -> dict[str, TableSpec]:
    """The checkpoint's hashed tables' specs, or its fixed-size ones', by name."""
    specs = {n: TableSpec.from_wire(t["spec"]) for n, t in ckpt.manifest.tables.items()}
    return {n: spec for n, spec in specs.items() if (spec.num_embeddings is None) == hashed}


def table_tensors(
    checkpoint_dir: str, ckpt: Checkpoint
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Every embedding table's rows in ``ckpt``'s shard files: per table, one map (``ids``,
    ``values``, ``opt/<key>``) per shard file that holds part of it."""
    urls = CheckpointDir(checkpoint_dir).shard_urls(ckpt.name, ckpt.manifest.num_shards)
    return read_table_tensors(urls)


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
    ) -> None:
        self.dir = CheckpointDir(checkpoint_dir)
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
        """
        self.wait(raise_error=True) if wait else self._raise_pending()
        if self.busy:
            log.info("checkpoint at step %d skipped: the previous one is still being written", step)
            return None
        name = f"ckpt-{step}"
        if any(c.name == name and c.complete for c in self.dir.checkpoints()):
            if final:
                self.dir.mark_final(name)
            return name
        start = time.perf_counter()
        # Shard 0 first, naming the directory by the global step its snapshot holds; the others
        # then write into that one.
        replies = self.client.save({0: self.dir.url_of(name)}, by_step=True)
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
            replies |= self.client.save(others)
        self.last_pause = time.perf_counter() - start
        self.last_snapshot_seconds = max(
            float(h.get(Key.SNAPSHOT_SECONDS, 0)) for h in replies.values()
        )
        self._thread = threading.Thread(
            target=self._finish,
            args=(name, url, replies, final, start),
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
        self, name: str, url: str, replies: dict[int, dict[str, Any]], final: bool, start: float
    ) -> None:
        try:
            client = self.make_client()
            try:
                self._await_shards(client, url)
            finally:
                client.close()
            manifest = self._manifest(replies)
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
