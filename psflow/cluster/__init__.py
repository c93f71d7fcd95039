"""The cluster: who the tasks are, where they listen, and starting them all on one machine.

- ``spec.py``: :class:`ClusterSpec`, :class:`TaskSpec`, :class:`TaskContext`; ``TF_CONFIG`` in and out.
- ``resolve.py``: :func:`resolve`: this process's task from flags, ``TF_CONFIG`` or a file.
- ``logs.py``: psflow's own log lines in a task, shown without the script configuring logging.
- ``shmfiles.py``: the names of a task's shared-memory files, and removing a dead task's.
- ``keys.py``: :func:`~psflow.cluster.keys.generate_keys`, a job's CurveZMQ key files.
- ``launch_config.py``: :class:`~psflow.cluster.launch_config.LaunchConfig`: what ``psflow launch``
  starts.
- ``launcher.py``: :class:`~psflow.cluster.launcher.Launcher`: ``psflow launch``, every task as a
  local process; the job loop. Its parts (mixins): ``launch_start.py``, starting a task's process
  (again after it failed) and relaying its output; ``launch_stop.py``, stopping the tasks (SIGTERM,
  SIGKILL) and removing the shared-memory files they left; ``launch_metrics.py``, the tasks'
  metrics ports, the job file ``psflow top`` reads, the progress line.
- ``forkserver.py``: ``psflow launch --preload``: tasks forked from a server that imported torch
  once; :class:`~psflow.cluster.forkserver.ForkServer` and
  :class:`~psflow.cluster.forkserver.ForkedTask`, the launcher's side of it.
  ``forkserver_process.py``: the server's own process, and each task it forks.
- ``ray_backend.py``: :class:`~psflow.cluster.ray_backend.RayLauncher`: ``psflow launch --backend
  ray``, every task as a Ray actor; ``ray_actor.py``: the actor that runs one task's script.
- ``ports.py``: free ports below the ephemeral range; :func:`~psflow.cluster.ports.local_cluster`.
- ``cores.py``: the cores each local task is bound to (``--bind-cores``) and its thread count.
- ``progress.py``: ``psflow launch``'s live progress line below the tasks' output.
- ``cli.py``: what ``psflow launch`` runs (its flags are in :mod:`psflow.cli`).
- ``jobs.py``: the job files ``psflow launch`` leaves for ``psflow top`` while it runs.
- ``watch.py``: a running job seen through its tasks' metrics (rates, rows, the progress line).
- ``top.py``: ``psflow top``, a live view of a job, one row per task.
"""

from psflow.cluster.resolve import add_cluster_flags, resolve, resolve_or_alone
from psflow.cluster.spec import JOBS, ClusterSpec, TaskContext, TaskSpec, parse_address

__all__ = [
    "JOBS",
    "ClusterSpec",
    "TaskContext",
    "TaskSpec",
    "add_cluster_flags",
    "parse_address",
    "resolve",
    "resolve_or_alone",
]
