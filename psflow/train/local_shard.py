"""All-reduce mode's and a cluster of one's checkpoints: the chief's own model and optimizer
as the one shard.

All-reduce mode has no ps, and every rank holds the whole model, the same on all of them. So
the chief saves its own copy, in ps mode's format: the ps's own snapshot and writer
(:class:`~psflow.ps.checkpoint.ShardCheckpointer`) run on a
:class:`~psflow.ps.store.ShardStore` that views the model's parameters and the engine's
``torch.optim`` optimizer, and the :class:`~psflow.train.checkpoint.Checkpointer` saves through
it as through a job of one ps: one shard file of every parameter, then the manifest and the
``latest`` pointer, on the same schedule, kept to the same ``max_to_keep``, each written
atomically. :func:`~psflow.train.checkpoint.load_checkpoint` reads it like any other, and a
checkpoint of either mode restores in the other (the same variables; only the placement
differs).

Restoring: the chief loads the checkpoint into its model and optimizer, then sends what it
loaded to the other ranks as the bytes of a shard file (no pickle), which they load the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from psflow.protocol import Key, OptimizerSpec
from psflow.ps.checkpoint import (
    ShardCheckpointer,
    ShardFile,
    encode_shard,
    load_optimizer_state,
    snapshot,
)
from psflow.ps.positions import restored_positions
from psflow.ps.store import ShardStore
from psflow.ps.tables import restore_tables
from psflow.train.checkpoint import Checkpoint
from psflow.worker.placement import Piece


class LocalShard:
    """A model and its optimizer, held whole by this process, as shard 0 of 1.

    It answers what :class:`~psflow.train.checkpoint.Checkpointer` asks of the ps (``save``,
    ``save_status``), so the chief of an all-reduce job, and a cluster of one
    (:mod:`psflow.train.alone`), save with the same code as a ps job.

    Args:
        store: the variables (views of the model's parameters), the optimizer and, in a
            cluster of one, the tables' rows.
        pieces: the placement: every parameter whole, on shard 0.
        global_step: the global step now, asked at each save.
        root: the checkpoint directory: saves go only into its ``ckpt-<n>`` directories.
    """

    num_shards = 1

    def __init__(
        self,
        store: ShardStore,
        pieces: list[Piece],
        global_step: Callable[[], int],
        *,
        root: str | None = None,
    ) -> None:
        self.store = store
        self.pieces = pieces
        self._global_step = global_step
        self._writer = ShardCheckpointer(self.store, shard=0, num_shards=1, root=root)

    @classmethod
    def of_model(
        cls,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        spec: OptimizerSpec,
        global_step: Callable[[], int],
        *,
        root: str | None = None,
    ) -> LocalShard:
        """All-reduce mode's: ``model`` and the ``torch.optim`` optimizer that trains it
        (``AllReduceEngine.optimizer``; ``spec`` is that optimizer, recorded in the
        checkpoint)."""
        params = dict(model.named_parameters())
        name_of = {id(p): n for n, p in params.items()}
        trained = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
        # The optimizer's parameters first, in its order: the ps's code finds a variable's
        # optimizer state by its position among the variables.
        order = trained + [n for n in params if n not in set(trained)]
        store = ShardStore()
        store.variables = {n: params[n].detach() for n in order}  # views: no copy
        store.optimizer = optimizer
        store.optimizer_spec = spec
        pieces = [Piece(var=n, param=n, shard=0) for n in params]
        return cls(store, pieces, global_step, root=root)

    # -- what a Checkpointer asks of the ps -------------------------------------------------

    def save(self, url_of: dict[int, str], *, by_step: bool = False) -> dict[int, dict[str, Any]]:
        """Snapshots the model and optimizer now and writes them in the background (with
        ``by_step``, into the ``ckpt-<step>`` of the global step now)."""
        self.store.step = self._global_step()
        return {0: self._writer.save({Key.DIR: url_of[0], Key.BY_STEP: by_step})}

    def save_status(self, url_of: dict[int, str]) -> dict[int, dict[str, Any]]:
        return {0: self._writer.status({Key.DIR: url_of[0]})}

    def close(self) -> None:
        """Nothing to close (a ps client would)."""

    # -- restore ----------------------------------------------------------------------------

    def load(
        self, ckpt: Checkpoint, *, optimizer_state: bool = True, table_files: Sequence[str] = ()
    ) -> None:
        """Loads a checkpoint of any mode into the model and, with ``optimizer_state``,
        into the optimizer (whose hyperparameters stay the running script's); the tables' rows
        and the input positions from its shard files ``table_files`` (all of them, written by
        any number of ps)."""
        tensors = ckpt.opt_tensors if optimizer_state else {}
        plain = ckpt.opt_plain if optimizer_state else {}
        self._load(ckpt.params, tensors, plain)
        metadata = restore_tables(self.store.tables, table_files)
        self.store.inputs = restored_positions(table_files, 0, 1, metadata=metadata)

    def load_shard(self, shard: ShardFile) -> None:
        """Loads the state another rank sent (:meth:`state_bytes`)."""
        self._load(shard.variables(), shard.optimizer_tensors(), shard.opt_state)

    def _load(
        self,
        params: dict[str, torch.Tensor],
        opt_tensors: dict[str, dict[str, torch.Tensor]],
        opt_plain: dict[str, dict[str, Any]],
    ) -> None:
        mine = self.store.variables
        if set(params) != set(mine):
            raise ValueError(
                f"the state holds {sorted(params)}, the model has {sorted(mine)}: not this model"
            )
        with torch.no_grad():
            for name, value in params.items():
                mine[name].copy_(value)
        if opt_tensors or opt_plain:
            load_optimizer_state(self.store, opt_tensors, opt_plain)

    def state_bytes(self, step: int) -> bytes:
        """The model and optimizer now, at global step ``step``, as a shard file's bytes."""
        self.store.step = step
        return encode_shard(snapshot(self.store, shard=0, num_shards=1))
