"""``DistributedOptimizer``: a module's parameters live on the ps; ``step()`` trains them there."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from psflow import allocator
from psflow import env as envvars
from psflow.cluster.resolve import resolve
from psflow.cluster.spec import TaskContext
from psflow.protocol import OptimizerSpec
from psflow.transport import TransportConfig, wire
from psflow.worker.client import ShardedClient, Tensors, group_by_shard
from psflow.worker.placement import ParamInfo, Piece, place
from psflow.worker.sync import Engine, ModeConfig, StalenessEngine, SyncEngine

log = logging.getLogger(__name__)


class DistributedOptimizer:
    """Trains ``model`` asynchronously against the job's parameter servers.

    The chief sends the model's initial values and the optimizer to the ps tasks; every other
    worker waits for them and starts from the same values. Each :meth:`step` pushes this
    worker's gradients and pulls the fresh parameters back in one round trip per shard; the ps
    tasks apply the named ``torch.optim`` optimizer.

    Args:
        model: the module to train; its parameters are overwritten with the ps values.
        ctx: this task's cluster and identity (default: from flags or ``TF_CONFIG``).
        optimizer: a ``torch.optim`` class name, applied on the ps.
        placement: ``"greedy"`` (by bytes) or ``"round_robin"``.
        partition_bytes: a parameter larger than this is split across the shards along dim 0.
        config: transport settings (timeouts, keys); default from the environment.
        ready_timeout: seconds a worker waits for the chief to initialise the ps.
        mode: ``"async"`` (default, or ``PSFLOW_MODE``), ``"sync"`` (gradients of
            ``replicas_to_aggregate`` workers averaged per step on the ps) or ``"allreduce"``
            (no ps: torch.distributed averages the gradients, each worker applies them); see
            docs/sync.md.
        replicas_to_aggregate, total_num_replicas: sync mode; more replicas than are
            aggregated makes backup workers (default: every worker, no backup).
        max_staleness: async mode: no worker pushes more than this many steps ahead of the
            slowest (it waits).
        sync_timeout: seconds a worker waits for its synchronous step (or for the slowest
            worker) before it fails with :class:`~psflow.worker.sync.SyncTimeoutError`.
        **optimizer_kwargs: the optimizer's arguments (``lr=0.01``, ``momentum=0.9``, ...).

    Example:
        >>> # ctx, _ = psflow.resolve()
        >>> # model = torch.nn.Linear(1, 1)
        >>> # with psflow.DistributedOptimizer(model, ctx, optimizer="SGD", lr=0.001) as opt:
        >>> #     for x, y in data:
        >>> #         opt.zero_grad()
        >>> #         torch.nn.functional.mse_loss(model(x), y).backward()
        >>> #         step = opt.step()   # the global step after this update
    """

    def __init__(
        self,
        model: nn.Module,
        ctx: TaskContext | None = None,
        *,
        optimizer: str = "SGD",
        placement: str = "greedy",
        partition_bytes: int | None = 64 << 20,
        config: TransportConfig | None = None,
        ready_timeout: float | None = None,
        mode: str | None = None,
        replicas_to_aggregate: int | None = None,
        total_num_replicas: int | None = None,
        max_staleness: int | None = None,
        sync_timeout: float | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if ctx is None:
            ctx, _ = resolve()
        if ctx.task.job not in ("worker", "chief"):
            raise ValueError(f"DistributedOptimizer runs on worker or chief tasks, not {ctx.task}")
        if ready_timeout is None:
            ready_timeout = float(os.environ.get(envvars.PSFLOW_READY_TIMEOUT, 300))
        allocator.tune()
        self.model = model
        self.ctx = ctx
        self.spec = OptimizerSpec(name=optimizer, kwargs=optimizer_kwargs or {"lr": 0.01})
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        given: dict[str, Any] = {"mode": mode, "timeout": sync_timeout}
        self.mode_config = ModeConfig(
            replicas_to_aggregate=replicas_to_aggregate,
            total_num_replicas=total_num_replicas,
            max_staleness=max_staleness,
            **{k: v for k, v in given.items() if v is not None},  # else from the environment
        )
        self._engine: Engine | None = None
        self._closed = False
        self._frozen = False
        if self.mode_config.mode == "allreduce":
            from psflow.worker.allreduce import AllReduceEngine  # torch.distributed: lazily

            self.pieces: list[Piece] = []
            self._engine = AllReduceEngine(model, ctx, self.spec, self.mode_config)
            self.global_step = 0
            self._frozen = allocator.freeze_gc()
            return
        infos = [
            ParamInfo(name=n, shape=tuple(p.shape), dtype=p.dtype) for n, p in self.params.items()
        ]
        self._client = ShardedClient(ctx, config or TransportConfig.from_env())
        self.pieces = place(
            infos, self._client.num_shards, strategy=placement, partition_bytes=partition_bytes
        )
        self._by_shard = group_by_shard(self.pieces)
        self._shard_of = {p.var: p.shard for p in self.pieces}
        self._grad_plan = [
            (shard, [(p.var, self.params[p.param], p.rows) for p in pieces])
            for shard, pieces in self._by_shard.items()
        ]
        # What a shard's gradients look like when every one of its variables has one.
        self._grad_layouts = {
            shard: wire.Layout.of(self._values(pieces)) for shard, pieces in self._by_shard.items()
        }
        # Parameters held whole by one shard, on the CPU: a pull may hand them memory of their
        # own instead of copying into theirs (see _load).
        self._whole = {
            p.var: self.params[p.param]
            for p in self.pieces
            if p.rows is None and self.params[p.param].device.type == "cpu"
        }
        self._client.transport.on_lane_retired(self._move_out_of)
        self._view_ptrs: tuple[int, ...] = ()
        self._view_of: dict[str, torch.Tensor] = {}
        self._into: dict[str, torch.Tensor] = {}
        self.global_step = 0
        self._closed = False
        if self.mode_config.mode == "sync":
            self._engine = SyncEngine(self, self.mode_config)
        elif self.mode_config.max_staleness is not None:
            self._engine = StalenessEngine(self, self.mode_config)
        try:
            self._start(ready_timeout)
        except BaseException:
            self._client.close()
            raise
        self._frozen = allocator.freeze_gc()  # what is alive now lives as long as the training

    @property
    def is_chief(self) -> bool:
        return self.ctx.is_chief

    def _start(self, ready_timeout: float) -> None:
        if self.is_chief:
            # The ps tasks may still be starting: wait for them, not just one request's timeout.
            self._client.wait_ready(ready_timeout, initialized=False)
            values = {s: self._values(pieces) for s, pieces in self._by_shard.items()}
            if self._client.initialize(values, self.spec):
                log.info("%s initialised the ps", self.ctx.task)
            else:
                log.info(
                    "%s found the ps already initialised (restored or restarted)", self.ctx.task
                )
        else:
            self._client.wait_ready(ready_timeout)
        self.pull()

    def _values(self, pieces: list[Piece]) -> Tensors:
        return [(p.var, self._slice(self.params[p.param].detach(), p)) for p in pieces]

    @staticmethod
    def _slice(t: torch.Tensor, piece: Piece) -> torch.Tensor:
        if piece.rows is None:
            return t
        return t[piece.rows[0] : piece.rows[1]]

    def _views(self) -> dict[str, torch.Tensor]:
        """Each variable's place in the model: views of the parameters' memory.

        Built once and rebuilt only when a parameter's storage changed (``model.to(...)``):
        this runs every step, and for small models its cost is the step's cost.
        """
        ptrs = tuple(p.data_ptr() for p in self.params.values())
        if ptrs != self._view_ptrs:
            self._view_of = {p.var: self._slice(self.params[p.param].data, p) for p in self.pieces}
            # Large tensors are received straight into the model (small ones arrive inline).
            self._into = {
                v: t
                for v, t in self._view_of.items()
                if t.is_contiguous() and t.nbytes > wire.INLINE_BYTES
            }
            self._view_ptrs = ptrs
        return self._view_of

    def _destinations(self) -> dict[str, torch.Tensor]:
        """The model's memory for the large variables, to receive them straight into it."""
        self._views()
        return self._into

    def _move_out_of(self, area: np.ndarray[Any, Any]) -> None:
        """Copies the parameters that live in ``area`` (a lane left to a ps that may still
        write there) into memory of their own."""
        lo = area.ctypes.data
        hi = lo + area.nbytes
        for param in self._whole.values():
            if lo <= param.data_ptr() < hi:
                param.data = param.data.clone()

    def _load(self, replies: dict[int, tuple[dict[str, Any], Tensors]]) -> None:
        """Puts the pulled values in the model (after :meth:`_destinations`, which refreshed
        the views of its parameters)."""
        views = self._view_of
        shard_of = self._shard_of
        whole = self._whole
        for shard, (header, tensors) in replies.items():
            # Tensors in a lane or in frames of their own may be adopted; inline ones are
            # views of one blob per message, copied.
            adopt = "b" not in header
            for var, value in tensors:
                dst = views.get(var)
                if dst is None or shard_of[var] != shard:
                    raise ValueError(f"ps:{shard} sent unknown variable {var!r}")
                if value.data_ptr() == dst.data_ptr():
                    continue  # received in place
                if dst.shape != value.shape:
                    raise ValueError(
                        f"ps:{shard} sent {var!r} with shape {list(value.shape)}, "
                        f"the model has {list(dst.shape)}: is every worker running the same model?"
                    )
                param = whole.get(var) if adopt else None
                if param is not None and value.dtype == param.dtype and param.is_cpu:
                    # Received into memory of its own (a frame, or the lane where the ps
                    # writes this variable every time): the parameter moves there.
                    param.data = value
                else:
                    with torch.no_grad():  # only here: a steady step copies nothing
                        dst.copy_(value)
            if shard == 0:
                self.global_step = int(header["step"])

    def pull(self) -> int:
        """Overwrites the model's parameters with the ps values; returns the global step."""
        if self._engine is not None:
            return self._engine.pull()
        self._load(self._client.pull(into=self._destinations(), lane_views=True))
        return self.global_step

    def step(self) -> int:
        """Pushes the gradients, pulls the updated parameters, returns the new global step.

        Parameters whose ``grad`` is ``None`` are not pushed (they still get pulled).
        """
        if self._engine is not None:
            self.global_step = self._engine.step()
            return self.global_step
        grads: dict[int, Tensors] = {}
        layouts = {}
        for shard, plan in self._grad_plan:
            out = []
            for var, param, rows in plan:
                g = param.grad
                if g is not None:
                    out.append((var, g if rows is None else g[rows[0] : rows[1]]))
            if out:
                grads[shard] = out
                if len(out) == len(plan):
                    layouts[shard] = self._grad_layouts[shard]
        if not grads:
            raise ValueError("no gradients to push: call loss.backward() before step()")
        replies = self._client.push(
            grads, pull=True, into=self._destinations(), lane_views=True, layouts=layouts
        )
        self._load(replies)
        return self.global_step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the model's parameters, like ``torch.optim.Optimizer``."""
        if self.mode_config.mode == "allreduce" and self._engine is not None:
            return self._engine.zero_grad(set_to_none)
        for p in self.params.values():  # the parameters we train: no walk over submodules
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def close(self, *, finished: bool = True) -> None:
        """Tells the ps this worker has finished (the ps exit after the last one) and disconnects.

        With ``finished=False`` it only disconnects: the worker goes on with a new optimizer
        (after a ps came back from a crash).
        """
        if self._closed:
            return
        self._closed = True
        if self._frozen:
            gc.unfreeze()  # training is over: what it kept may be collected again
            self._frozen = False
        if self._engine is not None:
            self._engine.close()
        if self.mode_config.mode == "allreduce":
            return
        try:
            if finished:
                self._client.done()
        finally:
            self._client.close()

    @property
    def mode(self) -> str:
        """``"async"``, ``"sync"`` or ``"allreduce"``."""
        return self.mode_config.mode

    def stats(self) -> dict[str, Any]:
        """The training mode's counters: sync accepted/dropped gradients, staleness, waits."""
        if self._engine is None:
            return {"mode": self.mode, "global_step": self.global_step}
        return {**self._engine.stats(), "global_step": self.global_step}

    def sync_status(self, timeout: float | None = None) -> dict[str, Any]:
        """ps:0's synchronous state: step, arrivals, dropped gradients per worker, decisions."""
        if self.mode == "allreduce":
            raise ValueError("mode='allreduce' has no ps to ask")
        return self._client.call({0: {"op": "sync_status"}}, timeout=timeout)[0][0]

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
