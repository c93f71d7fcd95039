"""Finding this process's cluster and task: flags, ``TF_CONFIG`` or a cluster file.

Precedence, lowest first: a cluster file (``--cluster_file`` or ``PSFLOW_CLUSTER_FILE``) <
``TF_CONFIG`` < the classic flags. A later source replaces the cluster of an earlier one whole;
``--job_name``/``--task_index`` alone override only the task.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from psflow import env as envvars
from psflow.cluster.spec import ClusterSpec, TaskContext, TaskSpec


def add_cluster_flags(parser: argparse.ArgumentParser) -> None:
    """Adds TensorFlow's classic cluster flags to ``parser``."""
    g = parser.add_argument_group("cluster (TensorFlow's classic flags)")
    g.add_argument("--ps_hosts", help="comma-separated host:port list of the ps tasks")
    g.add_argument("--worker_hosts", help="comma-separated host:port list of the worker tasks")
    g.add_argument("--chief_host", help="host:port of a separate chief task")
    g.add_argument("--job_name", help="this task's job: chief, ps, worker or evaluator")
    g.add_argument("--task_index", type=int, help="this task's index within its job")
    g.add_argument("--cluster_file", help="YAML or JSON file with the cluster (and task)")


def resolve(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[TaskContext, list[str]]:
    """This process's :class:`TaskContext`, and the arguments left for the script.

    Unknown arguments are returned untouched so that the user's script can parse its own.

    Raises:
        ValueError: when no source gives a cluster, or what is given is inconsistent.
    """
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(add_help=False)
    add_cluster_flags(parser)
    args, rest = parser.parse_known_args(argv)

    cluster: ClusterSpec | None = None
    task: TaskSpec | None = None
    source = ""

    cluster_file = args.cluster_file or environ.get(envvars.PSFLOW_CLUSTER_FILE)
    if cluster_file:
        cluster, task = ClusterSpec.from_file(cluster_file)
        source = f"cluster file {cluster_file!r}"
    tf_config = environ.get(envvars.TF_CONFIG)
    if tf_config:
        cluster, task = ClusterSpec.from_tf_config(tf_config)
        source = "TF_CONFIG"
    if args.ps_hosts is not None or args.worker_hosts is not None or args.chief_host:
        cluster = ClusterSpec.from_flags(
            ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts, chief_host=args.chief_host
        )
        source = "flags"
    if args.job_name is not None or args.task_index is not None:
        if args.job_name is None and task is None:
            raise ValueError("--task_index given without --job_name")
        task = TaskSpec(
            job=args.job_name or (task.job if task else ""),
            index=args.task_index if args.task_index is not None else 0,
        )
    if cluster is None:
        raise ValueError(
            "no cluster given: pass --ps_hosts/--worker_hosts with --job_name/--task_index, "
            "set TF_CONFIG, or give --cluster_file (or start the job with `psflow launch`)"
        )
    if task is None:
        raise ValueError(f"the cluster comes from {source} but no task does: pass --job_name")
    if task.job == "evaluator" and "evaluator" not in cluster.jobs:
        cluster = ClusterSpec(jobs=cluster.jobs, evaluators=max(cluster.evaluators, task.index + 1))
    return TaskContext(cluster=cluster, task=task), rest
