"""What the parser's modules share: a subcommand that takes ``--debug`` after its name, and a
command imported only when it runs."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

DEBUG_HELP = "on an error, show the Python traceback (so does PSFLOW_LOG_LEVEL=DEBUG)"


def command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    *,
    help: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """A subcommand that takes ``--debug`` after its name too."""
    # allow_abbrev=False: the script's own flags after SCRIPT (--p) are not taken for
    # abbreviations of psflow's (argparse checked them against --ps, --preload, ... first).
    parser = subparsers.add_parser(name, help=help, description=description, allow_abbrev=False)
    # SUPPRESS: absent here, the top-level --debug's value stands.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    parser.set_defaults(prog=parser.prog)
    return parser


def group(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str, *, help: str
) -> argparse.ArgumentParser:
    """A subcommand of actions (``psflow data ACTION``) that takes ``--debug`` before the
    action too."""
    parser = subparsers.add_parser(name, help=help, allow_abbrev=False)
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def positive_seconds(text: str) -> float:
    """A flag's seconds, more than 0 (argparse names the flag when this refuses)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def runs(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``module.name``, imported only when it runs: registering a subcommand must
    not load torch or ZeroMQ (``psflow --help`` would wait for them)."""

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module), name)(args) or 0)

    return run
