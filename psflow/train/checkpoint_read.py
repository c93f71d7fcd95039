"""A psflow checkpoint read back whole: :func:`load_checkpoint` gives a :class:`Checkpoint`,
its parameters reassembled from their parts and its tables' rows, every part checked by
:mod:`psflow.train.checkpoint_check` first. Every reader of a checkpoint (``psflow checkpoint
inspect|export``, the chief's restore, the evaluator, a cluster of one) reads it here.

Nothing is opened that is not a regular file inside the checkpoint directory (a FIFO, a device,
a directory where a file belongs, or a symlink that leads out of the directory is refused
before it is opened), and nothing is allocated that the files themselves do not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from psflow.protocol import OptimizerSpec, ScheduleSpec, TableSpec
from psflow.ps import safefile
from psflow.ps.files import join
from psflow.ps.positions import InputPositions
from psflow.ps.shard_file import ShardFile, read_shard, shard_file_name
from psflow.ps.tables import TABLE_PREFIX
from psflow.train.checkpoint_buffers import model_buffers
from psflow.train.checkpoint_check import (
    TableCheck,
    TableParts,
    check_buffers,
    check_manifest,
    check_parts,
    check_shard_file,
    check_tables,
)
from psflow.train.manifest import LATEST, MANIFEST, CheckpointDir, Manifest, VariableEntry
from psflow.transport.wire import dtype_name
from psflow.worker.client import Tensors
from psflow.worker.opt_state import place_optimizer_state
from psflow.worker.placement import Piece

__all__ = ["Checkpoint", "load_checkpoint"]


@dataclass(kw_only=True)
class Checkpoint:
    """A checkpoint reassembled into whole parameters, independent of any placement."""

    name: str
    manifest: Manifest
    params: dict[str, torch.Tensor]
    opt_tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    opt_plain: dict[str, dict[str, Any]] = field(default_factory=dict)
    tables: TableParts = field(default_factory=dict)
    """Every embedding table's rows, one map (``ids``, ``values``, ``opt/<key>``) per shard
    file that holds some, checked against the manifest's specs."""
    table_specs: dict[str, TableSpec] = field(default_factory=dict)
    """The manifest's tables' specs, by name."""
    inputs: dict[str, InputPositions] = field(default_factory=dict)
    """The input positions of each shard file read (by file name): those holding variables,
    and every one where there are tables."""
    buffers: dict[str, torch.Tensor] | None = None
    """The chief's model's persistent buffers (:mod:`psflow.train.checkpoint_buffers`), read
    from the buffers file and checked against the manifest; ``None`` for a checkpoint saved
    before they were (its manifest lists none: a model's buffers are then left as they are)."""

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
        self._check_against("the model", "", self.params, params)

    def check_buffers(self, buffers: dict[str, torch.Tensor]) -> None:
        """Raises ``ValueError`` naming the first of the model's ``buffers``
        (:func:`~psflow.train.checkpoint_buffers.model_buffers`) that differs from the
        checkpoint's: missing from one or the other, or of another dtype or shape. A checkpoint
        that records no buffers (saved before they were) matches any model."""
        if self.buffers is not None:
            self._check_against("the model's buffers", "buffer ", self.buffers, buffers)

    def _check_against(
        self, what: str, kind: str, saved: dict[str, torch.Tensor], given: dict[str, torch.Tensor]
    ) -> None:
        missing, extra = sorted(set(given) - set(saved)), sorted(set(saved) - set(given))
        if missing or extra:
            raise ValueError(
                f"checkpoint {self.name} does not match {what}: missing {missing}, "
                f"not in the model {extra}"
            )
        for name, g in given.items():
            t = saved[name]
            if t.shape != g.shape or t.dtype != g.dtype:
                raise ValueError(
                    f"checkpoint {self.name}: {kind}{name!r} is {dtype_name(t.dtype)}"
                    f"{list(t.shape)}, the model has {dtype_name(g.dtype)}{list(g.shape)}"
                )

    def load_buffers(self, model: nn.Module) -> bool:
        """Copies the checkpoint's buffers into ``model``'s (each on its own device), once
        :meth:`check_buffers` passed them; False (the model left as it is) for a checkpoint
        saved before buffers were.

        Raises:
            ValueError: naming the buffer that does not match the model.
        """
        if self.buffers is None:
            return False
        mine = model_buffers(model)
        self.check_buffers(mine)
        with torch.no_grad():
            for name, value in self.buffers.items():
                mine[name].copy_(value)
        return True

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


