"""Settings that travel between tasks as plain data: what the worker asks of the ps.

- :class:`OptimizerSpec`: a ``torch.optim`` optimizer named with its arguments.
- :class:`ScheduleSpec`: a ``torch.optim.lr_scheduler`` schedule named with its arguments, and
  :class:`StepSchedule`, the scheduler it builds, driven by the global step.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim import lr_scheduler

log = logging.getLogger(__name__)

_ARG_TYPES = (int, float, bool, str, type(None))


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """A ``torch.optim`` optimizer named with its arguments, so that it can travel as data.

    Example:
        >>> spec = OptimizerSpec(name="SGD", kwargs={"lr": 0.01, "momentum": 0.9})
        >>> spec.build([torch.zeros(2)]).__class__.__name__
        'SGD'
    """

    name: str = "SGD"
    """The class name in ``torch.optim`` (``SGD``, ``Adam``, ``Adagrad``, ...)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Its keyword arguments: numbers, strings, booleans, or lists of them. One not given is
    the class's own default (``lr``: torch's SGD and Adam take 1e-3)."""

    def __post_init__(self) -> None:
        cls = getattr(torch.optim, self.name, None) if isinstance(self.name, str) else None
        is_optimizer = isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        if cls is None or not is_optimizer or cls is torch.optim.Optimizer:
            raise ValueError(f"unknown optimizer {self.name!r}: expected a torch.optim class name")
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"optimizer arguments must be a mapping, got {self.kwargs!r}")
        for key, value in self.kwargs.items():
            if not isinstance(key, str) or not _plain_arg(value):
                raise ValueError(f"optimizer argument {key!r}={value!r} is not a plain value")
        try:
            # Checked here, on the worker, so a misspelt argument is named at once rather
            # than refused by every ps when the chief initialises them.
            inspect.signature(cls).bind([], **self.kwargs)
        except TypeError as e:
            raise ValueError(
                f"cannot build torch.optim.{self.name}({dict(self.kwargs)}): {e}"
            ) from None

    @classmethod
    def of(cls, optimizer: str | OptimizerSpec, **kwargs: Any) -> OptimizerSpec:
        """``optimizer`` itself, or the class it names with ``kwargs`` (those not given: the
        class's own defaults, as ``torch.optim`` gives them).

        Raises:
            ValueError: for an unknown class, an argument it does not take, or arguments
                given beside a spec.
        """
        if isinstance(optimizer, OptimizerSpec):
            if kwargs:
                raise ValueError(f"give {sorted(kwargs)} in the OptimizerSpec, not beside it")
            return optimizer
        return cls(name=optimizer, kwargs=kwargs)

    @property
    def lr(self) -> float | None:
        """The learning rate it gives (its class's default when not given), if it has one."""
        lr = self.kwargs.get("lr")
        if lr is None:
            param = inspect.signature(getattr(torch.optim, self.name)).parameters.get("lr")
            lr = None if param is None else param.default
        return float(lr) if isinstance(lr, int | float) and not isinstance(lr, bool) else None

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, self.name)
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in self.kwargs.items()}
        try:
            return cls(params, **kwargs)  # type: ignore[no-any-return]
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot build torch.optim.{self.name}({kwargs}): {e}") from None

    def state_keys(self, dtype: torch.dtype = torch.float32) -> dict[str, tuple[bool, torch.dtype]]:
        """The state keys this optimizer keeps for a parameter of ``dtype`` once it has
        stepped: for each, whether it has the parameter's shape (else a scalar, as ``step``)
        and its dtype. Found by one step of it on a scratch parameter of two elements with a
        zero gradient, so it is what torch's class does with these arguments (``Adam`` keeps
        ``max_exp_avg_sq`` only with ``amsgrad``).

        Raises:
            ValueError: for an optimizer that steps only with a closure (``LBFGS``).
        """
        scratch = torch.zeros(2, dtype=dtype, requires_grad=True)
        optimizer = self.build([scratch])
        scratch.grad = torch.zeros_like(scratch)
        try:
            optimizer.step()
        except (TypeError, RuntimeError) as e:
            raise ValueError(
                f"torch.optim.{self.name} does not step without a closure: {e}"
            ) from None
        return {
            key: (value.dim() > 0, value.dtype)
            for key, value in optimizer.state[scratch].items()
            if isinstance(value, torch.Tensor)
        }

    def lacking(self, state: Iterable[tuple[str, torch.dtype, Collection[str]]]) -> str | None:
        """Which variable's state lacks a key this optimizer keeps (``(name, dtype, keys)``
        each), said for a message; ``None`` when none does. Its every step would fail for want
        of it (state saved by ``Adam``, given to ``Adam(amsgrad=True)``: no
        ``max_exp_avg_sq``). Keys it does not keep are harmless. An optimizer that steps only
        with a closure is not checked."""
        kept: dict[torch.dtype, set[str]] = {}
        for name, dtype, keys in state:
            if dtype not in kept:
                try:
                    kept[dtype] = set(self.state_keys(dtype))
                except ValueError:
                    return None
            missing = sorted(kept[dtype] - set(keys))
            if missing:
                return f"the state of {name!r} lacks {missing}, which torch.optim.{self.describe()} keeps"
        return None

    def describe(self) -> str:
        """``Adam({'lr': 0.01, 'amsgrad': True})``, for messages."""
        return f"{self.name}({dict(self.kwargs)})"

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": {k: _plain(v) for k, v in self.kwargs.items()}}

    @classmethod
    def from_wire(cls, data: Any) -> OptimizerSpec:
        if not isinstance(data, dict):
            raise ValueError(f"optimizer spec must be a map, got {data!r}")
        return cls(name=data.get("name", ""), kwargs=data.get("kwargs", {}))


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


