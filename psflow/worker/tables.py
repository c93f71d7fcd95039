"""The worker's side of embedding tables: rows pulled by id at forward time, row gradients
pushed with the step.

A model's :mod:`psflow.nn` tables are attached to one :class:`TableClient` (their
:class:`~psflow.nn.RowSource`): the module drops its local weight, and each forward asks the
shards for the rows of the batch's unique ids (one request per shard, all in flight at once).
The rows come back as a leaf tensor that autograd fills with the gradient per id; at ``step()``
the exchange sends those gradients, summed per id, beside the dense ones in the same request
to each shard (:meth:`TableClient.gradients`), and the shard applies them with the table's
row-wise optimizer in the same update.

A table whose config names a narrower ``wire_dtype`` (:attr:`psflow.nn.TableConfig.wire_dtype`)
asks for its rows in it (:attr:`~psflow.protocol.Key.ROW_DTYPES`) and casts them back to the
table's dtype as they arrive; its row gradients go in it too, refused here if one does not fit.

Where each table's rows are (by shard, of what shape and dtype) is
:mod:`psflow.worker.row_layout`'s; a coming batch's rows that ride a push are
:mod:`psflow.worker.prefetch`'s.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

import psflow.sparse.kernels as kernels
from psflow.nn import RowSourceReplaced, TableModule
from psflow.protocol import OptimizerSpec, RowOptimizerSpec, TableSpec
from psflow.protocol.messages import (
    initial_ids_tensor_name,
    initial_rows_tensor_name,
    initial_state_tensor_name,
    row_tensor_names,
)
from psflow.sparse import coalesce
from psflow.transport import PeerError, PeerLostError, PeerTimeoutError
from psflow.worker.client import ShardedClient, Tensors
from psflow.worker.lookups import Lookups
from psflow.worker.prefetch import RowPrefetch
from psflow.worker.row_layout import Split, TableLayout
from psflow.worker.staging import Staging

log = logging.getLogger(__name__)


_ROW_WISE = {"SGD": "SGD", "Adagrad": "Adagrad", "Adam": "Adam", "SparseAdam": "Adam"}
"""The row-wise optimizer a table takes when it names none: the dense optimizer's own."""


_ROW_SETTINGS = {
    "SGD": {"lr"},
    "Adagrad": {"lr", "initial_accumulator_value", "eps"},
    "Adam": {"lr", "betas", "eps"},
}
"""The dense optimizer's settings its row-wise form takes; any other, given a value other than
torch's default (momentum, weight decay, maximize, ...), has no row-wise form and is refused
rather than dropped."""

_HOW = {"foreach", "fused", "capturable", "differentiable"}
"""Settings of how torch computes an update, not of what it is: they do not apply to rows."""


def row_optimizer_for(spec: OptimizerSpec) -> RowOptimizerSpec:
    """The row-wise form of the job's dense optimizer, with its settings (torch's defaults
    where it gives none, as ``torch.optim`` would apply to an ``nn.Embedding(sparse=True)``).

    Raises:
        ValueError: when the optimizer, or one of its settings (momentum, weight decay, ...),
            has no row-wise form (give the table an ``optimizer``).
    """
    name = _ROW_WISE.get(spec.name)
    if name is None:
        raise ValueError(
            f"embedding tables have no row-wise {spec.name}: give each table an optimizer "
            "(psflow.nn.Embedding(..., optimizer='Adagrad'); SGD, Adagrad, Adam or Ftrl)"
        )
    given = dict(spec.kwargs)
    defaults = inspect.signature(getattr(torch.optim, spec.name)).parameters
    lost = {
        key: value
        for key, value in given.items()
        if key not in _ROW_SETTINGS[name] and key not in _HOW and value != defaults[key].default
    }
    if lost:
        settings = ", ".join(f"{k}={v!r}" for k, v in lost.items())
        raise ValueError(
            f"embedding tables have no row-wise form of {spec.name}'s {settings}: give each "
            "table an optimizer of its own (psflow.nn.Embedding(..., optimizer=psflow.nn."
            f"RowOptimizerSpec.of({name!r}, lr=...)), which takes {sorted(_ROW_SETTINGS[name])})"
        )
    kwargs: dict[str, Any] = {"lr": spec.lr if spec.lr is not None else 0.01}
    if name == "Adagrad":
        kwargs["initial_accumulator_value"] = given.get("initial_accumulator_value", 0.0)
        kwargs["eps"] = given.get("eps", 1e-10)
    elif name == "Adam":
        kwargs["betas"] = tuple(given.get("betas", (0.9, 0.999)))
        kwargs["eps"] = given.get("eps", 1e-8)
    return RowOptimizerSpec.of(name, **kwargs)


