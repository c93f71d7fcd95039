"""A shard's ``push`` and ``push_pull`` with row gradients or a prefetch, served in native
code (see :mod:`psflow.ps.native`): :class:`NativePush` plans a request (its ids checked and
mapped by the kernels, nothing changed), then applies it and answers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import psflow.sparse.kernels as kernels
from psflow.protocol import Key, Op
from psflow.protocol.messages import prefetch_tensor_names, row_tensor_names
from psflow.protocol.tables import WIRE_DTYPES
from psflow.ps.native_rows import (
    NO_SLOTS,
    Narrow,
    absent_rows,
    enabled,
    find_absent,
    fresh_buffer,
    held_jobs,
    ids_of,
    job_parts,
    keep_rows,
    lookup_job,
    recalled_rows,
    remember,
    tensor_at,
    update_job,
    without_padding,
)
from psflow.ps.positions import pushed_input
from psflow.ps.row_wire import row_dtypes
from psflow.ps.service import ServiceHost
from psflow.sparse import HashedRows, Rows
from psflow.transport import Request, wire

_ROW_DTYPES = Key.ROW_DTYPES.value
_ROWS = Key.ROWS.value
_PREFETCH = Key.PREFETCH.value
_STEP = Key.STEP.value
_OP = Key.OP.value
_PUSH_PULL = Op.PUSH_PULL.value

_PLAIN_PUSH = frozenset(
    k.value
    for k in (
        Key.VERSION, Key.OP, Key.ID, Key.TASK, Key.TENSORS, Key.INLINE, Key.CHUNK, Key.IN_LANE,
        Key.ROWS, Key.STEP, Key.PREFETCH, Key.INPUT_SEQ, Key.INPUT_POSITION, Key.INPUT_EPOCH,
        Key.ROW_DTYPES,
    )
)  # fmt: skip
"""The header keys of a push the native path serves: any other (a key no client sends)
leaves it to Python."""


@dataclass(eq=False, slots=True)
class PushPlan:
    """A push the native path takes: its row gradients and prefetch ids checked and mapped to
    their rows by the kernels, its dense gradients decoded; nothing changed yet."""

    dense: list[tuple[str, torch.Tensor]]
    """The dense gradients (views of the lane or the frames, as the Python path's)."""
    rows: list[tuple[str, Rows, int]]
    """Each table the push updates, with its count of ids."""
    row_jobs: list[tuple[Any, ...]]
    """The kernels' jobs: the tables whose every id is held."""
    row_tables: list[Rows]
    """Those tables, one a job."""
    row_slots: np.ndarray[Any, Any]
    new_rows: list[NewRows]
    """The tables with ids they do not hold yet: their rows made before the update."""
    prefetch: list[tuple[str, Rows, int]]
    """Each table whose rows the reply brings (read after the update), with its count of ids."""
    prefetch_jobs: list[tuple[Any, ...]]
    prefetch_slots: np.ndarray[Any, Any]
    prefetch_versions: list[int]
    """Each prefetched table's :attr:`~psflow.sparse.Rows.map_version` when its ids were
    mapped."""
    narrow: list[Narrow]
    """The prefetched rows asked narrower than their table: cast once gathered."""
    reply_metas: list[list[Any]]
    """The reply's tensors when it prefetches: the shard's values (a ``push_pull``), then the
    rows."""
    reply_raws: list[Any] | None
    """Their bytes, by socket; ``None``: in the lane's request area, the values still to be
    copied to ``values_at``."""
    values_at: list[int]
    """Where each value goes in the lane's request area."""
    reply_area: Any
    """The buffer the reply's tensors go to (the lane's request area, or a fresh one); rows
    asked narrower are gathered elsewhere first (``narrow``)."""
    task: str
    """The task that sent it, as it says (whose prefetched rows are kept for its next push)."""


@dataclass(eq=False, slots=True)
class NewRows:
    """A table of a push with ids it does not hold yet: its ids, their gradients (views of
    the request) and their rows as the kernels mapped them (-1: not held)."""

    table: HashedRows
    """Only a hashed table's map leaves an id at -1."""
    ids: torch.Tensor
    grads: torch.Tensor
    slots: np.ndarray[Any, Any]

    def made(self) -> tuple[tuple[Any, ...], np.ndarray[Any, Any]]:
        """The rows made (the table's admission, eviction and new rows, as its ``apply`` makes
        them), then the kernels' job for the ids that have a row now, and their rows."""
        table = self.table
        table.make_rows(self.ids, torch.from_numpy(self.slots))
        keep = self.slots >= 0
        if bool(keep.all()):
            ids, grads, slots = self.ids, self.grads, self.slots
        else:  # the gradients of ids not admitted (or with no room) are dropped
            kept = torch.from_numpy(keep)
            ids, grads, slots = self.ids[kept], self.grads[kept], self.slots[keep]
        # Anew: making rows may have moved the table's storage and its id map.
        return update_job(table, ids, grads), slots


class NativePush:
    """The native path of one shard's ``push`` and ``push_pull`` with row gradients or a
    prefetch: the tables' ids and gradients read where they came, checked, mapped to their rows
    and applied with each table's row-wise optimizer by one call of
    :func:`psflow.sparse.kernels.apply_mapped`; the prefetched rows gathered after it where the
    reply goes by one call of :func:`psflow.sparse.kernels.gather_mapped`. Dense gradients are
    applied by the shard's optimizer (its schedule moved as in the Python path, and the tables
    that follow it given its rate), the new rows of a table with ids it does not hold yet made
    by the table (:class:`NewRows`), and an input position is checked and recorded, as in the
    Python path; so are a hashed table's time to live (its expiry when due, before the ids
    are mapped, and the time its updated rows are stamped with), a ``padding_idx`` (its
    gradient dropped once the ids are checked) and a snapshot or an export being taken (the
    rows kept before they change). What it does not serve (bad ids, a reply too large for its
    lane) is left to the Python path, nothing changed."""

    def __init__(self, host: ServiceHost) -> None:
        self.host = host
        self.on = enabled()
        self.served = 0
        """Pushes served here (the rest went to the Python path)."""

    def plan(self, request: Request, *, pull: bool) -> PushPlan | None:
        """``request`` checked and mapped for :meth:`run` (a ``push_pull`` with ``pull``);
        ``None`` when it is left to the Python path, with nothing changed.

        Raises:
            wire.WireError: for a header whose tensor list is malformed, or tensors that do not
                match it (as the Python path).
        """
        header = request.header
        store = self.host.store
        if not self.on or not _PLAIN_PUSH.issuperset(header):
            return None
        names, prefetch_names = _tables(header.get(_ROWS)), _tables(header.get(_PREFETCH))
        if names is None or prefetch_names is None or not (names or prefetch_names):
            return None
        if _ROW_DTYPES in header and not prefetch_names:
            return None  # no rows to send: the Python path refuses it
        tables = store.tables
        try:
            dtypes = row_dtypes(header, tables, prefetch_names)
        except ValueError:
            return None  # the Python path refuses it in its words
        metas = wire.tensor_metas(header)
        sources = self.host.tensor_buffers(request)
        if sources is None:
            return None
        where = {m.name: (m, src) for m, src in zip(metas, sources, strict=True)}
        if len(where) != len(metas):
            return None
        for name in {*names, *prefetch_names}:
            table = tables.get(name)
            if table is not None:
                table.expire_due()  # once a request, before its ids are mapped
        taken: set[str] = set()
        rows, row_jobs = [], []
        for name in names:
            table = tables.get(name)
            ids_name, grads_name = row_tensor_names(name)
            ids, grads = where.get(ids_name), where.get(grads_name)
            if table is None or ids is None or grads is None:
                return None
            (ids_meta, (ids_src, ids_offset)), (g_meta, (g_src, g_offset)) = ids, grads
            n = _count(ids_meta)
            if n < 0 or g_meta.shape != (n, table.dim):
                return None
            if g_meta.dtype is not table.dtype:  # narrower on the wire: cast up first
                wide = _widened(table, g_meta.dtype, g_src, g_offset, n)
                if wide is None:
                    return None
                g_src, g_offset = wide, 0
            job = table.apply_job(ids_src, ids_offset, n, g_src, g_offset)
            if job is None:
                return None
            row_jobs.append(job)
            rows.append((name, table, n))
            taken.update((ids_name, grads_name))
        prefetch, fetch_from = [], []
        for name in prefetch_names:
            table = tables.get(name)
            ids_name = prefetch_tensor_names(name)[0]
            ids = where.get(ids_name)
            if table is None or ids is None or _count(ids[0]) < 0:
                return None
            prefetch.append((name, table, _count(ids[0])))
            fetch_from.append(ids[1])
            taken.add(ids_name)
        wires = [dtypes.get(name, table.dtype) for name, table, _ in prefetch]
        reply = self._reply(request, pull, prefetch, wires)
        if reply is None:
            return None
        reply_metas, reply_raws, dst, offsets, values_at = reply
        prefetch_jobs: list[tuple[Any, ...]] = []
        narrow: list[Narrow] = []
        for (name, table, n), wire_dtype, (src, src_offset), offset in zip(
            prefetch, wires, fetch_from, offsets, strict=True
        ):
            job = lookup_job(name, table, wire_dtype, src, src_offset, n, dst, offset, narrow)
            if job is None:
                return None
            prefetch_jobs.append(job)
        # Every id checked before anything changes; ids a hashed table does not hold yet are
        # left at -1 (the table makes their rows in the update: NewRows).
        task = self.host.sender(request)
        row_slots = recalled_rows(task, rows, row_jobs)
        if row_slots is None:
            row_slots = kernels.map_rows(row_jobs, absent_ok=True)
        if row_slots is None:
            return None  # a bad id: the Python path names it
        row_jobs, row_slots = without_padding(rows, row_jobs, row_slots)
        prefetch_slots = (
            kernels.map_lookup(prefetch_jobs, absent_ok=True) if prefetch_jobs else NO_SLOTS
        )
        if prefetch_slots is None:
            return None
        prefetch_versions = [t.map_version for _, t, _ in prefetch]
        new_rows = []
        held, row_slots, not_held = (
            held_jobs(row_jobs, row_slots)
            if any(isinstance(t, HashedRows) for _, t, _ in rows)
            else (row_jobs, row_slots, [])  # a fixed table holds every id it takes
        )
        for i, part in not_held:
            ids, ids_offset, n, grads, grads_offset = row_jobs[i][:5]
            table = rows[i][1]
            assert isinstance(table, HashedRows), "only a hashed table leaves an id at -1"
            new_rows.append(
                NewRows(table, tensor_at(ids, ids_offset, torch.int64, (n,)),
                        tensor_at(grads, grads_offset, table.dtype, (n, table.dim)), part)
            )  # fmt: skip
        taken_at = {i for i, _ in not_held}
        row_tables = [t for i, (_, t, _) in enumerate(rows) if i not in taken_at]
        row_jobs = held
        dense_names = {m.name for m in metas} - taken
        dense = (
            self.host.tensors(request, into=store.grad_buffers, transient=True, only=dense_names)
            if dense_names
            else []
        )
        return PushPlan(
            dense, rows, row_jobs, row_tables, row_slots, new_rows, prefetch, prefetch_jobs,
            prefetch_slots, prefetch_versions, narrow, reply_metas, reply_raws, values_at, dst,
            task,
        )  # fmt: skip

    def _reply(
        self,
        request: Request,
        pull: bool,
        prefetch: list[tuple[str, Rows, int]],
        wires: list[torch.dtype],
    ) -> tuple[list[list[Any]], list[Any] | None, Any, list[int], list[int]] | None:
        """Where a prefetching reply's tensors go (the rows in ``wires``' dtypes): their
        descriptions, their bytes (by socket; ``None``: the lane), the buffer the rows are
        gathered into and each one's offset there, and where the values go in the lane;
        ``None`` when it is too large for the request's lane (the Python path answers by
        socket)."""
        if not prefetch:
            return [], None, None, [], []
        values = self.host.store.wire_set if pull else None
        row_metas = [
            [prefetch_tensor_names(name)[1], wire.dtype_name(w), [n, t.dim]]
            for (name, t, n), w in zip(prefetch, wires, strict=True)
        ]
        sizes = [n * t.dim * w.itemsize for (_, t, n), w in zip(prefetch, wires, strict=True)]
        value_sizes = [len(r) for r in values.raws] if values is not None else []
        metas = (values.layout.metas if values is not None else []) + row_metas
        place = self.host.reply_area(request, value_sizes + sizes)
        if place is not None:
            dst, offsets = place
            return metas, None, dst, offsets[len(value_sizes) :], offsets[: len(value_sizes)]
        if request.lane is not None:
            return None
        dst, offsets, raws = fresh_buffer(sizes)
        return metas, (list(values.raws) if values is not None else []) + raws, dst, offsets, []

    def run(self, request: Request, plan: PushPlan) -> None:
        """Applies ``plan`` and answers ``request``: the dense gradients by the shard's
        optimizer, the rows by the kernels, the prefetched rows gathered after them; a replay
        of an input the shard holds is answered without an update, as in the Python path."""
        host = self.host
        store = host.store
        host.flush()  # as the Python path: values still leaving must not change under them
        sender = host.sender(request)
        mark, replay = pushed_input(store.inputs, request.header, sender, host.shard)
        self.served += 1
        if replay:
            self._answer(request, plan, store.step, made_rows=False)
            return
        start = time.perf_counter()
        step = self._update(request, plan)
        if mark is not None:  # in this request, with the update: one moment for a snapshot
            store.inputs.record(sender, mark)
        metrics = host.metrics
        metrics.apply_seconds.observe(time.perf_counter() - start)
        if metrics.on:
            for name, _, n in plan.rows:
                metrics.rows_pushed(name).inc(n)
            for name, _, n in plan.prefetch:
                metrics.rows_pulled(name).inc(n)
        self._answer(request, plan, step, made_rows=bool(plan.new_rows))

    def _update(self, request: Request, plan: PushPlan) -> int:
        """The push's update: dense first (its checks refuse a bad push before any row
        changes), then the tables; the shard's new step."""
        host = self.host
        store = host.store
        # With a schedule, as in the Python path: shard 0 keeps the global step, the others
        # learn it from pushes.
        schedule = store.schedule
        if schedule is None and not plan.dense:
            step = store.advance()
        elif schedule is None or host.shard == 0:
            step = store.apply(plan.dense)
        else:
            step = store.apply(plan.dense, global_step=request.header.get(_STEP))
        jobs, slots, tables = plan.row_jobs, plan.row_slots, plan.row_tables
        if plan.new_rows:
            made = [new.made() for new in plan.new_rows]
            jobs = [*jobs, *(job for job, _ in made)]
            tables = [*tables, *(new.table for new in plan.new_rows)]
            slots = np.concatenate([slots, *(rows for _, rows in made)])
        if schedule is not None:
            jobs = _scheduled(jobs, tables, schedule.lr)
        if any(table.keeping for table in tables):
            keep_rows(jobs, tables, slots)
        if jobs:
            kernels.apply_mapped(jobs, slots)
        for table in tables:
            table.applied()
        return step

    def _answer(self, request: Request, plan: PushPlan, step: int, *, made_rows: bool) -> None:
        """The reply: the step, the values of a ``push_pull``, the prefetched rows (mapped
        again where ``made_rows``: rows were made or evicted since the plan mapped them)."""
        host = self.host
        store = host.store
        header: dict[str, Any] = {_STEP: step}
        if not plan.prefetch:
            if request.header[_OP] == _PUSH_PULL:
                host.reply(request, header, store.wire_set)
            else:
                host.reply(request, header)
            return
        jobs, slots, versions = plan.prefetch_jobs, plan.prefetch_slots, plan.prefetch_versions
        tables = [t for _, t, _ in plan.prefetch]
        ids = ids_of(jobs)  # read before the values and the rows overlay them
        if made_rows:
            # Maybe in storage that grew: jobs anew. Their ids mapped again, or, where no
            # row held when they were mapped has gone since, those not held found again.
            anew = []
            for (_, table, _), job in zip(plan.prefetch, jobs, strict=True):
                again = table.lookup_job(*job[:5])
                assert again is not None, "a table the plan took"
                anew.append(again)
            now = [t.map_version for t in tables]
            if now == versions:
                for table, known, part in zip(tables, ids, job_parts(slots, jobs), strict=True):
                    find_absent(table, known, part)
            else:
                remapped = kernels.map_lookup(anew, absent_ok=True)
                assert remapped is not None, "ids the plan checked"
                slots, versions = remapped, now
            jobs = anew
        absent = absent_rows(jobs, tables, ids, slots)
        if plan.values_at:  # into the lane's request area (by socket they are raws)
            area = memoryview(plan.reply_area)  # memcpy's
            for offset, raw in zip(plan.values_at, store.wire_set.raws, strict=True):
                area[offset : offset + len(raw)] = raw
        kernels.gather_mapped(jobs, slots, held=True)
        for table, absent_ids, at, place in absent:  # not held: initial rows, as a lookup's
            table.initial_at(absent_ids, at, place)
        for cast in plan.narrow:  # after the update, as the Python path: it refuses here too
            cast.done()
        remember(plan.task, jobs, tables, ids, slots, versions)
        # Values sent by socket from their own memory: the next update waits until they left.
        live = plan.reply_raws is not None and request.header[_OP] == _PUSH_PULL
        host.reply_placed(request, header, plan.reply_metas, plan.reply_raws, live=live)


def _scheduled(jobs: list[tuple[Any, ...]], tables: list[Rows], lr: float) -> list[tuple[Any, ...]]:
    """The jobs with the schedule's rate now (moved by the dense update) for the tables that
    follow it (``spec.scheduled``), as ``ShardStore.apply`` sets it."""
    out = []
    for job, table in zip(jobs, tables, strict=True):
        if table.spec.scheduled:
            table.optimizer.lr = lr
            job = (*job[:_LR_FIELD], lr, *job[_LR_FIELD + 1 :])
        out.append(job)
    return out


_LR_FIELD = 20
"""Where a job of :meth:`Rows.apply_job` holds its optimizer's rate (its first setting)."""


def _widened(
    table: Rows, dtype: torch.dtype, src: Any, offset: int, n: int
) -> np.ndarray[Any, Any] | None:
    """Row gradients that came narrower than their table (``dtype``, one of
    :data:`~psflow.protocol.tables.WIRE_DTYPES`) at byte ``offset`` of ``src``, cast up to the
    table's dtype as the Python path casts them; ``None`` for another dtype or a gradient that
    is not finite (the Python path refuses both)."""
    if wire.dtype_name(dtype) not in WIRE_DTYPES:
        return None
    grads = tensor_at(src, offset, dtype, (n, table.dim))
    if not kernels.all_finite(grads):
        return None
    wide: np.ndarray[Any, Any] = grads.to(table.dtype).numpy()
    return wide


def _tables(names: Any) -> list[str] | None:
    """A header's list of table names (none: empty), or ``None`` when it is not one."""
    if names is None:
        return []
    if type(names) is not list or len(set(names)) != len(names):
        return None
    return names if all(type(n) is str for n in names) else None


def _count(meta: wire.TensorMeta) -> int:
    """The ids a tensor of ids holds, or -1 when it is not 1-D int64."""
    return meta.shape[0] if meta.dtype is torch.int64 and len(meta.shape) == 1 else -1
