"""The ``pull``, ``push`` and ``push_pull`` ops: a shard's values out, gradients in.

- ``pull``: the current values (all, or the names listed in ``names``).
- ``push``: gradients, applied with the shard's optimizer; replies with the new step. Row
  gradients of embedding tables (:attr:`~psflow.protocol.Key.ROWS`) are applied in the same
  update; with :attr:`~psflow.protocol.Key.PREFETCH` the reply brings back the rows of the ids
  it names, read after the update. A push with its worker's input position
  (:attr:`~psflow.protocol.Key.INPUT_SEQ`) records it with the update, or is dropped when
  the shard holds that input already (:mod:`psflow.ps.positions`).
- ``push_pull``: ``push`` then ``pull`` in one round trip.

This is the ps's hot path (asynchronous training: every step of every worker), the worker's
counterpart of :class:`~psflow.worker.exchange.ParameterExchange`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from psflow.protocol import Key, Op
from psflow.protocol.messages import prefetch_tensor_names
from psflow.ps.native_push import NativePush
from psflow.ps.positions import pushed_input
from psflow.ps.row_wire import row_dtypes
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.tables import (
    check_lookup,
    count_rows,
    lookup_rows,
    row_specs,
    split_prefetch,
    split_rows,
)
from psflow.transport import Request, wire

# Bound once: reading an enum member off its class costs more than the dict lookup it serves,
# and push/push_pull run thousands of times a second.
_STEP, _ROWS, _PREFETCH, _ROW_DTYPES = Key.STEP, Key.ROWS, Key.PREFETCH, Key.ROW_DTYPES


class ExchangeService(Service):
    """The ``pull``, ``push`` and ``push_pull`` ops of one ps server."""

    def __init__(self, host: ServiceHost) -> None:
        self.host = host
        # Bound once too: what the handlers use of the host is one attribute away, as when
        # they were the server's own methods.
        self.store = host.store
        self.shard = host.shard
        self.metrics = host.metrics
        self.reply = host.reply
        self.reply_tensors = host.reply_tensors
        self.tensors = host.tensors
        self.flush = host.flush
        self.require_initialized = host.require_initialized
        self.native = NativePush(host)
        """Pushes with row gradients or a prefetch: the tables' part in native code
        (:mod:`psflow.ps.native_push`)."""

    def handlers(self) -> Mapping[Op, Handler]:
        return {Op.PULL: self._pull, Op.PUSH: self._push, Op.PUSH_PULL: self._push_pull}

    def _pull(self, request: Request) -> None:
        self.require_initialized()
        names = request.header.get(Key.NAMES)
        tensors: list[tuple[str, torch.Tensor]] | wire.TensorSet
        if names is None:
            tensors = self.store.wire_set
        else:
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("'names' must be a list of variable names")
            missing = [n for n in names if n not in self.store.variables]
            if missing:
                raise ValueError(f"unknown variable(s) {missing}")
            tensors = [(n, self.store.variables[n]) for n in names]
        self.reply(request, {}, tensors)

    def _push(self, request: Request) -> None:
        self.require_initialized()
        plan = self.native.plan(request, pull=False)
        if plan is not None:
            self.native.run(request, plan)
            return
        step, prefetch, dtypes = self._apply_push(request)
        if not prefetch:
            self.reply(request, {_STEP: step})
            return
        self._reply_with_rows(request, step, [], prefetch, dtypes)

    def _push_pull(self, request: Request) -> None:
        self.require_initialized()
        plan = self.native.plan(request, pull=True)
        if plan is not None:
            self.native.run(request, plan)
            return
        step, prefetch, dtypes = self._apply_push(request)
        if not prefetch:
            self.reply(request, {_STEP: step}, self.store.wire_set)
            return
        self._reply_with_rows(request, step, list(self.store.variables.items()), prefetch, dtypes)

    def _apply_push(
        self, request: Request
    ) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.dtype]]:
        """Applies a push; returns the new step, the ids per table whose rows it asks to
        prefetch (copies: the rows may be made where they were) and the dtypes it asks some
        of them in (:attr:`Key.ROW_DTYPES`)."""
        self.require_initialized()
        # Applied before the reply: gradients in a shared-memory lane need no copy.
        grads = self.tensors(request, into=self.store.grad_buffers, transient=True)
        rows = None
        header = request.header
        prefetch: dict[str, torch.Tensor] = {}
        dtypes: dict[str, torch.dtype] = {}
        if _PREFETCH in header:
            grads, prefetch = split_prefetch(header, grads)
            check_lookup(self.store.tables, prefetch)  # before anything changes
            dtypes = row_dtypes(header, self.store.tables, prefetch)
            prefetch = {name: ids.clone() for name, ids in prefetch.items()}
        elif _ROW_DTYPES in header:
            raise ValueError(f"'{_ROW_DTYPES}' comes without '{_PREFETCH}': no rows to send")
        if _ROWS in header:
            grads, rows = split_rows(header, grads)
        self.flush()
        sender = self.host.sender(request)
        mark, replay = pushed_input(self.store.inputs, header, sender, self.shard)
        if replay:
            return self.store.step, prefetch, dtypes
        start = time.perf_counter()
        if self.store.schedule is None or self.shard == 0:
            step = self.store.apply(grads, rows=rows)  # validates first: a bad push changes nothing
        else:
            # Shard 0 keeps the global step; the others learn it (their schedule's) from pushes.
            step = self.store.apply(grads, global_step=header.get(_STEP), rows=rows)
        self.metrics.apply_seconds.observe(time.perf_counter() - start)
        if mark is not None:  # in this request, with the update: one moment for a snapshot
            self.store.inputs.record(sender, mark)
        if rows:
            count_rows(self.metrics, rows, pushed=True)
        return step, prefetch, dtypes

    def _reply_with_rows(
        self,
        request: Request,
        step: int,
        dense: list[tuple[str, torch.Tensor]],
        prefetch: dict[str, torch.Tensor],
        dtypes: dict[str, torch.dtype],
    ) -> None:
        """Answers a push with ``dense`` and the rows of the ``prefetch`` ids (named
        ``<table>#rows``, in ``dtypes[table]`` where given), read after its update: gathered
        straight into the lane that carries the reply, where there is one."""
        tables = self.store.tables
        names = [prefetch_tensor_names(n)[1] for n in prefetch]
        specs = [(t.dtype, tuple(t.shape)) for _, t in dense] + row_specs(tables, prefetch, dtypes)
        out = self.reply_tensors(request, specs)
        if out is None:
            fetched = lookup_rows(tables, prefetch, dtypes=dtypes)
        else:
            placed = out[: len(dense)]
            for (_, value), place in zip(dense, placed, strict=True):
                place.copy_(value)
            dense = [(name, place) for (name, _), place in zip(dense, placed, strict=True)]
            fetched = lookup_rows(tables, prefetch, out[len(dense) :], dtypes=dtypes)
        count_rows(self.metrics, prefetch, pushed=False)
        rows = [(name, t) for name, (_, t) in zip(names, fetched, strict=True)]
        self.reply(request, {_STEP: step}, [*dense, *rows])
