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


def _pairs(items: list[str] | None, flag: str) -> dict[str, str] | None:
    """``KEY=VALUE`` flags as a mapping (``None``: the flag was not given)."""
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r} must be KEY=VALUE")
        out[key] = value
    return out


def parse_toleration(text: str) -> dict[str, Any]:
    """A toleration from ``KEY[=VALUE][:EFFECT]`` (a taint as ``kubectl taint`` writes it).

    Example:
        >>> parse_toleration("dedicated=ml:NoSchedule")
        {'key': 'dedicated', 'operator': 'Equal', 'value': 'ml', 'effect': 'NoSchedule'}
        >>> parse_toleration("spot")
        {'key': 'spot', 'operator': 'Exists'}
    """
    rest, colon, effect = text.rpartition(":") if ":" in text else (text, "", "")
    key, eq, value = rest.partition("=")
    if not key:
        raise ValueError(f"--toleration {text!r} must be KEY[=VALUE][:EFFECT]")
    out: dict[str, Any] = {"key": key, "operator": "Equal" if eq else "Exists"}
    if eq:
        out["value"] = value
    if colon:
        out["effect"] = effect
    return out


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The JobConfig fields that the flags set (``None`` for those not given)."""
    env = _pairs(args.env, "--env")
    special = ("args", "command", "env", "node_selector", "tolerations", "quota")
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
    out["node_selector"] = _pairs(getattr(args, "node_selector", None), "--node-selector")
    out["quota"] = _pairs(getattr(args, "quota", None), "--quota")
    tolerations = getattr(args, "tolerations", None)
    out["tolerations"] = [parse_toleration(t) for t in tolerations] if tolerations else None
    if args.run_command is not None and out["script"] is not None:
        raise ValueError("give either a SCRIPT or --command, not both")
    return out


def render(args: argparse.Namespace) -> int:
    """Renders the job and writes it to stdout or ``--output-dir``."""
    config = JobConfig.merged(
        file=args.job_file, overrides=_overrides(args), absolute_host_dirs=args.target == "compose"
    )
    rendered = render_manifests(config, args.target, template_dir=args.template_dir)
    if args.output_dir:
        path = rendered.write(args.output_dir)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(rendered.text)
    return 0
