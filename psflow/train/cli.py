"""``psflow checkpoint inspect DIR`` and ``psflow checkpoint export DIR OUT.safetensors``.

Their flags are in :mod:`psflow.cli`.
"""

from __future__ import annotations

import argparse
import json


def inspect(args: argparse.Namespace) -> int:
    from psflow.train.manifest import CheckpointDir

    d = CheckpointDir(args.dir)
    name = args.name or d.latest()
    if name is None:
        raise ValueError(f"no complete checkpoint in {args.dir}")
    m = d.manifest(name)
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
    if m.tables:
        print("embedding tables:")
        width = max(len(t) for t in m.tables)
        for table, entry in sorted(m.tables.items()):
            spec = entry["spec"]
            size = spec.get("num_embeddings")
            kind = (
                f"{size} x {spec.get('embedding_dim')}"
                if size
                else f"hashed x {spec.get('embedding_dim')}"
            )
            optimizer = (spec.get("optimizer") or {}).get("name")
            print(
                f"  {table:<{width}}  {kind:<20} rows {entry['rows']:<10} "
                f"{entry['bytes'] / 1e6:.1f} MB  partition {spec.get('partition')}  "
                f"row-wise {optimizer}"
            )
    return 0


def export(args: argparse.Namespace) -> int:
    from psflow.train.checkpoint import export_state_dict

    ckpt = export_state_dict(args.dir, args.out, args.name)
    tables = ckpt.manifest.tables
    fixed = [t for t, e in tables.items() if e["spec"].get("num_embeddings") is not None]
    hashed = sorted(set(tables) - set(fixed))
    print(
        f"wrote {len(ckpt.params)} parameters and {len(fixed)} embedding tables of {ckpt.name} "
        f"(global step {ckpt.global_step}) to {args.out}"
        + (f"; hashed tables not exported: {', '.join(hashed)}" if hashed else "")
    )
    return 0
