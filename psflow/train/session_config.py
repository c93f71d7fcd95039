"""How a :class:`~psflow.train.TrainingSession` supervises training: :class:`SessionConfig`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from psflow import env as envvars
from psflow.train.manifest import CheckpointDir


@dataclass(kw_only=True)
class SessionConfig:
    """How a :class:`TrainingSession` supervises training (TensorFlow's argument names)."""

    checkpoint_dir: str | None = None
    """Where checkpoints (and, by default, summaries) go: a path or fsspec URL. ``None``:
    ``PSFLOW_LOGDIR`` when it is set (the rendered manifests and the image set it), else no
    checkpoints and no summaries."""
    summary_dir: str | None = None
    """TensorBoard event files (a local path); default ``checkpoint_dir``."""
    save_checkpoint_secs: float | None = None
    """Save every this many seconds (default 600 when no ``save_checkpoint_steps``)."""
    save_checkpoint_steps: int | None = None
    """Save every this many global steps."""
    max_to_keep: int | None = 5
    """Complete checkpoints kept (older ones are deleted); ``None`` keeps all."""
    save_summaries_steps: int | None = 100
    """Scalar summaries every this many global steps; ``None``: no summaries."""
    histogram_steps: int | None = 1000
    """Parameter histograms every this many global steps; ``None``: none."""
    log_step_count_steps: int | None = 100
    """Progress line every this many steps on the chief (``None``: no progress output)."""
    last_step: int | None = None
    """Stop once the global step reaches this (a :class:`StopAtStepHook`)."""
    nan_guard: bool = True
    """Stop with an error on a non-finite loss or gradient, before it reaches the ps."""
    restore: bool = True
    """Whether the chief restores the latest checkpoint (when there is one)."""
    ready_timeout: float | None = None
    """Seconds a worker waits for the chief to make the model ready (default 300)."""
    save_timeout: float = 300.0
    """Seconds one checkpoint may take to write before it fails."""
    end_timeout: float = 60.0
    """Seconds the chief waits for the other workers before the final checkpoint."""
    recovery_timeout: float | None = dataclasses.field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_RECOVERY_TIMEOUT, 300.0)
    )
    """Seconds a worker waits, after a ps failed to answer, for every ps to answer again (a
    crashed one restarted by its cluster manager, a cut link mended); the chief then restores
    the latest checkpoint into every shard if one came back empty, and training goes on
    (asynchronous and synchronous modes; all-reduce has no ps). Default
    ``PSFLOW_RECOVERY_TIMEOUT``, else 300. ``None``: the error stops the worker."""
    stop_on_sigterm: bool = True
    """SIGTERM (what Kubernetes sends a pod 30 s before SIGKILL), and a first Ctrl-C of a
    script run by hand, stop the session cleanly: the step in progress ends, the loop's
    :meth:`TrainingSession.should_stop` turns true once the chief has saved its final
    checkpoint (before anything the script does after its loop), and closing says ``done``
    (when the session runs in the main thread; the previous handlers come back at close; a
    second Ctrl-C raises ``KeyboardInterrupt`` at once)."""

    def __post_init__(self) -> None:
        for name in ("save_checkpoint_secs", "ready_timeout", "recovery_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in (
            "save_checkpoint_steps",
            "max_to_keep",
            "save_summaries_steps",
            "histogram_steps",
            "log_step_count_steps",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
        if self.last_step is not None and self.last_step < 0:
            raise ValueError(f"last_step must be >= 0, got {self.last_step}")
        if self.save_timeout <= 0 or self.end_timeout <= 0:
            raise ValueError("save_timeout and end_timeout must be > 0 seconds")
        if self.checkpoint_dir is None:
            self.checkpoint_dir = envvars.text(envvars.PSFLOW_LOGDIR)
        if self.checkpoint_dir is not None:
            CheckpointDir(self.checkpoint_dir)  # validates the URL
            if self.save_checkpoint_secs is None and self.save_checkpoint_steps is None:
                self.save_checkpoint_secs = 600.0
        if self.summary_dir is None:
            self.summary_dir = self.checkpoint_dir
