"""``psflow checkpoint inspect DIR`` and ``psflow checkpoint export DIR OUT.safetensors``; DIR
may also be a TensorFlow checkpoint's prefix (:mod:`psflow.train.tf_checkpoint`).

Their flags are in :mod:`psflow.cli`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import TYPE_CHECKING

import fsspec

if TYPE_CHECKING:
    from psflow.ps.positions import InputPositions
    from psflow.train.tf_checkpoint import TFCheckpoint


def _tf_prefix(path: str) -> str | None:
    """``path`` as a TensorFlow checkpoint's prefix: itself, the latest in a directory that
    TensorFlow wrote checkpoints into, or a SavedModel's ``variables/variables``; ``None`` when
    it is none of these."""
    from psflow.train.tf_checkpoint import TFCheckpoint

    fs, local = fsspec.core.url_to_fs(path)
    if fs.exists(local + ".index"):
        return path
    if not fs.isdir(local):
        return None
    saved_model = path.rstrip("/") + "/variables/variables"
    if fs.exists(local.rstrip("/") + "/variables/variables.index"):
        return saved_model
    return TFCheckpoint.latest(path)


def _tf_files_hint(path: str) -> str:
    """For a directory of TensorFlow checkpoint files without the ``checkpoint`` state file that
    names the latest: their prefixes, one of which to give instead; else ``""``."""
    fs, local = fsspec.core.url_to_fs(path)
    if not fs.isdir(local):
        return ""
    names = [
        p.rsplit("/", 1)[-1][: -len(".index")] for p in fs.glob(local.rstrip("/") + "/*.index")
    ]
    found = sorted(names, key=lambda n: (int(m[1]) if (m := re.search(r"-(\d+)$", n)) else -1, n))
    if not found:
        return ""
    return (
        f" (TensorFlow checkpoint files, {', '.join(found[-3:])}, but no 'checkpoint' file naming "
        f"the latest: give a prefix, {path.rstrip('/')}/{found[-1]})"
    )


def inspect(args: argparse.Namespace) -> int:
    from psflow.ps.shard_file import shard_file_name
    from psflow.train.checkpoint import load_checkpoint
    from psflow.train.manifest import CheckpointDir

    prefix = _tf_prefix(args.dir)
    if prefix is not None:
        return _inspect_tf(prefix)
    d = CheckpointDir(args.dir)
    # Read and checked whole, as export and a restore read it: what one refuses, all refuse.
    ckpt = load_checkpoint(args.dir, args.name)
    if ckpt is None:
        raise ValueError(f"no complete checkpoint in {args.dir}{_tf_files_hint(args.dir)}")
    name, m = ckpt.name, ckpt.manifest
    if args.json:
        print(m.to_json())
        return 0
    others = [c.name + ("" if c.complete else " (incomplete)") for c in d.checkpoints()]
    print(f"checkpoint: {d.url_of(name)}")
    print(f"global step: {m.global_step}" + (" (final: training ended here)" if m.final else ""))
    print(
        f"psflow: {m.psflow_version}  optimizer: {m.optimizer.get('name')} {m.optimizer.get('kwargs')}"
    )
    if m.lr_schedule is not None:
        print(f"lr_schedule: {m.lr_schedule.get('name')} {m.lr_schedule.get('kwargs')}")
    print(f"shards: {m.num_shards} (steps {m.shard_steps})")
    print(f"all checkpoints: {', '.join(others)}")
    print("variables:")
    width = max((len(v.var) for v in m.variables), default=0)
    for v in sorted(m.variables, key=lambda v: v.var):
        rows = f" rows {v.rows[0]}:{v.rows[1]} of {v.param}" if v.rows else ""
        print(f"  {v.var:<{width}}  {v.dtype:<8} {json.dumps(v.shape):<16} {v.file}{rows}")
    if m.buffers:
        print(f"buffers (the chief's model's, in {m.buffers_file}):")
        width = max(len(b) for b in m.buffers)
        for buffer, meta in sorted(m.buffers.items()):
            print(f"  {buffer:<{width}}  {meta['dtype']:<8} {json.dumps(meta['shape'])}")
    if m.tables:
        print("embedding tables:")
        width = max(len(t) for t in m.tables)
        for table, entry in sorted(m.tables.items()):
            spec = ckpt.table_specs[table]
            size = spec.num_embeddings
            kind = f"{size} x {spec.embedding_dim}" if size else f"hashed x {spec.embedding_dim}"
            optimizer = spec.optimizer.name if spec.optimizer else None
            print(
                f"  {table:<{width}}  {kind:<20} rows {entry['rows']:<10} "
                f"{entry['bytes'] / 1e6:.1f} MB held on the ps  partition {spec.partition}  "
                f"row-wise {optimizer}"
            )
    # The shard files the check read: their positions are known, their headers not read again.
    read = [ckpt.inputs.get(shard_file_name(i, m.num_shards)) for i in range(m.num_shards)]
    _print_inputs(d.shard_urls(name, m.num_shards), read)
    return 0


def _print_inputs(urls: list[str], read: list[InputPositions | None]) -> None:
    """Where each worker's reader stood in what the shards hold (``input=``), once for a task
    whose shards agree, else per shard (a restarted worker replays between them); ``read``:
    each shard's positions where its file was read already (its header is not read again)."""
    from psflow.protocol.messages import InputMark, input_name
    from psflow.ps.positions import read_positions

    by_task: dict[str, list[InputMark | None]] = {}
    for i, (url, known) in enumerate(zip(urls, read, strict=True)):
        positions = read_positions(url) if known is None else known
        for task, mark in positions.marks.items():
            by_task.setdefault(task, [None] * len(urls))[i] = mark
    if not by_task:
        return
    print("input positions (each worker's reader, kept by the shards with their rows):")
    for task, marks in sorted(by_task.items()):
        if all(m == marks[0] for m in marks) and marks[0] is not None:
            print(f"  {task}  input {input_name(marks[0][0])}  {json.dumps(marks[0][1])}")
            continue
        for i, m in enumerate(marks):
            where = "none" if m is None else f"input {input_name(m[0])}  {json.dumps(m[1])}"
            print(f"  {task}  shard {i}: {where}")


