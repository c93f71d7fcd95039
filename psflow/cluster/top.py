"""``psflow top``: a live view of a running job, one row per task, from the tasks' metrics.

Where the tasks are: the ``psflow launch`` job running on this machine (its job file,
:mod:`psflow.cluster.jobs`; ``--pid`` picks one of several), or the cluster of a cluster file or
``TF_CONFIG``, every task serving its metrics on one port (``--metrics-port``, or
``PSFLOW_METRICS_PORT``) at its own host, as the rendered manifests set it up.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.live import Live

from psflow import env as envvars
from psflow import metrics
from psflow.cluster import jobs
from psflow.cluster.spec import ClusterSpec, parse_address
from psflow.cluster.watch import JobView, task_names, top_table


def targets_of(args: argparse.Namespace) -> tuple[dict[str, str], str]:
    """Task to metrics ``host:port``, and a title for the view.

    Raises:
        ValueError: when no job is found, or several and no ``--pid`` says which.
    """
    tf_config = envvars.text(envvars.TF_CONFIG)
    if args.cluster_file or (args.pid is None and tf_config):
        if args.cluster_file:
            cluster, _ = ClusterSpec.from_file(args.cluster_file)
            source = args.cluster_file
        else:
            assert tf_config is not None
            cluster, _ = ClusterSpec.from_tf_config(tf_config)
            source = envvars.TF_CONFIG
        port = args.metrics_port if args.metrics_port is not None else metrics.metrics_port()
        if not port:
            raise ValueError(
                f"give --metrics-port (or {envvars.PSFLOW_METRICS_PORT}): the port every task of "
                f"{source} serves its metrics on"
            )
        names = task_names(cluster.jobs)
        addresses = [a for _, addrs in cluster.jobs.items() for a in addrs]
        out = {}
        for name, address in zip(names, addresses, strict=True):
            host = parse_address(address)[0]
            out[name] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return out, source
    running = jobs.running_jobs()
    if args.pid is not None:
        running = [j for j in running if j.pid == args.pid]
        if not running:
            raise ValueError(
                f"no psflow launch job of pid {args.pid} runs on this machine "
                f"(job files in {jobs.jobs_dir()})"
            )
    if not running:
        raise ValueError(
            "no psflow launch job runs on this machine (none in "
            f"{jobs.jobs_dir()}): give --cluster-file or set TF_CONFIG for another job"
        )
    if len(running) > 1:
        listed = "; ".join(f"--pid {j.pid}: {j.script}" for j in running)
        raise ValueError(f"{len(running)} psflow launch jobs run here; pick one: {listed}")
    job = running[0]
    if not job.metrics:
        raise ValueError(f"the job of pid {job.pid} serves no metrics (psflow launch --no-metrics)")
    return dict(job.metrics), f"{job.script} (pid {job.pid})"


def top(args: argparse.Namespace) -> int:
    """Shows the view until Ctrl-C (``--once``: one view, printed)."""
    if args.interval <= 0:
        raise ValueError(f"--interval must be > 0 seconds, got {args.interval}")
    targets, title = targets_of(args)
    view = JobView(targets)
    console = Console()
    if not console.is_terminal:  # a pipe or a log: the table's own width, not rich's 80 columns
        console = Console(width=1000)
    try:
        if args.once:
            view.poll()
            time.sleep(args.interval)
            console.print(top_table(*view.poll(), title))
            return 0
        with Live(console=console, refresh_per_second=4, screen=False) as live:
            while True:
                live.update(top_table(*view.poll(), title))
                time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        view.close()
