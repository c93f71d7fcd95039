"""TensorBoard scalars of the training mode: dropped gradients, staleness, waiting time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psflow.train.hooks import Hook, StepContext

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class ModeStatsHook(Hook):
    """Writes the numeric entries of ``DistributedOptimizer.stats()`` as ``mode/<name>``.

    Synchronous mode: ``accepted``, ``dropped_stale``, ``wait_seconds``; bounded staleness:
    ``staleness_mean``, ``staleness_max``, ``waited_steps``, ``wait_seconds``.

    Example:
        >>> # with psflow.TrainingSession(model, ctx, mode="async", max_staleness=4,
        >>> #                             hooks=[ModeStatsHook("runs/x")]) as sess: ...
    """

    def __init__(self, logdir: str, *, every_n_steps: int = 100) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.logdir = logdir
        self.every_n_steps = every_n_steps
        self._writer: SummaryWriter | None = None
        self._last = 0

    def after_step(self, ctx: StepContext) -> None:
        if ctx.global_step - self._last < self.every_n_steps:
            return
        self._last = ctx.global_step
        self.write(ctx.session.opt.stats(), ctx.global_step)

    def write(self, stats: dict[str, Any], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.logdir)
        for name, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(f"mode/{name}", float(value), step)
        self._writer.flush()

    def end(self, session: Any) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
