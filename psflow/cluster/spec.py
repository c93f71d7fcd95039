"""The cluster spec and the identity of one task.

A cluster maps job names (`chief`, `ps`, `worker`, `evaluator`) to lists of ``host:port``
addresses, exactly as TensorFlow's ``tf.train.ClusterSpec`` and the ``TF_CONFIG`` variable do.
It can be read from the classic flags, from ``TF_CONFIG`` or from a YAML/JSON file, and written
back to ``TF_CONFIG``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

JOBS = ("chief", "ps", "worker", "evaluator")
"""The job names psflow knows, in TensorFlow's vocabulary."""

_JOB_ALIASES = {"master": "chief"}
_HOST_RE = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>[0-9]+)$"
)


def parse_address(address: str) -> tuple[str, int]:
    """Splits ``host:port`` (or ``[ipv6]:port``) and checks both parts.

    Raises:
        ValueError: naming the address when it is not ``host:port`` with a port in 1..65535.
    """
    if not isinstance(address, str):
        raise ValueError(f"address {address!r} is not a string of the form host:port")
    m = _HOST_RE.match(address.strip())
    if m is None:
        raise ValueError(f"malformed address {address!r}: expected host:port, e.g. localhost:2222")
    port = int(m.group("port"))
    if not 1 <= port <= 65535:
        raise ValueError(f"malformed address {address!r}: port {port} is not in 1..65535")
    return m.group("v6") or m.group("host"), port


def _canonical_job(job: str) -> str:
    job = _JOB_ALIASES.get(job, job)
    if job not in JOBS:
        close = difflib.get_close_matches(job, (*JOBS, *_JOB_ALIASES), n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown job {job!r}{guess}: expected one of {', '.join(JOBS)} (or 'master')"
        )
    return job