def _inspect_tf(prefix: str) -> int:
    from psflow.train.tf_checkpoint import TFCheckpoint

    ckpt = TFCheckpoint(prefix)
    shards = ckpt.num_shards
    print(f"TensorFlow checkpoint: {prefix} ({shards} data file{'s' if shards > 1 else ''})")
    variables = _tf_variables(ckpt)
    if variables:
        # A TensorFlow 2 checkpoint: its variables by their own names, each with its key.
        print("variables (name, then the key it is saved under):")
        _print_tf_tensors(ckpt, variables)
        keyed = set(variables.values())
        rest = {key: key for key in ckpt.names() if key not in keyed}
        if rest:
            print("other tensors:")
            _print_tf_tensors(ckpt, rest, keys=False)
        return 0
    print("tensors:")
    _print_tf_tensors(ckpt, {name: name for name in ckpt.names()}, keys=False)
    return 0


def _tf_variables(ckpt: TFCheckpoint) -> dict[str, str]:
    """``ckpt.variables()``, or none with a warning when its object graph is damaged: the
    tensors still read by key."""
    try:
        return ckpt.variables()
    except ValueError as e:
        print(f"warning: {e}; its tensors go by key", file=sys.stderr)
        return {}


def _print_tf_tensors(ckpt: TFCheckpoint, names: dict[str, str], *, keys: bool = True) -> None:
    """One line per tensor: name, dtype, shape, how it was saved in slices (and its key)."""
    width = max((len(n) for n in names), default=0)
    for name, key in names.items():
        dtype = ckpt.dtype(key)
        kind = "string" if dtype is None else str(dtype).removeprefix("torch.")
        where = _tf_slices(ckpt.slices(key), ckpt.shape(key))
        shape = json.dumps(list(ckpt.shape(key)))
        line = f"  {name:<{width}}  {kind:<8} {shape:<16}{where}" + (f"  {key}" if keys else "")
        print(line.rstrip())


