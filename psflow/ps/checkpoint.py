"""One ps shard's checkpoint file: a safetensors file of its variables and optimizer state.

The format, shared with :mod:`psflow.train` (which reads the files back and writes the
manifest):

- ``<var>``: each variable under its placement name (``fc.weight``, ``emb/part_0``);
- ``<var>/opt/<key>``: each tensor of the optimizer state of that variable (``exp_avg``,
  ``momentum_buffer``, Adam's ``step``);
- ``@table/<name>/ids``, ``.../values``, ``.../opt/<key>``: the shard's rows of each embedding
  table (their global ids, values and row-wise optimizer state, taken at one moment);
- metadata (string to string, JSON values): the shard index and count, the shard's step, the
  optimizer spec, the optimizer's non-tensor state per variable and its ``param_groups`` (the
  learning rate at that step among them), and the learning-rate schedule's spec when there is
  one. A schedule is a function of the global step: the step is all the state it has.

Saving happens in two parts, so that serving pauses only for an in-memory copy: the serving
thread takes a :class:`ShardSnapshot` between two requests, and a background thread writes it
(temporary name, fsync, rename). Nothing is pickled, ever: safetensors holds only raw tensors.
:class:`ShardCheckpointer` does both; :class:`CheckpointService` serves it as the ``save`` and
``save_status`` ops.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fsspec.core import split_protocol
from safetensors.torch import save as st_save

from psflow.env import PSFLOW_CHECKPOINT_DIR
from psflow.metrics import PsMetrics
from psflow.protocol import Key, Op, OptimizerSpec, SaveState
from psflow.protocol.messages import OPT_SEP, optimizer_state_tensor_name
from psflow.ps import safefile
from psflow.ps.files import atomic_write, join, url_to_fs  # psflow.train imports them from here
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.store import ShardStore
from psflow.ps.tables import TABLE_PREFIX, begin_table_snapshots, finish_table_snapshots
from psflow.sparse.rows import RowSnapshot
from psflow.transport import Request, wire

log = logging.getLogger(__name__)

CKPT_DIR_RE = re.compile(r"^ckpt-(\d+)$")
"""A checkpoint directory's name: ``ckpt-<global step>``."""


def shard_file_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard}-of-{num_shards}.safetensors"


# -- optimizer state ------------------------------------------------------------------------


def flatten_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Splits ``optimizer.state_dict()`` into tensors keyed ``<var>/opt/<key>`` and plain data.

    ``names`` are the variables in the order they were given to the optimizer. Returns the
    tensors (not copied), the non-tensor state per variable, and the ``param_groups`` without
    their parameter indices.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        var = names[index]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[optimizer_state_tensor_name(var, key)] = value
            else:
                plain.setdefault(var, {})[key] = _json_value(value, f"{var}/{key}")
    groups = [
        {k: _json_value(v, k) for k, v in g.items() if k != "params"} for g in sd["param_groups"]
    ]
    return tensors, plain, groups


def _json_value(value: Any, what: str) -> Any:
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except TypeError:
        raise ValueError(f"optimizer state {what!r} is not plain data: {value!r}") from None
    return value


def split_opt_key(name: str) -> tuple[str, str] | None:
    """``("fc.weight", "exp_avg")`` for ``"fc.weight/opt/exp_avg"``, ``None`` for a variable."""
    var, sep, key = name.rpartition(OPT_SEP)
    return (var, key) if sep and var and key else None


