"""``psflow``: the command line, thin over the library.

Each subcommand lives beside the code it drives, in a module with ``add_parser(subparsers)``
that registers the subcommand and sets ``func`` (taking the parsed args, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from psflow import env as envvars

_SUBCOMMAND_MODULES = (
    "psflow.cluster.cli",  # launch
    "psflow.transport.cli",  # keys
    "psflow.train.cli",  # checkpoint
    "psflow.data.cli",  # data
    "psflow.deploy.cli",  # render
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psflow", description="Parameter-server training for PyTorch."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get(envvars.PSFLOW_LOG_LEVEL, "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"psflow {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
