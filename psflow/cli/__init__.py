"""``psflow``: the command line, thin over the library.

The parser, every subcommand and flag, is built in this package without importing what the
commands drive (``__init__.py``: ``launch``, ``top``, ``keys``, ``checkpoint`` and ``main``;
``data.py`` and ``render.py``: those commands' arguments; ``common.py``: what they share):
``psflow --help``, ``psflow COMMAND --help``, ``psflow --version`` and a mistyped flag answer at
once, and torch, ZeroMQ or pyspark load only in a command that uses them. What a command does
lives beside the code it drives, in ``psflow/<package>/cli.py``, imported when that command runs.

A mistake (a missing file, a bad value, an invalid job file) is one line on stderr,
``psflow COMMAND: error: ...``, and exit status 2, as argparse does for a bad flag;
``--debug`` or ``PSFLOW_LOG_LEVEL=DEBUG`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from psflow import __version__
from psflow import env as envvars
from psflow.cli.common import DEBUG_HELP, command, group, positive_seconds, runs
from psflow.cli.data import add_data
from psflow.cli.render import add_render
from psflow.cluster.launcher import LAUNCH_MODES

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""What ``PSFLOW_LOG_LEVEL`` may say (any case)."""


def build_parser() -> argparse.ArgumentParser:
    """The whole ``psflow`` parser; each command sets ``func`` (args in, exit status out)."""
    parser = argparse.ArgumentParser(
        prog="psflow", description="Parameter-server training for PyTorch.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"psflow {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_launch(subparsers)
    _add_top(subparsers)
    _add_keys(subparsers)
    _add_checkpoint(subparsers)
    add_data(subparsers)
    add_render(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (envvars.text(envvars.PSFLOW_LOG_LEVEL) or "INFO").strip().upper()
    if level not in _LEVELS:
        print(
            f"psflow: error: {envvars.PSFLOW_LOG_LEVEL}={level!r} is not "
            f"{', '.join(_LEVELS[:-1])} or {_LEVELS[-1]}",
            file=sys.stderr,
        )
        return 2
    debug = args.debug or level == "DEBUG"
    logging.basicConfig(
        level="DEBUG" if debug else level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"{args.prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: Exception) -> str:
    """What went wrong, on one line; the type is named unless it is a plain user mistake."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) or type(e).__name__
    if not isinstance(e, ValueError | OSError):
        text = f"{type(e).__name__}: {text} (--debug shows the traceback)"
    return " ".join(text.split())


# -- psflow launch ---------------------------------------------------------------------------


def _add_launch(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        subparsers,
        "launch",
        help="start every task of a job as a local process",
        description="Start a ps job on this machine: every task runs SCRIPT with its own TF_CONFIG.",
    )
    p.add_argument(
        "--ps",
        type=int,
        default=None,
        help="ps tasks (default: one to every 3 workers, printed; 0 with allreduce)",
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker tasks (default 2)")
    p.add_argument("--chief", action="store_true", help="add a separate chief task")
    p.add_argument("--host", default="127.0.0.1", help="address the tasks listen on")
    p.add_argument(
        "--evaluator",
        action="store_true",
        help="add an evaluator task: the script's evaluator branch (psflow.Evaluator) scores "
        "every checkpoint and exits after the final one",
    )
    p.add_argument(
        "--mode",
        choices=LAUNCH_MODES,
        default=None,
        help="training mode for every task (PSFLOW_MODE); allreduce starts no ps",
    )
    p.add_argument(
        "--ps-exit-timeout",
        type=positive_seconds,
        default=None,
        help="seconds the ps tasks may take to exit after the workers finish (default: "
        "PSFLOW_WORKER_TIMEOUT + 30, so 60: a ps waits one worker timeout for a worker that "
        "never spoke to it)",
    )
    p.add_argument(
        "--grace",
        type=positive_seconds,
        default=30.0,
        help="seconds the tasks get between SIGTERM and SIGKILL when the job is stopped "
        "(Ctrl-C, SIGTERM, a failed task; a second Ctrl-C kills at once); default 30",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="start a failed task again (same address and TF_CONFIG), up to N times in all "
        "for the job, before stopping it (default 0)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="run without CurveZMQ keys (by default each job gets fresh ones, unless "
        "PSFLOW_KEYS_DIR names your own)",
    )
    p.add_argument(
        "--bind-cores",
        action="store_true",
        help="bind each task to cores of its own (as mpirun --bind-to core): the trainers "
        "first, then the ps; with more tasks than cores a ps shares a trainer's core",
    )
    p.add_argument(
        "--ps-threads",
        type=int,
        metavar="N",
        help="threads each ps task serves a request with (PSFLOW_PS_THREADS, and its "
        "OMP_NUM_THREADS): the rows in stripes, one a thread, and the dense optimizer's; "
        "default: the host's cores shared out among all tasks",
    )
    p.add_argument(
        "--preload",
        metavar="MODULES",
        help="start each task by forking it from a server that imported these modules once "
        "(torch,psflow): a task, and a restarted one, skips their import "
        "(default: PSFLOW_PRELOAD; none: each task a fresh python)",
    )
    p.add_argument(
        "--gpus-per-task",
        type=float,
        default=0.0,
        help="GPUs of the chief's and each worker's own: a whole number, or a share of one "
        "below 1 (0.5: two a GPU); locally through CUDA_VISIBLE_DEVICES, dealt from its value "
        "or nvidia-smi's GPUs, the ps and evaluator seeing none; on Ray, their actors' "
        "(default 0: CUDA_VISIBLE_DEVICES left alone, every task sees every GPU)",
    )
    _add_launch_watching(p)
    r = p.add_argument_group("on Ray (--backend ray)")
    r.add_argument(
        "--backend",
        choices=("local", "ray"),
        default="local",
        help="local: processes on this machine (default); ray: each task a Ray actor",
    )
    r.add_argument(
        "--address",
        help="the Ray cluster's head, HOST:PORT (default: RAY_ADDRESS, else a Ray started here)",
    )
    r.add_argument(
        "--placement",
        default="SPREAD",
        help="placement group strategy: SPREAD (default) or PACK (STRICT_SPREAD, STRICT_PACK)",
    )
    r.add_argument("--cpus-per-task", type=float, default=1.0, help="CPUs of each task's actor")
    r.add_argument(
        "--node-ip", help="this machine's address in the Ray cluster, where Ray cannot tell"
    )
    p.add_argument("script", help="the training script")
    rest = p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    rest.required = False  # argparse marks a REMAINDER required: a script may take none
    p.set_defaults(func=runs("psflow.cluster.cli", "launch"))


def _add_launch_watching(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="serve no Prometheus metrics (by default each task serves them on a free port, "
        "listed at the start, and psflow top finds the job)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one live progress line below the tasks' output (default: when stdout is a terminal)",
    )


# -- psflow top -------------------------------------------------------------------------------


def _add_top(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = command(
        subparsers,
        "top",
        help="a live view of a running job, one row per task, from the tasks' metrics",
        description="Finds the psflow launch job running on this machine (or the one of --pid), "
        "or reads the cluster of --cluster-file or TF_CONFIG, whose tasks serve their metrics "
        "on --metrics-port at their own hosts (as the rendered manifests set it up).",
    )
    p.add_argument("--pid", type=int, help="the psflow launch job of this launcher process")
    p.add_argument("--cluster-file", help="a YAML or JSON cluster file (else TF_CONFIG)")
    p.add_argument(
        "--metrics-port",
        type=int,
        help="with a cluster file or TF_CONFIG: the port every task serves its metrics on "
        "(default PSFLOW_METRICS_PORT)",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument(
        "--once", action="store_true", help="print one view (two scrapes, --interval apart)"
    )
    p.set_defaults(func=runs("psflow.cluster.top", "top"))


# -- psflow keys -----------------------------------------------------------------------------


def _add_keys(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = group(subparsers, "keys", help="CurveZMQ keys that encrypt and authenticate a job")
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    gen = command(sub, "generate", help="write a server and a client key pair into DIR")
    gen.add_argument("dir", help="directory to create (give it to tasks as PSFLOW_KEYS_DIR)")
    gen.add_argument("--force", action="store_true", help="replace keys already in DIR")
    gen.set_defaults(func=runs("psflow.transport.cli", "generate"))


# -- psflow checkpoint -----------------------------------------------------------------------


def _add_checkpoint(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = group(subparsers, "checkpoint", help="inspect or export a checkpoint")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = command(sub, "inspect", help="step, variables, shapes and shards")
    inspect.add_argument(
        "dir", help="checkpoint directory (path or fsspec URL), or a TensorFlow checkpoint's prefix"
    )
    inspect.add_argument("--name", help="a ckpt-<step> (default: the latest)")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    inspect.set_defaults(func=runs("psflow.train.cli", "inspect"))
    export = command(sub, "export", help="a plain state dict for model.load_state_dict")
    export.add_argument(
        "dir", help="checkpoint directory (path or fsspec URL), or a TensorFlow checkpoint's prefix"
    )
    export.add_argument("out", help="output .safetensors file")
    export.add_argument("--name", help="a ckpt-<step> (default: the latest)")
    export.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="NAME=mod|div",
        help="TensorFlow checkpoints: write this partitioned embedding table's rows in id order, "
        "for the partition_strategy it was trained with (repeatable)",
    )
    export.set_defaults(func=runs("psflow.train.cli", "export"))
