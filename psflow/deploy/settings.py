"""Checks of the cluster settings a :class:`~psflow.deploy.config.JobConfig` carries.

What a platform team sets once per cluster (limits, node selectors, tolerations, priority class,
data volume, queue, image pull policy and secrets, gang scheduling and quota) is checked here, so
that a manifest the API server would refuse fails at render time with one line naming the field.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Protocol

from psflow import env as envvars
from psflow.cluster.modes import MODES, Mode
from psflow.deploy.quantity import parse_quantity, quantity_setting


class JobSettings(Protocol):
    """What these checks read of a :class:`~psflow.deploy.config.JobConfig` (which calls them
    from its ``__post_init__``, so this module cannot import it)."""

    image: str
    ps: int
    gpus: int
    cpu: str | None
    memory: str | None
    logdir: str
    keys_mount: str
    env: dict[str, str]
    mode: str | None
    cpu_limit: str | None
    memory_limit: str | None
    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    priority_class: str | None
    service_account: str | None
    data_claim: str | None
    data_host_dir: str | None
    data_dir: str
    queue: str | None
    image_pull_policy: str | None
    image_pull_secrets: list[str]
    gang: str | None
    quota: dict[str, Any]
    runtime_kind: str

    def counts(self) -> dict[str, int]: ...


PULL_POLICIES = ("Always", "IfNotPresent", "Never")
"""Kubernetes' image pull policies."""

GANGS = ("volcano", "coscheduling")
"""Gang schedulers a job can ask for: Volcano, or the scheduler-plugins' coscheduling."""

RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
"""The Kubeflow Trainer v2 runtime kinds ``psflow render trainer`` can write."""

_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
QUOTA_RESOURCES = ("pods", "cpu", "memory", "nvidia.com/gpu")
"""What a stated ``quota`` may bound."""

# The image reference grammar of the container runtimes (distribution/reference): an optional
# registry host[:port], lowercase path components, then :tag and/or @digest.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_PATH_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?$")
_DOMAIN_RE = re.compile(rf"^{_DOMAIN}$")
# A label key: an optional DNS subdomain prefix and a name of at most 63 characters.
_LABEL_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_image(image: Any) -> None:
    """Raises ``ValueError`` naming ``image`` when no container runtime would pull it.

    Example:
        >>> check_image("registry.example.com:5000/ml/psflow:0.1.0")
        >>> check_image("Psflow:1")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: image 'Psflow:1' is not an image reference Kubernetes accepts: ...
    """
    hint = (
        "use [registry[:port]/]path[:tag][@sha256:digest] with a lowercase path, e.g. "
        "registry.example.com/psflow:0.1.0"
    )
    if not isinstance(image, str) or not image:
        raise ValueError(f"image {image!r} must be a non-empty image reference: {hint}")
    first, sep, rest = image.partition("/")
    # As the runtimes decide it: a first component with '.' or ':' (or localhost) is a registry.
    has_domain = bool(sep) and ("." in first or ":" in first or first == "localhost")
    name_part = rest if has_domain else image
    ok = (not has_domain or bool(_DOMAIN_RE.match(first))) and bool(_PATH_RE.match(name_part))
    if not ok or len(image.split("@")[0].rsplit(":", 1)[0]) > 255:
        raise ValueError(f"image {image!r} is not an image reference Kubernetes accepts: {hint}")


def _check_label_key(key: Any, *, what: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"{what} key {key!r} must be a non-empty string")
    prefix, sep, name = key.rpartition("/")
    if (sep and (not _SUBDOMAIN_RE.match(prefix) or len(prefix) > 253)) or not (
        _LABEL_NAME_RE.match(name)
    ):
        raise ValueError(f"{what} key {key!r} is not a valid Kubernetes label key")


def _check_label_value(value: Any, *, what: str) -> None:
    if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid Kubernetes label value (at most 63 letters, digits, "
            "'-', '_' or '.', quoted in YAML)"
        )


def _check_tolerations(value: Any) -> None:
    if not isinstance(value, list):
        raise ValueError(f"tolerations must be a list of mappings, got {value!r}")
    for i, t in enumerate(value):
        what = f"tolerations[{i}]"
        if not isinstance(t, dict) or not t:
            raise ValueError(f"{what} must be a mapping (key, operator, value, effect), got {t!r}")
        unknown = set(t) - _TOLERATION_KEYS
        if unknown:
            raise ValueError(
                f"{what} has unknown field(s) {sorted(unknown)}: use {sorted(_TOLERATION_KEYS)}"
            )
        op = t.get("operator", "Equal")
        if op not in _TOLERATION_OPERATORS:
            raise ValueError(f"{what}.operator {op!r} must be Exists or Equal")
        if "key" in t:
            _check_label_key(t["key"], what=f"{what}.key")
        if op == "Exists" and t.get("value"):
            raise ValueError(f"{what}: operator Exists takes no value, got {t['value']!r}")
        if "value" in t:
            _check_label_value(t["value"], what=f"{what}.value")
        if "effect" in t and t["effect"] not in _TOLERATION_EFFECTS:
            raise ValueError(
                f"{what}.effect {t['effect']!r} must be one of {', '.join(_TOLERATION_EFFECTS)}"
            )
        if "tolerationSeconds" in t:
            secs = t["tolerationSeconds"]
            if isinstance(secs, bool) or not isinstance(secs, int):
                raise ValueError(f"{what}.tolerationSeconds must be an integer, got {secs!r}")
            if t.get("effect") != "NoExecute":
                raise ValueError(f"{what}.tolerationSeconds goes only with effect NoExecute")