def load_checkpoint(
    checkpoint_dir: str, name: str | None = None, *, table_rows: bool = True
) -> Checkpoint | None:
    """Reads a checkpoint (the latest complete one by default), every part checked (see
    :mod:`psflow.train.checkpoint_check`); ``None`` when there is none.

    With ``table_rows=False`` the tables are checked as thoroughly, a file at a time, but the
    :attr:`Checkpoint.tables` hold only their ids: what the chief needs to restore a job whose
    ps read their own rows, so that no table is ever whole in the chief's memory.

    Raises:
        ValueError: naming the file and the tensor, table or field that cannot be trusted.

    Example:
        >>> load_checkpoint("memory://nothing-here") is None
        True
    """
    d = CheckpointDir(checkpoint_dir)
    root = d.url
    pointer = join(d.url, LATEST)
    if name is None and d.fs.lexists(join(d.path, LATEST)):
        safefile.check_regular(pointer, root)
    name = name or d.latest()
    if name is None:
        return None
    manifest_url = d.url_of(f"{name}/{MANIFEST}")
    if d.fs.lexists(join(d.path, name, MANIFEST)):
        safefile.check_regular(manifest_url, root)
    manifest = d.manifest(name)
    specs = check_manifest(manifest, manifest_url)
    n = manifest.num_shards
    wanted = {e.file for e in manifest.variables}
    if specs:  # every shard holds rows of every table
        wanted |= {shard_file_name(i, n) for i in range(n)}
    files: dict[str, ShardFile] = {}
    early = None if table_rows else TableCheck(d.url_of(name), specs, keep_rows=False)
    for file in sorted(wanted, key=lambda f: int(f.split("-")[1])):
        url = d.url_of(f"{name}/{file}")
        try:
            files[file] = read_shard(url, root)
        except FileNotFoundError:
            raise ValueError(f"{url}, named in {name}'s manifest, does not exist") from None
        check_shard_file(files[file], int(file.split("-")[1]), n, url)
        if early is not None:  # checked now, then let go: only the variables stay
            early.add(url, files[file])
            tensors = files[file].tensors
            for key in [k for k in tensors if k.startswith(TABLE_PREFIX)]:
                del tensors[key]
    by_param: dict[str, list[VariableEntry]] = {}
    for entry in manifest.variables:
        by_param.setdefault(entry.param, []).append(entry)
    unsaved = sorted(set(manifest.params) - set(by_param))
    if unsaved:
        raise ValueError(f"{manifest_url}: parameters {unsaved} are in no shard file")
    unknown = sorted(set(by_param) - set(manifest.params)) if manifest.params else []
    if unknown:
        raise ValueError(f"{manifest_url}: variables of {unknown}, which params lacks")
    params: dict[str, torch.Tensor] = {}
    opt_tensors: dict[str, dict[str, torch.Tensor]] = {}
    opt_plain: dict[str, dict[str, Any]] = {}
    for param, entries in by_param.items():
        entries.sort(key=lambda e: e.rows[0] if e.rows else 0)
        where = f"{d.url_of(name)}/{','.join(sorted({e.file for e in entries}))}"
        parts, states = [], []
        for e in entries:
            shard = files[e.file]
            value = shard.tensors.get(e.var)
            if value is None:
                raise ValueError(f"{where} lacks variable {e.var!r} named in the manifest")
            parts.append(value)
            states.append(shard.optimizer_tensors().get(e.var, {}))
            if e.var in shard.opt_state:
                opt_plain.setdefault(param, shard.opt_state[e.var])
        check_parts(param, entries, parts, manifest, where)
        params[param] = _join(parts, where, repr(param))
        keys = set().union(*states)
        for key in sorted(keys):
            ts = [s[key] for s in states if key in s]
            if len(ts) != len(parts):
                raise ValueError(f"{where}: optimizer state {key!r} missing for part of {param!r}")
            for t, part, e in zip(ts, parts, entries, strict=True):
                if t.dim() and t.shape != part.shape:
                    raise ValueError(
                        f"{where}: optimizer state {key!r} of {e.var!r} has shape "
                        f"{list(t.shape)}, the variable {list(part.shape)}"
                    )
            joined = ts[0] if len(ts) == 1 or ts[0].dim() == 0 else _join(ts, where, key)
            opt_tensors.setdefault(param, {})[key] = joined
    if early is not None:
        tables = early.result()
    else:
        urls = [(d.url_of(f"{name}/{f}"), files[f]) for f in sorted(files)]
        tables = check_tables(d.url_of(name), specs, urls)
    buffers: dict[str, torch.Tensor] | None = None if manifest.buffers is None else {}
    if manifest.buffers_file is not None:  # a file of few, small tensors: read whole
        url = d.url_of(f"{name}/{manifest.buffers_file}")
        try:
            buffers, _ = safefile.read(url, root)
        except FileNotFoundError:
            raise ValueError(f"{url}, named in {name}'s manifest, does not exist") from None
        check_buffers(buffers, manifest, url, manifest_url)
    return Checkpoint(
        name=name,
        manifest=manifest,
        params=params,
        opt_tensors=opt_tensors,
        opt_plain=opt_plain,
        tables=tables,
        table_specs=specs,
        inputs={file: shard.inputs for file, shard in files.items()},
        buffers=buffers,
    )


def _join(parts: list[torch.Tensor], where: str, what: str) -> torch.Tensor:
    """Row-partitioned parts concatenated; parts that do not fit together are the files' fault."""
    if len(parts) == 1:
        return parts[0]
    try:
        return torch.cat(parts)
    except RuntimeError as e:
        raise ValueError(f"{where}: the parts of {what} do not fit together: {e}") from None
