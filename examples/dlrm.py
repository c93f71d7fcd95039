"""The DLRM of ``examples/ctr.py`` (facebookresearch/dlrm), with Wide & Deep's first-order term.

Its tables are ``psflow.nn.EmbeddingBag`` over hashed ids (value ``v`` of column ``c`` is row
``(c << 48) | v``), held on the ps only; ``benchmarks/`` train the same model.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

import psflow.nn as pnn

COLUMN_BITS = 48
"""A categorical value keeps its low 48 bits; the column goes above them."""


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    columns: torch.Tensor  # buffers, moved with the model: each column's high bits
    lower: torch.Tensor  # ... and the flat indices of the pairs below the diagonal

    def __init__(
        self,
        dim: int,
        bottom: list[int],
        top: list[int],
        table: pnn.RowOptimizerSpec,
        wide: pnn.RowOptimizerSpec | None = None,
        min_count: int = 0,
        wire_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.bottom = mlp([13, *bottom, dim])
        # min_count: an id gets a row of its own only once seen that often (rarer ones keep
        # their small initial row): what keeps a model of click logs from learning noise.
        bag = functools.partial(
            pnn.EmbeddingBag, None, mode="sum", min_count=min_count, wire_dtype=wire_dtype
        )
        self.embedding = bag(dim, init_std=0.01, seed=1, optimizer=table)
        # The first-order ("wide") term of Wide & Deep and DeepFM: one weight per id.
        self.wide = None if wide is None else bag(1, init_std=0.0, seed=2, optimizer=wide)
        pairs = 27 * 26 // 2
        self.top = nn.Sequential(mlp([dim + pairs, *top]), nn.Linear(top[-1], 1))
        # Not persistent: constants of the shape, never trained, so that the parameters a
        # checkpoint exports load with load_state_dict's default strict=True.
        columns = torch.arange(26, dtype=torch.int64) << COLUMN_BITS
        self.register_buffer("columns", columns, persistent=False)
        rows, cols = torch.tril_indices(27, 27, offset=-1)
        self.register_buffer("lower", rows * 27 + cols, persistent=False)

    def table_ids(self, categorical: torch.Tensor) -> torch.Tensor:
        """The tables' ids of a batch's categorical features, ``[B, 26]``."""
        return (categorical & ((1 << COLUMN_BITS) - 1)) | self.columns

    def prefetch(self, categorical: torch.Tensor) -> None:
        """The tables' rows of a coming batch ride the next step (see ``--prefetch``)."""
        ids = self.table_ids(categorical)
        self.embedding.prefetch(ids)
        if self.wide is not None:
            self.wide.prefetch(ids)

    def interact(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The top MLP's logit ``[B, 1]`` of the bottom MLP's ``x`` ``[B, dim]`` and the 26
        columns' rows ``e`` ``[B, 26, dim]``, with their pairwise dot products."""
        t = torch.cat([x.unsqueeze(1), e], dim=1)  # [B, 27, dim]
        # The 351 pairs below the diagonal. gather, not index_select or [:, lower]: the same
        # values, and a backward by one scatter_add (each place once: the same bits) instead of
        # index_add's column by column or index_put's accumulation (1.1 ms a batch of 512
        # against 1.5 and 1.6 here, forward and backward).
        products = torch.bmm(t, t.transpose(1, 2)).flatten(1)  # [B, 729]
        pairs = self.lower.expand(products.shape[0], -1)  # the batch's size stays symbolic
        z = torch.gather(products, 1, pairs)  # [B, 351]
        return self.top(torch.cat([x, z], dim=1))  # type: ignore[no-any-return]

    def forward(self, dense: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # [B, dim]
        ids = self.table_ids(categorical)
        e = self.embedding(ids.reshape(-1, 1)).view(len(dense), 26, -1)  # [B, 26, dim]
        logit = self.interact(x, e)
        if self.wide is not None:
            logit = logit + self.wide(ids)
        return logit.squeeze(1)
