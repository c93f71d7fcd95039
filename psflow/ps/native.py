"""A shard's sparse requests served in native code, from the request's bytes to the reply's.

:class:`NativeLookup` serves a ``lookup`` without making a tensor in Python: the ids are read
where they came (a lane's request area, the header's inline bytes, a frame), checked, mapped to
their rows in the shard's storage (a fixed table's by its partition, a hashed table's through
its id map) and gathered where the reply goes (the lane's request area, or one fresh buffer sent
from its own memory) by one call of :func:`psflow.sparse.kernels.lookup_rows`, which releases
the GIL. :class:`NativePush` serves the tables' part of a ``push`` or ``push_pull`` the same
way: every table's row gradients applied by :func:`psflow.sparse.kernels.apply_mapped`, the
next batch's rows (a prefetch) gathered after them; its dense gradients go to the shard's
optimizer, as in the Python path. Python decodes the header and encodes the reply's: the
dispatch around the calls.

Rows asked narrower than their table (``row_dtypes``, :mod:`psflow.ps.row_wire`) are gathered
at the table's width and cast where the reply goes, and narrower row gradients cast up before
the update, as the Python path casts them. What it does not serve as it came is left to the
handler's Python path, which serves or refuses it: a tensor in several frames, a reply too
large for the lane, a bad id (the kernel writes nothing then). So a refusal's words are that
path's, and its tests hold for both. Ids a hashed table does not hold yet are left by the
kernels' map for that table's Python, within the native request: a push makes their rows first
(``HashedRows.make_rows``: admission, eviction, new rows, as its ``apply`` makes them) and the
kernels then update them with the rest; a lookup or a prefetch gives them their initial rows
(``HashedRows.initial_at``) where the kernels' gather of the held ones left their places.
``PSFLOW_NATIVE_REQUESTS=0`` serves everything in Python.

The push is :mod:`psflow.ps.native_push`'s; what both take from the kernels (their jobs' rows,
the ids a table does not hold, the casts and buffers of a reply) is :mod:`psflow.ps.native_rows`'s.
"""

from __future__ import annotations

from typing import Any

import torch

import psflow.sparse.kernels as kernels
from psflow.protocol import Key
from psflow.ps.native_rows import (
    Narrow,
    absent_rows,
    enabled,
    fresh_buffer,
    ids_of,
    lookup_job,
    remember,
)
from psflow.ps.row_wire import row_dtypes
from psflow.ps.service import ServiceHost
from psflow.sparse import HashedRows, Rows
from psflow.transport import Request, wire

__all__ = ["NativeLookup"]

_ABSENT_ZEROS = Key.ABSENT_ZEROS.value

_PLAIN_LOOKUP = frozenset(
    k.value
    for k in (
        Key.VERSION, Key.OP, Key.ID, Key.TASK, Key.TENSORS, Key.INLINE, Key.CHUNK, Key.IN_LANE,
        Key.ABSENT_ZEROS, Key.ROW_DTYPES,
    )
)  # fmt: skip
"""The header keys of a lookup the native path serves: any other (a key no client sends)
leaves it to Python."""


class NativeLookup:
    """The native path of one shard's ``lookup`` (see the module docstring)."""

    def __init__(self, host: ServiceHost) -> None:
        self.host = host
        self.on = enabled()
        self.served = 0
        """Lookups answered here (the rest went to the Python path)."""

    def serve(self, request: Request) -> bool:
        """Answers ``request`` (a ``lookup``) natively; ``False`` when it is left to the
        Python path, with nothing answered and nothing written.

        Raises:
            wire.WireError: for a header whose tensor list is malformed (as the Python path).
            ValueError: for rows asked narrower than a value of theirs fits (as the Python
                path, in its words).
        """
        header = request.header
        if not self.on or not _PLAIN_LOOKUP.issuperset(header):
            return False
        if type(header.get(_ABSENT_ZEROS, False)) is not bool:
            return False
        metas = wire.tensor_metas(header)
        sources = self.host.tensor_buffers(request)
        if not metas or sources is None or len({m.name for m in metas}) != len(metas):
            return False
        tables = self.host.store.tables
        chosen: list[Rows] = []
        for m in metas:
            table = tables.get(m.name)
            if table is None or m.dtype is not torch.int64 or len(m.shape) != 1:
                return False
            chosen.append(table)
        for table in chosen:
            table.expire_due()
        try:
            dtypes = row_dtypes(header, tables, (m.name for m in metas))
        except ValueError:
            return False  # the Python path refuses it in its words
        wires = [dtypes.get(m.name, t.dtype) for m, t in zip(metas, chosen, strict=True)]
        counts = [m.shape[0] for m in metas]
        sizes = [n * t.dim * w.itemsize for n, t, w in zip(counts, chosen, wires, strict=True)]
        raws: list[Any] | None = None
        place = self.host.reply_area(request, sizes)
        if place is not None:
            dst, offsets = place
        elif request.lane is not None:
            return False  # too large for its lane: the Python path answers by socket
        else:
            dst, offsets, raws = fresh_buffer(sizes)
        jobs: list[tuple[Any, ...]] = []
        narrow: list[Narrow] = []
        for m, table, wire_dtype, (src, src_offset), offset in zip(
            metas, chosen, wires, sources, offsets, strict=True
        ):
            job = lookup_job(m.name, table, wire_dtype, src, src_offset, m.shape[0], dst, offset,
                              narrow)  # fmt: skip
            if job is None:
                return False
            jobs.append(job)
        task = self.host.sender(request)
        if not self._gather(jobs, chosen, header.get(_ABSENT_ZEROS, False), task):
            return False  # a bad id: the Python path names it
        for cast in narrow:
            cast.done()
        out = [
            [m.name, wire.dtype_name(w), [m.shape[0], t.dim]]
            for m, t, w in zip(metas, chosen, wires, strict=True)
        ]
        metrics = self.host.metrics
        if metrics.on:
            for m in metas:
                metrics.rows_pulled(m.name).inc(m.shape[0])
        self.served += 1
        self.host.reply_placed(request, {}, out, raws)
        return True

    @staticmethod
    def _gather(
        jobs: list[tuple[Any, ...]], tables: list[Rows], absent_zeros: bool, task: str
    ) -> bool:
        """The rows of ``jobs`` (one a table of ``tables``) where the reply goes; an id a
        hashed table does not hold gets its initial row (zeros with ``absent_zeros``), as the
        Python path's lookup gives it. ``False`` for a bad id, nothing written. The rows found
        are kept for ``task``'s push of the same ids (:class:`~psflow.sparse.mapped.MappedIds`)."""
        if not any(isinstance(t, HashedRows) for t in tables):
            return kernels.lookup_rows(jobs)  # map and gather in one call
        ids = ids_of(jobs)  # before the rows overlay them
        slots = kernels.map_lookup(jobs, absent_ok=True)
        if slots is None:
            return False
        versions = [t.map_version for t in tables]
        absent = absent_rows(jobs, tables, ids, slots)
        kernels.gather_mapped(jobs, slots, held=True)
        for table, absent_ids, at, place in absent:
            table.initial_at(absent_ids, at, place, zeros=absent_zeros)
        remember(task, jobs, tables, ids, slots, versions)
        return True