def check_settings(config: JobSettings) -> None:
    """Checks the cluster settings of ``config`` (called by its ``__post_init__``).

    Raises:
        ValueError: naming the field and its value.
    """
    check_image(config.image)
    mode = config.mode if config.mode is not None else config.env.get(envvars.PSFLOW_MODE)
    if config.mode is not None and envvars.PSFLOW_MODE in config.env:
        raise ValueError(f"give the mode once: mode {config.mode!r} or env {envvars.PSFLOW_MODE}")
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} must be one of {', '.join(MODES)}")
        if mode == Mode.ALLREDUCE and config.ps:
            raise ValueError(f"ps: mode allreduce runs without ps tasks, got ps {config.ps}")
        if mode != Mode.ALLREDUCE and not config.ps:
            raise ValueError(f"ps: mode {mode} needs at least one ps task, got ps 0")
    for attr in ("cpu_limit", "memory_limit"):
        quantity_setting(config, attr)
    for request, limit in (("cpu", "cpu_limit"), ("memory", "memory_limit")):
        low, high = getattr(config, request), getattr(config, limit)
        if (
            low is not None
            and high is not None
            and parse_quantity(low, what=request) > parse_quantity(high, what=limit)
        ):
            raise ValueError(f"{limit} {high!r} is below the request {request} {low!r}")
    if not isinstance(config.node_selector, dict):
        raise ValueError(
            f"node_selector must map label keys to values, got {config.node_selector!r}"
        )
    for key, value in config.node_selector.items():
        _check_label_key(key, what="node_selector")
        _check_label_value(value, what=f"node_selector {key}")
    _check_tolerations(config.tolerations)
    for attr in ("priority_class", "data_claim", "service_account"):
        value = getattr(config, attr)
        if value is not None and (
            not isinstance(value, str) or not _SUBDOMAIN_RE.match(value) or len(value) > 253
        ):
            raise ValueError(f"{attr} {value!r} is not a valid Kubernetes object name")
    if config.data_host_dir is not None and (
        not isinstance(config.data_host_dir, str) or not config.data_host_dir
    ):
        raise ValueError(f"data_host_dir must be a non-empty path, got {config.data_host_dir!r}")
    if not isinstance(config.data_dir, str) or not config.data_dir.startswith("/"):
        raise ValueError(f"data_dir {config.data_dir!r} must be an absolute path in the container")
    if config.data_dir in (config.logdir, config.keys_mount):
        raise ValueError(f"data_dir {config.data_dir!r} is also the logdir or the keys' mount")
    if config.queue is not None:
        _check_label_value(config.queue, what="queue")
        if not config.queue:
            raise ValueError("queue must not be empty")
    if config.image_pull_policy is not None and config.image_pull_policy not in PULL_POLICIES:
        raise ValueError(
            f"image_pull_policy {config.image_pull_policy!r} must be one of "
            f"{', '.join(PULL_POLICIES)}"
        )
    if not isinstance(config.image_pull_secrets, list):
        raise ValueError(
            f"image_pull_secrets must be a list of Secret names, got {config.image_pull_secrets!r}"
        )
    for name in config.image_pull_secrets:
        if not isinstance(name, str) or not _SUBDOMAIN_RE.match(name) or len(name) > 253:
            raise ValueError(f"image_pull_secrets: {name!r} is not a valid Secret name")
    if config.gang is not None and config.gang not in GANGS:
        raise ValueError(f"gang {config.gang!r} must be one of {', '.join(GANGS)} (or unset)")
    if config.runtime_kind not in RUNTIME_KINDS:
        raise ValueError(
            f"runtime_kind {config.runtime_kind!r} must be one of {', '.join(RUNTIME_KINDS)}"
        )
    check_quota(config)


def gang_demand(config: JobSettings) -> dict[str, Decimal]:
    """What the whole job asks for at once: its pods and their summed requests.

    Example:
        >>> from psflow.deploy.config import JobConfig
        >>> job = JobConfig(name="a", image="i", ps=1, workers=2, cpu="2", script="t.py")
        >>> gang_demand(job)["cpu"]
        Decimal('6')
    """
    counts = config.counts()
    pods = sum(counts.values())
    trainers = counts["chief"] + counts["worker"]
    out: dict[str, Decimal] = {
        "pods": Decimal(pods),
        "nvidia.com/gpu": Decimal(trainers * config.gpus),
    }
    if config.cpu is not None:
        out["cpu"] = parse_quantity(config.cpu, what="cpu") * pods
    if config.memory is not None:
        out["memory"] = parse_quantity(config.memory, what="memory") * pods
    return out


def check_quota(config: JobSettings) -> None:
    """Raises ``ValueError`` when the whole job asks for more than the stated ``quota``: a gang
    larger than its quota would wait forever for room that can never be free."""
    if not isinstance(config.quota, dict):
        raise ValueError(f"quota must map resources to amounts, got {config.quota!r}")
    demand = gang_demand(config)
    for resource, amount in config.quota.items():
        if resource not in QUOTA_RESOURCES:
            raise ValueError(
                f"quota {resource!r} is not one psflow checks: use {', '.join(QUOTA_RESOURCES)}"
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float | str):
            raise ValueError(f"quota {resource} must be a quantity, got {amount!r}")
        limit = parse_quantity(str(amount), what=f"quota {resource}")
        if resource in ("cpu", "memory") and resource not in demand:
            raise ValueError(
                f"quota {resource}: the job states no {resource} request to check it against "
                f"(give {resource})"
            )
        asked = demand[resource]
        if asked > limit:
            raise ValueError(
                f"quota {resource}: the job's {int(demand['pods'])} pods ask {resource} {_fmt(asked)} in all, "
                f"more than the quota's {amount}: its gang could never be scheduled whole"
            )


def _fmt(value: Decimal) -> str:
    return format(value.normalize(), "f")
