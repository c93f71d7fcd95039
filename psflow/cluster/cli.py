"""``psflow launch``: a whole job on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from psflow.cluster.launcher import LAUNCH_MODES, LaunchConfig, Launcher


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    p = subparsers.add_parser(
        "launch",
        help="start every task of a job as a local process",
        description="Start a ps job on this machine: every task runs SCRIPT with its own TF_CONFIG.",
    )
    p.add_argument(
        "--ps", type=int, default=None, help="number of ps tasks (default 1; 0 with allreduce)"
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker tasks (default 2)")
    p.add_argument("--chief", action="store_true", help="add a separate chief task")
    p.add_argument("--host", default="127.0.0.1", help="address the tasks listen on")
    p.add_argument(
        "--mode",
        choices=LAUNCH_MODES,
        default=None,
        help="training mode for every task (PSFLOW_MODE); allreduce starts no ps",
    )
    p.add_argument(
        "--ps-exit-timeout",
        type=float,
        default=30.0,
        help="seconds the ps tasks may take to exit after the workers finish",
    )
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    config = LaunchConfig(
        script=args.script,
        args=args.args,
        ps=args.ps if args.ps is not None else (0 if args.mode == "allreduce" else 1),
        workers=args.workers,
        chief=args.chief,
        host=args.host,
        ps_exit_timeout=args.ps_exit_timeout,
        mode=args.mode,
    )
    return Launcher(config).run()
