"""Which cluster settings each target can express: a setting a target would drop fails instead.

A silently dropped toleration or pull secret renders a job that never schedules or never pulls,
far from the flag that asked for it; so each target names what it cannot do, in one line.
"""

from __future__ import annotations

from psflow.deploy.config import DNS_LABEL_MAX, JobConfig

_K8S_ONLY = (
    "node_selector",
    "tolerations",
    "priority_class",
    "service_account",
    "data_claim",
    "queue",
    "image_pull_secrets",
)


def _given(config: JobConfig, attr: str) -> bool:
    value = getattr(config, attr)
    return value is not None and value != [] and value != {}


def check_settings_for(config: JobConfig, target: str) -> None:
    """Raises ``ValueError`` naming the field when ``target`` cannot express a setting."""
    k8s = target in ("kubernetes", "tfjob", "trainer", "volcano")
    if k8s:
        if config.data_host_dir is not None:
            raise ValueError(
                f"data_host_dir is for compose and marathon: {target} mounts the data from a "
                "PersistentVolumeClaim (give data_claim)"
            )
    else:
        for attr in _K8S_ONLY:
            if _given(config, attr):
                raise ValueError(f"{attr} is a Kubernetes setting: {target} cannot express it")
        if config.gang is not None:
            raise ValueError(f"gang: {target} has no gang scheduler (use kubernetes or volcano)")
        if target == "marathon":
            for attr in ("cpu_limit", "memory_limit", "image_pull_policy"):
                if _given(config, attr):
                    raise ValueError(
                        f"{attr}: marathon's cpus and mem (cpu, memory) are the tasks' limits; "
                        "it has no separate " + attr.replace("_", " ")
                    )
    if config.gang == "coscheduling" and target != "trainer":
        raise ValueError(
            f"gang coscheduling is for target trainer (its podGroupPolicy); {target} "
            "schedules a gang with gang: volcano"
        )
    if config.gang is not None and target == "tfjob":
        raise ValueError(
            "gang: the v1 training operator's own gang settings are not rendered; use target "
            "trainer or volcano"
        )
    if target == "trainer":
        _check_trainer(config)


def _check_trainer(config: JobConfig) -> None:
    if config.workers < 1:
        raise ValueError(
            "workers: trainer needs at least one worker (the TrainJob's numNodes counts them)"
        )
    counts = config.counts()
    for job, n in counts.items():
        if not n:
            continue
        group = "node" if job == "worker" else job
        host = f"{config.name}-{group}-0-{n - 1}"
        if len(host) > DNS_LABEL_MAX:
            raise ValueError(
                f"name {config.name!r} is too long for trainer: pod host name {host!r} has "
                f"{len(host)} characters, more than the {DNS_LABEL_MAX} a DNS label allows"
            )
