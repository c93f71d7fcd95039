"""A psflow checkpoint written as a job writes one, in one process: two ps shards (their
stores, row stores and the ps's own shard writer), the chief's manifest (its
:class:`~psflow.train.checkpoint.Checkpointer` builds it from the shards' replies), with a
partitioned dense parameter, a whole one, a fixed-size table and a hashed one, trained a few
steps. :func:`known_values` is what the shards held: what an export must give.
"""

from __future__ import annotations

import atexit
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from psflow.protocol import OptimizerSpec, RowOptimizerSpec, TableSpec
from psflow.ps.checkpoint import ShardCheckpointer
from psflow.ps.store import ShardStore
from psflow.ps.tables import build_tables
from psflow.train.checkpoint import Checkpointer
from psflow.train.manifest import CheckpointDir
from psflow.worker.placement import ParamInfo, place

NUM_SHARDS = 2
STEP = 3
NAME = f"ckpt-{STEP}"
ADAM = OptimizerSpec(name="Adam", kwargs={"lr": 0.01})
ADAGRAD = RowOptimizerSpec.of("Adagrad", lr=0.1)
TABLES = [
    TableSpec(name="items", embedding_dim=3, num_embeddings=40, optimizer=ADAGRAD),
    TableSpec(name="users", embedding_dim=3, num_embeddings=None, optimizer=ADAGRAD),
]
USERS = torch.tensor([5, -7, 123456789, 42, 8, 2**40], dtype=torch.int64)


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"fc.weight": torch.randn(10, 4, generator=g), "fc.bias": torch.randn(4, generator=g)}


def write(root: Path) -> dict[str, torch.Tensor]:
    """Writes ``root/ckpt-3`` (two shards and the manifest); returns :func:`known_values`."""
    params = _params()
    infos = [ParamInfo(name=n, shape=tuple(t.shape), dtype=t.dtype) for n, t in params.items()]
    pieces = place(infos, NUM_SHARDS, partition_bytes=64)
    stores = []
    for s in range(NUM_SHARDS):
        store = ShardStore()
        values = [
            (p.var, params[p.param] if p.rows is None else params[p.param][p.rows[0] : p.rows[1]])
            for p in pieces
            if p.shard == s
        ]
        store.initialize(values, ADAM, tables=build_tables(TABLES, s, NUM_SHARDS))
        stores.append(store)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEP):
        for s, store in enumerate(stores):
            grads = [(n, torch.randn(t.shape, generator=g)) for n, t in store.variables.items()]
            store.apply(grads)
            items = store.tables["items"]
            mine = torch.arange(40)[torch.arange(40) % NUM_SHARDS == s]
            items.apply(mine, torch.randn(len(mine), 3, generator=g))
            users = USERS[(USERS % NUM_SHARDS).eq(s)]
            store.tables["users"].apply(users, torch.randn(len(users), 3, generator=g))
    url = str(root)
    replies = {}
    for s, store in enumerate(stores):
        saver = ShardCheckpointer(store, shard=s, num_shards=NUM_SHARDS, root=url)
        replies[s] = saver.save({"dir": f"{url}/{NAME}"})
        saver.wait(30)
        assert saver.status({"dir": f"{url}/{NAME}"})["state"] == "done"
    chief = Checkpointer(url, client=_Shards(), pieces=pieces, params=params, make_client=_Shards)
    CheckpointDir(url).publish(NAME, chief._manifest(replies))
    return known_values(stores, pieces)


class _Shards:
    num_shards = NUM_SHARDS


def known_values(stores: list[ShardStore], pieces: Any) -> dict[str, torch.Tensor]:
    """The export the shards' state makes: each parameter whole, ``items.weight`` in id order,
    ``users.ids`` sorted and ``users.rows``."""
    held = {n: t for store in stores for n, t in store.variables.items()}
    out = {}
    for param in ("fc.weight", "fc.bias"):
        parts = sorted((p for p in pieces if p.param == param), key=lambda p: p.rows or (0, 0))
        out[param] = (
            torch.cat([held[p.var] for p in parts]) if len(parts) > 1 else held[parts[0].var]
        )
    ids = torch.arange(40)
    weight = torch.empty(40, 3)
    for s, store in enumerate(stores):
        mine = ids[ids % NUM_SHARDS == s]
        weight[mine] = store.tables["items"].lookup(mine)
    out["items.weight"] = weight
    users = torch.sort(USERS).values
    rows = torch.empty(len(users), 3)
    for s, store in enumerate(stores):
        mine = users % NUM_SHARDS == s
        rows[mine] = store.tables["users"].lookup(users[mine])
    out["users.ids"], out["users.rows"] = users, rows
    return {n: t.clone() for n, t in out.items()}


_CACHE: dict[str, tuple[Path, dict[str, torch.Tensor]]] = {}


def _remove(directory: str, owner: int) -> None:
    """Removes the written checkpoint's directory at exit, in the process that made it alone: a
    child forked from it (``os.fork``) inherits the exit hooks, and must not take the
    directory from under its parent."""
    if os.getpid() == owner:
        shutil.rmtree(directory, ignore_errors=True)


def copy(tmp: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A fresh copy of one checkpoint written once per process, and its known values.

    The one written lives in a directory of its own (not under the first caller's ``tmp``,
    which its test may change or pytest remove), removed when the process exits: each pytest
    process of every suite otherwise left one in the temporary directory."""
    if "ckpt" not in _CACHE:
        import tempfile

        made = tempfile.mkdtemp(prefix="psflow-ckpt-fixture-")
        atexit.register(_remove, made, os.getpid())
        src = Path(made) / "run"
        _CACHE["ckpt"] = (src, write(src))
    src, values = _CACHE["ckpt"]
    dst = tmp / "run"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst, values
