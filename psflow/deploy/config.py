"""The job description that ``psflow render`` turns into manifests.

One :class:`JobConfig` holds everything a target needs. Precedence, lowest first: the field
defaults < a YAML job file (:func:`load_job_file`) < command-line flags; :meth:`JobConfig.merged`
applies it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psflow import env as envvars
from psflow.cluster.spec import read_yaml
from psflow.deploy.quantity import quantity_setting
from psflow.deploy.settings import check_settings

DNS_LABEL_MAX = 63
"""Kubernetes (and Mesos-DNS) limit on one DNS label: every task name must fit in it."""

_DNS1035_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN_RE = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The environment variables that the renderer sets itself; a user's `env` may not shadow them.
_RESERVED_ENV = (envvars.TF_CONFIG, envvars.PSFLOW_KEYS_DIR, envvars.PSFLOW_LOGDIR)


def _check_dns(value: Any, *, what: str, pattern: re.Pattern[str], kind: str) -> None:
    if not isinstance(value, str) or not pattern.match(value) or len(value) > 253:
        raise ValueError(
            f"{what} {value!r} is not a valid {kind}: use lowercase letters, digits and '-'"
            + (", starting with a letter" if pattern is _DNS1035_RE else "")
        )


def _check_int(value: Any, *, what: str, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{what} must be in {low}..{high}, got {value!r}")


def _check_str_list(value: Any, *, what: str) -> None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of strings, got {value!r}")


@dataclass(kw_only=True)
class JobConfig:
    """A training job, independent of where it runs.

    Example:
        >>> job = JobConfig(name="mnist", image="psflow:0.1.0", ps=2, workers=4, script="train.py")
        >>> job.task_name("worker", 3)
        'mnist-worker-3'
    """

    name: str
    """The job's name: a DNS-1035 label, the prefix of every task name (``<name>-<job>-<i>``)."""
    image: str
    """The container image every task runs (build it from the repository's ``Dockerfile``)."""
    ps: int = 1
    """Parameter-server tasks."""
    workers: int = 2
    """Worker tasks."""
    chief: bool = False
    """Whether a separate chief task runs (otherwise worker 0 is the chief)."""
    evaluators: int = 0
    """Evaluator tasks (outside the training cluster, as TensorFlow keeps them)."""
    port: int = 2222
    """The port every task listens on, in its own container or pod."""
    script: str | None = None
    """The training script, run as ``python SCRIPT ARGS`` (give this or ``command``)."""
    args: list[str] = field(default_factory=list)
    """Arguments after the script."""
    command: list[str] | None = None
    """A whole command line to run instead of ``python SCRIPT ARGS``."""
    gpus: int = 0
    """GPUs for each training task (workers and chief), as ``nvidia.com/gpu`` limits."""
    cpu: str | None = None
    """CPU request of every task, a Kubernetes quantity (``500m``, ``2``)."""
    memory: str | None = None
    """Memory request of every task, a Kubernetes quantity (``512Mi``, ``4Gi``)."""
    logdir: str = "/logs"
    """Where checkpoints and summaries go inside the container (``PSFLOW_LOGDIR``)."""
    logdir_claim: str | None = None
    """Kubernetes: PersistentVolumeClaim holding the logdir (an emptyDir per pod when unset)."""
    logdir_host_dir: str | None = None
    """Compose and Marathon: host directory holding the logdir."""
    keys_secret: str | None = None
    """Kubernetes: Secret holding the CurveZMQ keys (``kubectl create secret generic``)."""
    keys_host_dir: str | None = None
    """Compose and Marathon: host directory made by ``psflow keys generate``."""
    keys_mount: str = "/etc/psflow/keys"
    """Where the keys appear inside the container (``PSFLOW_KEYS_DIR``), read-only."""
    namespace: str | None = None
    """Kubernetes namespace of every object (kubectl's current namespace when unset)."""
    tensorboard: bool = False
    """Also run TensorBoard on the logdir (needs a shared logdir)."""
    metrics_port: int = 9090
    """The port every task serves its Prometheus metrics on (``PSFLOW_METRICS_PORT``, at the
    task's own address); the Kubernetes pods carry ``prometheus.io/scrape`` annotations for it.
    0: no metrics. Marathon tasks share their agents' network and get none."""
    pod_monitor: bool = False
    """Kubernetes and TFJob: also a ``PodMonitor`` for the Prometheus operator."""
    backoff_limit: int = 6
    """Kubernetes Job and TFJob: retries of a failing task before the job fails."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every task (e.g. ``PSFLOW_TIMEOUT``)."""
    mode: str | None = None
    """Training mode of every task (``PSFLOW_MODE``: async, sync, allreduce); a ps mode needs a
    ps, allreduce none. ``None`` leaves it to the script."""
    cpu_limit: str | None = None
    """CPU limit of every task, a Kubernetes quantity (compose: ``deploy.resources.limits``)."""
    memory_limit: str | None = None
    """Memory limit of every task, a Kubernetes quantity (above it the pod is OOM-killed)."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Kubernetes: node labels every pod must match (e.g. ``{node.kubernetes.io/instance-type:
    m7i.4xlarge}``)."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Kubernetes: taints every pod tolerates (``key``, ``operator``, ``value``, ``effect``,
    ``tolerationSeconds``)."""
    priority_class: str | None = None
    """Kubernetes: the PriorityClass of every pod (and of Volcano's job)."""
    service_account: str | None = None
    """Kubernetes: the ServiceAccount every pod runs as (e.g. one bound to a cloud workload
    identity that may read the data bucket)."""
    data_claim: str | None = None
    """Kubernetes: PersistentVolumeClaim with the training data, mounted read-only at
    ``data_dir``."""
    data_host_dir: str | None = None
    """Compose and Marathon: host directory with the training data, read-only at ``data_dir``."""
    data_dir: str = "/data"
    """Where the data volume appears inside the container."""
    queue: str | None = None
    """Kubernetes, TFJob and Trainer: the Kueue LocalQueue (label ``kueue.x-k8s.io/queue-name``);
    Volcano: the Volcano queue."""
    image_pull_policy: str | None = None
    """Always, IfNotPresent or Never (compose: always, missing, never)."""
    image_pull_secrets: list[str] = field(default_factory=list)
    """Kubernetes: Secrets with the registry's credentials (``kubectl create secret
    docker-registry``)."""
    gang: str | None = None
    """Gang scheduling (all pods or none): ``volcano`` (kubernetes: a Volcano PodGroup; trainer:
    the runtime's podGroupPolicy) or ``coscheduling`` (trainer: the scheduler-plugins')."""
    quota: dict[str, Any] = field(default_factory=dict)
    """The quota the job must fit (``pods``, ``cpu``, ``memory``, ``nvidia.com/gpu``): a job
    asking more in all fails to render, as its gang could never be scheduled."""
    runtime_kind: str = "ClusterTrainingRuntime"
    """Trainer: the runtime kind, ``ClusterTrainingRuntime`` (cluster-wide) or
    ``TrainingRuntime`` (in ``namespace``)."""

    def __post_init__(self) -> None:
        _check_dns(self.name, what="name", pattern=_DNS1035_RE, kind="DNS-1035 label")
        _check_int(self.ps, what="ps", low=0)
        _check_int(self.workers, what="workers", low=0)
        _check_int(self.evaluators, what="evaluators", low=0)
        if not isinstance(self.chief, bool):
            raise ValueError(f"chief must be true or false, got {self.chief!r}")
        if self.workers == 0 and not self.chief:
            raise ValueError("the job has no worker: give workers >= 1 or a chief")
        _check_int(self.port, what="port", low=1, high=65535)
        _check_int(self.gpus, what="gpus", low=0)
        _check_int(self.backoff_limit, what="backoff_limit", low=0)
        longest = max(
            (self.task_name(job, n - 1) for job, n in self.counts().items() if n),
            key=len,
        )
        if self.tensorboard:
            longest = max(longest, f"{self.name}-tensorboard", key=len)
        if len(longest) > DNS_LABEL_MAX:
            raise ValueError(
                f"name {self.name!r} is too long: task name {longest!r} has {len(longest)} "
                f"characters, more than the {DNS_LABEL_MAX} a DNS label allows"
            )
        self._check_command()
        # YAML reads `cpu: 2` and `cpu: 0.5` as numbers; Kubernetes wants the quantity string.
        for attr in ("cpu", "memory"):
            quantity_setting(self, attr)
        for attr in ("logdir", "keys_mount"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value.startswith("/"):
                raise ValueError(f"{attr} {value!r} must be an absolute path in the container")
        if self.logdir_claim is not None:
            _check_dns(
                self.logdir_claim,
                what="logdir_claim",
                pattern=_DNS1123_SUBDOMAIN_RE,
                kind="PersistentVolumeClaim name",
            )
        if self.keys_secret is not None:
            _check_dns(
                self.keys_secret,
                what="keys_secret",
                pattern=_DNS1123_SUBDOMAIN_RE,
                kind="Secret name",
            )
        if self.namespace is not None:
            _check_dns(
                self.namespace, what="namespace", pattern=_DNS1123_LABEL_RE, kind="namespace"
            )
            if len(self.namespace) > DNS_LABEL_MAX:
                raise ValueError(f"namespace {self.namespace!r} is longer than 63 characters")
        for attr in ("logdir_host_dir", "keys_host_dir"):
            value = getattr(self, attr)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{attr} must be a non-empty path, got {value!r}")
        if not isinstance(self.tensorboard, bool):
            raise ValueError(f"tensorboard must be true or false, got {self.tensorboard!r}")
        _check_int(self.metrics_port, what="metrics_port", low=0, high=65535)
        if self.metrics_port == self.port:
            raise ValueError(
                f"metrics_port {self.metrics_port} is the tasks' port: give another (or 0: none)"
            )
        if not isinstance(self.pod_monitor, bool):
            raise ValueError(f"pod_monitor must be true or false, got {self.pod_monitor!r}")
        if self.pod_monitor and not self.metrics_port:
            raise ValueError("pod_monitor needs metrics: give a metrics_port other than 0")
        self._check_env()
        check_settings(self)

    def _check_command(self) -> None:
        if self.script is not None and self.command is not None:
            raise ValueError("give either a script (with args) or a command, not both")
        if self.script is None and self.command is None:
            raise ValueError("nothing to run: give the training script (or a command)")
        if self.script is not None and (not isinstance(self.script, str) or not self.script):
            raise ValueError(f"script must be a non-empty path, got {self.script!r}")
        _check_str_list(self.args, what="args")
        if self.command is not None:
            _check_str_list(self.command, what="command")
            if not self.command or not self.command[0]:
                raise ValueError(f"command {self.command!r} must name a program first")
            if self.args:
                raise ValueError("args go with a script; put them in the command instead")

    def _check_env(self) -> None:
        if not isinstance(self.env, dict):
            raise ValueError(f"env must map names to values, got {self.env!r}")
        for key, value in self.env.items():
            if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
                raise ValueError(f"env name {key!r} is not a valid environment variable name")
            if key in _RESERVED_ENV:
                raise ValueError(f"env may not set {key}: psflow render sets it for each task")
            if not isinstance(value, str):
                raise ValueError(f"env {key} must be a string, got {value!r} (quote it in YAML)")

    # -- derived ---------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Tasks per job, in the order :data:`psflow.cluster.JOBS` lists them."""
        return {
            "chief": int(self.chief),
            "ps": self.ps,
            "worker": self.workers,
            "evaluator": self.evaluators,
        }

    def task_name(self, job: str, index: int) -> str:
        """The stable name of a task: its Service, Job, compose service and host name."""
        return f"{self.name}-{job}-{index}"

    def argv(self) -> list[str]:
        """The command line every task runs."""
        if self.command is not None:
            return list(self.command)
        assert self.script is not None  # __post_init__ guarantees one of the two
        return ["python", self.script, *self.args]

    @classmethod
    def merged(
        cls,
        *,
        file: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        absolute_host_dirs: bool = False,
    ) -> JobConfig:
        """The config from a YAML job file (if any) overridden by ``overrides`` (the flags).

        ``None`` values in ``overrides`` mean "not given" and leave the file's value. What to
        run (``script`` with ``args``, or ``command``) is replaced as a whole. With
        ``absolute_host_dirs`` (compose: it would take a relative one from the compose file's
        own directory), a relative host directory (:data:`HOST_DIRS`) is made absolute from
        the job file's directory, or for a flag from the current one.

        Example:
            >>> JobConfig.merged(overrides={"name": "a", "image": "i", "script": "t.py"}).ps
            1
        """
        data: dict[str, Any] = load_job_file(file) if file is not None else {}
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        bases = [(data, Path(file).parent if file is not None else Path()), (given, Path())]
        for values, base in bases if absolute_host_dirs else ():
            for key in HOST_DIRS:
                if isinstance(values.get(key), str) and values[key]:
                    values[key] = os.path.abspath(base / values[key])
        if "script" in given or "command" in given:
            # What to run is one option: a script given by flag replaces the file's command.
            for key in ("script", "args", "command"):
                data.pop(key, None)
        data.update(given)
        for required in ("name", "image"):
            if required not in data:
                raise ValueError(
                    f"no {required}: pass --{required} or put `{required}:` in the job file"
                )
        return cls(**data)


HOST_DIRS = ("logdir_host_dir", "keys_host_dir", "data_host_dir")
"""The fields naming a directory of the host a compose or Marathon task mounts."""

FIELDS = tuple(f.name for f in dataclasses.fields(JobConfig))
"""Every key a job file may hold."""


def load_job_file(path: str | Path) -> dict[str, Any]:
    """The fields of a YAML job file, checked for unknown keys (``-`` may stand for ``_``).

    Raises:
        ValueError: when the file cannot be read, is not a YAML mapping, or has unknown keys.
    """
    p = Path(path)
    data = read_yaml(p, "job file")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"job file {str(p)!r} must hold a mapping of options to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELDS:
            raise ValueError(
                f"job file {str(p)!r}: unknown option {key!r}; known options: {', '.join(FIELDS)}"
            )
        out[name] = value
    return out