def load_optimizer_state(
    store: ShardStore,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    plain: Mapping[str, Mapping[str, Any]],
) -> None:
    """Loads per-variable optimizer state into an initialised shard.

    The hyperparameters stay those of the shard's current :class:`OptimizerSpec` (the running
    script's, as in TensorFlow where they are part of the graph); only the state is restored.

    Raises:
        ValueError: naming a variable the shard does not hold, or a state tensor whose shape
            matches neither the variable nor a scalar.
    """
    assert store.optimizer is not None and store.optimizer_spec is not None
    spec = store.optimizer_spec
    names = list(store.variables)
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    given = sorted(set(tensors) | set(plain))
    unknown = [var for var in given if var not in index]
    if unknown:
        raise ValueError(f"optimizer state for unknown variable {unknown[0]!r}")
    # Refused now, by name, rather than failing every push for want of the key.
    lacking = spec.lacking(
        (var, store.variables[var].dtype, {*tensors.get(var, {}), *plain.get(var, {})})
        for var in given
    )
    if lacking is not None:
        raise ValueError(f"optimizer state: {lacking}")
    for var in given:
        entry: dict[str, Any] = dict(plain.get(var, {}))
        for key, t in tensors.get(var, {}).items():
            shape = store.variables[var].shape
            if t.dim() != 0 and t.shape != shape:
                raise ValueError(
                    f"optimizer state {var!r}/{key!r} has shape {list(t.shape)}, "
                    f"the variable {list(shape)}"
                )
            entry[key] = t.detach().clone()
        state[index[var]] = entry
    sd = store.optimizer.state_dict()
    store.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def split_init_tensors(
    header: Mapping[str, Any], tensors: list[tuple[str, torch.Tensor]]
) -> tuple[
    list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]], dict[str, dict[str, Any]]
]:
    """Splits an ``init`` request into variables and optimizer state (``opt_state`` header).

    An ``init`` without ``opt_state`` (the original form) has only variables.
    """
    opt_plain = header.get(Key.OPT_STATE)
    if opt_plain is None:
        return tensors, {}, {}
    if not isinstance(opt_plain, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in opt_plain.items()
    ):
        raise ValueError("'opt_state' must map variable names to maps")
    variables: list[tuple[str, torch.Tensor]] = []
    opt: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        split = split_opt_key(name)
        if split is None:
            variables.append((name, t))
        else:
            opt.setdefault(split[0], {})[split[1]] = t
    return variables, opt, opt_plain


# -- snapshots and the background writer ------------------------------------------------------


@dataclass(kw_only=True)
class ShardSnapshot:
    """An in-memory copy of one shard, taken between two requests."""

    shard: int
    num_shards: int
    step: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    tables: dict[str, RowSnapshot] = field(default_factory=dict)
    """The embedding tables, completed by the writer (:func:`finish_table_snapshots`)."""
    seconds: float = 0.0
    """How long taking the copy paused serving."""


def snapshot(store: ShardStore, *, shard: int, num_shards: int) -> ShardSnapshot:
    """Copies the shard's variables and optimizer state (the only part that pauses serving)."""
    assert store.optimizer is not None and store.optimizer_spec is not None
    start = time.perf_counter()
    store.learning_rate()  # with a schedule: the learning rate saved is the step's
    opt_tensors, plain, groups = flatten_optimizer_state(store.optimizer, list(store.variables))
    tensors = {n: t.detach().clone() for n, t in store.variables.items()}
    tensors.update({n: t.detach().clone() for n, t in opt_tensors.items()})
    tables = begin_table_snapshots(store.tables)
    metadata = {
        "psflow.format": "1",
        "psflow.shard": str(shard),
        "psflow.num_shards": str(num_shards),
        "psflow.step": str(store.step),
        "psflow.optimizer": json.dumps(store.optimizer_spec.to_wire()),
        "psflow.opt_state": json.dumps(plain),
        "psflow.param_groups": json.dumps(groups),
    }
    if store.schedule is not None:
        metadata["psflow.lr_schedule"] = json.dumps(store.schedule.spec.to_wire())
    if store.tables:
        metadata["psflow.tables"] = json.dumps(
            {n: t.spec.to_wire() for n, t in store.tables.items()}
        )
    return ShardSnapshot(
        shard=shard,
        num_shards=num_shards,
        step=store.step,
        tensors=tensors,
        metadata=metadata,
        tables=tables,
        seconds=time.perf_counter() - start,
    )


@dataclass(kw_only=True)
class ShardFile:
    """A shard file read back: its tensors and decoded metadata."""

    tensors: dict[str, torch.Tensor]
    shard: int
    num_shards: int
    step: int
    optimizer: OptimizerSpec
    opt_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    lr_schedule: dict[str, Any] | None = None
    """The schedule the shard followed, as data (``ScheduleSpec.from_wire`` reads it; its
    learning rate at :attr:`step` is in :attr:`param_groups`). Kept as data: a schedule this
    torch no longer has does not make the file unreadable."""

    def variables(self) -> dict[str, torch.Tensor]:
        return {
            n: t
            for n, t in self.tensors.items()
            if split_opt_key(n) is None and not n.startswith(TABLE_PREFIX)
        }

    def optimizer_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for n, t in self.tensors.items():
            split = split_opt_key(n)
            if split is not None and not n.startswith(TABLE_PREFIX):
                out.setdefault(split[0], {})[split[1]] = t
        return out


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""safetensors' names of the dtypes a shard file may hold."""