def _tf_slices(slices: list[tuple[tuple[int, int], ...]], shape: tuple[int, ...]) -> str:
    """How a TensorFlow variable was saved in slices: ``"  3 partitions: rows 0:4, 4:8,
    8:11"`` (split along its first dimension, as ``embedding_lookup`` assumes), ``"  2
    partitions along dim 1: 0:3, 3:5"``, or every slice whole; ``""`` for one saved whole."""
    if not slices:
        return ""
    split = [d for d in range(len(shape)) if any(s[d] != (0, shape[d]) for s in slices)]
    if len(split) == 1:
        dim = split[0]
        spans = ", ".join(f"{s[dim][0]}:{s[dim][1]}" for s in slices)
        if dim == 0:
            return f"  {len(slices)} partitions: rows {spans}"
        return f"  {len(slices)} partitions along dim {dim}: {spans}"
    boxes = ", ".join("[" + ", ".join(f"{a}:{b}" for a, b in s) + "]" for s in slices)
    return f"  {len(slices)} slices: {boxes}"


def export(args: argparse.Namespace) -> int:
    from psflow.train.checkpoint import export_state_dict
    from psflow.train.manifest import CheckpointDir

    prefix = _tf_prefix(args.dir)
    if prefix is not None:
        return _export_tf(prefix, args.out, args.table)
    if args.table:
        raise ValueError("--table is for a TensorFlow checkpoint's prefix")
    hint = _tf_files_hint(args.dir)
    if hint and CheckpointDir(args.dir).latest() is None:
        raise ValueError(f"no complete checkpoint in {args.dir}{hint}")
    ckpt = export_state_dict(args.dir, args.out, args.name)
    tables = ckpt.manifest.tables
    hashed = sum(e["spec"].get("num_embeddings") is None for e in tables.values())
    print(
        f"wrote {len(ckpt.params)} parameters and {len(tables)} embedding tables "
        f"({hashed} hashed: <table>.ids and <table>.rows) of {ckpt.name} "
        f"(global step {ckpt.global_step}) to {args.out}"
    )
    return 0


def _export_tf(prefix: str, out: str, tables: list[str]) -> int:
    """A TensorFlow checkpoint's numeric tensors, partitioned ones whole, into a safetensors
    file under their TensorFlow names; each ``--table NAME=mod|div`` in id order."""
    from safetensors.torch import save_file

    from psflow.train.tf_checkpoint import TFCheckpoint

    ckpt = TFCheckpoint(prefix)
    strategy: dict[str, str] = {}
    for item in tables:
        name, sep, how = item.rpartition("=")
        if not sep or not name:
            raise ValueError(f"--table takes NAME=mod or NAME=div, got {item!r}")
        if name not in ckpt:
            raise ValueError(f"--table {item}: {prefix} holds no tensor {name!r}")
        strategy[name] = how
    tensors = {}
    skipped = []
    # A TensorFlow 2 checkpoint's variables under their own names; any other tensor by key.
    named = {key: name for name, key in _tf_variables(ckpt).items()}
    for key in ckpt.names():
        name = named.get(key, key)
        order = strategy.get(name) or strategy.get(key)
        if ckpt.dtype(key) is None:
            skipped.append(name)
        elif order is not None:
            tensors[name] = ckpt.embedding(key, order)
        else:
            tensors[name] = ckpt.tensor(key)
    save_file(tensors, out)
    print(
        f"wrote {len(tensors)} tensors of {prefix} to {out}"
        + (
            f" (in id order: {', '.join(f'{n} by {s}' for n, s in strategy.items())})"
            if strategy
            else ""
        )
        + (f"; string tensors not exported: {', '.join(skipped)}" if skipped else "")
    )
    return 0
