"""Hooks: code that runs at the begin, around each step, and at the end of a session.

TensorFlow's ``SessionRunHook`` vocabulary: ``begin``, ``before_run``/``after_run`` (here
:meth:`Hook.before_step`/:meth:`Hook.after_step`) and ``end``. Built in:

- :class:`StopAtStepHook`: stop once the global step reaches ``last_step``.
- :class:`NanGuardHook`: stop with :class:`NanLossError` before a non-finite loss or gradient
  reaches the ps (so it is never checkpointed).
- :class:`LoggingHook`: a progress bar with rate, loss and ETA on the chief's terminal.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import torch
from torch import nn

from psflow.cluster.spec import TaskContext
from psflow.sparse import kernels
from psflow.worker import DistributedOptimizer


class Session(Protocol):
    """What a hook sees of its session (:class:`~psflow.train.TrainingSession` is one): hooks
    depend on this, not on the session's module."""

    model: nn.Module
    ctx: TaskContext
    opt: DistributedOptimizer
    global_step: int

    @property
    def latest_checkpoint(self) -> str | None: ...

    def request_stop(self) -> None: ...


class NanLossError(RuntimeError):
    """The loss (or a gradient) was NaN or infinite; nothing of that step reached the ps."""


@dataclass(kw_only=True)
class StepContext:
    """What a hook sees of one step."""

    session: Session
    global_step: int
    """Before the step: the last global step seen; after it: the new one."""
    loss: float | None = None
    values: dict[str, Any] = field(default_factory=dict)
    """Anything the script passed to :meth:`TrainingSession.step` besides the loss."""

    def request_stop(self) -> None:
        self.session.request_stop()


class Hook:
    """Subclass and override what you need; every method does nothing by default.

    Example:
        >>> class PrintEvery100(Hook):
        ...     def after_step(self, ctx: StepContext) -> None:
        ...         if ctx.global_step % 100 == 0:
        ...             print(ctx.global_step, ctx.loss)
    """

    def begin(self, session: Session) -> None:
        """After the model is ready (restored or initialised), before the first step."""

    def before_step(self, ctx: StepContext) -> None:
        """After backward, before the gradients are pushed."""

    def after_step(self, ctx: StepContext) -> None:
        """After the push and pull; ``ctx.global_step`` is the new global step."""

    def end(self, session: Session) -> None:
        """When the session ends without an error (before the final checkpoint)."""


class StopAtStepHook(Hook):
    """Requests a stop once the global step reaches ``last_step``."""

    def __init__(self, last_step: int) -> None:
        if last_step < 0:
            raise ValueError(f"last_step must be >= 0, got {last_step}")
        self.last_step = last_step

    def begin(self, session: Session) -> None:
        if session.global_step >= self.last_step:
            session.request_stop()

    def after_step(self, ctx: StepContext) -> None:
        if ctx.global_step >= self.last_step:
            ctx.request_stop()


class NanGuardHook(Hook):
    """Stops with :class:`NanLossError` when the loss or a gradient is not finite.

    It runs before the push, so the bad values never reach the ps (nor a checkpoint).
    """

    def __init__(self, *, check_gradients: bool = True) -> None:
        self.check_gradients = check_gradients

    def before_step(self, ctx: StepContext) -> None:
        if ctx.loss is not None and not math.isfinite(ctx.loss):
            raise NanLossError(f"loss is {ctx.loss} {_stopping(ctx)}")
        if not self.check_gradients:
            return
        grads = [(n, p.grad) for n, p in ctx.session.model.named_parameters() if p.grad is not None]
        if _all_finite([g for _, g in grads]):
            return
        for name, g in grads:
            if not _all_finite([g]):
                raise NanLossError(f"gradient of {name!r} is not finite {_stopping(ctx)}")


def _stopping(ctx: StepContext) -> str:
    """Where a bad step was stopped, and the last checkpoint: read only then (the checkpoint
    directory, perhaps remote, is not read on every step that is fine)."""
    latest = ctx.session.latest_checkpoint
    after = f"; the last checkpoint is {latest}" if latest else ""
    return f"at global step {ctx.global_step} on {ctx.session.ctx.task}: stopping without pushing it{after}"


