"""A shard's sparse requests served in native code, from the request's bytes to the reply's.

:class:`NativeLookup` serves a ``lookup`` without making a tensor in Python: the ids are read
where they came (a lane's request area, the header's inline bytes, a frame), checked, mapped to
their rows in the shard's storage (a fixed table's by its partition, a hashed table's through
its id map) and gathered where the reply goes (the lane's request area, or one fresh buffer sent
from its own memory) by one call of :func:`psflow.sparse.kernels.lookup_rows`, which releases
the GIL. :class:`NativePush` applies a push of row gradients the same way
(:func:`psflow.sparse.kernels.apply_rows`). Python decodes the header and encodes the reply's:
the dispatch around the call.

What it does not serve as it came is left to the handler's Python path, which serves or refuses
it: an id a hashed table does not hold (its row is made there), rows asked in another dtype, a
tensor in several frames, a reply too large for the lane, a bad id (the kernel writes nothing
then). So a refusal's words are that path's, and its tests hold for both.
``PSFLOW_NATIVE_REQUESTS=0`` serves everything in Python.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

import psflow.sparse.kernels as kernels
from psflow import env as envvars
from psflow.protocol import Key
from psflow.protocol.messages import row_tensor_names
from psflow.ps.service import ServiceHost
from psflow.sparse import Rows
from psflow.transport import Request, wire

_ABSENT_ZEROS = Key.ABSENT_ZEROS.value

_PLAIN_LOOKUP = frozenset(
    k.value
    for k in (
        Key.VERSION, Key.OP, Key.ID, Key.TASK, Key.TENSORS, Key.INLINE, Key.CHUNK, Key.IN_LANE,
        Key.ABSENT_ZEROS,
    )
)  # fmt: skip
"""The header keys of a lookup the native path serves: any other (``row_dtypes``, or a key
no client sends) leaves it to Python."""


_ROWS = Key.ROWS.value

_PLAIN_PUSH = frozenset(
    k.value
    for k in (
        Key.VERSION, Key.OP, Key.ID, Key.TASK, Key.TENSORS, Key.INLINE, Key.CHUNK, Key.IN_LANE,
        Key.ROWS, Key.STEP,
    )
)  # fmt: skip
"""The header keys of a push the native path serves: a prefetch, an input position or rows
in another dtype leave it to Python."""


def enabled() -> bool:
    """Whether this process serves sparse requests natively (the kernels are built, and
    ``PSFLOW_NATIVE_REQUESTS`` is not ``0``)."""
    return kernels.KERNELS is not None and envvars.flag(envvars.PSFLOW_NATIVE_REQUESTS, True)


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
        sizes = [m.shape[0] * t.dim * t.dtype.itemsize for m, t in zip(metas, chosen, strict=True)]
        raws: list[Any] | None = None
        place = self.host.reply_area(request, sizes)
        if place is not None:
            dst, offsets = place
        elif request.lane is not None:
            return False  # too large for its lane: the Python path answers by socket
        else:
            dst = np.empty(sum(sizes), np.uint8)
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            raws = [dst[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        jobs = []
        for m, table, (src, src_offset), offset in zip(
            metas, chosen, sources, offsets, strict=True
        ):
            job = table.lookup_job(src, src_offset, m.shape[0], dst, offset)
            if job is None:
                return False
            jobs.append(job)
        if not kernels.lookup_rows(jobs):
            return False  # a bad id: the Python path names it
        out = [
            [m.name, wire.dtype_name(t.dtype), [m.shape[0], t.dim]]
            for m, t in zip(metas, chosen, strict=True)
        ]
        metrics = self.host.metrics
        if metrics.on:
            for m in metas:
                metrics.rows_pulled(m.name).inc(m.shape[0])
        self.served += 1
        self.host.reply_placed(request, {}, out, raws)
        return True


class NativePush:
    """The native path of one shard's ``push`` and ``push_pull`` of row gradients alone (no
    dense gradient): the ids and gradients read where they came, checked, mapped to their
    rows and applied with the table's row-wise optimizer by one call of
    :func:`psflow.sparse.kernels.apply_rows`. What it does not serve (dense gradients, a
    learning-rate schedule, a prefetch, an id a hashed table does not hold, a hashed table's
    time to live, a ``padding_idx``, rows a snapshot or an export is keeping, bad ids) is left
    to the Python path, nothing changed."""

    def __init__(self, host: ServiceHost) -> None:
        self.host = host
        self.on = enabled()
        self.served = 0
        """Pushes applied here (the rest went to the Python path)."""

    def apply(self, request: Request) -> int | None:
        """Applies ``request``'s row gradients natively and returns the shard's new step;
        ``None`` when it is left to the Python path, with nothing changed.

        Raises:
            wire.WireError: for a header whose tensor list is malformed (as the Python path).
        """
        header = request.header
        store = self.host.store
        if not self.on or store.schedule is not None or not _PLAIN_PUSH.issuperset(header):
            return None
        names = header.get(_ROWS)
        if type(names) is not list or not names or len(set(names)) != len(names):
            return None
        metas = wire.tensor_metas(header)
        if len(metas) != 2 * len(names):
            return None  # dense gradients too, or tensors missing
        sources = self.host.tensor_buffers(request)
        if sources is None:
            return None
        where = {m.name: (m, src) for m, src in zip(metas, sources, strict=True)}
        tables = store.tables
        jobs = []
        chosen: list[tuple[str, Rows, int]] = []
        for name in names:
            table = tables.get(name) if type(name) is str else None
            if table is None:
                return None
            ids_name, grads_name = row_tensor_names(name)
            ids, grads = where.get(ids_name), where.get(grads_name)
            if ids is None or grads is None:
                return None
            (ids_meta, (ids_src, ids_offset)), (g_meta, (g_src, g_offset)) = ids, grads
            n = ids_meta.shape[0] if len(ids_meta.shape) == 1 else -1
            if (
                ids_meta.dtype is not torch.int64
                or n < 0
                or g_meta.dtype is not table.dtype
                or g_meta.shape != (n, table.dim)
            ):
                return None
            job = table.apply_job(ids_src, ids_offset, n, g_src, g_offset)
            if job is None:
                return None
            jobs.append(job)
            chosen.append((name, table, n))
        self.host.flush()  # as the Python path: replies still leaving keep their values
        start = time.perf_counter()
        if not kernels.apply_rows(jobs):
            return None  # a bad id: the Python path names it
        for _, table, _ in chosen:
            table.applied()
        store.step += 1
        metrics = self.host.metrics
        metrics.apply_seconds.observe(time.perf_counter() - start)
        if metrics.on:
            for name, _, n in chosen:
                metrics.rows_pushed(name).inc(n)
        self.served += 1
        return store.step
