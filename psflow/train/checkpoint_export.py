"""A psflow checkpoint as a plain safetensors state dict (``psflow checkpoint export``), and
its embedding tables whole, from the rows :func:`~psflow.train.checkpoint_read.load_checkpoint`
read and checked (each id once; a fixed table's ids exactly its rows): nothing here sizes an
allocation by what the manifest says alone.
"""

from __future__ import annotations

import torch
from safetensors.torch import save as st_save

from psflow.ps.checkpoint import atomic_write, url_to_fs
from psflow.train.checkpoint_check import TableParts
from psflow.train.checkpoint_read import Checkpoint, load_checkpoint

__all__ = ["export_state_dict", "fixed_tables", "hashed_tables", "table_tensors"]


def export_state_dict(checkpoint_dir: str, out: str, name: str | None = None) -> Checkpoint:
    """Writes the checkpoint's parameters and the chief's model's buffers (a BatchNorm's
    running statistics) as a plain safetensors state dict.

    ``model.load_state_dict(safetensors.torch.load_file(out))`` loads it with no cluster,
    strictly (a checkpoint saved before buffers were holds none: ``strict=False`` for a model
    with buffers then). Each fixed-size embedding table is written whole as ``<table>.weight``,
    the name a ``torch.nn.Embedding`` (or ``psflow.nn.Embedding``) at that path loads; each
    hashed table as ``<table>.ids`` and ``<table>.rows`` (its rows in id order), which a hashed
    ``psflow.nn`` table at that path loads (optimizer state is not written, as for the fixed
    ones).

    Raises:
        ValueError: when there is no complete checkpoint, or one that fails a check (see
            :mod:`psflow.train.checkpoint_check`), naming the file and what is wrong.
    """
    ckpt = load_checkpoint(checkpoint_dir, name)
    if ckpt is None:
        raise ValueError(f"no complete checkpoint in {checkpoint_dir}")
    tensors = {n: t.contiguous() for n, t in ckpt.params.items()}
    tensors.update(ckpt.buffers or {})
    if ckpt.table_specs:
        tensors.update(fixed_tables(checkpoint_dir, ckpt))
        tensors.update(hashed_tables(ckpt, ckpt.tables))
    data = st_save(tensors, metadata={"global_step": str(ckpt.global_step), "source": ckpt.name})
    fs, path = url_to_fs(out)
    atomic_write(fs, path, data)
    return ckpt


def fixed_tables(
    checkpoint_dir: str, ckpt: Checkpoint, saved: TableParts | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint's fixed-size embedding tables, each assembled whole from its shards'
    rows, as ``<table>.weight`` (from ``saved`` when given, else the rows ``ckpt`` read)."""
    saved = ckpt.tables if saved is None else saved
    out = {}
    for table, spec in ckpt.table_specs.items():
        if spec.num_embeddings is None:
            continue
        parts = saved.get(table, [])
        # load_checkpoint checked that the parts' ids are 0 .. num_embeddings - 1, each once:
        # the files hold every row allocated here.
        weight = torch.empty(
            (spec.num_embeddings, spec.embedding_dim), dtype=getattr(torch, spec.dtype)
        )
        for part in parts:
            weight[part["ids"]] = part["values"]
        out[f"{table}.weight"] = weight
    return out


def hashed_tables(ckpt: Checkpoint, saved: TableParts) -> dict[str, torch.Tensor]:
    """The checkpoint's hashed tables (from ``saved``, :func:`table_tensors`), each as
    ``<table>.ids`` and ``<table>.rows``, its shards' rows together in id order."""
    out = {}
    for table, spec in ckpt.table_specs.items():
        if spec.num_embeddings is not None:
            continue
        parts = saved.get(table, [])
        if parts:
            ids = torch.cat([p["ids"] for p in parts])
            rows = torch.cat([p["values"] for p in parts])
        else:
            ids = torch.empty(0, dtype=torch.int64)
            rows = torch.empty(0, spec.embedding_dim, dtype=getattr(torch, spec.dtype))
        order = torch.argsort(ids)
        out[f"{table}.ids"] = ids[order]
        out[f"{table}.rows"] = rows[order]
    return out


def table_tensors(checkpoint_dir: str, ckpt: Checkpoint) -> TableParts:
    """Every embedding table's rows in ``ckpt``'s shard files: per table, one map (``ids``,
    ``values``, ``opt/<key>``) per shard file that holds part of it, as
    :func:`~psflow.train.checkpoint_read.load_checkpoint` read and checked them."""
    return ckpt.tables
