"""The checkpoint directory: manifests, the ``latest`` pointer, retention.

Layout of a checkpoint directory (a local path or any fsspec URL)::

    <dir>/latest                          "ckpt-<step>": the newest complete checkpoint
    <dir>/ckpt-<step>/shard-<i>-of-<n>.safetensors   one per ps task, written by that task
    <dir>/ckpt-<step>/buffers.safetensors the chief's model's buffers (BatchNorm's statistics)
    <dir>/ckpt-<step>/manifest.json       written by the chief once every shard is on disk

A checkpoint is complete when its manifest exists; the manifest is written after every shard
file (and the buffers file) and the pointer after the manifest, each by an atomic replace, so a
task killed at any moment leaves ``latest`` naming a complete checkpoint. Incomplete
directories are ignored by readers and removed by the chief.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from psflow.ps import safefile
from psflow.ps.checkpoint import CKPT_DIR_RE, atomic_write, join, url_to_fs
from psflow.ps.shard_file import shard_file_name

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
BUFFERS_FILE = "buffers.safetensors"
"""The chief's model's persistent buffers (``state_dict()`` less parameters and tables), in
the checkpoint's directory beside the shard files."""
LATEST = "latest"
FORMAT = 1
_POINTER_BYTES = 256  # the most of ``latest`` read: it holds one name
_SHARD_FILE_RE = re.compile(r"^shard-(\d+)-of-(\d+)\.safetensors$")


def psflow_version() -> str:
    try:
        from importlib.metadata import version

        return version("psflow")
    except Exception:
        return "unknown"


@dataclass(kw_only=True)
class VariableEntry:
    """One variable as a ps held it: a parameter or a row range of one, in one shard file."""

    var: str
    param: str
    shard: int
    file: str
    shape: list[int]
    dtype: str
    rows: list[int] | None = None


