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
    print(f"global step: {m.global_step}")
    print(
        f"psflow: {m.psflow_version}  optimizer: {m.optimizer.get('name')} {m.optimizer.get('kwargs')}"
    )
    print(f"shards: {m.num_shards} (steps {m.shard_steps})")
    print(f"all checkpoints: {', '.join(others)}")
    print("variables:")
    width = max((len(v.var) for v in m.variables), default=0)
    for v in sorted(m.variables, key=lambda v: v.var):
        rows = f" rows {v.rows[0]}:{v.rows[1]} of {v.param}" if v.rows else ""
        print(f"  {v.var:<{width}}  {v.dtype:<8} {json.dumps(v.shape):<16} {v.file}{rows}")
    return 0


def export(args: argparse.Namespace) -> int:
    from psflow.train.checkpoint import export_state_dict

    ckpt = export_state_dict(args.dir, args.out, args.name)
    print(
        f"wrote {len(ckpt.params)} parameters of {ckpt.name} (global step {ckpt.global_step}) to {args.out}"
    )
    return 0
