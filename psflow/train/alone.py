"""A cluster of one: a script started with no cluster trains in its own process, as the ps would.

``psflow.resolve_or_alone()`` gives a script started with no flags, no ``TF_CONFIG`` and no
cluster file the context of a cluster of one task (:meth:`~psflow.cluster.TaskContext.alone`);
a :class:`~psflow.train.TrainingSession` (or a ``DistributedOptimizer``) over it trains with
the ps's own parts, in this process, with no communication:

- the model's parameters are the variables of a :class:`~psflow.ps.store.ShardStore` (shared,
  not copied), which applies the same ``torch.optim`` optimizer and learning-rate schedule by
  the global step as a ps does on a push (:meth:`~psflow.ps.store.ShardStore.apply`);
- each :mod:`psflow.nn` table is attached to :class:`LocalTables`: its rows live in the ps's
  row store (:func:`~psflow.ps.tables.build_tables`, one shard of one), the rows the model held
  first go in as a ps's init puts them (:func:`~psflow.ps.tables.set_initial_rows`), and each
  step's row gradients, summed per id, are applied with the table's row-wise optimizer in the
  same update as the dense ones;
- checkpoints are the job's: one shard, written by the ps's own writer
  (:class:`~psflow.train.local_shard.LocalShard`), and restored from a checkpoint of any number
  of shards (a table's rows re-shard as they do on a ps). A job of any number of ps restores
  one written here.

The loop, the hooks, the summaries and the stop on SIGTERM are the session's, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from psflow.protocol import OptimizerSpec, ScheduleSpec, TableSpec
from psflow.ps.positions import InputMark
from psflow.ps.store import RowGrads, ShardStore
from psflow.ps.tables import FirstRows, build_tables, restore_tables, set_initial_rows
from psflow.sparse import coalesce
from psflow.worker.exchange import clear_grads
from psflow.worker.lookups import Lookups
from psflow.worker.modes import Engine, Mode, ModeConfig
from psflow.worker.opt_state import State, load_optimizer_state
from psflow.worker.placement import Piece, dense_parameters
from psflow.worker.tables import TableModule, tables_of


class LocalTables:
    """The :class:`~psflow.nn.RowSource` of a model's tables held in this process.

    Each forward's rows come from the table's row store as a leaf tensor; :meth:`gradients`
    gives what autograd left on them, summed per id, for the step to apply (as a worker's
    :class:`~psflow.worker.tables.TableClient` pushes them; :meth:`zero_grad` clears them and
    keeps the lookups, as it does: :class:`~psflow.worker.tables.Lookups`).
    """

    def __init__(self, model: nn.Module, specs: Sequence[TableSpec]) -> None:
        self.modules = tables_of(model)
        self.tables = build_tables(specs, 0, 1)
        first: dict[str, FirstRows] = {}
        for name, module in self.modules.items():
            held = module.held()  # before attach() drops it
            if held is not None:
                state = {k: v.detach().cpu() for k, v in held.state.items()}
                first[name] = FirstRows(held.rows.detach().cpu(), state, held.ids)
        set_initial_rows(self.tables, first)
        self._name_of = {id(m): name for name, m in self.modules.items()}
        self._looked_up: Lookups[tuple[str, torch.Tensor]] = Lookups()
        for module in self.modules.values():
            module.attach(self)

    def rows(self, table: TableModule, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (1-D, unique) of ``table``: a leaf whose gradient the next
        :meth:`gradients` takes."""
        name = self._name_of.get(id(table))
        if name is None:
            raise ValueError(f"{type(table).__name__} is not one of this model's tables")
        flat = ids.detach().to("cpu", torch.int64)
        # In eval mode an id the table does not hold reads zeros, as through a ps.
        rows = self.tables[name].lookup(flat, absent_zeros=not table.training)
        leaf = rows.to(ids.device).requires_grad_(True)
        if torch.is_grad_enabled():
            self._looked_up.add((name, flat), leaf)
        return leaf

    def gradients(self) -> RowGrads:
        """Per table, the ids looked up since the last step and their gradients, one row per
        id. Forgets the lookups (those whose rows got no gradient are left out)."""
        per_table: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for (name, ids), leaf in self._looked_up.take():
            assert leaf.grad is not None  # (take gives only those)
            per_table.setdefault(name, []).append((ids, leaf.grad.detach().to("cpu")))
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, parts in per_table.items():
            if len(parts) == 1:
                out[name] = parts[0]
            else:  # looked up more than once: one row per id, as the ps takes them
                out[name] = coalesce(
                    torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
                )
        return out

    def zero_grad(self) -> None:
        """Clears the row gradients of the lookups since the last step and keeps the lookups
        (a backward after ``zero_grad()`` still reaches the step, as in torch)."""
        self._looked_up.zero_grad()

    def clear(self) -> None:
        """Forgets the lookups since the last step: none of them is applied."""
        self._looked_up.clear()


