"""TensorBoard summaries written by the chief: loss, steps per second, learning rate, histograms.

Events go through ``torch.utils.tensorboard.SummaryWriter`` (TensorBoard's own format), so
``tensorboard --logdir DIR`` shows the run.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from psflow.train.hooks import Hook, Session, StepContext

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class SummaryHook(Hook):
    """Writes ``loss`` (mean since the last write), ``global_step/sec``, ``learning_rate``
    every ``every_n_steps`` global steps, and a histogram of each parameter every
    ``histogram_steps``.

    ``learning_rate`` at step ``n`` is the one applied to the update made at ``n`` (torch's
    scheduler stepped ``n`` times): with a schedule, as the ps reported it with step ``n``
    (:attr:`DistributedOptimizer.learning_rate
    <psflow.worker.DistributedOptimizer.learning_rate>`); give ``learning_rate`` to write a
    fixed value instead.
    """

    def __init__(
        self,
        logdir: str,
        *,
        every_n_steps: int = 100,
        histogram_steps: int | None = 1000,
        learning_rate: float | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if histogram_steps is not None and histogram_steps < 1:
            raise ValueError(f"histogram_steps must be >= 1 or None, got {histogram_steps}")
        self.logdir = logdir
        self.every_n_steps = every_n_steps
        self.histogram_steps = histogram_steps
        self.learning_rate = learning_rate
        self._writer: SummaryWriter | None = None
        self._last_t = time.monotonic()
        self._last_step = 0
        self._last_hist = 0
        self._loss_sum = 0.0
        self._loss_n = 0

    @property
    def writer(self) -> SummaryWriter:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.logdir)
        return self._writer

    def begin(self, session: Session) -> None:
        self._last_t = time.monotonic()
        self._last_step = self._last_hist = session.global_step

    def after_step(self, ctx: StepContext) -> None:
        if ctx.loss is not None:
            self._loss_sum += ctx.loss
            self._loss_n += 1
        step = ctx.global_step
        if step - self._last_step >= self.every_n_steps:
            now = time.monotonic()
            w = self.writer
            if self._loss_n:
                w.add_scalar("loss", self._loss_sum / self._loss_n, step)
            w.add_scalar(
                "global_step/sec", (step - self._last_step) / max(now - self._last_t, 1e-9), step
            )
            lr = self.learning_rate
            if lr is None:
                lr = ctx.session.opt.learning_rate
            if lr is not None:
                w.add_scalar("learning_rate", lr, step)
            self._last_t, self._last_step = now, step
            self._loss_sum, self._loss_n = 0.0, 0
        if self.histogram_steps is not None and step - self._last_hist >= self.histogram_steps:
            self.histograms(ctx.session, step)
            self._last_hist = step

    def histograms(self, session: Session, step: int) -> None:
        for name, p in session.model.named_parameters():
            self.writer.add_histogram(name, p.detach(), step)

    def scalar(self, tag: str, value: Any, step: int) -> None:
        self.writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
