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
  learning rate at that step among them), the learning-rate schedule's spec when there is
  one, and where each worker's input stood (``psflow.inputs``, :mod:`psflow.ps.positions`).
  A schedule is a function of the global step: the step is all the state it has.

The serving thread takes a :class:`ShardSnapshot` (:func:`snapshot`) between two requests;
:func:`safetensors_chunks` turns it into the file's bytes without copying the tensors, which
:class:`~psflow.ps.checkpoint.ShardCheckpointer` writes in the background. Nothing is pickled,
ever: safetensors holds only raw tensors, and :func:`read_shard` / :func:`decode_shard` check
the metadata of what they read back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save as st_save

from psflow.protocol import OptimizerSpec
from psflow.ps import safefile
from psflow.ps.optimizer_state import flatten_optimizer_state, split_opt_key
from psflow.ps.positions import METADATA_KEY as INPUTS_KEY
from psflow.ps.positions import InputPositions
from psflow.ps.store import ShardStore
from psflow.ps.tables import TABLE_PREFIX, begin_table_snapshots
from psflow.sparse.snapshot import RowSnapshot


def shard_file_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard}-of-{num_shards}.safetensors"


@dataclass(kw_only=True)
class ShardSnapshot:
    """An in-memory copy of one shard, taken between two requests."""

    shard: int
    num_shards: int
    step: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    tables: dict[str, RowSnapshot] = field(default_factory=dict)
    """The embedding tables, completed by the writer
    (:func:`~psflow.ps.tables.finish_table_snapshots`)."""
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
    if store.inputs.marks:  # with the rows they led to: taken at the same moment
        metadata[INPUTS_KEY] = store.inputs.to_metadata()
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
    tables: dict[str, Any] = field(default_factory=dict)
    """The specs of the tables whose rows the file holds, as data (``psflow.tables``)."""
    inputs: InputPositions = field(default_factory=InputPositions)
    """Where each worker's input stood in what the file holds (``psflow.inputs``)."""

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


def read_shard(url: str, root: str | None = None) -> ShardFile:
    """Reads one shard file (safetensors only: nothing in it can run code).

    Raises:
        ValueError: naming the file (and the byte offset where one applies) when it is not a
            psflow shard: truncated, corrupt, or with a header length past its end (refused
            before the rest of the file is read); or when it is not a regular file, or with
            ``root`` (the checkpoint directory) a symlink out of it (refused before it is
            opened).
    """
    return decode_shard(safefile.read_bytes(url, root), url)


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
            tables=json.loads(meta.get("psflow.tables", "{}")),
            inputs=InputPositions.from_metadata(meta.get(INPUTS_KEY, "{}"), source),
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
    elif not isinstance(f.tables, dict) or not all(isinstance(v, dict) for v in f.tables.values()):
        problem = "psflow.tables is not a map of maps"
    if problem is not None:
        raise ValueError(f"{source} is not a readable psflow shard file: bad metadata: {problem}")