@dataclass(kw_only=True)
class Manifest:
    """What a checkpoint holds, written last (its presence makes the checkpoint complete)."""

    global_step: int
    num_shards: int
    optimizer: dict[str, Any]
    variables: list[VariableEntry]
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every model parameter: ``{"shape": [...], "dtype": "float32"}``."""
    shard_steps: list[int] = field(default_factory=list)
    lr_schedule: dict[str, Any] | None = None
    """The learning-rate schedule as data (``{"name": "StepLR", "kwargs": {...}}``), or
    ``None``; a function of ``global_step``, it needs no other state."""
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every embedding table: ``{"spec": TableSpec as data, "rows": rows held, "bytes": the
    ps's memory for it when saved (its tensors at their capacity, id map and admission sketch
    included), not the bytes saved}``; each shard file holds its rows (``@table/<name>/...``)."""
    buffers: dict[str, dict[str, Any]] | None = None
    """The chief's model's persistent buffers (a BatchNorm's ``running_mean``, ``running_var``,
    ``num_batches_tracked``: its ``state_dict()`` less the parameters and the tables), each
    ``{"shape": [...], "dtype": "float32"}``, held by :attr:`buffers_file`. ``{}``: the model
    has none; ``None``: not recorded (manifests written before the field: the model's buffers
    are left as they are)."""
    buffers_file: str | None = None
    """The file of the checkpoint's directory that holds :attr:`buffers`
    (:data:`BUFFERS_FILE`), ``None`` when there are none."""
    final: bool = False
    """Whether this is the job's last checkpoint: the one the chief saves when training ends
    normally (not on SIGTERM, which a cluster manager may follow with a restart). An evaluator
    stops after it. Manifests written before this field read as ``False``."""
    psflow_version: str = field(default_factory=psflow_version)
    format: int = FORMAT
    created: float = 0.0

    def __post_init__(self) -> None:
        if self.global_step < 0:
            raise ValueError(f"global_step must be >= 0, got {self.global_step}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, source: str = MANIFEST) -> Manifest:
        """A manifest from its JSON, every field's type checked (a manifest read from a file
        is not trusted: its entries name the files read next).

        Raises:
            ValueError: naming ``source`` (and the byte offset of a JSON error).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{source}: malformed manifest: bad JSON at byte offset {_byte_offset(text, e.pos)}: "
                f"{e.msg}"
            ) from None
        except (UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{source}: malformed manifest: {type(e).__name__}: {e}") from None
        try:
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            if data.get("format") != FORMAT:
                raise ValueError(f"unsupported manifest format {data.get('format')!r}")
            variables = data["variables"]
            if not isinstance(variables, list) or not all(isinstance(v, dict) for v in variables):
                raise TypeError("'variables' is not a list of objects")
            data["variables"] = [VariableEntry(**v) for v in variables]
            manifest = cls(**data)
            manifest._check_types()
            return manifest
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: malformed manifest: {type(e).__name__}: {e}") from None

    def _check_types(self) -> None:
        def ints(x: Any) -> bool:
            return isinstance(x, list) and all(_is_int(i) and i >= 0 for i in x)

        for name in ("global_step", "num_shards"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} is not an integer")
        for name in ("optimizer", "params", "tables"):
            if not isinstance(getattr(self, name), dict):
                raise TypeError(f"{name} is not an object")
        if not all(isinstance(v, dict) for v in [*self.params.values(), *self.tables.values()]):
            raise TypeError("params and tables must map names to objects")
        if self.buffers is not None and (
            not isinstance(self.buffers, dict)
            or not all(isinstance(v, dict) for v in self.buffers.values())
        ):
            raise TypeError("buffers must map names to objects")
        if self.buffers_file is not None and self.buffers_file != BUFFERS_FILE:
            raise ValueError(f"buffers_file {self.buffers_file!r} is not {BUFFERS_FILE!r}")
        if bool(self.buffers) != (self.buffers_file is not None):
            raise ValueError(
                f"buffers_file is {self.buffers_file!r} for {len(self.buffers or {})} buffers"
            )
        if not isinstance(self.final, bool):
            raise TypeError("final is not true or false")
        if not ints(self.shard_steps):
            raise TypeError("shard_steps is not a list of steps")
        if self.lr_schedule is not None and not isinstance(self.lr_schedule, dict):
            raise TypeError("lr_schedule is not an object")
        for v in self.variables:
            m = _SHARD_FILE_RE.match(v.file) if isinstance(v.file, str) else None
            if not (
                isinstance(v.var, str) and isinstance(v.param, str) and isinstance(v.dtype, str)
            ):
                raise TypeError(f"variable {v.var!r}: var, param and dtype must be strings")
            if m is None or int(m.group(2)) != self.num_shards or int(m.group(1)) != v.shard:
                raise ValueError(
                    f"variable {v.var!r}: file {v.file!r} is not "
                    f"shard-{v.shard}-of-{self.num_shards}.safetensors"
                )
            if not _is_int(v.shard) or not 0 <= v.shard < self.num_shards:
                raise ValueError(f"variable {v.var!r}: shard {v.shard!r} out of range")
            if not ints(v.shape):
                raise TypeError(f"variable {v.var!r}: shape {v.shape!r} is not a list of sizes")
            if v.rows is not None and not (
                ints(v.rows) and len(v.rows) == 2 and v.rows[0] <= v.rows[1]
            ):
                raise ValueError(f"variable {v.var!r}: rows {v.rows!r} are not [begin, end]")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _byte_offset(text: str | bytes, pos: int) -> int:
    """The byte offset of character ``pos`` (``json`` counts characters of the decoded text)."""
    decoded = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    return len(decoded[:pos].encode("utf-8", "replace"))


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    name: str
    step: int
    complete: bool


class CheckpointDir:
    """A directory of checkpoints: list them, find the latest, publish a new one, prune.

    Example:
        >>> d = CheckpointDir("memory://doc-example")
        >>> d.latest() is None
        True
    """

    def __init__(self, url: str) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"checkpoint_dir must be a path or URL, got {url!r}")
        self.url = url.rstrip("/") or "/"
        self.fs, self.path = url_to_fs(self.url)

    def url_of(self, name: str) -> str:
        return join(self.url, name)

    def shard_urls(self, name: str, num_shards: int) -> list[str]:
        """The shard files of checkpoint ``name``, saved by ``num_shards`` ps, in shard order."""
        return [self.url_of(f"{name}/{shard_file_name(i, num_shards)}") for i in range(num_shards)]

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every ``ckpt-<step>`` directory, oldest first."""
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for entry in entries:
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            m = CKPT_DIR_RE.match(name)
            if m:
                complete = self.fs.exists(join(self.path, name, MANIFEST))
                out.append(CheckpointInfo(name=name, step=int(m.group(1)), complete=complete))
        return sorted(out, key=lambda c: c.step)

    def latest(self) -> str | None:
        """The newest complete checkpoint's name: the pointer's, else the newest manifest's."""
        pointer = join(self.path, LATEST)
        try:
            # A FIFO there would block the read (and the chief's save with it): only a file.
            safefile.check_regular(self.url_of(LATEST), self.url)
            raw = self.fs.cat_file(pointer, start=0, end=_POINTER_BYTES)
            name = raw.decode("utf-8", "replace").strip()
        except FileNotFoundError:
            name = ""
        except ValueError as e:
            log.warning("%s: not read; the newest complete checkpoint is the latest", e)
            name = ""
        if CKPT_DIR_RE.match(name) and self.fs.exists(join(self.path, name, MANIFEST)):
            return name
        if name:
            log.warning("%s names %r, which is not a complete checkpoint", pointer, name)
        complete = [c for c in self.checkpoints() if c.complete]
        return complete[-1].name if complete else None

    def manifest(self, name: str) -> Manifest:
        path = join(self.path, name, MANIFEST)
        try:
            safefile.check_regular(self.url_of(f"{name}/{MANIFEST}"), self.url)
            return Manifest.from_json(self.fs.cat_file(path), self.url_of(f"{name}/{MANIFEST}"))
        except FileNotFoundError:
            raise ValueError(
                f"{self.url_of(name)} has no {MANIFEST}: not a complete checkpoint"
            ) from None

    def publish(self, name: str, manifest: Manifest) -> None:
        """Writes the manifest, then points ``latest`` at it (each an atomic replace)."""
        atomic_write(self.fs, join(self.path, name, MANIFEST), manifest.to_json().encode())
        atomic_write(self.fs, join(self.path, LATEST), f"{name}\n".encode())

    def mark_final(self, name: str) -> None:
        """Rewrites ``name``'s manifest (an atomic replace) with ``final`` set: the job's
        training ended at this checkpoint, already saved at the same step."""
        manifest = self.manifest(name)
        if not manifest.final:
            manifest.final = True
            atomic_write(self.fs, join(self.path, name, MANIFEST), manifest.to_json().encode())

    def prune(
        self,
        max_to_keep: int | None,
        *,
        incomplete_below: int | None = None,
        spare: Collection[str] = (),
    ) -> list[str]:
        """Removes complete checkpoints beyond the newest ``max_to_keep`` (never the latest)
        and incomplete ones older than step ``incomplete_below`` (not those named in ``spare``);
        returns the names removed."""
        latest = self.latest()
        items = self.checkpoints()
        complete = [c for c in items if c.complete]
        doomed = []
        if max_to_keep is not None and len(complete) > max_to_keep:
            doomed += [c for c in complete[: len(complete) - max_to_keep] if c.name != latest]
        if incomplete_below is not None:
            doomed += [
                c
                for c in items
                if not c.complete and c.step < incomplete_below and c.name not in spare
            ]
        removed = []
        for c in doomed:
            try:
                self.fs.rm(join(self.path, c.name), recursive=True)
                removed.append(c.name)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not remove %s: %s", self.url_of(c.name), e)
        return removed
