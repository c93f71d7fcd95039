"""What a :class:`~psflow.train.TrainingSession` takes, as one nested config (torchtitan's way):
:class:`SessionConfig` holds how it trains (:class:`~psflow.worker.config.OptimizerConfig`: the
optimizer, its schedule, the mode, the placement, the transport), its checkpoints
(:class:`CheckpointConfig`), its summaries and progress lines (:class:`SummaryConfig`), its
exports for serving (:class:`ExportConfig`), and
the supervision's own settings. Every setting keeps TensorFlow's name, and
:meth:`SessionConfig.of` takes them all as flat keywords, the one-line common case
(``optimizer="Adam", lr=1e-3, checkpoint_dir=..., last_step=...``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from psflow import env as envvars
from psflow.train.manifest import CheckpointDir
from psflow.worker.config import SETTINGS as TRAINING_SETTINGS
from psflow.worker.config import OptimizerConfig, unknown_setting


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where and when the chief saves checkpoints, and whether it restores the latest."""

    checkpoint_dir: str | None = None
    """Where checkpoints (and, by default, summaries) go: a path or fsspec URL. ``None``:
    ``PSFLOW_LOGDIR`` when it is set (the rendered manifests and the image set it), else no
    checkpoints and no summaries."""
    save_checkpoint_secs: float | None = None
    """Save every this many seconds (default 600 when no ``save_checkpoint_steps``)."""
    save_checkpoint_steps: int | None = None
    """Save every this many global steps."""
    max_to_keep: int | None = 5
    """Complete checkpoints kept (older ones are deleted); ``None`` keeps all."""
    restore: bool = True
    """Whether the chief restores the latest checkpoint (when there is one)."""
    save_timeout: float = 300.0
    """Seconds one checkpoint may take to write before it fails."""

    def __post_init__(self) -> None:
        if self.save_checkpoint_secs is not None and self.save_checkpoint_secs <= 0:
            raise ValueError(f"save_checkpoint_secs must be > 0, got {self.save_checkpoint_secs}")
        _at_least_one(self, "save_checkpoint_steps", "max_to_keep")
        if self.save_timeout <= 0:
            raise ValueError(f"save_timeout must be > 0 seconds, got {self.save_timeout}")
        if self.checkpoint_dir is None:
            self.checkpoint_dir = envvars.text(envvars.PSFLOW_LOGDIR)
        if self.checkpoint_dir is not None:
            CheckpointDir(self.checkpoint_dir)  # validates the URL
            if self.save_checkpoint_secs is None and self.save_checkpoint_steps is None:
                self.save_checkpoint_secs = 600.0


@dataclass(kw_only=True)
class ExportConfig:
    """Where and how often the chief exports the model for serving: a full base, then deltas
    (the rows changed and the ids evicted since the last export, and the dense parameters);
    see :mod:`psflow.train.exports` and :mod:`psflow.serve.delta`."""

    export_dir: str | None = None
    """Where exports go (``export-<n>`` directories): a path or fsspec URL that every ps task
    can write. ``None``: no exports."""
    export_every: float | None = None
    """Export every this many seconds (default 300 with an ``export_dir``); ``None`` with no
    ``export_dir``. :meth:`TrainingSession.export` exports at once too."""
    export_base_every: int = 10
    """A new base after this many deltas: bounds the chain a server applies at start."""
    export_keep_bases: int | None = 2
    """Chains (a base and its deltas) kept; older ones are deleted once a newer base is
    complete. ``None``: all kept."""
    export_reserve_bytes: int = 0
    """Bytes each ps's disk must keep free after writing its file of an export (local disks):
    an export that would leave less is refused, and the previous exports stay whole."""
    export_timeout: float = 300.0
    """Seconds one export may take to write before it fails."""

    def __post_init__(self) -> None:
        if self.export_every is not None and self.export_every <= 0:
            raise ValueError(f"export_every must be > 0 seconds, got {self.export_every}")
        _at_least_one(self, "export_base_every", "export_keep_bases")
        if self.export_reserve_bytes < 0:
            raise ValueError(f"export_reserve_bytes must be >= 0, got {self.export_reserve_bytes}")
        if self.export_timeout <= 0:
            raise ValueError(f"export_timeout must be > 0 seconds, got {self.export_timeout}")
        if self.export_dir is None and self.export_every is not None:
            raise ValueError(f"export_every={self.export_every} needs an export_dir")
        if self.export_dir is not None:
            CheckpointDir(self.export_dir)  # validates the URL
            if self.export_every is None:
                self.export_every = 300.0


@dataclass(kw_only=True)
class SummaryConfig:
    """What the chief writes to TensorBoard and to its progress line."""

    summary_dir: str | None = None
    """TensorBoard event files (a local path); default the checkpoint directory."""
    save_summaries_steps: int | None = 100
    """Scalar summaries every this many global steps; ``None``: no summaries."""
    histogram_steps: int | None = 1000
    """Parameter histograms every this many global steps; ``None``: none."""
    log_step_count_steps: int | None = 100
    """Progress line every this many steps on the chief (``None``: no progress output)."""

    def __post_init__(self) -> None:
        _at_least_one(self, "save_summaries_steps", "histogram_steps", "log_step_count_steps")