def safetensors_chunks(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> list[bytes | memoryview]:
    """A safetensors file as pieces to write one after the other: its header, then each
    tensor's own memory (no copy of the whole file in memory, which for a shard of a large
    table would double what the ps holds). ``safetensors.torch.load`` reads the result back.
    """
    # safetensors' own order: larger dtypes first, then by name.
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {}
    views: list[bytes | memoryview] = []
    offset = 0
    for name, t in items:
        t = t.detach().contiguous()
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
        if size:
            views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # type: ignore[arg-type]
    header["__metadata__"] = dict(metadata)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [len(raw).to_bytes(8, "little"), raw, *views]


def encode_shard(snap: ShardSnapshot) -> bytes:
    return st_save({n: t.contiguous() for n, t in snap.tensors.items()}, metadata=snap.metadata)


def read_shard(url: str) -> ShardFile:
    """Reads one shard file (safetensors only: nothing in it can run code).

    Raises:
        ValueError: naming the file (and the byte offset where one applies) when it is not a
            psflow shard: truncated, corrupt, or with a header length past its end (refused
            before the rest of the file is read).
    """
    return decode_shard(safefile.read_bytes(url), url)


def decode_shard(data: bytes, source: str) -> ShardFile:
    """A shard file's bytes (from a file, or broadcast from the chief) decoded; ``source``
    names them in errors.

    Raises:
        ValueError: naming ``source`` when the bytes are not a psflow shard.
    """
    tensors, meta = safefile.decode(data, source)
    try:
        shard_file = ShardFile(
            tensors=tensors,
            shard=int(meta["psflow.shard"]),
            num_shards=int(meta["psflow.num_shards"]),
            step=int(meta["psflow.step"]),
            optimizer=OptimizerSpec.from_wire(json.loads(meta["psflow.optimizer"])),
            opt_state=json.loads(meta.get("psflow.opt_state", "{}")),
            param_groups=json.loads(meta.get("psflow.param_groups", "[]")),
            lr_schedule=json.loads(meta.get("psflow.lr_schedule", "null")),
        )
    except KeyError as e:
        raise ValueError(f"{source} is not a readable psflow shard file: no metadata {e}") from None
    except Exception as e:  # bad numbers, JSON, optimizer specs: all the file's fault
        raise ValueError(
            f"{source} is not a readable psflow shard file: bad metadata: {type(e).__name__}: {e}"
        ) from None
    _check_shard_metadata(shard_file, source)
    return shard_file


def _check_shard_metadata(f: ShardFile, source: str) -> None:
    problem = None
    if not 0 <= f.shard < f.num_shards:
        problem = f"shard {f.shard} of {f.num_shards}"
    elif f.step < 0:
        problem = f"step {f.step}"
    elif not isinstance(f.opt_state, dict) or not all(
        isinstance(v, dict) for v in f.opt_state.values()
    ):
        problem = "psflow.opt_state is not a map of maps"
    elif not isinstance(f.param_groups, list) or not all(
        isinstance(g, dict) for g in f.param_groups
    ):
        problem = "psflow.param_groups is not a list of maps"
    elif f.lr_schedule is not None and not isinstance(f.lr_schedule, dict):
        problem = "psflow.lr_schedule is not a map"
    if problem is not None:
        raise ValueError(f"{source} is not a readable psflow shard file: bad metadata: {problem}")


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
        """Handles a ``save`` request: ``{"dir": URL of ckpt-<n>}``; returns the reply header."""
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
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                raise ValueError("a checkpoint of this shard is still being written")
        snap = snapshot(self.store, shard=self.shard, num_shards=self.num_shards)
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


def _normal(url: str) -> tuple[str, str] | None:
    """``(scheme, absolute normalised path)`` of a local path or fsspec URL; ``None`` when a
    component is ``..`` (refused, not resolved)."""
    scheme, path = split_protocol(url)
    if ".." in path.split("/"):
        return None
    if scheme in (None, "file", "local"):
        return "file", os.path.abspath(path)
    return scheme, posixpath.normpath("/" + path.lstrip("/"))


def is_checkpoint_of(root: str, url: str) -> bool:
    """Whether ``url`` is a ``ckpt-<step>`` directory right under ``root`` (same scheme, same
    normalised path; no ``..`` anywhere in ``url``)."""
    want, got = _normal(root), _normal(url)
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
