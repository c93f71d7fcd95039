"""Subcommands of this layer (registered by ``psflow.cli``)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Registers this layer's subcommands (none yet)."""
