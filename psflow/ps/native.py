"""A shard's sparse requests served in native code, from the request's bytes to the reply's.

:class:`NativeLookup` serves a ``lookup`` of fixed tables' rows without making a tensor in
Python: the ids are read where they came (a lane's request area, the header's inline bytes, a
frame), checked, mapped to their rows in the shard's storage and gathered where the reply goes
(the lane's request area, or one fresh buffer sent from its own memory) by one call of
:func:`psflow.sparse.kernels.lookup_rows`, which releases the GIL. Python decodes the header and
encodes the reply's: the dispatch around the call.

What it does not serve as it came is left to the handler's Python path, which serves or refuses
it: a hashed table, rows asked in another dtype, a tensor in several frames, a reply too large
for the lane, a bad id (the kernel writes nothing then). So a refusal's words are that path's,
and its tests hold for both. ``PSFLOW_NATIVE_REQUESTS=0`` serves everything in Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import psflow.sparse.kernels as kernels
from psflow import env as envvars
from psflow.protocol import Key
from psflow.ps.service import ServiceHost
from psflow.sparse import FixedRows
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
        chosen: list[FixedRows] = []
        for m in metas:
            table = tables.get(m.name)
            if type(table) is not FixedRows or m.dtype is not torch.int64 or len(m.shape) != 1:
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
