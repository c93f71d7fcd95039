"""Which ids a hashed table admits: :class:`Admission`, a count-min sketch of their pushes.

Counted in C (``_sketch.c``) where the row kernels are built, else in torch's ops; the two
give the same counts and the same sketch to the bit. A CTR shard with ``min_count`` 5 spent 0.9
ms a push of 4,600 ids (about 3,000 of them not held) in torch's ops here: a dozen index
operations over four hashes an id.
"""

from __future__ import annotations

import torch

from psflow.sparse import kernels
from psflow.sparse.init import splitmix64

DEPTH = 4
"""Hashes (rows of the sketch) an id is counted in."""

_SALT = 0x632BE59BD9B4E019


class Admission:
    """Counts each push of an id a table does not hold yet, in fixed memory, and says which
    have now been pushed ``min_count`` times.

    A count-min sketch with conservative update: counts are never under-estimated, and each
    saturates at ``min_count`` (all admission needs). The counts halve each time the sketch's
    width in pushes has gone by (TinyLFU's aging), so that an id has to come back while about
    ``16 * max_rows`` newcomers stream past, and the sketch never fills up (which would admit
    everything).

    Example:
        >>> admission = Admission(min_count=2, max_rows=100)
        >>> admission.admit(torch.tensor([7, 8])).tolist()
        [False, False]
        >>> admission.admit(torch.tensor([7])).tolist()
        [True]
    """

    def __init__(self, min_count: int, max_rows: int | None) -> None:
        self.min_count = min_count
        target = 16 * (max_rows or 1 << 16)
        self.width = 1 << max(12, min(20, (target - 1).bit_length()))
        self.sketch = torch.zeros(DEPTH * self.width, dtype=torch.int32)
        self._pushes = 0
        # torch's int64 multiplication wraps as the C kernel's does.
        self._salts = torch.arange(1, DEPTH + 1, dtype=torch.int64) * _SALT
        self._rows = torch.arange(DEPTH, dtype=torch.int64) * self.width

    @property
    def nbytes(self) -> int:
        return self.sketch.nbytes

    def admit(self, ids: torch.Tensor) -> torch.Tensor:
        """Counts one push of each of ``ids`` (unique, int64); which have now been pushed
        ``min_count`` times (estimated), as a bool tensor."""
        k = kernels.KERNELS
        if k is not None and ids.is_cpu and ids.dtype == torch.int64:
            ids = ids.contiguous()
            count = torch.empty(ids.numel(), dtype=torch.int32)
            k.sketch_count(ids.data_ptr(), ids.numel(), self.sketch.data_ptr(), self.width,
                           self._salts.data_ptr(), DEPTH, self.min_count,
                           count.data_ptr())  # fmt: skip
        else:
            count = self._count(ids)
        self._pushes += ids.numel()
        if self._pushes >= self.width:
            self.sketch.bitwise_right_shift_(1)
            self._pushes = 0
        return count >= self.min_count

    def _count(self, ids: torch.Tensor) -> torch.Tensor:
        """The sketch's update in torch's ops: every id's cells read, then raised."""
        sketch = self.sketch
        h = splitmix64(ids[None, :] + self._salts[:, None])
        cells = (h & (self.width - 1)).add_(self._rows[:, None])
        # Conservative update: each cell rises to the id's new estimate, no further.
        count = sketch[cells].amin(0).add_(1).clamp_(max=self.min_count)
        sketch.scatter_reduce_(0, cells.view(-1), count.repeat(DEPTH), reduce="amax")
        return count
