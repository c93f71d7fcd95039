"""The parameter exchange: where a model's parameters live on the ps, and how they move.

Every training mode that uses a ps goes through one :class:`ParameterExchange`: it places the
parameters on the shards, sends the chief's initial values, gathers each shard's gradients,
and puts pulled values back into the model, received straight into the model's memory where
it can. The engines (:mod:`psflow.worker.engine`) decide only *when* to push and pull.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from psflow.cluster.spec import TaskContext
from psflow.protocol import Key, OptimizerSpec, ScheduleSpec
from psflow.protocol.messages import IN_REQUEST_AREA, InputMark, row_tensor_names
from psflow.transport import TransportConfig, wire
from psflow.worker.client import Replies, ShardedClient, Tensors, group_by_shard
from psflow.worker.heartbeat import Heartbeat
from psflow.worker.opt_state import State, place_optimizer_state
from psflow.worker.placement import Piece, dense_parameters
from psflow.worker.staging import Staging
from psflow.worker.tables import TableClient

log = logging.getLogger(__name__)

_LR = Key.LEARNING_RATE


class ParameterExchange:
    """A model's parameters placed on the ps shards, pulled and pushed.

    Args:
        model: the module whose parameters the ps hold; pulls overwrite them.
        ctx: this task.
        pieces: the placement (:func:`~psflow.worker.placement.place`), the same on every
            worker.
        transport: transport settings.
        lr_schedule: the learning-rate schedule the chief sends the ps with the optimizer.
        optimizer_state: the optimizer's first state the chief sends the ps (checked:
            :func:`~psflow.worker.opt_state.check_optimizer_state`).
        staging: the copies between the host and a model's GPU (default: plain copies).

    Example:
        >>> # ex = ParameterExchange(model, ctx, pieces=place(...), transport=TransportConfig())
        >>> # ex.start(spec, ready_timeout=300)   # chief: init; others: wait
        >>> # ex.pull()
        >>> # grads, layouts, rows = ex.gradients(); ex.push_pull(grads, layouts, rows)
    """

    def __init__(
        self,
        model: nn.Module,
        ctx: TaskContext,
        *,
        pieces: Sequence[Piece],
        transport: TransportConfig,
        lr_schedule: ScheduleSpec | None = None,
        optimizer_state: State | None = None,
        staging: Staging | None = None,
    ) -> None:
        self.ctx = ctx
        self.staging = staging if staging is not None else Staging(pinned=False)
        self.lr_schedule = lr_schedule
        self.optimizer_state = optimizer_state or {}
        self.params: dict[str, nn.Parameter] = dense_parameters(model)
        self.pieces = list(pieces)
        unknown = sorted({p.param for p in self.pieces} - set(self.params))
        if unknown:
            raise ValueError(f"the placement names parameters the model lacks: {unknown}")
        self.client = ShardedClient(ctx, transport)
        self.tables = TableClient(model, self.client, staging=self.staging)
        """The model's embedding tables (:mod:`psflow.nn`), attached: rows come from the ps."""
        self.global_step = 0
        """Shard 0's step in its last reply."""
        self.input_mark: InputMark | None = None
        """The input number and reader position the next :meth:`push_pull` carries to every
        shard (:mod:`psflow.ps.positions`); each push takes it once."""
        self.input_epochs: dict[int, int] | None = None
        """Each shard's epoch when this worker last asked where its input stands."""
        self.learning_rate: float | None = None
        """The learning rate shard 0 applies at :attr:`global_step`, as its last reply said
        (only a ps with a schedule says)."""
        self._by_shard = group_by_shard(self.pieces)
        too_high = sorted(s for s in self._by_shard if s >= self.client.num_shards)
        if too_high:
            self.client.close()
            raise ValueError(
                f"the placement uses shards {too_high}, the cluster has "
                f"{self.client.num_shards} ps task(s)"
            )
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
        # own instead of copying into theirs (see load).
        self._whole = {
            p.var: self.params[p.param]
            for p in self.pieces
            if p.rows is None and self.params[p.param].device.type == "cpu"
        }
        self.client.transport.on_lane_retired(self._move_out_of)
        self._view_ptrs: tuple[int, ...] = ()
        self._view_of: dict[str, torch.Tensor] = {}
        self._into: dict[str, torch.Tensor] = {}
        self._heartbeat: Heartbeat | None = None

    @property
    def num_shards(self) -> int:
        return self.client.num_shards

    # -- start ------------------------------------------------------------------------------

    def start(self, spec: OptimizerSpec, *, ready_timeout: float) -> None:
        """The chief initialises the ps with the model's values (unless they already are:
        restored, or restarted); other workers wait for it. The engine pulls next, its way.
        """
        if self.ctx.is_chief:
            # The ps tasks may still be starting: wait for them, not just one request's timeout.
            self.client.wait_ready(ready_timeout, initialized=False)
            values = {s: self._values(pieces) for s, pieces in self._by_shard.items()}
            tables = self.tables.wire_specs(spec) if self.tables else None
            held = list(self.tables.initial)
            if held:  # tables this model holds rows of: they start from those, not the seed
                for s in range(self.num_shards):
                    values.setdefault(s, []).extend(self.tables.initial_rows(s))
            state, opt_vars = place_optimizer_state(self.pieces, self.optimizer_state)
            for s, tensors in state.items():
                values.setdefault(s, []).extend(tensors)
            # A ps allocates the model and its tables' rows before it answers (20M rows take it
            # seconds; more on a loaded machine): more than one request's timeout may pass.
            initialized = self.client.initialize(
                values,
                spec,
                schedule=self.lr_schedule,
                tables=tables,
                initial_rows=held,
                opt_state=opt_vars,
                timeout=ready_timeout,
            )
            if initialized:
                log.info("%s initialised the ps", self.ctx.task)
            else:
                log.info(
                    "%s found the ps already initialised (restored or restarted)", self.ctx.task
                )
        else:
            self.client.wait_ready(ready_timeout)
        self.tables.forget_initial()
        self.optimizer_state = {}  # sent (or the ps had theirs): not held for the whole run
        # From now on the ps expect to hear from this task (psflow.ps.liveness).
        self._heartbeat = Heartbeat(self.ctx, self.client.config).start()

    def _values(self, pieces: list[Piece]) -> Tensors:
        return [(p.var, _rows(self.params[p.param].detach(), p.rows)) for p in pieces]

    # -- gradients --------------------------------------------------------------------------

    def gradients(
        self,
    ) -> tuple[dict[int, Tensors], dict[int, wire.Layout], dict[int, list[str]]]:
        """Each shard's slice of the model's gradients (parameters without one are left
        out), the layout of each shard whose every variable has one, and the tables whose
        row gradients each shard's tensors carry (after the dense ones).

        Raises:
            ValueError: when no parameter has a gradient.
        """
        grads: dict[int, Tensors] = {}
        layouts = {}
        rows: dict[int, list[str]] = {}
        for shard, plan in self._grad_plan:
            out = []
            sparse: Tensors = []
            for var, param, part in plan:
                g = param.grad
                if g is None:
                    continue
                if g.is_sparse:  # nn.Embedding(sparse=True): only the rows it touched
                    sparse.extend(_sparse_rows(var, g, part))
                    rows.setdefault(shard, []).append(var)
                else:  # from a GPU: into pinned memory, read after the wait below
                    g = g if part is None else g[part[0] : part[1]]
                    out.append((var, self.staging.to_host(g)))
            if out and len(out) == len(plan):
                layouts[shard] = self._grad_layouts[shard]
            if out or sparse:
                grads[shard] = out + sparse
        if self.tables:
            row_grads, table_rows = self.tables.gradients()
            for shard, tensors in row_grads.items():
                grads.setdefault(shard, []).extend(tensors)
                rows.setdefault(shard, []).extend(table_rows[shard])
                layouts.pop(shard, None)  # the layout describes the dense gradients only
        self.staging.wait()  # (the tables' gradients waited for all; without tables, here)
        if not grads:
            raise ValueError("no gradients to push: call loss.backward() before step()")
        return grads, layouts, rows

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the placed parameters, like ``torch.optim.Optimizer``, and
        the tables' row gradients since the last step, whose lookups are kept: as in torch, a
        backward after ``zero_grad()`` (``out = model(x); zero_grad(); loss.backward()``) is
        what the next step pushes (:meth:`TableClient.zero_grad`). Zeroed in place, the
        parameters' gradients may be the bytes of a push still in flight (``overlap``: a
        socket sends them from their own memory): its reply is taken first."""
        if not set_to_none:
            self.client.settle()
        self.tables.zero_grad()
        clear_grads(self.params.values(), set_to_none)  # what we train: no walk over submodules

    # -- values -----------------------------------------------------------------------------

    def destinations(self) -> dict[str, torch.Tensor]:
        """The model's memory for its large variables, to receive pulls straight into.

        Built once and rebuilt only when a parameter's storage changed (``model.to(...)``):
        this runs every step, and for small models its cost is the step's cost.
        """
        ptrs = tuple(p.data_ptr() for p in self.params.values())
        if ptrs != self._view_ptrs:
            self._view_of = {p.var: _rows(self.params[p.param].data, p.rows) for p in self.pieces}
            # Large tensors are received straight into the model (small ones arrive inline).
            self._into = {
                v: t
                for v, t in self._view_of.items()
                if t.is_cpu and t.is_contiguous() and t.nbytes > wire.INLINE_BYTES
            }
            self._view_ptrs = ptrs
        return self._into

    def load(self, replies: Replies, *, adopt: bool = True) -> int:
        """Puts pulled values in the model; returns the global step (shard 0's).

        Call :meth:`destinations` first (for the request these replies answer): it refreshes
        the views of the model's parameters that this fills. ``adopt=False``: every value is
        copied into the parameters' memory, none adopted where it came (``overlap``: the ps
        rewrites its lane's reply area while this worker computes the next step).
        """
        views = self._view_of
        shard_of = self._shard_of
        whole = self._whole
        for shard, (header, tensors) in replies.items():
            # Tensors in a lane or in frames of their own may be adopted; inline ones are
            # views of one blob per message, and values that came beside prefetched rows in a
            # lane's request area (which the next request overwrites), copied: into the
            # model's memory, which stays where it is (no new tensors a step).
            adopted = adopt and Key.INLINE not in header and not _in_request_area(header)
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
                param = whole.get(var) if adopted else None
                if param is not None and value.dtype == param.dtype and param.is_cpu:
                    # Received into memory of its own (a frame, or the lane where the ps
                    # writes this variable every time): the parameter moves there.
                    param.data = value
                else:
                    with torch.no_grad():  # only here: a steady step copies nothing
                        self.staging.copy_into(dst, value)  # to a GPU: the host goes on
            if shard == 0:
                self.global_step = int(header[Key.STEP])
                lr = header.get(_LR)
                if lr is not None:
                    self.learning_rate = float(lr)
        return self.global_step

    def _move_out_of(self, area: np.ndarray[Any, Any]) -> None:
        """Copies the parameters that live in ``area`` (a lane left to a ps that may still
        write there) into memory of their own."""
        lo = area.ctypes.data
        hi = lo + area.nbytes
        for param in self._whole.values():
            if lo <= param.data_ptr() < hi:
                param.data = param.data.clone()

    # -- the round trips every asynchronous mode makes ----------------------------------------

    def pull(self) -> int:
        """Overwrites the model's parameters with the ps values; returns the global step."""
        return self.load(self.client.pull(into=self.destinations(), lane_views=True))

    def push_pull(
        self,
        grads: dict[int, Tensors],
        layouts: dict[int, wire.Layout],
        rows: dict[int, list[str]] | None = None,
        *,
        overlap: bool = False,
    ) -> int:
        """Pushes ``grads`` (each shard applies them at once; ``rows``: the tables whose row
        gradients they carry) and pulls the values that result, one round trip per shard;
        returns the global step. With ``overlap``, the round trip ends at the next request
        (:meth:`ShardCalls.defer`): the values and the prefetched rows come into the model
        then, and the global step returned is the last one known (the previous push's)."""
        if overlap:
            # The last push's reply first: its rows are taken before this push's prefetch.
            self.client.settle()
            # This push's reply is written while the next step computes: no parameter may
            # live in a lane's reply area then (a pull adopts them there), or the next forward
            # would see values a step fresher than the schedule, or half of them.
            transport = self.client.transport
            for peer in transport.peers:
                lane = transport.lane(peer)
                if lane is not None:
                    self._move_out_of(lane.reply)
        prefetch: dict[int, list[str]] = {}
        if self.tables:
            ids, prefetch = self.tables.prefetched.take()
            if ids:
                grads = {s: list(t) for s, t in grads.items()}
                for s, tensors in ids.items():
                    grads.setdefault(s, []).extend(tensors)
                    layouts.pop(s, None)
        mark, self.input_mark = self.input_mark, None

        def took(replies: Replies) -> int:
            if prefetch:
                rest = self.tables.prefetched.put({s: t for s, (_, t) in replies.items()})
                replies = {s: (h, rest[s]) for s, (h, _) in replies.items()}
            before = self.global_step
            # With overlap the next push's reply is written while the next step computes: a
            # value left in the lane would change under its forward (a push fresher than meant).
            step = self.load(replies, adopt=not overlap)
            # The other workers' updates applied between this worker's last pull and its push.
            self.client.metrics.staleness.observe(max(0, step - before - 1))
            return step

        replies = self.client.push(
            grads,
            pull=True,
            input_mark=mark,
            input_epochs=self.input_epochs,
            into=self.destinations(),
            lane_views=True,
            layouts=layouts,
            global_step=self.global_step,
            rows=rows,
            prefetch=prefetch,
            row_dtypes=self.tables.layout.row_dtypes(prefetch) if prefetch else None,
            # The rows stay where they came until used (RowPrefetch.put).
            request_views=bool(prefetch),
            deferred=took if overlap else None,
        )
        return self.global_step if overlap else took(replies)

    def close(self, *, finished: bool) -> None:
        """Tells the ps this worker has finished (with ``finished``) and disconnects."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        try:
            if finished:
                self.client.done()
        finally:
            self.client.close()


def _sparse_rows(var: str, grad: torch.Tensor, part: tuple[int, int] | None) -> Tensors:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as the rows it touches: their ids
    (within ``part``, the rows this variable holds) and gradients, summed per id."""
    grad = grad.coalesce()
    ids = grad.indices()[0]
    values = grad.values()
    if part is not None:
        keep = (ids >= part[0]) & (ids < part[1])
        ids, values = ids[keep] - part[0], values[keep]
    ids_name, grads_name = row_tensor_names(var)
    return [(ids_name, ids.to("cpu")), (grads_name, values.to("cpu").contiguous())]


def _in_request_area(header: dict[str, Any]) -> bool:
    return header.get(Key.IN_LANE) == IN_REQUEST_AREA


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0] : rows[1]]


def clear_grads(params: Iterable[torch.Tensor], set_to_none: bool = True) -> None:
    """Clears the gradients of ``params`` as ``torch.optim.Optimizer.zero_grad`` does."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.detach_().zero_()
