"""``psflow render``: a job description in, manifests out (registered by ``psflow.cli``).

Examples::

    psflow render kubernetes --name mnist --image psflow:0.1.0 --ps 2 --workers 4 train.py \\
        | kubectl apply -f -
    psflow render compose --job-file job.yaml --output-dir deploy/
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from psflow.deploy.config import FIELDS, JobConfig
from psflow.deploy.layout import TARGETS
from psflow.deploy.render import render


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Registers ``psflow render``."""
    p = subparsers.add_parser(
        "render",
        help="render manifests for Kubernetes, Kubeflow TFJob, docker compose or Marathon",
        description=(
            "Render a training job for a cluster manager. Options come from the field defaults, "
            "then the YAML --job-file, then these flags (each overriding the one before)."
        ),
    )
    p.add_argument("target", choices=TARGETS, help="what to render")
    p.add_argument("--job-file", help="YAML file of job options (the JobConfig field names)")
    p.add_argument("--template-dir", help="directory of templates that override the packaged ones")
    p.add_argument(
        "-o", "--output-dir", help="write the manifest into this directory instead of stdout"
    )

    g = p.add_argument_group("the job")
    g.add_argument("--name", help="job name, a DNS-1035 label; tasks are <name>-<job>-<index>")
    g.add_argument("--image", help="container image (built from the repository's Dockerfile)")
    g.add_argument("--ps", type=int, help="parameter-server tasks (default 1)")
    g.add_argument("--workers", type=int, help="worker tasks (default 2)")
    g.add_argument(
        "--chief", action=argparse.BooleanOptionalAction, help="run a separate chief task"
    )
    g.add_argument(
        "--evaluator", dest="evaluators", type=int, metavar="N", help="evaluator tasks (default 0)"
    )
    g.add_argument("--port", type=int, help="port every task listens on (default 2222)")
    g.add_argument(
        "--command",
        dest="run_command",
        help="whole command line to run instead of `python SCRIPT ARGS` (one shell-quoted string)",
    )
    g.add_argument(
        "--env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment variable for every task (repeatable)",
    )

    r = p.add_argument_group("resources")
    r.add_argument("--gpus", type=int, help="GPUs per training task (workers and chief)")
    r.add_argument("--cpu", help="CPU request per task, a Kubernetes quantity (500m, 2)")
    r.add_argument("--memory", help="memory request per task, a Kubernetes quantity (4Gi)")

    s = p.add_argument_group("storage, keys and placement")
    s.add_argument("--logdir", help="logdir inside the container (default /logs)")
    s.add_argument("--logdir-claim", help="Kubernetes PersistentVolumeClaim for the logdir")
    s.add_argument("--logdir-host-dir", help="compose/Marathon host directory for the logdir")
    s.add_argument("--keys-secret", help="Kubernetes Secret holding the CurveZMQ keys")
    s.add_argument("--keys-host-dir", help="compose/Marathon host directory of CurveZMQ keys")
    s.add_argument("--namespace", help="Kubernetes namespace")
    s.add_argument(
        "--tensorboard",
        action=argparse.BooleanOptionalAction,
        help="also run TensorBoard on the logdir",
    )
    s.add_argument("--backoff-limit", type=int, help="retries of a failing task (default 6)")

    # PARSER (not REMAINDER) so that options before the script are still read as psflow's own:
    # everything from the script on belongs to the script.
    script = p.add_argument(
        "script_argv",
        nargs=argparse.PARSER,
        metavar="SCRIPT [ARGS ...]",
        help="training script and its arguments, run as `python SCRIPT ARGS`",
    )
    script.required = False  # the job file may name the script instead
    p.set_defaults(func=run)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The JobConfig fields that the flags set (``None`` for those not given)."""
    env: dict[str, str] | None = None
    if args.env:
        env = {}
        for item in args.env:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--env {item!r} must be KEY=VALUE")
            env[key] = value
    special = ("args", "command", "env")
    out: dict[str, Any] = {
        f: getattr(args, f) for f in FIELDS if f not in special and hasattr(args, f)
    }
    argv = list(args.script_argv or [])
    if argv[:1] == ["--"]:
        argv = argv[1:]
    out["script"] = argv[0] if argv else None
    out["args"] = argv[1:] if argv else None
    out["command"] = shlex.split(args.run_command) if args.run_command is not None else None
    out["env"] = env
    if args.run_command is not None and out["script"] is not None:
        raise ValueError("give either a SCRIPT or --command, not both")
    return out


def run(args: argparse.Namespace) -> int:
    """Renders the job and writes it to stdout or ``--output-dir``."""
    config = JobConfig.merged(file=args.job_file, overrides=_overrides(args))
    rendered = render(config, args.target, template_dir=args.template_dir)
    if args.output_dir:
        path = rendered.write(args.output_dir)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(rendered.text)
    return 0