def tables_of(model: nn.Module) -> dict[str, TableModule]:
    """``model``'s embedding tables that train, by their path in it (``"table"`` for the model
    itself). A frozen one (:attr:`TableModule.frozen`) is left out: it stays on each worker as
    a plain weight, neither on the ps nor in checkpoints (it is built again from its source)."""
    return {
        name or "table": m
        for name, m in model.named_modules()
        if isinstance(m, TableModule) and not m.frozen
    }


def table_specs(modules: Mapping[str, TableModule], optimizer: OptimizerSpec) -> list[TableSpec]:
    """The tables' specs as the ps take them: a table that names no row-wise optimizer takes
    the row-wise form of the job's ``optimizer`` (:func:`row_optimizer_for`), and its learning
    rate schedule (``TableSpec.scheduled``)."""
    out = []
    for name, module in modules.items():
        spec = module.spec(name)
        if spec.optimizer is None:
            spec = dataclasses.replace(spec, optimizer=row_optimizer_for(optimizer), scheduled=True)
        out.append(spec)
    return out


def narrowed(table: str, grads: torch.Tensor, wire: str) -> torch.Tensor:
    """``table``'s row gradients cast to ``wire`` (``bfloat16``, ``float16``) to be pushed.

    Raises:
        ValueError: naming the table when one is not finite after the cast (out of float16's
            range, or not finite before it): it would reach the rows as inf or nan.
    """
    out = grads.to(getattr(torch, wire))
    if not kernels.all_finite(out):
        worst = float(grads.abs().max())
        raise ValueError(
            f"table {table!r}: a row gradient does not fit {wire} (largest magnitude {worst:.4g}"
            f"{', beyond 65504' if wire == 'float16' else ''}): it would reach the ps as inf or "
            "nan; carry the table's rows as bfloat16 (wire_dtype=torch.bfloat16) or float32"
        )
    return out