ALONE_ADDRESS = "localhost:2222"
"""The chief's address in a cluster of one (:meth:`TaskContext.alone`): nothing binds it."""
_ALONE = "alone"


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """One task of the cluster: its job and its index within the job."""

    job: str
    """The job name, one of :data:`JOBS`."""
    index: int = 0
    """The task's index within its job."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "job", _canonical_job(self.job))
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"task index {self.index!r} must be an integer >= 0")

    def __str__(self) -> str:
        return f"{self.job}:{self.index}"


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The jobs of a cluster and their task addresses.

    Example:
        >>> spec = ClusterSpec(jobs={"ps": ["localhost:2222"], "worker": ["localhost:2223"]})
        >>> spec.num_tasks("worker"), spec.address(TaskSpec(job="ps", index=0))
        (1, 'localhost:2222')
    """

    jobs: Mapping[str, Sequence[str]]
    """Job name to the list of ``host:port`` addresses of its tasks, in index order."""
    evaluators: int = 0
    """Evaluator tasks that run outside the cluster (TensorFlow keeps them out of ``cluster``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.jobs, Mapping):
            raise ValueError(f"cluster must map job names to address lists, got {self.jobs!r}")
        jobs: dict[str, tuple[str, ...]] = {}
        seen: dict[str, str] = {}
        for raw_job, addresses in self.jobs.items():
            job = _canonical_job(str(raw_job))
            if job in jobs:
                raise ValueError(f"job {job!r} is given twice (is 'master' given beside 'chief'?)")
            if isinstance(addresses, str) or not isinstance(addresses, Sequence):
                raise ValueError(f"job {job!r} must list its addresses, got {addresses!r}")
            if len(addresses) == 0:
                raise ValueError(f"job {job!r} has no hosts: give at least one host:port")
            if job == "chief" and len(addresses) != 1:
                raise ValueError(f"job 'chief' must have exactly one task, got {len(addresses)}")
            for i, address in enumerate(addresses):
                parse_address(address)
                if address in seen:
                    raise ValueError(
                        f"duplicate address {address!r}: used by {seen[address]} and {job}:{i}"
                    )
                seen[address] = f"{job}:{i}"
            jobs[job] = tuple(addresses)
        if "worker" not in jobs and "chief" not in jobs:
            raise ValueError("cluster has no worker: give at least one worker (or a chief) task")
        if self.evaluators < 0:
            raise ValueError(f"evaluators must be >= 0, got {self.evaluators}")
        object.__setattr__(self, "jobs", {j: jobs[j] for j in JOBS if j in jobs})

    # -- queries ---------------------------------------------------------------------------

    def num_tasks(self, job: str) -> int:
        """The number of tasks in ``job`` (0 when the job is absent)."""
        job = _canonical_job(job)
        if job == "evaluator" and job not in self.jobs:
            return self.evaluators
        return len(self.jobs.get(job, ()))

    def address(self, task: TaskSpec) -> str:
        """The ``host:port`` of ``task``."""
        self.check_task(task)
        return self.jobs[task.job][task.index]

    def addresses(self, job: str) -> tuple[str, ...]:
        """All addresses of ``job``, in index order."""
        return tuple(self.jobs.get(_canonical_job(job), ()))

    def check_task(self, task: TaskSpec) -> None:
        """Raises ``ValueError`` unless ``task`` is a task of this cluster."""
        n = self.num_tasks(task.job)
        if n == 0:
            raise ValueError(
                f"task {task} names job {task.job!r}, which this cluster does not have"
            )
        if task.index >= n:
            raise ValueError(
                f"task index {task.index} out of range: job {task.job!r} has {n} task(s)"
            )

    def tasks(self) -> list[TaskSpec]:
        """Every task of the cluster (evaluators included), chief first."""
        out = [TaskSpec(job=job, index=i) for job, a in self.jobs.items() for i in range(len(a))]
        if "evaluator" not in self.jobs:
            out += [TaskSpec(job="evaluator", index=i) for i in range(self.evaluators)]
        return out

    @property
    def chief(self) -> TaskSpec:
        """The chief: the ``chief`` task when there is one, else ``worker:0`` (TensorFlow's rule)."""
        return TaskSpec(job="chief" if "chief" in self.jobs else "worker", index=0)

    @property
    def trainers(self) -> list[TaskSpec]:
        """The tasks that compute gradients: the chief (if a separate job) then every worker."""
        out = [TaskSpec(job="chief", index=0)] if "chief" in self.jobs else []
        return out + [TaskSpec(job="worker", index=i) for i in range(self.num_tasks("worker"))]

    # -- conversions -----------------------------------------------------------------------

    def as_dict(self) -> dict[str, list[str]]:
        """The ``cluster`` part of ``TF_CONFIG``."""
        return {job: list(addresses) for job, addresses in self.jobs.items()}

    def to_tf_config(self, task: TaskSpec) -> str:
        """``TF_CONFIG`` JSON for ``task``, in the schema TensorFlow and Kubeflow use."""
        self.check_task(task)
        return json.dumps(
            {"cluster": self.as_dict(), "task": {"type": task.job, "index": task.index}},
            sort_keys=True,
        )

    @classmethod
    def from_flags(
        cls,
        *,
        ps_hosts: str | Sequence[str] | None,
        worker_hosts: str | Sequence[str] | None,
        chief_host: str | None = None,
    ) -> ClusterSpec:
        """The cluster from the classic comma-separated ``--ps_hosts --worker_hosts`` flags."""
        jobs: dict[str, list[str]] = {}
        if chief_host:
            jobs["chief"] = [chief_host]
        if ps_hosts is not None:
            jobs["ps"] = _split_hosts(ps_hosts)
        if worker_hosts is not None:
            jobs["worker"] = _split_hosts(worker_hosts)
        return cls(jobs=jobs)

    @classmethod
    def from_tf_config(cls, tf_config: str | Mapping[str, Any]) -> tuple[ClusterSpec, TaskSpec]:
        """The cluster and this task from ``TF_CONFIG`` (a JSON string or an already-parsed dict).

        ``master`` is read as ``chief``; an ``evaluator`` task may stand outside ``cluster``.
        """
        if isinstance(tf_config, str):
            try:
                config = json.loads(tf_config)
            except json.JSONDecodeError as e:
                raise ValueError(f"TF_CONFIG is not valid JSON: {e}") from None
        else:
            config = dict(tf_config)
        if not isinstance(config, dict):
            raise ValueError(f"TF_CONFIG must be a JSON object, got {type(config).__name__}")
        cluster = config.get("cluster")
        if not isinstance(cluster, dict):
            raise ValueError("TF_CONFIG has no 'cluster' object mapping jobs to address lists")
        task_cfg = config.get("task")
        if not isinstance(task_cfg, dict) or "type" not in task_cfg:
            raise ValueError("TF_CONFIG has no 'task' object with 'type' and 'index'")
        task = TaskSpec(job=str(task_cfg["type"]), index=_as_index(task_cfg.get("index", 0)))
        in_cluster = {_canonical_job(str(j)) for j in cluster}
        evaluators = 0
        if task.job == "evaluator" and "evaluator" not in in_cluster:
            evaluators = task.index + 1
        spec = cls(jobs=cluster, evaluators=evaluators)
        spec.check_task(task)
        return spec, task

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> tuple[ClusterSpec, TaskSpec | None]:
        """The cluster (and the task, when the file names one) from a YAML or JSON file.

        The file holds either a ``TF_CONFIG``-shaped object (``cluster`` and optional ``task``)
        or just the ``cluster`` mapping itself.
        """
        p = Path(path)
        data = read_yaml(p, "cluster file")
        if not isinstance(data, dict):
            raise ValueError(f"cluster file {str(p)!r} must hold a mapping of jobs to addresses")
        if "cluster" not in data:
            return cls(jobs=data), None
        if "task" in data:
            return cls.from_tf_config(data)
        return cls(jobs=data["cluster"]), None


def read_yaml(path: str | os.PathLike[str], kind: str) -> Any:
    """The parsed contents of a YAML (or JSON: YAML is its superset) file.

    Raises:
        ValueError: naming the ``kind`` of file and its path when it cannot be read or parsed.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {kind} {str(p)!r}: {e.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{kind} {str(p)!r} is not valid YAML or JSON: {e}") from None


def _split_hosts(hosts: str | Sequence[str]) -> list[str]:
    if isinstance(hosts, str):
        return [h.strip() for h in hosts.split(",") if h.strip()]
    return list(hosts)


def _as_index(value: Any) -> int:
    # An int, or its decimal digits as a string (as some TF_CONFIG writers give it); never a
    # float int() would cut (0.9 is task 0) nor a bool (true is task 1).
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value.strip())
    raise ValueError(f"task index {value!r} is not an integer")


@dataclass(frozen=True, kw_only=True)
class TaskContext:
    """Where this process stands: the cluster and its own task within it."""

    cluster: ClusterSpec
    """The whole cluster."""
    task: TaskSpec
    """This process's task."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the source carried (unused by psflow itself)."""

    def __post_init__(self) -> None:
        self.cluster.check_task(self.task)

    @property
    def is_chief(self) -> bool:
        """True for the task that initialises, restores, checkpoints and writes summaries."""
        return self.task == self.cluster.chief

    @property
    def is_evaluator(self) -> bool:
        """True for an ``evaluator`` task (``TF_CONFIG``'s ``task.type``): it trains nothing and
        scores each checkpoint the chief writes (:class:`psflow.Evaluator`)."""
        return self.task.job == "evaluator"

    @property
    def job(self) -> str:
        return self.task.job

    @property
    def index(self) -> int:
        return self.task.index

    @property
    def address(self) -> str | None:
        """This task's own address (``None`` for an evaluator outside the cluster)."""
        if self.task.job == "evaluator" and "evaluator" not in self.cluster.jobs:
            return None
        return self.cluster.address(self.task)

    @property
    def host(self) -> str | None:
        """The host of this task's own address (what its servers bind), without a port."""
        address = self.address
        return None if address is None else parse_address(address)[0]

    @classmethod
    def alone(cls) -> TaskContext:
        """A cluster of one: this process is its chief, and there is no ps. What
        :func:`~psflow.cluster.resolve_or_alone` gives a script started with no cluster; a
        :class:`~psflow.train.TrainingSession` over it trains in this process
        (:mod:`psflow.train.alone`). Nothing binds its address.

        Example:
            >>> ctx = TaskContext.alone()
            >>> ctx.is_chief, ctx.is_alone, ctx.worker_index, ctx.num_workers
            (True, True, 0, 1)
        """
        return cls(
            cluster=ClusterSpec(jobs={"chief": [ALONE_ADDRESS]}),
            task=TaskSpec(job="chief", index=0),
            extra={_ALONE: True},
        )

    @property
    def is_alone(self) -> bool:
        """True in a cluster of one (:meth:`alone`)."""
        return bool(self.extra.get(_ALONE))

    @property
    def worker_index(self) -> int:
        """This task's place among the tasks that train (the chief first, then each worker):
        the shard of the data it reads, of :attr:`num_workers`.

        Raises:
            ValueError: on a task that trains nothing (a ps, an evaluator).
        """
        trainers = self.cluster.trainers
        if self.task not in trainers:
            raise ValueError(f"{self.task} trains nothing: it has no share of the data")
        return trainers.index(self.task)

    @property
    def num_workers(self) -> int:
        """The tasks that train (the chief included): how many shards the data splits into."""
        return len(self.cluster.trainers)
