"""``psflow checkpoint inspect DIR`` and ``psflow checkpoint export DIR OUT.safetensors``."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Registers ``psflow checkpoint``."""
    parser = subparsers.add_parser("checkpoint", help="inspect or export a checkpoint")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = sub.add_parser("inspect", help="step, variables, shapes and shards")
    inspect.add_argument("dir", help="checkpoint directory (path or fsspec URL)")
    inspect.add_argument("--name", help="a ckpt-<step> (default: the latest)")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    inspect.set_defaults(func=_inspect)
    export = sub.add_parser("export", help="a plain state dict for model.load_state_dict")
    export.add_argument("dir", help="checkpoint directory (path or fsspec URL)")
    export.add_argument("out", help="output .safetensors file")
    export.add_argument("--name", help="a ckpt-<step> (default: the latest)")
    export.set_defaults(func=_export)


def _inspect(args: argparse.Namespace) -> int:
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


def _export(args: argparse.Namespace) -> int:
    from psflow.train.checkpoint import export_state_dict

    ckpt = export_state_dict(args.dir, args.out, args.name)
    print(
        f"wrote {len(ckpt.params)} parameters of {ckpt.name} (global step {ckpt.global_step}) to {args.out}"
    )
    return 0
