"""One ps shard's variables, the optimizer that updates them, and its learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

import psflow.sparse.kernels as kernels
from psflow.protocol import OptimizerSpec, ScheduleSpec, StepSchedule
from psflow.protocol.tables import WIRE_DTYPES
from psflow.ps.fused_adam import FusedAdam
from psflow.ps.positions import InputPositions
from psflow.sparse import Rows
from psflow.transport.wire import TensorSet, dtype_name

RowGrads = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
"""Per table: the unique ids a push updates and their gradients, one row per id."""


class GradBuffers(Mapping[str, torch.Tensor]):
    """Where gradients that arrive in several frames are assembled, one buffer per variable,
    allocated the first time it is needed: a tensor that arrives in one frame or through a
    shared-memory lane is used where it lies, so most variables never need one."""

    def __init__(self, like: Mapping[str, torch.Tensor]) -> None:
        self._like = like
        self._made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        buf = self._made.get(name)
        if buf is None:
            buf = self._made[name] = torch.empty_like(self._like[name])
        return buf

    def __iter__(self) -> Iterator[str]:
        return iter(self._like)

    def __len__(self) -> int:
        return len(self._like)


MAX_SCHEDULE_CATCH_UP = 1 << 16
"""Steps of the schedule one push may move a shard by (a worker's word on the global step);
a shard that lags more catches up over several pushes, and no request can stall the ps."""


FOREACH_SAME_BITS = frozenset({"Adam", "AdamW"})
"""Optimizers whose ``foreach`` form a shard takes on CPU unless told otherwise: the same bits
as torch's default per-tensor loop there, in 0.75-0.85 of its time (a CTR job's ps spent 47% of
its serving in single-tensor Adam; ``benchmarks/dense_optimizer.py``). Adagrad's and SGD's
``foreach`` forms were slower; the ``fused`` ones faster still, but they round differently."""


def build_optimizer(spec: OptimizerSpec, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """``spec``'s optimizer over ``params``, in its ``foreach`` form where that gives the same
    values faster (:data:`FOREACH_SAME_BITS`) and the spec chose neither form itself."""
    chosen = "foreach" in spec.kwargs or "fused" in spec.kwargs
    if (
        spec.name in FOREACH_SAME_BITS
        and not chosen
        and all(p.device.type == "cpu" for p in params)
    ):
        spec = OptimizerSpec(name=spec.name, kwargs={**spec.kwargs, "foreach": True})
    return spec.build(params)


class ShardStore:
    """The variables of one shard, their optimizer, and the count of updates applied.

    With a learning-rate schedule, each update uses the schedule's learning rate at the
    global step it belongs to: the shard's own step on shard 0 (the global step) and in
    synchronous training (every shard applies step ``t`` at ``t``); on the other shards in
    asynchronous training, the highest of their own step and the global steps their workers'
    pushes carry (:meth:`apply`), so that a shard that some pushes pass by still follows the
    job's step.
    """

    def __init__(self) -> None:
        self.variables: dict[str, torch.Tensor] = {}
        self.tables: dict[str, Rows] = {}
        """This shard's part of each embedding table, with its row-wise optimizer state."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_spec: OptimizerSpec | None = None
        self.schedule: StepSchedule | None = None
        """The learning-rate schedule driving the optimizer, if any."""
        self.step = 0
        """Updates applied (on shard 0: the job's global step)."""
        self.inputs = InputPositions()
        """Where each worker's input stands in the updates applied (:mod:`psflow.ps.positions`):
        saved and restored with them."""
        self.grad_buffers = GradBuffers(self.variables)
        self._wire: TensorSet | None = None
        self._step: Callable[[], Any] = lambda: None
        self._fused: FusedAdam | None = None
        self._names: list[str] = []

    @property
    def initialized(self) -> bool:
        return self.optimizer is not None

    def reset(self) -> None:
        """Forgets the variables and optimizer, so that :meth:`initialize` may run again."""
        self.variables = {}
        self.tables = {}
        self.optimizer = None
        self.optimizer_spec = None
        self.schedule = None
        self.grad_buffers = GradBuffers(self.variables)
        self._wire = None
        self._step = lambda: None
        self._fused = None
        self._names = []
        self.step = 0
        self.inputs = InputPositions()

    def initialize(
        self,
        tensors: Sequence[tuple[str, torch.Tensor]],
        spec: OptimizerSpec,
        *,
        step: int = 0,
        schedule: ScheduleSpec | None = None,
        tables: Mapping[str, Rows] | None = None,
        share: bool = False,
    ) -> None:
        """Takes the variables and this shard's part of the embedding tables, builds the
        optimizer (and the schedule, at ``step``: a restore goes on with the learning rate of
        the restored step). With ``share``, the variables are the given tensors themselves,
        not copies (a cluster of one, :mod:`psflow.train.alone`: the model's parameters)."""
        if self.initialized:
            raise ValueError("shard is already initialised")
        names = [n for n, _ in tensors]
        if len(set(names)) != len(names):
            raise ValueError("duplicate variable names in init")
        for name, t in tensors:
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"initial value of {name!r} is not finite")
        # Own copies: the received tensors may be views of network buffers.
        self.variables = {name: t.detach() if share else t.detach().clone() for name, t in tensors}
        self._wire = None
        # Gradients in several frames are assembled into these: no allocation per push.
        self.grad_buffers = GradBuffers(self.variables)
        # A shard may hold no dense variable (only table rows, or more shards than
        # variables): torch.optim refuses an empty parameter list, so it gets a placeholder
        # that never has a gradient, and no state (Adagrad makes its own when built): a
        # snapshot lists the state of the shard's variables only.
        optimizer = build_optimizer(spec, list(self.variables.values()) or [torch.zeros(0)])
        if not self.variables:
            optimizer.state.clear()
        self.schedule = schedule.build(optimizer) if schedule is not None else None
        if self.schedule is not None:
            self.schedule.advance(step)
        self.optimizer = optimizer
        # torch.optim wraps step() in a profiler range and hook calls that cost more than the
        # update itself for small models; the ps registers no hooks, so it calls step directly.
        raw_step = getattr(type(self.optimizer).step, "__wrapped__", None)
        opt = self.optimizer
        self._step = (lambda: raw_step(opt)) if raw_step is not None else opt.step
        self._fused = FusedAdam.of(opt) if self.variables else None
        self._names = list(self.variables)
        self.optimizer_spec = spec
        self.tables = dict(tables or {})
        self.step = step

    @property
    def wire_set(self) -> TensorSet:
        """All variables, described for the wire once (every pull and push_pull sends them)."""
        if self._wire is None:
            self._wire = TensorSet(list(self.variables.items()))
        return self._wire

    def check(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Raises ``ValueError`` unless every tensor matches a stored variable exactly."""
        names = set()
        for name, t in tensors:
            var = self.variables.get(name)
            if var is None:
                raise ValueError(f"unknown variable {name!r}")
            if t.dtype != var.dtype:
                raise ValueError(
                    f"{name!r}: dtype {dtype_name(t.dtype)} does not match the stored "
                    f"{dtype_name(var.dtype)}"
                )
            if t.shape != var.shape:
                raise ValueError(
                    f"{name!r}: shape {list(t.shape)} does not match the stored {list(var.shape)}"
                )
            if name in names:
                raise ValueError("a variable appears twice in one push")
            names.add(name)

    def check_rows(self, rows: RowGrads) -> None:
        """Raises ``ValueError`` unless every table (or variable, for the sparse gradient of
        an ``nn.Embedding(sparse=True)``) is known and its ids and gradients fit it. A table's
        gradients may come narrower than its rows (:data:`~psflow.protocol.tables.WIRE_DTYPES`),
        each of them finite (a float16 gradient beyond its range arrives as inf)."""
        for name, (ids, grads) in rows.items():
            table = self.tables.get(name)
            if table is None:
                self._check_sparse_grad(name, ids, grads)
                continue
            table.check_ids(ids)
            dim = table.spec.embedding_dim
            got = dtype_name(grads.dtype)
            if got != table.spec.dtype:
                if got not in WIRE_DTYPES:
                    raise ValueError(
                        f"table {name!r}: gradient dtype {got} does not match the table's "
                        f"{table.spec.dtype} (nor is it one of the wire dtypes {WIRE_DTYPES})"
                    )
                if not kernels.all_finite(grads):
                    raise ValueError(
                        f"table {name!r}: a {got} row gradient is not finite (beyond {got}'s "
                        "range, or not finite before the cast): nothing of the push is applied"
                    )
            if grads.shape != (ids.shape[0], dim):
                raise ValueError(
                    f"table {name!r}: {ids.shape[0]} ids with gradients of shape "
                    f"{list(grads.shape)}; expected [{ids.shape[0]}, {dim}]"
                )

    def _check_sparse_grad(self, name: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        var = self.variables.get(name)
        if var is None:
            raise ValueError(f"unknown embedding table or variable {name!r}")
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"{name!r}: row ids must be a 1-D int64 tensor")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= var.shape[0]):
            bad = ids[(ids < 0) | (ids >= var.shape[0])][0]
            raise ValueError(f"{name!r}: row id {int(bad)} out of range [0, {var.shape[0]})")
        if grads.dtype != var.dtype or grads.shape != (ids.shape[0], *var.shape[1:]):
            raise ValueError(
                f"{name!r}: row gradients {dtype_name(grads.dtype)}{list(grads.shape)} do not "
                f"fit {ids.shape[0]} rows of {dtype_name(var.dtype)}{list(var.shape)}"
            )

    def apply(
        self,
        grads: Sequence[tuple[str, torch.Tensor]],
        *,
        global_step: Any = None,
        rows: RowGrads | None = None,
    ) -> int:
        """Applies one gradient for (some of) the variables and table rows and returns the
        new step count.

        ``global_step``: with a schedule, the global step the pushing worker last saw (a
        shard other than 0 in asynchronous training has no other way to know it). ``rows``:
        per table, unique ids and their gradients, applied with the table's row-wise optimizer.
        Everything is checked before anything changes.
        """
        assert self.optimizer is not None
        self.check(grads)
        sparse: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if rows:
            self.check_rows(rows)
            sparse = {n: r for n, r in rows.items() if n not in self.tables}
        self._apply_dense(grads, sparse, global_step)
        if rows:
            # The schedule's rate now (moved by _apply_dense), for tables that follow it.
            lr = None if self.schedule is None else self.schedule.lr
            for name, (ids, g) in rows.items():
                table = self.tables.get(name)
                if table is not None:
                    if lr is not None and table.spec.scheduled:
                        table.optimizer.lr = lr
                    # Rows travel narrow; the optimizer runs at the table's width.
                    table.apply(ids, g if g.dtype == table.dtype else g.to(table.dtype))
        self.step += 1
        return self.step

    def advance(self) -> int:
        """Counts an update that changed no dense variable (row gradients alone, applied by
        the native path) and returns the new step: what :meth:`apply` does with no dense
        gradient and no schedule."""
        self.step += 1
        return self.step

    def _apply_dense(
        self,
        grads: Sequence[tuple[str, torch.Tensor]],
        sparse: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        global_step: Any,
    ) -> None:
        schedule = self.schedule
        if schedule is not None:
            schedule.advance(self._schedule_step(schedule, global_step))
        fused = self._fused
        if fused is not None and grads and not sparse:
            # The same kernels as Adam.step, without its Python (psflow/ps/fused_adam.py).
            ordered = self._in_order(grads)
            if ordered is not None and fused.step(ordered):
                return
        lr = self._plain_sgd_lr()
        if lr is not None:
            # What torch.optim.SGD does for these settings (p -= lr * g, the same kernel),
            # without its per-step bookkeeping, which costs more than a small model's update.
            variables = self.variables
            for name, g in grads:
                variables[name].add_(g, alpha=-lr)
            for name, (ids, g) in sparse.items():
                variables[name].index_add_(0, ids, g, alpha=-lr)
            return
        names = [n for n, _ in grads] + list(sparse)
        for name, g in grads:
            self.variables[name].grad = g
        for name, (ids, g) in sparse.items():
            var = self.variables[name]
            var.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), g, var.shape)
        try:
            self._step()
        except RuntimeError as e:  # e.g. torch.optim.Adam given a sparse gradient
            name = self.optimizer_spec.name if self.optimizer_spec else "the optimizer"
            raise ValueError(f"torch.optim.{name} cannot apply this update: {e}") from None
        finally:
            for name in names:
                # Drop the reference: the gradient may be a view of a network buffer.
                self.variables[name].grad = None

    def _in_order(self, grads: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor] | None:
        """A gradient for every variable, in the optimizer's order; ``None`` when some have
        none (the push names each once: :meth:`check`)."""
        if len(grads) != len(self._names):
            return None
        if all(n == want for (n, _), want in zip(grads, self._names, strict=True)):
            return [g for _, g in grads]
        given = dict(grads)
        if any(n not in given for n in self._names):
            return None
        return [given[n] for n in self._names]

    def _schedule_step(self, schedule: StepSchedule, global_step: Any) -> int:
        if global_step is None:
            return self.step
        if isinstance(global_step, bool) or not isinstance(global_step, int):
            raise ValueError(f"'step' must be a global step (an integer), got {global_step!r}")
        if global_step <= self.step:
            return self.step
        return min(global_step, max(schedule.step, self.step) + MAX_SCHEDULE_CATCH_UP)

    def learning_rate(self) -> float | None:
        """The learning rate at the shard's step, with a schedule (``None`` without)."""
        schedule = self.schedule
        if schedule is None:
            return None
        schedule.advance(self.step)
        return schedule.lr

    def _plain_sgd_lr(self) -> float | None:
        """The learning rate when the optimizer is plain SGD (no momentum, no weight decay,
        one parameter group), read afresh each step (a restore may change it); else None."""
        opt = self.optimizer
        if type(opt) is not torch.optim.SGD:
            return None
        groups = opt.param_groups
        if len(groups) != 1:
            return None
        g = groups[0]
        lr = g["lr"]
        if (
            type(lr) not in (float, int)
            or g["momentum"]
            or g["weight_decay"]
            or g["maximize"]
            or g["differentiable"]
        ):
            return None
        return float(lr)

    def nbytes(self) -> int:
        dense = sum(math.prod(t.shape) * t.element_size() for t in self.variables.values())
        return dense + sum(t.nbytes for t in self.tables.values())
