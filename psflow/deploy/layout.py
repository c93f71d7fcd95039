"""Everything per task that a template needs, computed once in Python.

Templates stay declarative: names, addresses, ``TF_CONFIG`` and resource figures are decided here,
so that all four targets agree on them and the tests can check them without parsing Jinja.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal

from psflow.cluster import ClusterSpec, TaskSpec
from psflow.deploy.config import JobConfig
from psflow.deploy.quantity import parse_quantity
from psflow.deploy.targets import check_settings_for

TARGETS = ("kubernetes", "tfjob", "trainer", "volcano", "compose", "marathon")
"""What ``psflow render`` can produce."""

K8S_TARGETS = ("kubernetes", "tfjob", "trainer", "volcano")
"""The targets whose tasks are Kubernetes pods."""

TASK_INDEX_VAR = "PSFLOW_TASK_INDEX"
"""Trainer and Volcano: the pod's index within its job, from the downward API; Kubernetes
expands ``$(PSFLOW_TASK_INDEX)`` in the ``TF_CONFIG`` value after it, so one pod template gives
every pod its own ``TF_CONFIG`` (psflow itself never reads it)."""

INDEX_FIELDS = {
    # JobSet's child Jobs are Indexed: each pod carries its completion index.
    "trainer": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
    # Volcano's job controller annotates each pod with its index within its task.
    "volcano": "metadata.annotations['volcano.sh/task-index']",
}
"""Where a pod of each target finds its index (a downward-API field path)."""

TRAINER_NODE = "node"
"""Trainer v2 applies a TrainJob's image, args, numNodes and resourcesPerNode to the replicated
job labelled as the trainer step, in its container of this name: psflow's workers."""

TENSORBOARD_PORT = 6006
"""TensorBoard's own default port."""

# Marathon's defaults (0.1 cpu, 128 MiB) would get torch OOM-killed before it imports.
_MARATHON_DEFAULT_CPUS = 1.0
_MARATHON_DEFAULT_MEM_MIB = 1024


@dataclass(frozen=True, kw_only=True)
class Task:
    """One task as a target deploys it."""

    job: str
    """Its job: chief, ps, worker or evaluator."""
    index: int
    """Its index within the job."""
    name: str
    """``<name>-<job>-<index>``: Service, Job, compose service and container host name."""
    host: str | None
    """The host name the other tasks use for it (``None``: an evaluator, which nobody calls)."""
    port: int
    """The port it listens on, the one in its own address."""
    tf_config: str
    """Its ``TF_CONFIG`` (on TFJob the operator sets the same value; templates leave it out)."""
    gpus: int
    """GPUs it asks for (only training tasks get any)."""

    @property
    def address(self) -> str | None:
        """``host:port`` as the cluster spec lists it."""
        return None if self.host is None else f"{self.host}:{self.port}"

    @property
    def spec(self) -> TaskSpec:
        return TaskSpec(job=self.job, index=self.index)


@dataclass(frozen=True, kw_only=True)
class Group:
    """The tasks of one job as one pod template: a Trainer v2 replicated job or a Volcano task."""

    job: str
    """chief, ps, worker or evaluator."""
    name: str
    """The replicated job's or task's name (Trainer's workers: :data:`TRAINER_NODE`)."""
    replicas: int
    """Its pods."""
    host: str | None
    """The host of its first task (``None``: an evaluator, which nobody calls)."""
    port: int
    """The port its tasks listen on."""
    tf_config: str
    """``TF_CONFIG`` with ``$(PSFLOW_TASK_INDEX)`` for the index: Kubernetes expands it."""
    gpus: int
    """GPUs each of its pods asks for."""
    index_field: str
    """The downward-API field path that holds a pod's index."""
    index: None = None
    """A group stands for every index: its pods' labels carry none."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A job laid out for one target."""

    target: str
    """One of :data:`TARGETS`."""
    cluster: ClusterSpec
    """The cluster every task's ``TF_CONFIG`` describes."""
    tasks: tuple[Task, ...]
    """Every task, chief first, evaluators last."""
    groups: tuple[Group, ...] = ()
    """Trainer and Volcano: one pod template per job, in the order of :attr:`tasks`."""


def host_for(config: JobConfig, target: str, job: str, index: int) -> str:
    """The DNS name the other tasks reach task ``job:index`` by, on ``target``."""
    name = config.task_name(job, index)
    if target == "tfjob":
        # The training operator writes TF_CONFIG itself, with names of this form.
        return f"{name}.{config.namespace or 'default'}.svc"
    if target == "marathon":
        # Mesos-DNS names an app `/<group>/<app>` as `<app>-<group>.marathon.mesos`.
        return f"{job}-{index}-{config.name}.marathon.mesos"
    if target == "trainer":
        # JobSet (named as the TrainJob) names replicated job R's Indexed Job `<set>-R-0`, its
        # pods' host names `<set>-R-0-<index>`, in the headless Service (subdomain) `<set>`.
        return f"{config.name}-{group_name(target, job)}-0-{index}.{config.name}"
    if target == "volcano":
        # Volcano's svc plugin: pod `<job>-<task>-<index>` in the headless Service `<job>`.
        return f"{config.name}-{job}-{index}.{config.name}"
    return name


def group_name(target: str, job: str) -> str:
    """The replicated job (Trainer) or task (Volcano) that runs ``job``'s tasks."""
    return TRAINER_NODE if target == "trainer" and job == "worker" else job


