"""A fixed-size table's rows on one shard: :class:`FixedRows`, one dense tensor made at once."""

from __future__ import annotations

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

    def _native_map(self) -> tuple[int, int, int, int, int] | None:
        n_emb = self.spec.num_embeddings
        assert n_emb is not None
        return self._rows, n_emb, 0, 0, 0

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