@dataclass(kw_only=True)
class SessionConfig:
    """How a :class:`~psflow.train.TrainingSession` trains and supervises training.

    Example:
        >>> cfg = SessionConfig.of(optimizer="Adam", lr=1e-3, checkpoint_dir="/tmp/run",
        ...                        save_checkpoint_steps=500, last_step=10_000)
        >>> cfg.training.optimizer.name, cfg.checkpoint.save_checkpoint_steps, cfg.last_step
        ('Adam', 500, 10000)
        >>> cfg.summaries.summary_dir   # the checkpoint directory's, by default
        '/tmp/run'
    """

    training: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer, its schedule, the mode, the placement, the transport, the ready timeout
    (what :class:`~psflow.worker.DistributedOptimizer` takes)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and when checkpoints go, and the restore at start."""
    summaries: SummaryConfig = field(default_factory=SummaryConfig)
    """TensorBoard summaries and progress lines."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """Incremental exports for serving: where, how often."""
    last_step: int | None = None
    """Stop once the global step reaches this (a :class:`StopAtStepHook`)."""
    nan_guard: bool = True
    """Stop with an error on a non-finite loss or gradient, before it reaches the ps."""
    end_timeout: float = 60.0
    """Seconds the chief waits for the other workers before the final checkpoint."""
    recovery_timeout: float | None = field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_RECOVERY_TIMEOUT, 300.0)
    )
    """Seconds a worker waits, after a ps failed to answer, for every ps to answer again (a
    crashed one restarted by its cluster manager, a cut link mended); the chief then restores
    the latest checkpoint into every shard if one came back empty, and training goes on
    (asynchronous and synchronous modes; all-reduce has no ps). One global step failing for
    longer than this while every ps answers (a sync step awaiting a worker hung in its own
    code) ends the recoveries with its error. Default ``PSFLOW_RECOVERY_TIMEOUT``, else 300.
    ``None``: the error stops the worker."""
    stop_on_sigterm: bool = True
    """SIGTERM (what Kubernetes sends a pod 30 s before SIGKILL), and a first Ctrl-C of a
    script run by hand, stop the session cleanly: the step in progress ends, the loop's
    :meth:`TrainingSession.should_stop` turns true once the chief has saved its final
    checkpoint (before anything the script does after its loop), and closing says ``done``
    (when the session runs in the main thread; the previous handlers come back at close; a
    second Ctrl-C raises ``KeyboardInterrupt`` at once)."""

    def __post_init__(self) -> None:
        for name, kind in _NESTED.items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(
                    f"SessionConfig.{name} must be a {kind.__name__}, got "
                    f"{getattr(self, name)!r} (or give its settings to SessionConfig.of)"
                )
        if self.recovery_timeout is not None and self.recovery_timeout <= 0:
            raise ValueError(f"recovery_timeout must be > 0, got {self.recovery_timeout}")
        if self.last_step is not None and self.last_step < 0:
            raise ValueError(f"last_step must be >= 0, got {self.last_step}")
        if self.end_timeout <= 0:
            raise ValueError(f"end_timeout must be > 0 seconds, got {self.end_timeout}")
        if self.summaries.summary_dir is None:
            self.summaries.summary_dir = self.checkpoint.checkpoint_dir

    @classmethod
    def of(cls, **settings: Any) -> SessionConfig:
        """Every setting as a flat keyword, each going to the config that names it: the
        training's (:meth:`OptimizerConfig.of`: ``optimizer``, ``lr``, ``lr_schedule``,
        ``mode`` and its settings, ``placement``, ``partition_bytes``, ``transport``,
        ``ready_timeout``), the checkpoints', the summaries' and the session's own.

        Raises:
            ValueError: naming a setting that none of them takes (with the closest one, and
                where an optimizer's own arguments go).
        """
        parts: dict[str, dict[str, Any]] = {name: {} for name in (*_NESTED, "session")}
        given = settings.get("optimizer")
        for key, value in settings.items():
            owner = _OWNER.get(key) or unknown_setting(key, _OWNER, "the session", given)
            parts[owner][key] = value
        return cls(
            training=OptimizerConfig.of(**parts["training"]),
            checkpoint=CheckpointConfig(**parts["checkpoint"]),
            summaries=SummaryConfig(**parts["summaries"]),
            export=ExportConfig(**parts["export"]),
            **parts["session"],
        )


_NESTED: dict[str, type] = {
    "training": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "summaries": SummaryConfig,
    "export": ExportConfig,
}
_OWNER: dict[str, str] = {
    **{key: "training" for key in TRAINING_SETTINGS},
    **{f.name: "checkpoint" for f in dataclasses.fields(CheckpointConfig)},
    **{f.name: "summaries" for f in dataclasses.fields(SummaryConfig)},
    **{f.name: "export" for f in dataclasses.fields(ExportConfig)},
    **{f.name: "session" for f in dataclasses.fields(SessionConfig) if f.name not in _NESTED},
}
"""Which config takes each flat setting (the names are unique across them)."""
SETTINGS = frozenset(_OWNER)
"""The flat keywords :meth:`SessionConfig.of` (and so a :class:`TrainingSession`) takes."""
assert len(_OWNER) == len(TRAINING_SETTINGS) + sum(
    len(dataclasses.fields(kind))
    for kind in (CheckpointConfig, SummaryConfig, ExportConfig, SessionConfig)
) - len(_NESTED), "a setting's name is taken by two configs"


def _at_least_one(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
