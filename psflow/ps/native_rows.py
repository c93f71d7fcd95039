"""What a shard's native lookups and pushes (:mod:`psflow.ps.native`,
:mod:`psflow.ps.native_push`) share: whether they serve, the kernels' jobs of a request's
ids and where their rows go, the ids a hashed table does not hold among them, the rows a task
looked up kept for its push, and the buffers and casts of a reply.

A job list's rows come back from the kernels as one array, every job's one after another
(:func:`job_parts` gives each its own); -1 marks an id a hashed table does not hold.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import psflow.sparse.kernels as kernels
from psflow import env as envvars
from psflow.ps.row_wire import narrowed
from psflow.sparse import HashedRows, Rows
from psflow.transport import wire


def enabled() -> bool:
    """Whether this process serves sparse requests natively (the kernels are built, and
    ``PSFLOW_NATIVE_REQUESTS`` is not ``0``)."""
    return kernels.KERNELS is not None and envvars.flag(envvars.PSFLOW_NATIVE_REQUESTS, True)


@dataclass(eq=False, slots=True)
class Narrow:
    """Rows asked narrower than their table (:attr:`Key.ROW_DTYPES`): gathered at the table's
    width into ``rows``, then cast where the reply goes (``dst`` at ``offset``), as the Python
    path casts them (:func:`~psflow.ps.row_wire.narrowed`, which refuses a row beyond the
    narrow dtype's range)."""

    name: str
    table: Rows
    n: int
    rows: np.ndarray[Any, Any]
    wire: torch.dtype
    dst: Any
    offset: int

    def done(self) -> None:
        table = self.table
        shape = (self.n, table.dim)
        rows = tensor_at(self.rows, 0, table.dtype, shape)
        narrowed(self.name, rows, self.wire, tensor_at(self.dst, self.offset, self.wire, shape))


def lookup_job(
    name: str,
    table: Rows,
    wire_dtype: torch.dtype,
    src: Any,
    src_offset: int,
    n: int,
    dst: Any,
    offset: int,
    narrow: list[Narrow],
) -> tuple[Any, ...] | None:
    """``table``'s lookup job for ``n`` ids at ``src``, its rows to go to ``dst`` at
    ``offset`` in ``wire_dtype``: there directly at the table's own width, else into a scratch
    buffer whose cast is added to ``narrow``; ``None`` where the kernels cannot serve it."""
    if wire_dtype == table.dtype:
        return table.lookup_job(src, src_offset, n, dst, offset)
    rows = np.empty(n * table.dim * table.dtype.itemsize, np.uint8)
    narrow.append(Narrow(name, table, n, rows, wire_dtype, dst, offset))
    return table.lookup_job(src, src_offset, n, rows, 0)


NO_SLOTS = np.empty(0, np.int64)


def job_parts(
    slots: np.ndarray[Any, Any], jobs: list[tuple[Any, ...]]
) -> list[np.ndarray[Any, Any]]:
    """Each job's rows, views of ``slots`` (every job's one after another, a job's count of
    ids third in it: :meth:`Rows.lookup_job`'s and :meth:`Rows.apply_job`'s)."""
    ends = list(itertools.accumulate(job[2] for job in jobs))
    return [slots[end - job[2] : end] for job, end in zip(jobs, ends, strict=True)]


def ids_of(jobs: list[tuple[Any, ...]]) -> list[np.ndarray[Any, Any]]:
    """A copy of each lookup job's ids (its rows may go where they lie)."""
    return [np.frombuffer(src, np.int64, n, offset).copy() for src, offset, n, *_ in jobs]


def remember(
    task: str,
    jobs: list[tuple[Any, ...]],
    tables: list[Rows],
    ids: list[np.ndarray[Any, Any]],
    slots: np.ndarray[Any, Any],
    versions: list[int],
) -> None:
    """Each table's ``ids`` (of its lookup job) looked up by ``task`` kept with their rows
    (``slots``, every job's one after another) as mapped at ``versions``, for its push of the
    same ids (a table that keeps them: a hashed one)."""
    for table, known, part, version in zip(
        tables, ids, job_parts(slots, jobs), versions, strict=True
    ):
        if table.mapped is not None:
            table.mapped.remember(task, known, part, version)


def find_absent(table: Rows, ids: np.ndarray[Any, Any], slots: np.ndarray[Any, Any]) -> None:
    """The rows of ``ids`` not held when ``slots`` were mapped (-1), found again in place:
    rows may have been made for them since (no held id has lost its row: the caller checked
    the table's :attr:`~psflow.sparse.Rows.map_version`)."""
    if not len(slots) or int(slots.min()) >= 0:
        return
    assert isinstance(table, HashedRows), "only a hashed table leaves an id at -1"
    where = np.flatnonzero(slots < 0)
    slots[where] = table.held_at(ids[where])


def absent_rows(
    jobs: list[tuple[Any, ...]],
    tables: list[Rows],
    ids: list[np.ndarray[Any, Any]],
    slots: np.ndarray[Any, Any],
) -> list[tuple[HashedRows, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each lookup job with ids its table does not hold (-1 in ``slots``, every job's rows
    one after another, of ``map_lookup(absent_ok=True)``; ``ids``, each job's, copied out of
    the request by :func:`ids_of`): the table, those ids, their places among the job's rows,
    and the job's rows where the reply goes, for ``HashedRows.initial_at``."""
    out = []
    for job, table, known, part in zip(jobs, tables, ids, job_parts(slots, jobs), strict=True):
        if not len(part) or int(part.min()) >= 0:
            continue
        assert isinstance(table, HashedRows), "only a hashed table leaves an id at -1"
        where = np.flatnonzero(part < 0)
        dst, dst_offset = job[3:5]
        place = tensor_at(dst, dst_offset, table.dtype, (len(part), table.dim))
        out.append((table, torch.from_numpy(known[where]), torch.from_numpy(where), place))
    return out


def tensor_at(
    buffer: Any, offset: int, dtype: torch.dtype, shape: tuple[int, ...], *, copy: bool = False
) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buffer``'s bytes at ``offset`` (a copy with
    ``copy``, or when the buffer is read-only: the header's inline bytes, a received frame)."""
    count = math.prod(shape)
    raw = np.dtype(np.int16) if dtype is torch.bfloat16 else wire.NUMPY_DTYPES[dtype]
    array = np.frombuffer(buffer, raw, count, offset)  # numpy has no bfloat16: its bits
    if copy or not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).view(dtype).view(shape)


def fresh_buffer(sizes: list[int]) -> tuple[np.ndarray[Any, Any], list[int], list[Any]]:
    """One fresh buffer for a reply's tensors of these byte sizes, sent by socket: the buffer,
    each one's offset, and each one's bytes there."""
    dst = np.empty(sum(sizes), np.uint8)
    offsets = list(itertools.accumulate(sizes[:-1], initial=0)) if sizes else []
    return dst, offsets, [dst[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


def keep_rows(jobs: list[tuple[Any, ...]], tables: list[Rows], slots: np.ndarray[Any, Any]) -> None:
    """Before the kernels update the rows of ``jobs`` (at ``slots``, every job's one after
    another): the snapshots and exports being taken of their tables keep them."""
    for table, part in zip(tables, job_parts(slots, jobs), strict=True):
        if table.keeping:
            table.before_update(torch.from_numpy(part))


def held_jobs(
    jobs: list[tuple[Any, ...]], slots: np.ndarray[Any, Any]
) -> tuple[list[tuple[Any, ...]], np.ndarray[Any, Any], list[tuple[int, np.ndarray[Any, Any]]]]:
    """The jobs whose every id is held, with their rows (of ``slots``, all jobs' rows one after
    another, -1 where a hashed table does not hold an id), and the others' places with their
    rows (views of ``slots``)."""
    if not len(slots) or int(slots.min()) >= 0:  # every id held: one pass, not one a job
        return jobs, slots, []
    held, parts, others = [], [], []
    for i, (job, part) in enumerate(zip(jobs, job_parts(slots, jobs), strict=True)):
        if len(part) and int(part.min()) < 0:
            others.append((i, part))
        else:
            held.append(job)
            parts.append(part)
    if not others:
        return jobs, slots, []
    return held, (np.concatenate(parts) if parts else NO_SLOTS), others


def recalled_rows(
    task: str, rows: list[tuple[str, Rows, int]], jobs: list[tuple[Any, ...]]
) -> np.ndarray[Any, Any] | None:
    """The rows of a push's ids (every job's one after another) as ``task``'s last lookup of
    the same ids in each table found them, while its ids have the same rows; ``None`` for the
    kernels to map them (a table that keeps none: a fixed one, whose map costs less; ids
    that are others, or mapped otherwise)."""
    if not jobs:
        return NO_SLOTS
    parts = []
    for (_, table, n), job in zip(rows, jobs, strict=True):
        try:
            ids = np.frombuffer(job[0], np.int64, n, job[1])
        except ValueError:  # not in its buffer: the kernels refuse it
            return None
        part = None if table.mapped is None else table.mapped.recall(task, ids, table.map_version)
        if part is None:
            return None
        find_absent(table, ids, part)
        parts.append(part)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def update_job(table: Rows, ids: torch.Tensor, grads: torch.Tensor) -> tuple[Any, ...]:
    """``table``'s update job for ``ids`` and ``grads`` (tensors of their own, some of a
    request's), for a table the plan already took."""
    job = table.apply_job(ids.numpy(), 0, ids.numel(), grads.numpy(), 0)
    assert job is not None, "a table the plan took"
    return job


def without_padding(
    rows: list[tuple[str, Rows, int]], jobs: list[tuple[Any, ...]], slots: np.ndarray[Any, Any]
) -> tuple[list[tuple[Any, ...]], np.ndarray[Any, Any]]:
    """The push's jobs and their rows (``slots``, every job's one after another) without a
    table's ``padding_idx`` where it came, once the kernels have checked every id: that row
    never changes, as the Python path drops its gradient (``Rows.apply``)."""
    if all(table.spec.padding_idx is None for _, table, _ in rows):
        return jobs, slots
    out, parts = [], []
    dropped = False
    for (_, table, n), job, part in zip(rows, jobs, job_parts(slots, jobs), strict=True):
        pad = table.spec.padding_idx
        if pad is not None and n:
            ids_src, ids_offset, _, grads_src, grads_offset = job[:5]
            keep = np.frombuffer(ids_src, np.int64, n, ids_offset) != pad
            if not keep.all():
                kept = torch.from_numpy(keep)
                ids = tensor_at(ids_src, ids_offset, torch.int64, (n,))[kept]
                grads = tensor_at(grads_src, grads_offset, table.dtype, (n, table.dim))[kept]
                job, part, dropped = update_job(table, ids, grads), part[keep], True
        out.append(job)
        parts.append(part)
    return out, (np.concatenate(parts) if dropped else slots)
