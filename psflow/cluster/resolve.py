"""Finding this process's cluster and task: flags, ``TF_CONFIG`` or a cluster file.

Precedence, lowest first: a cluster file (``--cluster_file`` or ``PSFLOW_CLUSTER_FILE``) <
``TF_CONFIG`` < the classic flags. A later source replaces the cluster of an earlier one whole;
``--job_name``/``--task_index`` alone override only the task.

A mistake in any of them is a ``ValueError`` naming where it was found; a script's own
``psflow.resolve()`` turns it into one line, ``train.py: error: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

from psflow import env as envvars
from psflow.cluster import logs
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
    *,
    exit_on_error: bool | None = None,
) -> tuple[TaskContext, list[str]]:
    """This process's :class:`TaskContext`, and the arguments left for the script.

    Only the flags above are taken, by their exact names (``--flag value`` or ``--flag=value``);
    every other argument is returned untouched and in order, so that the script can parse its
    own, ``--job`` or ``--cluster`` included.

    Args:
        argv: the arguments to read (default ``sys.argv[1:]``).
        environ: where ``TF_CONFIG`` and ``PSFLOW_CLUSTER_FILE`` are read (default ``os.environ``).
        exit_on_error: on a mistake (an unknown job, an index out of range, a bad ``TF_CONFIG``),
            print ``PROG: error: MESSAGE`` on stderr and exit with status 2, as argparse does for
            a bad flag, instead of raising. Default: when ``argv`` is ``None``, that is when this
            reads the script's own command line, whose user needs the message, not a traceback.
            ``PSFLOW_LOG_LEVEL=DEBUG`` raises all the same, traceback and all.

    psflow's own log lines show from here on, at ``PSFLOW_LOG_LEVEL`` (INFO by default),
    whether or not the script configures logging (:mod:`psflow.cluster.logs`).

    Raises:
        ValueError: when no source gives a cluster, or what is given is inconsistent; the message
            names the source (flags, ``TF_CONFIG`` or the cluster file).
    """
    ctx, rest = _resolve_or_exit(argv, environ, exit_on_error, alone=False)
    assert ctx is not None
    return ctx, rest


def resolve_or_alone(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    exit_on_error: bool | None = None,
) -> tuple[TaskContext, list[str]]:
    """Like :func:`resolve`, but a script given no cluster at all (no flags, no ``TF_CONFIG``,
    no cluster file) runs alone: the context is a cluster of one
    (:meth:`TaskContext.alone`, this process its chief, no ps), and a
    :class:`~psflow.train.TrainingSession` over it trains in this one process, as
    ``python script.py`` users expect, with the same script.

    Example:
        >>> ctx, argv = resolve_or_alone(["--lr", "0.1"], {})
        >>> ctx.is_alone, argv
        (True, ['--lr', '0.1'])
    """
    ctx, args = _resolve_or_exit(argv, environ, exit_on_error, alone=True)
    return (TaskContext.alone() if ctx is None else ctx), args


class _NoClusterError(ValueError):
    """No source gives a cluster."""


def _resolve_or_exit(
    argv: Sequence[str] | None,
    environ: Mapping[str, str] | None,
    exit_on_error: bool | None,
    *,
    alone: bool,
) -> tuple[TaskContext | None, list[str]]:
    if exit_on_error is None:
        exit_on_error = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    level = envvars.text(envvars.PSFLOW_LOG_LEVEL, environ=environ) or ""
    debug = level.strip().upper() == "DEBUG"
    try:
        logs.configure(environ)
        return _resolve(args, environ)
    except _NoClusterError:
        if alone:
            return None, args
        error: ValueError = _NoClusterError(_NO_CLUSTER)
        if not exit_on_error or debug:
            raise
    except ValueError as e:
        error = e
        if not exit_on_error or debug:
            raise
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "psflow"
    print(f"{prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


_NO_CLUSTER = (
    "no cluster given: pass --ps_hosts/--worker_hosts with --job_name/--task_index, "
    "set TF_CONFIG, or give --cluster_file (or start the job with `psflow launch`)"
)


def _resolve(
    argv: Sequence[str], environ: Mapping[str, str] | None
) -> tuple[TaskContext, list[str]]:
    # allow_abbrev=False: argparse would otherwise take the script's --cluster for --cluster_file
    # and its --job for --job_name (prefix matching), and leave the script without them.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_cluster_flags(parser)
    try:
        args, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    hint = _misspelt(rest, [o for a in parser._actions for o in a.option_strings])
    try:
        return _context(args, environ), rest
    except _NoClusterError:
        if not hint and args.job_name is None and args.task_index is None:
            raise
        # A task named, or a cluster flag misspelt: an error, never a cluster of one.
        raise ValueError(f"{_NO_CLUSTER}{hint}") from None
    except ValueError as e:
        if not hint:
            raise
        raise ValueError(f"{e}{hint}") from None


def _misspelt(rest: Sequence[str], flags: Sequence[str]) -> str:
    """A hint for the first argument left to the script that looks like a misspelt cluster
    flag (``--ps_host`` for ``--ps_hosts``), or ``""``."""
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name.startswith("--"):
            close = difflib.get_close_matches(name, flags, n=1, cutoff=0.8)
            if close:
                return f" (did you mean {close[0]}, not {name}?)"
    return ""


def _context(args: argparse.Namespace, environ: Mapping[str, str] | None) -> TaskContext:
    cluster: ClusterSpec | None = None
    task: TaskSpec | None = None
    source = ""
    task_source = ""

    cluster_file = args.cluster_file or envvars.text(envvars.PSFLOW_CLUSTER_FILE, environ=environ)
    if cluster_file:
        source = f"cluster file {cluster_file!r}"
        with _naming(source):
            cluster, task = ClusterSpec.from_file(cluster_file)
        task_source = source
    tf_config = envvars.text(envvars.TF_CONFIG, environ=environ)
    if tf_config:
        source = task_source = envvars.TF_CONFIG
        with _naming(source):
            cluster, task = ClusterSpec.from_tf_config(tf_config)
    if args.ps_hosts is not None or args.worker_hosts is not None or args.chief_host:
        source = "the flags"
        cluster = ClusterSpec.from_flags(
            ps_hosts=args.ps_hosts, worker_hosts=args.worker_hosts, chief_host=args.chief_host
        )
    if args.job_name is not None or args.task_index is not None:
        if args.job_name is None and task is None:
            raise ValueError("--task_index given without --job_name")
        task_source = "the flags"
        task = TaskSpec(
            job=args.job_name or (task.job if task else ""),
            index=args.task_index if args.task_index is not None else 0,
        )
    if cluster is None:
        raise _NoClusterError(_NO_CLUSTER)
    if task is None:
        raise ValueError(f"the cluster comes from {source} but no task does: pass --job_name")
    if task.job == "evaluator" and "evaluator" not in cluster.jobs:
        cluster = ClusterSpec(jobs=cluster.jobs, evaluators=max(cluster.evaluators, task.index + 1))
    try:
        return TaskContext(cluster=cluster, task=task)
    except ValueError as e:
        if source == task_source:
            raise
        # Two sources disagree, e.g. a TF_CONFIG left in the shell and the flags of this run.
        raise ValueError(
            f"{e} (the cluster comes from {source}, the task from {task_source})"
        ) from None


@contextlib.contextmanager
def _naming(source: str) -> Iterator[None]:
    """Puts ``source`` in front of a ``ValueError`` raised while reading it, unless it is named."""
    try:
        yield
    except ValueError as e:
        if source in str(e):
            raise
        raise ValueError(f"{source}: {e}") from None