class TableClient:
    """The :class:`~psflow.nn.RowSource` of a model's tables on the ps (see the module
    docstring).

    Args:
        model: holds the :mod:`psflow.nn` tables; each is attached here (its local weight is
            dropped: the table lives on the ps).
        client: the requests to the shards.
        staging: the copies between the host and a model's GPU (default: plain copies).
    """

    def __init__(
        self, model: nn.Module, client: ShardedClient, *, staging: Staging | None = None
    ) -> None:
        self.client = client
        self.staging = staging if staging is not None else Staging(pinned=False)
        self.modules = tables_of(model)
        self.layout = TableLayout(client.num_shards)
        """The tables by name: spec, partition over the shards, the dtype their rows travel in."""
        self._name_of: dict[int, str] = {}
        self.initial_state: dict[str, dict[str, torch.Tensor]] = {}
        """Per table in :attr:`initial`, the row-wise optimizer state given with its rows
        (``from_pretrained(optimizer_state=...)``), sent with them; empty for most."""
        self.initial: dict[str, torch.Tensor] = {}
        """Per table, the rows the model held when it was given to the job (a fixed table's
        weight not on the meta device: pretrained, loaded from a state dict, or the seeded
        start; a hashed table's rows given by id, :meth:`~psflow.nn.TableModule.load_rows`):
        the chief's init makes them the table's first rows (:meth:`initial_rows`). Dropped
        when the job starts (:meth:`forget_initial`)."""
        self.initial_ids: dict[str, torch.Tensor] = {}
        """Per hashed table in :attr:`initial`, the ids of its rows."""
        for name, module in self.modules.items():
            spec = module.spec(name)
            held = module.held()  # before attach() drops it
            if held is not None:
                self.initial[spec.name] = held.rows
                self.initial_state[spec.name] = held.state
                if held.ids is not None:
                    self.initial_ids[spec.name] = held.ids
            self.layout.add(spec, module.config.wire_name(getattr(torch, spec.dtype)))
            self._name_of[id(module)] = spec.name
        self._looked_up: Lookups[tuple[str, torch.Tensor, Split]] = Lookups()
        self.prefetched = RowPrefetch(self.layout, client, self.staging)
        """The rows of coming batches, asked for with a push (:meth:`prefetch`)."""
        self.on_lost: Callable[[PeerError], None] | None = None
        """What a lookup that meets a lost ps (:class:`~psflow.transport.PeerLostError`, a
        timeout) calls before the table asks again: the training session's recovery, which
        waits for the ps, has the chief restore an empty one, and attaches a new source to
        the tables (it raises when it cannot). ``None``: the error reaches the forward pass."""
        for module in self.modules.values():
            module.attach(self)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def initial_rows(self, shard: int) -> Tensors:
        """``shard``'s part of each table in :attr:`initial`, in its storage order, as an
        init carries it (:func:`~psflow.protocol.messages.initial_rows_tensor_name`)."""
        out: Tensors = []
        for name, held in self.initial.items():
            given = self.initial_ids.get(name)
            if given is None:  # a fixed table: all the shard's rows, in its storage order
                at = self.layout.partitions[name].ids_on(shard).to(held.device)
            else:  # a hashed one: the rows of the ids on the shard (maybe none), and the ids
                shard_ids, at = (
                    self.layout.partitions[name]
                    .split(given)
                    .get(shard, (given[:0], torch.empty(0, dtype=torch.int64)))
                )
                out.append((initial_ids_tensor_name(name), shard_ids))
            out.append((initial_rows_tensor_name(name), held.index_select(0, at).cpu()))
            for key, state in self.initial_state.get(name, {}).items():
                mine = state.index_select(0, at.to(state.device)).cpu()
                out.append((initial_state_tensor_name(name, key), mine))
        return out

    def forget_initial(self) -> None:
        """Drops :attr:`initial` and its ids and state: the ps hold the tables now."""
        self.initial = {}
        self.initial_ids = {}
        self.initial_state = {}

    def wire_specs(self, optimizer: OptimizerSpec) -> list[dict[str, Any]]:
        """The tables as an ``init`` carries them (see :func:`table_specs`)."""
        return [spec.to_wire() for spec in table_specs(self.modules, optimizer)]

    # -- forward: rows by id ----------------------------------------------------------------

    def rows(self, table: TableModule, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (1-D, unique) of ``table``, in their order, from the shards that
        hold them: a leaf tensor whose gradient :meth:`gradients` pushes at the next step."""
        name, flat = self._name_and_ids(table, ids)
        _, positions, split, (values,) = self._rows_of(
            name, flat, views=False, eval=not table.training
        )
        aligned = values[positions]  # into the ids' order; the split follows them there
        order = torch.empty_like(positions)
        order[positions] = torch.arange(positions.numel())
        split = {s: (shard_ids, order[at]) for s, (shard_ids, at) in split.items()}
        return self._looked(name, flat, aligned, split, ids.device)

    def batch_rows(
        self, table: TableModule, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of a batch's ``ids`` (1-D, repeats allowed) as they came from the shards:
        ``(rows, positions)``, the unique ids' rows grouped by shard (a leaf whose gradient
        :meth:`gradients` pushes at the next step, each shard's a slice of it) and which row
        each id is (see :func:`psflow.nn.table.batch_rows`). The ids' range is checked here, on
        the host, as they are grouped."""
        name, flat = self._name_and_ids(table, ids)
        unique, positions, split, (values,) = self._rows_of(
            name, flat, views=False, check=table, eval=not table.training
        )
        looked = self._looked(name, unique, values, split, ids.device)
        return looked, self.staging.to_device(positions, ids.device)

    def batch_parts(
        self, table: TableModule, ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """:meth:`batch_rows` for a caller that gathers the batch's rows at once (CPU only):
        ``(leaf, parts, positions)``. The rows stay where they came in: ``parts``, whose
        concatenation is the unique ids' rows (each shard's, a view of its lane), valid only
        until the next request to that shard. ``leaf`` stands for those rows in autograd (its
        gradient is what :meth:`gradients` pushes) and holds no values: a 1 MB copy out of the
        lanes a step saved (see :func:`psflow.sparse.kernels.gather_parts`)."""
        name, flat = self._name_and_ids(table, ids)
        unique, positions, split, parts = self._rows_of(
            name, flat, views=True, check=table, eval=not table.training
        )
        spec = self.layout.specs[name]
        leaf = torch.empty((unique.numel(), spec.embedding_dim), dtype=getattr(torch, spec.dtype))
        return self._looked(name, unique, leaf, split, ids.device), parts, positions

    def _name_and_ids(self, table: TableModule, ids: torch.Tensor) -> tuple[str, torch.Tensor]:
        return self._name(table), ids.detach().to("cpu", torch.int64)

    def _name(self, table: TableModule) -> str:
        name = self._name_of.get(id(table))
        if name is None:
            raise ValueError(f"{type(table).__name__} is not one of this model's tables")
        return name

    def _rows_of(
        self,
        name: str,
        flat: torch.Tensor,
        *,
        views: bool,
        check: TableModule | None = None,
        eval: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, Split, list[torch.Tensor]]:
        """A batch's ids grouped (see :meth:`TableLayout.group`) and their rows (see
        :meth:`_fetch`): those that came with the last push when it asked for exactly these ids
        (grouped, and checked, then: :meth:`RowPrefetch.hit`), else one request per shard.
        ``eval`` (the table in eval mode): ids a hashed table does not hold read zeros, and
        never rows prefetched for training."""
        hit = self.prefetched.hit(name, flat, views=views, eval=eval)
        if hit is not None:
            _, unique, positions, split, _ = hit.grouped
            if hit.on_device is not None:  # there already, or on their way
                return unique, positions, split, [hit.on_device]
            parts = hit.parts
            if name in self.layout.wire:  # cast back to the table's dtype: a copy of their own
                return unique, positions, split, self.layout.widened(name, split, parts, views)
            if views:  # each where it came; the caller gathers before any other request
                return unique, positions, split, [parts[s] for s in split]
            return unique, positions, split, [torch.cat([parts[s] for s in split])]
        unique, positions, split = self.layout.group(name, flat, check)
        return unique, positions, split, self._fetch(name, unique, split, views=views, eval=eval)

    def _fetch(
        self,
        name: str,
        unique: torch.Tensor,
        split: Split,
        *,
        views: bool = False,
        eval: bool = False,
    ) -> list[torch.Tensor]:
        """The rows of ``unique`` (grouped by shard as ``split`` says), shard after shard, in
        parts whose concatenation they are: one request per shard, all in flight at once, each
        shard's rows received into their place in one tensor, or with ``views`` left where
        they came in (views of its lane, valid until the next request to it), a part each."""
        layout = self.layout
        spec = layout.specs[name]
        values = None
        into = None
        wire = layout.wire.get(name)
        if not views and wire is None:
            dtype = getattr(torch, spec.dtype)
            values = torch.empty((unique.numel(), spec.embedding_dim), dtype=dtype)
            into = {s: {name: values[at]} for s, (_, at) in split.items() if isinstance(at, slice)}
        try:
            replies = self.client.lookup(
                {s: [(name, shard_ids)] for s, (shard_ids, _) in split.items()},
                into,
                # Narrow rows are left where they came and cast as they are copied out of there.
                views=views or wire is not None,
                absent_zeros=eval,
                row_dtypes=None if wire is None else {name: wire},
            )
        except (PeerLostError, PeerTimeoutError) as e:
            if self.on_lost is None:
                raise
            self.on_lost(e)  # recovered (or raises): a new source is attached to the tables
            raise RowSourceReplaced(f"{name}'s lookup met {e.peer} lost; asked again") from e
        parts = {}
        for s, (_, shard_tensors) in replies.items():
            if len(shard_tensors) != 1 or shard_tensors[0][0] != name:
                raise ValueError(
                    f"ps:{s} answered a lookup of {name!r} with {len(shard_tensors)} tensors"
                )
            parts[s] = shard_tensors[0][1]
        layout.check_parts(name, split, parts)
        if values is None:
            if wire is not None:
                return layout.widened(name, split, parts, views)
            return [parts[s] for s in split]
        return [layout.joined(split, parts, values)]

    def _looked(
        self, name: str, ids: torch.Tensor, values: torch.Tensor, split: Split, device: torch.device
    ) -> torch.Tensor:
        """``values`` as the forward's leaf (on ``device``), remembered with its ids (in the
        leaf's order) and ``split`` for the next push."""
        out = self.staging.to_device(values, device)
        out.requires_grad_(True)
        self._looked_up.add((name, ids, split), out)
        return out

    # -- step: row gradients ----------------------------------------------------------------

    def gradients(self) -> tuple[dict[int, Tensors], dict[int, list[str]]]:
        """The row gradients of the lookups since the last step, summed per id and split by
        shard, as tensors to push (:func:`~psflow.protocol.messages.row_tensor_names`), and the
        tables each shard's push carries. Forgets the lookups (those whose rows got no
        gradient are not pushed: :meth:`~psflow.worker.lookups.Lookups.take`). Every copy to the host that
        :attr:`staging` began, these and any before, has ended when this returns."""
        per_table: dict[str, list[tuple[torch.Tensor, torch.Tensor, Split]]] = {}
        for (name, ids, split), leaf in self._looked_up.take():
            assert leaf.grad is not None  # (take gives only those)
            grads = self.staging.to_host(leaf.grad.detach())
            per_table.setdefault(name, []).append((ids, grads, split))
        self.staging.wait()  # one wait for the device, for every table's (and the dense ones)
        tensors: dict[int, Tensors] = {}
        tables: dict[int, list[str]] = {}
        for name, lookups in per_table.items():
            if len(lookups) == 1:
                ids, grads, split = lookups[0]  # split by shard at the lookup already
            else:  # the table was looked up more than once: one row per id
                ids, grads = coalesce(
                    torch.cat([x[0] for x in lookups]), torch.cat([x[1] for x in lookups])
                )
                split = self.layout.partitions[name].split(ids)
            wire = self.layout.wire.get(name)
            if wire is not None:
                grads = narrowed(name, grads, wire)
            ids_name, grads_name = row_tensor_names(name)
            for s, (shard_ids, at) in split.items():
                # ``at``: a slice of a grouped leaf's gradient (a view), or positions
                tensors.setdefault(s, []).extend([(ids_name, shard_ids), (grads_name, grads[at])])
                tables.setdefault(s, []).append(name)
        return tensors, tables

    def zero_grad(self) -> None:
        """Clears the row gradients of the lookups since the last step and keeps the lookups,
        as ``torch.optim.Optimizer.zero_grad`` clears gradients and not the graph: a backward
        after it still reaches the next push (:meth:`~psflow.worker.lookups.Lookups.zero_grad`)."""
        self._looked_up.zero_grad()

    def clear(self) -> None:
        """Forgets the lookups since the last step: none of them is pushed."""
        self._looked_up.clear()

    # -- prefetch: the next batch's rows ride the step ----------------------------------------

    def prefetch(self, table: TableModule, ids: torch.Tensor) -> None:
        """Asks for the rows of a coming batch's ``ids`` (as its forward will give them) with
        the next push: its reply brings them, read right after that push is applied, and the
        forward that asks for exactly those ids uses them instead of a request of its own
        (:class:`~psflow.worker.prefetch.RowPrefetch`). Their range is checked on the host
        (that forward's are then not checked again): here, or for ids on a GPU, as the step
        takes them, their copy to the host begun here and waited for with the step's
        gradients (no wait for the device of its own)."""
        if self.staging.crosses(ids.device):
            host = self.staging.to_host(ids.detach().reshape(-1).to(torch.int64))
            self.prefetched.ask(self._name(table), host, ids.device, check=table)
            return
        name, flat = self._name_and_ids(table, ids)
        if flat.numel():
            table.check_range(*torch.aminmax(flat))
        self.prefetched.ask(name, flat, ids.device)

    def status(self) -> dict[int, Mapping[str, Any]]:
        """Each shard's counters per table: rows held, bytes, admissions, evictions."""
        return self.client.table_status()