class LocalEngine(Engine):
    """The mode of a cluster of one: what a ps does with a push, done here (module docstring).

    Args:
        model: the module; its parameters are the store's variables, its tables attached here.
        spec: the optimizer of the dense parameters.
        mode: the job's mode; with one worker every mode trains alike.
        lr_schedule: applied by the global step, as on a ps.
        optimizer_state: the optimizer's first state by parameter name (checked).
        tables: the tables' specs (:func:`~psflow.worker.tables.table_specs`).
        task: this task's name, under which its input positions are kept.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: OptimizerSpec,
        mode: ModeConfig,
        *,
        lr_schedule: ScheduleSpec | None = None,
        optimizer_state: State | None = None,
        tables: Sequence[TableSpec] = (),
        task: str = "worker:0",
    ) -> None:
        if mode.mode == Mode.SYNC:
            mode.replicas(1)  # refuses backup workers a cluster of one cannot have
        self.mode = mode.mode
        self.model = model
        self.tables = LocalTables(model, tables)
        self.params = dense_parameters(model)
        self.store = ShardStore()
        self.store.initialize(
            [(n, p.detach()) for n, p in self.params.items()],
            spec,
            schedule=lr_schedule,
            tables=self.tables.tables,
            share=True,
        )
        if optimizer_state:
            assert self.store.optimizer is not None
            load_optimizer_state(self.store.optimizer, self.store.variables, optimizer_state)
        self.pieces_here = [Piece(var=n, param=n, shard=0) for n in self.params]
        """Every parameter whole, on the one shard (the checkpoint's placement)."""
        self.task = task
        self._input_mark: InputMark | None = None

    @property
    def global_step(self) -> int:
        return self.store.step

    @property
    def learning_rate(self) -> float | None:
        return self.store.learning_rate()

    def start_at(self, step: int) -> None:
        """Goes on from ``step`` (a restored checkpoint's), with the schedule's rate there."""
        self.store.step = step
        if self.store.schedule is not None:
            self.store.schedule.advance(step)

    def restore_tables(self, urls: Sequence[str]) -> None:
        """Each table's rows and row-wise optimizer state from the shard files at ``urls``
        (written by any number of shards)."""
        restore_tables(self.store.tables, urls)

    def input_positions(self) -> list[InputMark | None]:
        return [self.store.inputs.marks.get(self.task)]

    def mark_input(self, seq: tuple[int, ...], position: dict[str, Any]) -> None:
        self._input_mark = (seq, position)

    def step(self) -> int:
        grads = [(n, p.grad) for n, p in self.params.items() if p.grad is not None]
        rows = self.tables.gradients()
        self.store.apply(grads, rows=rows or None)
        mark, self._input_mark = self._input_mark, None
        if mark is not None:  # with the update, as a ps keeps it
            self.store.inputs.record(self.task, mark)
        return self.store.step

    def pull(self) -> int:
        return self.store.step  # the model's parameters are the store's variables

    def zero_grad(self, set_to_none: bool = True) -> None:
        clear_grads(self.model.parameters(), set_to_none)
        self.tables.zero_grad()  # the rows' gradients, not the lookups: a backward may follow

    def close(self, *, finished: bool) -> None:
        """Nothing to release: no peer to tell."""
