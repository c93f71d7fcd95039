"""``psflow launch``: a whole job on this machine (its flags are in :mod:`psflow.cli`)."""

from __future__ import annotations

import argparse
import errno
import os
import sys

from psflow.cluster.cores import host_cpus
from psflow.cluster.launch_config import WORKERS_PER_PS, planned_ps
from psflow.cluster.launcher import LaunchConfig, Launcher
from psflow.env import PSFLOW_PRELOAD, text, threads_per_task


def launch(args: argparse.Namespace) -> int:
    """Runs every task of the job; the exit status is the first failed task's, else 0."""
    # Checked here, once: otherwise every task would fail alike with Python's own message.
    if not os.path.exists(args.script):
        raise FileNotFoundError(errno.ENOENT, "no such training script", args.script)
    if os.path.isdir(args.script):
        raise IsADirectoryError(errno.EISDIR, "a directory, not a training script", args.script)
    local = getattr(args, "backend", "local") == "local"
    preload = getattr(args, "preload", None)
    if preload and not local:
        raise ValueError("--preload forks local processes: Ray starts its own actors")
    if preload is None and local:
        preload = text(PSFLOW_PRELOAD, "")
    planned = args.ps is None
    ps = planned_ps(args.workers, args.mode) if planned else args.ps
    config = LaunchConfig(
        script=args.script,
        args=args.args,
        ps=ps,
        workers=args.workers,
        chief=args.chief,
        evaluators=int(args.evaluator),
        host=args.host,
        ps_exit_timeout=args.ps_exit_timeout,
        grace=args.grace,
        mode=args.mode,
        max_restarts=args.max_restarts,
        insecure=args.insecure,
        metrics=args.metrics,
        progress=args.progress,
        bind_cores=args.bind_cores,
        ps_threads=args.ps_threads,
        trainer_gpus=args.gpus_per_task,
        preload=[m.strip() for m in (preload or "").split(",") if m.strip()],
    )
    if getattr(args, "backend", "local") == "ray":
        # What only a local job has: refused rather than ignored.
        if args.bind_cores:
            raise ValueError("--bind-cores binds local processes: give Ray --cpus-per-task")
        if args.ps_threads is not None:
            raise ValueError("--ps-threads is the local launcher's: on Ray a ps serves with its "
                             "--cpus-per-task")  # fmt: skip
        if args.host != "127.0.0.1":
            raise ValueError("--host is the local launcher's: on Ray each task listens on its node")
        # Imported here: Ray is an optional extra (psflow[ray]).
        from psflow.cluster.ray_backend import RayLauncher, RayOptions

        options = RayOptions(
            address=args.address,
            strategy=args.placement,
            task_cpus=args.cpus_per_task,
            trainer_gpus=args.gpus_per_task,
            node_ip=args.node_ip,
        )
        ray = RayLauncher(config, options)
        if planned and ps:
            _say_plan(args, ps, local=False)
        return ray.run()
    launcher = Launcher(config)
    if planned and ps:
        _say_plan(args, ps, local=True)
    return launcher.run()


def _say_plan(args: argparse.Namespace, ps: int, *, local: bool) -> None:
    """Prints the ps tasks chosen without ``--ps`` (once the job's flags were all accepted)."""
    plan = f"{ps} ps for {args.workers} workers (one to every {WORKERS_PER_PS})"
    if local:
        tasks = ps + args.workers + int(args.chief) + int(args.evaluator)
        threads = threads_per_task(tasks)
        plan += (
            f", {threads} thread{'' if threads == '1' else 's'} a task on {len(host_cpus())} cores"
        )
        if args.ps_threads is not None:
            plan += f" ({args.ps_threads} a ps, --ps-threads)"
    print(f"psflow launch: {plan}; --ps N chooses another count", file=sys.stderr)