def check_target(config: JobConfig, target: str) -> None:
    """Raises ``ValueError`` when ``config`` asks for something ``target`` cannot give."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")
    k8s = target in K8S_TARGETS
    # Silently dropping the keys would run the job unencrypted while the user thinks otherwise.
    if k8s and config.keys_host_dir is not None and config.keys_secret is None:
        raise ValueError(
            f"{target} reads the CurveZMQ keys from a Secret: give keys_secret "
            f"(kubectl create secret generic NAME --from-file={config.keys_host_dir})"
        )
    if not k8s and config.keys_secret is not None and config.keys_host_dir is None:
        raise ValueError(
            f"{target} cannot mount the Kubernetes Secret {config.keys_secret!r}: "
            "give keys_host_dir, the directory made by `psflow keys generate`"
        )
    if config.tensorboard and k8s and config.logdir_claim is None:
        raise ValueError(
            "tensorboard needs a logdir shared by all pods: give logdir_claim "
            "(a ReadWriteMany PersistentVolumeClaim)"
        )
    private_logdir = (k8s and config.logdir_claim is None) or (
        target == "marathon" and config.logdir_host_dir is None
    )
    if config.evaluators and private_logdir:
        raise ValueError(
            "an evaluator reads the checkpoints the chief writes into the logdir, so the logdir "
            "must be shared: give "
            + ("logdir_claim (a ReadWriteMany PersistentVolumeClaim)" if k8s else "logdir_host_dir")
        )
    if target == "marathon":
        if config.tensorboard and config.logdir_host_dir is None:
            raise ValueError("tensorboard on marathon needs logdir_host_dir (a shared mount)")
        for attr in ("logdir_host_dir", "keys_host_dir"):
            value = getattr(config, attr)
            if value is not None and not value.startswith("/"):
                raise ValueError(f"marathon needs an absolute {attr}, got {value!r}")
        last = config.port + sum(config.counts()[j] for j in ("chief", "ps", "worker")) - 1
        if last > 65535:
            raise ValueError(
                f"port {config.port} is too high: marathon gives task k port {config.port}+k "
                f"and the last would be {last}"
            )


def plan(config: JobConfig, target: str) -> Plan:
    """Lays ``config`` out for ``target``: names, addresses and ``TF_CONFIG`` per task.

    Example:
        >>> job = JobConfig(name="mnist", image="psflow", ps=1, workers=1, script="train.py")
        >>> [t.address for t in plan(job, "kubernetes").tasks]
        ['mnist-ps-0:2222', 'mnist-worker-0:2222']
    """
    check_target(config, target)
    check_settings_for(config, target)
    counts = config.counts()
    # The v1 training operator lists evaluators in `cluster` too; psflow reads both forms.
    in_cluster = (
        ("chief", "ps", "worker", "evaluator") if target == "tfjob" else ("chief", "ps", "worker")
    )
    ports: dict[tuple[str, int], int] = {}
    for job in in_cluster:
        for i in range(counts[job]):
            # Marathon tasks share their agents' network: distinct ports let two share an agent.
            ports[(job, i)] = config.port + len(ports) if target == "marathon" else config.port
    cluster = ClusterSpec(
        jobs={
            job: [
                f"{host_for(config, target, job, i)}:{ports[(job, i)]}" for i in range(counts[job])
            ]
            for job in in_cluster
            if counts[job]
        },
        evaluators=0 if "evaluator" in in_cluster else counts["evaluator"],
    )
    tasks = []
    for spec in cluster.tasks():
        listens = (spec.job, spec.index) in ports
        tasks.append(
            Task(
                job=spec.job,
                index=spec.index,
                name=config.task_name(spec.job, spec.index),
                host=host_for(config, target, spec.job, spec.index) if listens else None,
                port=ports.get((spec.job, spec.index), config.port),
                tf_config=cluster.to_tf_config(spec),
                gpus=config.gpus if spec.job in ("chief", "worker") else 0,
            )
        )
    groups: list[Group] = []
    if target in INDEX_FIELDS:
        for job, n in counts.items():
            if not n:
                continue
            first = TaskSpec(job=job, index=0)
            # A sentinel index, replaced by the variable reference in the JSON text.
            data = json.loads(cluster.to_tf_config(first))
            data["task"]["index"] = -(10**9)
            text = json.dumps(data, sort_keys=True).replace(str(-(10**9)), f"$({TASK_INDEX_VAR})")
            groups.append(
                Group(
                    job=job,
                    name=group_name(target, job),
                    replicas=n,
                    host=host_for(config, target, job, 0) if job != "evaluator" else None,
                    port=config.port,
                    tf_config=text,
                    gpus=config.gpus if job in ("chief", "worker") else 0,
                    index_field=INDEX_FIELDS[target],
                )
            )
    return Plan(target=target, cluster=cluster, tasks=tuple(tasks), groups=tuple(groups))


def cpus(config: JobConfig) -> float:
    """The CPU request as a number of cores (Marathon's and compose's unit)."""
    if config.cpu is None:
        return _MARATHON_DEFAULT_CPUS
    return float(parse_quantity(config.cpu, what="cpu"))


def memory_mib(config: JobConfig) -> int:
    """The memory request in MiB, rounded up (Marathon's unit)."""
    if config.memory is None:
        return _MARATHON_DEFAULT_MEM_MIB
    mib = parse_quantity(config.memory, what="memory") / Decimal(2**20)
    return int(mib.to_integral_value(rounding=ROUND_CEILING))


def compose_bytes(quantity: str) -> str:
    """A Kubernetes memory quantity in compose's byte syntax (``512Mi`` -> ``512m``)."""
    value = parse_quantity(quantity, what="memory").to_integral_value(rounding=ROUND_CEILING)
    for suffix, unit in (("g", 2**30), ("m", 2**20), ("k", 2**10)):
        if value % unit == 0:
            return f"{int(value // unit)}{suffix}"
    return f"{int(value)}b"