# -- learning-rate schedules ----------------------------------------------------------------

_REFUSED_SCHEDULES = {
    "LambdaLR": "takes a Python function (lr_lambda), which cannot travel to the ps as data",
    "MultiplicativeLR": "takes a Python function (lr_lambda), which cannot travel to the ps "
    "as data",
    "ReduceLROnPlateau": "steps on a metric, and the ps sees only gradients and the global step",
}

_COMPOSITES = ("SequentialLR", "ChainedScheduler")
"""Schedulers made of schedulers: given as specs (``"schedulers": [(name, {args}), ...]``)."""

_NEVER = 1 << 62
"""A step no training reaches: "the learning rate does not change again"."""


SCHEDULES: tuple[str, ...] = tuple(
    sorted(
        name
        for name, cls in vars(lr_scheduler).items()
        if isinstance(cls, type)
        and issubclass(cls, lr_scheduler.LRScheduler)
        and cls is not lr_scheduler.LRScheduler
        and not name.startswith("_")
        and name not in _REFUSED_SCHEDULES
    )
)
"""The ``torch.optim.lr_scheduler`` classes a :class:`ScheduleSpec` may name."""


def _count_arg(kwargs: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = kwargs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value


def _next_change(name: str, kwargs: Mapping[str, Any]) -> Callable[[int], int]:
    """For a schedule whose learning rate stays put between known steps, the first step after
    ``t`` at which it may change; for any other, ``t + 1``.

    Only an optimisation: stepping torch's scheduler on the steps skipped would return the
    learning rate it holds (``tests/unit/test_schedule.py`` checks every class against torch
    stepped once a step).
    """
    if name == "StepLR":
        size = _count_arg(kwargs, "step_size")
        if size < 1:
            raise ValueError(f"step_size must be >= 1, got {size}")
        return lambda t: (t // size + 1) * size
    if name == "MultiStepLR":
        milestones = kwargs.get("milestones")
        if not isinstance(milestones, list | tuple) or not all(
            isinstance(m, int) and not isinstance(m, bool) for m in milestones
        ):
            raise ValueError(f"milestones must be a list of integers, got {milestones!r}")
        ordered = sorted(set(milestones))
        return lambda t: next((m for m in ordered if m > t), _NEVER)
    if name == "ConstantLR":
        total = _count_arg(kwargs, "total_iters", 5)
        return lambda t: total if t < total else _NEVER
    if name in ("LinearLR", "PolynomialLR"):
        total = _count_arg(kwargs, "total_iters", 5)
        return lambda t: t + 1 if t < total else _NEVER
    return lambda t: t + 1


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """A ``torch.optim.lr_scheduler`` schedule named with its arguments, applied by the ps as
    a function of the global step (TensorFlow's ``exponential_decay(global_step)``).

    Any scheduler that steps on the step count alone: ``StepLR``, ``MultiStepLR``,
    ``ExponentialLR``, ``CosineAnnealingLR``, ``LinearLR``, ``OneCycleLR``, ...; and
    ``SequentialLR`` (a warmup, then a decay) and ``ChainedScheduler`` (TensorFlow's
    ``piecewise_constant``, as ``MultiStepLR`` pieces) over such schedules, given as specs or
    ``(name, {arguments})`` pairs under ``"schedulers"``. Those that need a Python function
    (``LambdaLR``) or a metric (``ReduceLROnPlateau``) are refused: nothing but data travels
    to the ps.

    Example:
        >>> spec = ScheduleSpec(name="StepLR", kwargs={"step_size": 1000, "gamma": 0.5})
        >>> opt = torch.optim.SGD([torch.zeros(1)], lr=0.1)
        >>> schedule = spec.build(opt)
        >>> schedule.advance(2500)   # the learning rate of global step 2500
        >>> schedule.lr
        0.025
    """

    name: str
    """The class name in ``torch.optim.lr_scheduler``."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Its keyword arguments but the optimizer: numbers, strings, booleans, or lists of them
    (and the ``schedulers`` of a composite, as specs). No ``last_epoch``: the global step
    drives the schedule."""

    def __post_init__(self) -> None:
        name = self.name
        if isinstance(name, str) and name in _REFUSED_SCHEDULES:
            raise ValueError(
                f"lr_schedule {name!r} {_REFUSED_SCHEDULES[name]}: name one that steps on "
                f"the global step alone ({', '.join(SCHEDULES)})"
            )
        cls = getattr(lr_scheduler, name, None) if isinstance(name, str) else None
        if name not in SCHEDULES or cls is None:
            raise ValueError(
                f"unknown lr_schedule {name!r}: expected a torch.optim.lr_scheduler class "
                f"name ({', '.join(SCHEDULES)})"
            )
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"lr_schedule arguments must be a mapping, got {self.kwargs!r}")
        kwargs = dict(self.kwargs)
        for key, value in kwargs.items():
            if key in ("optimizer", "last_epoch"):
                why = "psflow passes" if key == "optimizer" else "the global step sets"
                raise ValueError(f"lr_schedule {name}: do not give {key!r}, {why} it")
            if key == "schedulers" and name in _COMPOSITES:
                kwargs[key] = _sub_schedules(name, value)
            elif not isinstance(key, str) or not _plain_arg(value):
                raise ValueError(
                    f"lr_schedule argument {key!r}={value!r} is not a plain value (a "
                    "function or an object cannot travel to the ps)"
                )
            else:
                kwargs[key] = _plain(value)  # (3, 9) and [3, 9] make one spec
        # Normalised, so that a spec compares equal to itself come back from the wire.
        object.__setattr__(self, "kwargs", kwargs)
        try:
            if name == "ChainedScheduler":
                inspect.signature(cls).bind(**kwargs)
            else:
                inspect.signature(cls).bind(None, **kwargs)
        except TypeError as e:
            raise ValueError(
                f"cannot build torch.optim.lr_scheduler.{name}({kwargs}): {e}"
            ) from None
        _next_change(name, kwargs)  # its own checks of the step arguments

    @classmethod
    def of(
        cls, schedule: str | tuple[str, Mapping[str, Any]] | ScheduleSpec | None
    ) -> ScheduleSpec | None:
        """``schedule`` as a spec: a spec, a ``(name, {arguments})`` pair, a bare name, or
        ``None`` (no schedule: the optimizer's learning rate throughout).

        Raises:
            ValueError: for anything else, and for what the spec itself refuses.
        """
        if schedule is None or isinstance(schedule, ScheduleSpec):
            return schedule
        if isinstance(schedule, str):
            return cls(name=schedule)
        if isinstance(schedule, tuple | list) and len(schedule) == 2:
            name, kwargs = schedule
            return cls(name=name, kwargs=kwargs)
        raise ValueError(
            f"lr_schedule must be a ScheduleSpec or a (name, {{arguments}}) pair such as "
            f'("StepLR", {{"step_size": 1000, "gamma": 0.5}}), got {schedule!r}'
        )

    def build(self, optimizer: torch.optim.Optimizer) -> StepSchedule:
        """The schedule driving ``optimizer``'s learning rate, at step 0."""
        return StepSchedule(self, optimizer)

    def check(self, optimizer: OptimizerSpec) -> None:
        """Raises ``ValueError`` unless the schedule can drive ``optimizer`` (``CyclicLR``
        cycles the momentum: it needs an optimizer that has one); checked on the worker, so
        that the ps never refuse it."""
        self.build(optimizer.build([torch.zeros(1)]))

    def describe(self) -> str:
        """``StepLR(step_size=1000, gamma=0.5)``."""

        def arg(v: Any) -> str:
            if isinstance(v, tuple) and all(isinstance(s, ScheduleSpec) for s in v):
                return "[" + ", ".join(s.describe() for s in v) + "]"
            return repr(v)

        args = ", ".join(f"{k}={arg(v)}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": {k: _wire(v) for k, v in self.kwargs.items()}}

    def scheduler(self, optimizer: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        """Torch's scheduler (at step 0) on ``optimizer``: what :class:`StepSchedule` drives.

        Raises:
            ValueError: when torch refuses the arguments for this optimizer.
        """
        cls = getattr(lr_scheduler, self.name)
        kwargs = dict(self.kwargs)
        try:
            if self.name in _COMPOSITES:
                kwargs["schedulers"] = [s.scheduler(optimizer) for s in kwargs["schedulers"]]
            if self.name == "ChainedScheduler":
                return cls(optimizer=optimizer, **kwargs)  # type: ignore[no-any-return]
            return cls(optimizer, **kwargs)  # type: ignore[no-any-return]
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
            raise ValueError(
                f"cannot build torch.optim.lr_scheduler.{self.describe()} for "
                f"{type(optimizer).__name__}: {e}"
            ) from None

    @classmethod
    def from_wire(cls, data: Any) -> ScheduleSpec:
        if not isinstance(data, dict):
            raise ValueError(f"lr_schedule spec must be a map, got {data!r}")
        return cls(name=data.get("name", ""), kwargs=data.get("kwargs", {}))


class StepSchedule:
    """A ``torch.optim.lr_scheduler`` scheduler whose position is a step number.

    :meth:`advance` moves it to a step and sets the optimizer's learning rate (and, for the
    cyclic schedules, its momentum) to torch's values there: exactly those of the scheduler
    built at step 0 and stepped once a step, the way a training loop steps it. Going to step
    ``n`` is a pure function of ``n``, which is why a restore at step ``n`` needs no state but
    the step. Between the steps where the learning rate can change (``StepLR``,
    ``MultiStepLR``, ``ConstantLR``, and ``LinearLR``/``PolynomialLR`` after
    ``total_iters``) nothing is computed; other schedules step torch's scheduler once a step
    (about 2 us).
    """

    def __init__(self, spec: ScheduleSpec, optimizer: torch.optim.Optimizer) -> None:
        self._scheduler = spec.scheduler(optimizer)
        # Torch's schedulers warn ("lr_scheduler.step() before optimizer.step()") unless the
        # optimizer was stepped through the wrapper they install; the ps steps it its own way.
        optimizer._opt_called = True  # type: ignore[attr-defined]
        self.spec = spec
        self.optimizer = optimizer
        self.step = 0
        """The step whose learning rate the optimizer holds."""
        self.ended_at: int | None = None
        """The step past which the scheduler would not go (``OneCycleLR``'s ``total_steps``):
        the learning rate stays the last one it gave."""
        self._next_change = _next_change(spec.name, spec.kwargs)
        self._next = self._next_change(0)

    @property
    def lr(self) -> float:
        """The learning rate at :attr:`step`."""
        return float(self.optimizer.param_groups[0]["lr"])

    def advance(self, step: int) -> None:
        """Moves to ``step`` (never back: an earlier step leaves it where it is)."""
        if step < self._next:
            if step > self.step:
                self.step = step
            return
        scheduler = self._scheduler
        while self._next <= step:
            target = self._next
            # Skipped steps would leave the learning rate as it is (see _next_change).
            scheduler.last_epoch = target - 1
            try:
                scheduler.step()
            except ValueError as e:  # OneCycleLR past total_steps
                self.ended_at = target - 1
                self._next = _NEVER
                scheduler.last_epoch = target - 1
                log.warning(
                    "lr_schedule %s ended at step %d (%s); the learning rate stays %g",
                    self.spec.describe(),
                    target - 1,
                    e,
                    self.lr,
                )
                break
            self._next = self._next_change(target)
        self.step = step


def _sub_schedules(name: str, value: Any) -> tuple[ScheduleSpec, ...]:
    """The ``schedulers`` of a composite as specs (from specs, pairs, or their wire form)."""
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"lr_schedule {name}: schedulers must be a non-empty list of schedules, each a "
            f"(name, {{arguments}}) pair, got {value!r}"
        )
    out = []
    for item in value:
        spec = ScheduleSpec.from_wire(item) if isinstance(item, dict) else ScheduleSpec.of(item)
        if spec is None:
            raise ValueError(f"lr_schedule {name}: a schedule in schedulers is None")
        out.append(spec)
    return tuple(out)


def _wire(v: Any) -> Any:
    if isinstance(v, tuple) and v and all(isinstance(s, ScheduleSpec) for s in v):
        return [s.to_wire() for s in v]
    return _plain(v)


def _plain_arg(value: Any) -> bool:
    return isinstance(value, _ARG_TYPES) or (
        isinstance(value, list | tuple) and all(isinstance(v, _ARG_TYPES) for v in value)
    )
