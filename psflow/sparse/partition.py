"""How a table's ids map to ps shards: TensorFlow's ``partition_strategy``."""

from __future__ import annotations

import torch

from psflow.protocol import PARTITIONS


class Partition:
    """Which shard holds each id of a table, and where in its storage.

    ``mod``: id ``i`` on shard ``i % S`` at row ``i // S``. ``div`` (fixed-size tables):
    contiguous ranges, TensorFlow's rule: the first ``N % S`` shards hold ``N // S + 1`` rows,
    the rest ``N // S``. A hashed table (``num_embeddings=None``) is always ``mod``.

    Example:
        >>> p = Partition("div", 10, 3)
        >>> [p.rows_on(s) for s in range(3)], p.shard_of(torch.tensor([0, 3, 4, 9])).tolist()
        ([4, 3, 3], [0, 0, 1, 2])
    """

    def __init__(self, kind: str, num_embeddings: int | None, num_shards: int) -> None:
        if kind not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {kind!r}")
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an integer >= 1, got {num_shards!r}")
        if num_embeddings is not None and num_embeddings < 1:
            raise ValueError(f"num_embeddings must be >= 1 or None, got {num_embeddings!r}")
        self.kind = "mod" if num_embeddings is None else kind
        self.num_embeddings = num_embeddings
        self.num_shards = num_shards
        n = num_embeddings or 0
        self._q, self._r = divmod(n, num_shards)
        self._boundary = self._r * (self._q + 1)  # div: ids below are in the longer shards

    def rule(self) -> tuple[bool, int, int, int, int]:
        """The rule as :mod:`psflow.sparse.kernels` takes it: ``(div, shards, q, r,
        boundary)``, where ``q, r = divmod(num_embeddings, shards)`` and ids below ``boundary``
        lie in the ``r`` shards of ``q + 1`` rows (``div``)."""
        return self.kind == "div", self.num_shards, self._q, self._r, self._boundary

    def shard_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The shard of each id (int64, like ``ids``)."""
        if self.num_shards == 1:
            return torch.zeros_like(ids)
        if self.kind == "mod":
            return torch.remainder(ids, self.num_shards)
        q, r = self._q, self._r
        long_shard = ids // (q + 1)
        short_shard = r + (ids - self._boundary) // max(q, 1)
        return torch.where(ids < self._boundary, long_shard, short_shard)

    def start_of(self, shard: int) -> int:
        """Fixed ``div`` tables: the first global id on ``shard``."""
        q, r = self._q, self._r
        return shard * (q + 1) if shard < r else self._boundary + (shard - r) * q

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Fixed tables: each id's row in its shard's storage."""
        if self.num_shards == 1:
            return ids
        if self.kind == "mod":
            return ids // self.num_shards
        q = self._q
        long_local = ids % (q + 1)
        short_local = (ids - self._boundary) % max(q, 1)
        return torch.where(ids < self._boundary, long_local, short_local)

    def rows_on(self, shard: int) -> int:
        """Fixed tables: the rows ``shard`` holds."""
        self._check_shard(shard)
        if self.num_embeddings is None:
            raise ValueError("a hashed table has no fixed rows per shard")
        if self.kind == "mod":
            return max(0, -(-(self.num_embeddings - shard) // self.num_shards))
        return self._q + 1 if shard < self._r else self._q

    def ids_on(self, shard: int) -> torch.Tensor:
        """Fixed tables: the global ids ``shard`` holds, in storage order."""
        rows = self.rows_on(shard)
        if self.kind == "mod":
            return torch.arange(shard, shard + rows * self.num_shards, self.num_shards)
        start = self.start_of(shard)
        return torch.arange(start, start + rows)

    def split(self, ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``shard -> (its ids, their positions in ids)``, for the shards that have any."""
        if self.num_shards == 1:
            if ids.numel() == 0:
                return {}
            return {0: (ids, torch.arange(ids.numel(), device=ids.device))}
        shards = self.shard_of(ids)
        order = torch.argsort(shards, stable=True)
        counts = torch.bincount(shards, minlength=self.num_shards).tolist()
        out = {}
        for shard, positions in enumerate(torch.split(order, counts)):
            if counts[shard]:
                out[shard] = (ids[positions], positions)
        return out

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must be in [0, {self.num_shards}), got {shard}")


def coalesce(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row gradients summed per id: ``(unique ids, one summed row each)``."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros((unique.shape[0], *grads.shape[1:]), dtype=grads.dtype)
    return unique, summed.index_add_(0, inverse, grads)
