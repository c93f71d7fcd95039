"""Rendering a :class:`~psflow.deploy.config.JobConfig` through the Jinja2 templates.

The templates ship in ``psflow/deploy/templates`` (one ``<target>.*.j2`` file per target and
``_*.j2`` partials). A ``template_dir`` is searched first, so a user can override one file and
keep the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from psflow import env as envvars
from psflow.deploy import layout
from psflow.deploy.config import JobConfig
from psflow.deploy.quantity import parse_quantity

METRICS_PATH = "/metrics"
"""Where a task serves its metrics (``psflow.metrics.PATH``: deploy does not import it)."""

OUTPUT_FILES = {
    "kubernetes": "kubernetes.yaml",
    "tfjob": "tfjob.yaml",
    "trainer": "trainer.yaml",
    "volcano": "volcano.yaml",
    # The name `docker compose` looks for by default, so no `-f` is needed.
    "compose": "compose.yaml",
    "marathon": "marathon.json",
}
"""The file each target renders to (its template is the same name plus ``.j2``)."""


@dataclass(frozen=True, kw_only=True)
class Rendered:
    """The output of one target: a file name and its text."""

    target: str
    """One of :data:`~psflow.deploy.layout.TARGETS`."""
    filename: str
    """The name it takes in an output directory."""
    text: str
    """The manifest(s)."""

    def write(self, directory: str | Path) -> Path:
        """Writes the text to ``directory/filename`` (creating the directory) and returns it."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / self.filename
        path.write_text(self.text)
        return path


def _yaml_quote(value: Any) -> str:
    """A YAML scalar that always reads back as the same string (single-quoted when possible)."""
    text = str(value)
    if text.isprintable():
        return "'" + text.replace("'", "''") + "'"
    return json.dumps(text)


def _json(value: Any) -> str:
    # Jinja's own `tojson` escapes <, > and & for HTML; manifests want the plain JSON.
    return json.dumps(value)


def environment(template_dir: str | Path | None = None) -> jinja2.Environment:
    """The Jinja environment: ``template_dir`` first, then the packaged templates."""
    loaders: list[jinja2.BaseLoader] = []
    if template_dir is not None:
        path = Path(template_dir)
        if not path.is_dir():
            raise ValueError(f"template dir {str(path)!r} is not a directory")
        loaders.append(jinja2.FileSystemLoader(str(path)))
    loaders.append(jinja2.PackageLoader("psflow.deploy", "templates"))
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        # A misspelt variable must fail the render, not leave a hole in a manifest.
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = _yaml_quote
    env.filters["json"] = _json
    env.filters["pull_secret"] = lambda name: {"name": name}
    return env


def context(config: JobConfig, target: str) -> dict[str, Any]:
    """The variables every template sees."""
    laid_out = layout.plan(config, target)
    env_vars = {**envvars.TASK_DEFAULTS, envvars.PSFLOW_LOGDIR: config.logdir, **config.env}
    if config.keys_secret is not None or config.keys_host_dir is not None:
        env_vars[envvars.PSFLOW_KEYS_DIR] = config.keys_mount
    # Marathon tasks share their agents' network: one port for every task would collide.
    metrics_port = config.metrics_port if target != "marathon" else 0
    if metrics_port:
        env_vars.setdefault(envvars.PSFLOW_METRICS_PORT, str(metrics_port))
    if config.mode is not None:
        env_vars[envvars.PSFLOW_MODE] = config.mode
    return {
        "job": config,
        "target": target,
        "cluster": laid_out.cluster,
        "tasks": laid_out.tasks,
        "groups": laid_out.groups,
        "task_index_var": layout.TASK_INDEX_VAR,
        "trainer_node": layout.TRAINER_NODE,
        "runtime_name": f"psflow-{config.name}",
        "resources": lambda gpus: resources(config, gpus),
        "argv": config.argv(),
        "env": env_vars,
        "tf_config_var": envvars.TF_CONFIG,
        "has_keys": envvars.PSFLOW_KEYS_DIR in env_vars,
        "tensorboard_port": layout.TENSORBOARD_PORT,
        "metrics_port": metrics_port,
        "metrics_path": METRICS_PATH,
        "cpus": layout.cpus(config),
        "memory_mib": layout.memory_mib(config),
        "compose_pull_policy": _COMPOSE_PULL.get(config.image_pull_policy or "", ""),
        "compose_cpu_limit": (
            float(parse_quantity(config.cpu_limit, what="cpu_limit")) if config.cpu_limit else None
        ),
        "compose_memory_limit": (
            layout.compose_bytes(config.memory_limit) if config.memory_limit else None
        ),
        "marathon_volumes": _marathon_volumes(config),
        "compose_memory": (
            layout.compose_bytes(config.memory) if config.memory is not None else None
        ),
    }


_COMPOSE_PULL = {"Always": "always", "IfNotPresent": "missing", "Never": "never"}
"""Kubernetes' image pull policies in compose's words."""


def _marathon_volumes(config: JobConfig) -> list[dict[str, str]]:
    out = []
    for path, host, mode in (
        (config.logdir, config.logdir_host_dir, "RW"),
        (config.keys_mount, config.keys_host_dir, "RO"),
        (config.data_dir, config.data_host_dir, "RO"),
    ):
        if host:
            out.append({"containerPath": path, "hostPath": host, "mode": mode})
    return out


def resources(config: JobConfig, gpus: int) -> dict[str, dict[str, Any]]:
    """A container's ``resources``: the requests, the limits and ``gpus`` GPUs (empty: none).

    Example:
        >>> job = JobConfig(name="a", image="i", cpu="1", memory_limit="2Gi", script="t.py")
        >>> resources(job, 1)
        {'requests': {'cpu': '1'}, 'limits': {'memory': '2Gi', 'nvidia.com/gpu': 1}}
    """
    out: dict[str, dict[str, Any]] = {}
    requests = {k: v for k, v in (("cpu", config.cpu), ("memory", config.memory)) if v}
    limits: dict[str, Any] = {
        k: v for k, v in (("cpu", config.cpu_limit), ("memory", config.memory_limit)) if v
    }
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def render(config: JobConfig, target: str, *, template_dir: str | Path | None = None) -> Rendered:
    """Renders ``config`` for ``target``.

    Example:
        >>> job = JobConfig(name="mnist", image="psflow:0.1.0", workers=2, script="train.py")
        >>> out = render(job, "kubernetes")
        >>> out.filename, out.text.count("kind: Job")
        ('kubernetes.yaml', 3)

    Raises:
        ValueError: for an unknown target, a config the target cannot express, or a template
            (e.g. an override from ``template_dir``) that fails or renders unparseable output.
    """
    ctx = context(config, target)
    filename = OUTPUT_FILES[target]
    try:
        text = environment(template_dir).get_template(filename + ".j2").render(ctx)
    except jinja2.TemplateError as e:
        raise ValueError(f"template {filename}.j2 failed: {e}") from None
    _check_parses(filename, text)
    return Rendered(target=target, filename=filename, text=text)


def _check_parses(filename: str, text: str) -> None:
    """Fails on output the cluster manager would reject as unparseable."""
    try:
        if filename.endswith(".json"):
            json.loads(text)
        else:
            list(yaml.safe_load_all(text))
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"template {filename}.j2 rendered invalid output: {e}") from None