def _all_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every value of ``grads`` is finite: per device, one reduction a gradient and one
    wait for them all. ``isfinite`` on each instead made a bool tensor the size of each
    gradient and waited on each: a third of a CTR worker's step outside the push
    (benchmarks/results/profile.md).

    Where the kernels are built, a contiguous float32 or float64 gradient on the CPU is instead
    checked by their one pass over its exponent bits (:func:`psflow.sparse.kernels.native_finite`:
    the DLRM's gradients in a sixth of the 2-norm's time). For the others, the reduction is
    the 2-norm: a NaN or an infinity anywhere makes it NaN or infinite, and
    torch computes it 12 times faster than the largest magnitude (the DLRM's 476k gradients on
    one CPU thread: 0.32 ms against 3.8 ms, a tenth of a 16-core worker's step). Only finite
    values whose squares overflow (above about 1e19) make it infinite too: the largest
    magnitude then decides, exactly as before."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.layout != torch.strided:  # sparse (an EmbeddingBag's): its values
            if not bool(torch.isfinite(g.coalesce().values()).all()):
                return False
        elif g.numel():
            finite = kernels.native_finite(g)  # a CPU float32 or float64 one, at reading speed
            if finite is None:
                by_device.setdefault(g.device, []).append(g)
            elif not finite:
                return False
    return all(
        bool(torch.stack(torch._foreach_norm(gs, 2)).isfinite().all())
        or bool(torch.stack(torch._foreach_norm(gs, float("inf"))).isfinite().all())
        for gs in by_device.values()
    )


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LoggingHook(Hook):
    """A progress line: global step (of ``last_step``), steps per second, mean loss, ETA.

    On a terminal it redraws one line in place a few times a second; otherwise (under
    ``psflow launch``, which relays lines) it prints a line every ``every_n_steps`` steps.
    """

    def __init__(
        self,
        *,
        every_n_steps: int = 100,
        last_step: int | None = None,
        stream: IO[str] | None = None,
        width: int = 24,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.last_step = last_step
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = self._last_t = time.monotonic()
        self._step0 = self._last_step = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self._drawn = False

    def begin(self, session: Session) -> None:
        self._t0 = self._last_t = time.monotonic()
        self._step0 = self._last_step = session.global_step

    def after_step(self, ctx: StepContext) -> None:
        if ctx.loss is not None:
            self._loss_sum += ctx.loss
            self._loss_n += 1
        now = time.monotonic()
        due = (
            now - self._last_t >= 0.2
            if self.tty
            else ctx.global_step - self._last_step >= self.every_n_steps
        )
        if due:
            self._emit(ctx.global_step, now)

    def _emit(self, step: int, now: float) -> None:
        rate = (step - self._last_step) / max(now - self._last_t, 1e-9)
        loss = self._loss_sum / self._loss_n if self._loss_n else float("nan")
        parts = [f"step {step}" + (f"/{self.last_step}" if self.last_step else "")]
        if self.last_step:
            frac = min(1.0, step / self.last_step) if self.last_step else 0.0
            filled = int(frac * self.width)
            parts[0] += f" [{'#' * filled}{'.' * (self.width - filled)}] {frac:4.0%}"
        parts.append(f"{rate:.1f} steps/s")
        parts.append(f"loss {loss:.4g}")
        if self.last_step:
            overall = (step - self._step0) / max(now - self._t0, 1e-9)
            eta = (self.last_step - step) / overall if overall > 0 else float("inf")
            parts.append(f"ETA {_duration(max(eta, 0.0))}")
        line = " | ".join(parts)
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last_t, self._last_step = now, step
        self._loss_sum, self._loss_n = 0.0, 0

    def end(self, session: Session) -> None:
        if self.tty and self._drawn:
            self._emit(session.global_step, time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
