"""``psflow keys generate DIR``: CurveZMQ keys for a job (its flags are in :mod:`psflow.cli`)."""

from __future__ import annotations

import argparse

from psflow.transport.auth import generate_keys


def generate(args: argparse.Namespace) -> int:
    d = generate_keys(args.dir, force=args.force)
    print(f"wrote CurveZMQ keys to {d}; start every task with PSFLOW_KEYS_DIR={d}")
    return 0
