"""``psflow keys generate DIR``: CurveZMQ keys for a job."""

from __future__ import annotations

import argparse
from typing import Any

from psflow.transport.auth import generate_keys


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    keys = subparsers.add_parser("keys", help="CurveZMQ keys that encrypt and authenticate a job")
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    gen = sub.add_parser("generate", help="write a server and a client key pair into DIR")
    gen.add_argument("dir", help="directory to create (give it to tasks as PSFLOW_KEYS_DIR)")
    gen.add_argument("--force", action="store_true", help="replace keys already in DIR")
    gen.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    d = generate_keys(args.dir, force=args.force)
    print(f"wrote CurveZMQ keys to {d}; start every task with PSFLOW_KEYS_DIR={d}")
    return 0
