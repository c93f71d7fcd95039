"""A fixed-size table's rows on one shard: :class:`FixedRows`, one dense tensor made at once."""

from __future__ import annotations

from typing import Any

import torch

import psflow.sparse.kernels as kernels
from psflow import allocator
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse.init import initial_rows
from psflow.sparse.rows import Rows
from psflow.sparse.snapshot import STATE_PREFIX, RowSnapshot


class FixedRows(Rows):
    """The rows of a fixed-size table that one shard holds, in one dense tensor.

    Example:
        >>> spec = TableSpec(name="emb", embedding_dim=4, num_embeddings=10, dtype="float64")
        >>> rows = FixedRows(spec, shard=1, num_shards=2)
        >>> rows.num_rows, rows.lookup(torch.tensor([3, 5])).shape
        (5, torch.Size([2, 4]))
    """

    def __init__(
        self,
        spec: TableSpec,
        shard: int,
        num_shards: int,
        *,
        optimizer: RowOptimizerSpec | None = None,
    ) -> None:
        if spec.num_embeddings is None:
            raise ValueError(f"table {spec.name!r} is hashed: use HashedRows")
        super().__init__(spec, shard, num_shards, optimizer=optimizer)
        self._rows = self.partition.rows_on(shard)
        self.values = initial_rows(
            spec.seed,
            self.partition.ids_on(shard),
            self.dim,
            std=spec.init_std,
            dtype=self.dtype,
            padding_idx=spec.padding_idx,
            out=allocator.table_empty((self._rows, self.dim), self.dtype),
        )
        self.state = self.optimizer.new_state(self._rows, self.dim, self.dtype)

    def lookup(
        self, ids: torch.Tensor, out: torch.Tensor | None = None, *, absent_zeros: bool = False
    ) -> torch.Tensor:
        return kernels.gather(self.values, kernels.local_index(ids, self.partition), out)

    def lookup_job(
        self, src: Any, src_offset: int, n: int, dst: Any, dst_offset: int
    ) -> tuple[Any, ...] | None:
        """What :func:`kernels.lookup_rows` takes to look up ``n`` ids that lie at byte
        ``src_offset`` of buffer ``src`` (int64, unchecked), their rows to go to byte
        ``dst_offset`` of buffer ``dst``; ``None`` where the kernels cannot (not built, or the
        rows not one contiguous CPU tensor)."""
        v = self.values
        if kernels.KERNELS is None or not v.is_contiguous() or v.device.type != "cpu":
            return None
        n_emb = self.spec.num_embeddings
        assert n_emb is not None
        div, shards, q, r, boundary = self.partition.rule()
        row_bytes = self.dim * v.element_size()
        return (
            src, src_offset, n, dst, dst_offset, v.data_ptr(), self._rows, row_bytes,
            n_emb, div, shards, self.shard, q, r, boundary,
        )  # fmt: skip

    def apply_job(
        self, ids: Any, ids_offset: int, n: int, grads: Any, grads_offset: int
    ) -> tuple[Any, ...] | None:
        """What :func:`kernels.apply_rows` takes to apply the gradients of ``n`` ids that lie
        at byte ``ids_offset`` of buffer ``ids`` (int64, unchecked), their gradients (``[n,
        dim]`` of the table's dtype) at byte ``grads_offset`` of buffer ``grads``; ``None``
        where only :meth:`apply` can: the kernels are not built or cannot take the rows, a
        ``padding_idx`` (its row never changes), or rows a snapshot or an export is keeping."""
        v = self.values
        if (
            self.spec.padding_idx is not None
            or self._snapshots
            or self._changed is not None
            or not kernels.fused(v, self.state, v)
        ):
            return None
        kind, keys, settings = self.optimizer.settings()
        state = [self.state[k].data_ptr() for k in keys] + [0] * (3 - len(keys))
        n_emb = self.spec.num_embeddings
        assert n_emb is not None
        div, shards, q, r, boundary = self.partition.rule()
        return (
            ids, ids_offset, n, grads, grads_offset, kind, kernels.is_double(v), v.data_ptr(),
            *state, self._rows, self.dim, n_emb, div, shards, self.shard, q, r, boundary,
            *settings,
        )  # fmt: skip

    def applied(self) -> None:
        """Counts an update :func:`kernels.apply_rows` made with :meth:`apply_job`'s job."""
        self.updates += 1

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self._check_grads(ids, grads)
        ids, grads = self._without_padding(ids, grads)
        local = kernels.local_index(ids, self.partition)
        self._preserve(local)
        self.optimizer.apply(self.values, self.state, local, grads)
        self.updates += 1

    @property
    def num_rows(self) -> int:
        return self._rows

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + sum(t.nbytes for t in self.state.values())

    @property
    def stats(self) -> dict[str, int]:
        return {"rows": self._rows, "updates": self.updates}

    def _begin_snapshot(self) -> RowSnapshot:
        live = {"values": self.values, **{STATE_PREFIX + k: v for k, v in self.state.items()}}
        return RowSnapshot(live, self._rows, {"ids": self.partition.ids_on(self.shard)})

    def load(self, ids: torch.Tensor, values: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        ids, values, state = self._snapshot_rows(ids, values, state)
        local = kernels.local_index(ids, self.partition)
        self._preserve(local)
        self.values.index_copy_(0, local, values)
        for key, tensor in state.items():
            self.state[key].index_copy_(0, local, tensor)
