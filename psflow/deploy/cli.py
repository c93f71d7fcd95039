"""``psflow render``: a job description in, manifests out (its flags are in :mod:`psflow.cli`).

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
from psflow.deploy.render import render as render_manifests


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


def render(args: argparse.Namespace) -> int:
    """Renders the job and writes it to stdout or ``--output-dir``."""
    config = JobConfig.merged(file=args.job_file, overrides=_overrides(args))
    rendered = render_manifests(config, args.target, template_dir=args.template_dir)
    if args.output_dir:
        path = rendered.write(args.output_dir)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(rendered.text)
    return 0
