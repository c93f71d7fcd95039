"""What a table module holds on this process, and how it goes into a state dict.

- :class:`TableState`, the base of :class:`~psflow.nn.table.TableModule`: the table's
  :class:`~psflow.nn.config.TableConfig`, and the rows it holds itself (a fixed table's weight
  and the optimizer state given with it; a hashed table's rows given by id, or made and trained
  here), as :meth:`~TableState.held` gives them to a job and a state dict saves them.
- :class:`FusedRows`: a hashed table's rows kept on this process, updated once per backward
  pass.
- :class:`Held`: what :meth:`~TableState.held` gives.
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.autograd import Variable

from psflow.nn.config import TableConfig
from psflow.protocol import RowOptimizerSpec
from psflow.sparse import HashedRows, RowOptimizer, Rows, make_rows
from psflow.sparse.rows import STATE_PREFIX


class Held(NamedTuple):
    """A table's rows as the module holds them (:meth:`TableState.held`): ``rows``, their
    row-wise optimizer ``state`` (empty when none was given), and for a hashed table the
    ``ids`` of the rows (``None`` for a fixed one: its rows are ``0..num_embeddings-1``)."""

    rows: torch.Tensor
    state: dict[str, torch.Tensor]
    ids: torch.Tensor | None


class FusedRows:
    """The row source of a hashed table kept on this process.

    Rows come from a :class:`psflow.sparse.Rows`; the table's row-wise optimizer is applied in
    the backward pass, so that no optimizer step and no dense gradient are needed (TorchRec's
    fused backward and optimizer). One update per backward pass: a hook on each lookup's rows
    keeps their gradient, and once the whole pass is done (a callback of autograd's engine)
    each id used is updated once, with the gradients of all the pass's lookups summed in the
    order they came (a table looked up twice in one loss is updated as one lookup of both, as a
    ps updates it at a step). Two backward passes, two updates, each of its own lookups' rows as
    they came in; a pass that fails applies nothing. A table with no optimizer named looks rows
    up (with gradients off: a model loaded to serve) but cannot train here: the module refuses
    to before asking (:meth:`~psflow.nn.table.TableModule._row_source`).
    """

    def __init__(self, rows: Rows) -> None:
        self.store = rows
        self._lock = threading.Lock()
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """The gradients come so far in each backward pass (by autograd's graph task id)."""

    def rows(self, table: object, ids: torch.Tensor) -> torch.Tensor:
        on_cpu = ids.cpu()
        values = self.store.lookup(on_cpu).to(ids.device).requires_grad_(True)
        if torch.is_grad_enabled():
            values.register_hook(partial(self._keep, on_cpu))
        return values

    def _keep(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """A lookup's gradient (a hook on its rows, in a backward pass): kept for the pass's
        one update, which the pass's first gradient asks to follow the pass."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            kept = self._pending.get(task)
            first = kept is None
            if kept is None:
                kept = self._pending[task] = []
            kept.append((ids, grad.detach().to("cpu")))
        if first:
            Variable._execution_engine.queue_callback(partial(self._apply, task))

    def _apply(self, task: int) -> None:
        """The backward pass ``task`` is done: each id it used updated once, with its
        gradients summed (in the order the lookups' came)."""
        with self._lock:
            kept = self._pending.pop(task, [])
        if not kept:
            return
        if len(kept) == 1:
            ids, grads = kept[0]
        else:
            ids, where = torch.unique(torch.cat([i for i, _ in kept]), return_inverse=True)
            every = torch.cat([g for _, g in kept])
            grads = every.new_zeros(len(ids), every.shape[1]).index_add_(0, where, every)
        with torch.no_grad():
            self.store.apply(ids, grads)


class TableState(nn.Module):
    """A table's config and the rows its module holds on this process (see the module
    docstring); :class:`~psflow.nn.table.TableModule` adds the lookup and the weight.

    Args:
        config: the table.
        on_meta: whether the module was built on the meta device (it holds no rows).
    """

    config: TableConfig
    """The table, as the module was built from it."""
    num_embeddings: int | None
    embedding_dim: int
    padding_idx: int | None
    _source: object | None
    """The row source of an attached table (:meth:`~psflow.nn.table.TableModule.attach`)."""

    def __init__(self, config: TableConfig, on_meta: bool) -> None:
        super().__init__()
        self.config = config
        # torch's attributes, read by the forward pass as torch's modules read them.
        self.num_embeddings = config.num_embeddings
        self.embedding_dim = config.embedding_dim
        self.padding_idx = config.padding_idx
        self._dtype = config.dtype  # the weight's, once attached (module.double() changes it)
        self._on_meta = on_meta
        self._name: str | None = None
        self._source = None
        self._held_state: dict[str, torch.Tensor] = {}
        self._held_ids: torch.Tensor | None = None
        self._held_hashed: torch.Tensor | None = None
        """A hashed table's rows given by :meth:`load_rows`, and their ids: sent by a job's
        chief as the table's first rows, as a fixed table's weight is."""
        self._fused: FusedRows | None = None

    def _label(self) -> str:
        shape = f"{type(self).__name__}({self.num_embeddings}, {self.embedding_dim})"
        return shape if self._name is None else f"table {self._name!r} ({shape})"

    @property
    def _row_optimizer(self) -> RowOptimizerSpec | None:
        optimizer = self.config.optimizer
        assert not isinstance(optimizer, str)  # TableConfig keeps a name as its spec
        return optimizer

    @property
    def attached(self) -> bool:
        """Whether the rows come from a row source (see
        :meth:`~psflow.nn.table.TableModule.attach`)."""
        return self._source is not None

    @property
    def frozen(self) -> bool:
        """Whether the module holds a weight that does not train (``requires_grad=False``,
        ``from_pretrained``'s default): a job leaves it on each worker as a plain weight."""
        weight = self._parameters.get("weight")
        return weight is not None and not weight.requires_grad

    def _fused_rows(self) -> FusedRows:
        """This process's store of a hashed table's rows, made at its first use from the rows
        given (:meth:`load_rows`), if any."""
        if self._fused is None:
            name = self._name or type(self).__name__.lower()
            store = make_rows(self.config.spec(name, dtype=self._dtype), 0, 1)
            if self._held_ids is not None and self._held_hashed is not None:
                assert isinstance(store, HashedRows)
                store.give(self._held_ids, self._held_hashed, self._held_state)
            self._fused = FusedRows(store)
        return self._fused

    # -- rows held here ----------------------------------------------------------------------

    def give_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """The row-wise optimizer's state for every row, kept with the weight for a job to
        start the table from (see :meth:`psflow.nn.Embedding.from_pretrained`): the keys and
        shapes of the table's ``optimizer`` (``"Adagrad"``: ``sum``; ``"RowWiseAdagrad"``:
        ``sum``, one number a row; ``"Ftrl"``: ``accum`` and ``linear``; ``"Adam"``:
        ``exp_avg``, ``exp_avg_sq`` and ``step``, one count a row).

        Raises:
            ValueError: without a weight or a named optimizer, or for state that is not the
                optimizer's.
        """
        weight = self._parameters.get("weight")
        if weight is None or weight.is_meta:
            raise ValueError(f"{self._label()}: optimizer state goes with rows it holds")
        self._held_state = self._checked_state(state, weight.shape[0], weight.dtype)

    def _checked_state(
        self, state: dict[str, torch.Tensor], rows: int, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """``state`` for ``rows`` rows of ``dtype``, detached, once checked to be what the
        table's row-wise optimizer keeps (keys, shapes, dtypes)."""
        spec = self._row_optimizer
        if spec is None:
            raise ValueError(
                f"{self._label()}: optimizer state needs the table's optimizer named "
                "(the state is that optimizer's)"
            )
        fresh = RowOptimizer(spec).new_state(1, self.embedding_dim, dtype)
        if set(state) != set(fresh):
            raise ValueError(
                f"{self._label()}: {spec.name} keeps state {sorted(fresh)}, got {sorted(state)}"
            )
        for key, t in state.items():
            want = (rows, *fresh[key].shape[1:])
            if tuple(t.shape) != want or t.dtype != fresh[key].dtype:
                raise ValueError(
                    f"{self._label()}: optimizer state {key!r} is {list(t.shape)} {t.dtype}, "
                    f"expected {list(want)} {fresh[key].dtype}"
                )
        return {k: t.detach() for k, t in state.items()}

    def load_rows(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        optimizer_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """A hashed table's rows for ``ids`` (1-D int64, unique), e.g. a TensorFlow
        ``MutableHashTable``'s or a dynamic embedding's keys and values, and maybe their
        row-wise optimizer state (the keys :meth:`give_optimizer_state` lists, one row per
        id). Here they are the table's rows at once; given to a job, the chief's init sends
        each ps the rows of its ids, and the job starts from them (a restored checkpoint wins).
        Other ids start from the seed, as always.

        Raises:
            ValueError: for a fixed-size or attached table, bad ids (repeated, not int64, the
                padding id), rows not ``[len(ids), embedding_dim]`` floats, or state that is not
                the table's optimizer's.
        """
        if self.num_embeddings is not None:
            raise ValueError(
                f"{self._label()}: load_rows is for a hashed table (num_embeddings=None); a "
                "fixed-size one takes its rows as its weight (from_pretrained)"
            )
        if self._source is not None:
            raise ValueError(f"{self._label()} is attached: its rows are on the ps")
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(
                f"{self._label()}: ids must be a 1-D int64 tensor, got {ids.dtype} of shape "
                f"{list(ids.shape)}"
            )
        ids = ids.detach().cpu()
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"{self._label()}: ids repeat")
        if self.padding_idx is not None and bool((ids == self.padding_idx).any()):
            raise ValueError(
                f"{self._label()}: ids include the padding id {self.padding_idx}, whose row "
                "is always zero"
            )
        if list(rows.shape) != [ids.numel(), self.embedding_dim] or not rows.is_floating_point():
            raise ValueError(
                f"{self._label()}: rows are {list(rows.shape)} {rows.dtype}; expected "
                f"[len(ids), embedding_dim] = [{ids.numel()}, {self.embedding_dim}] floats"
            )
        rows = rows.detach().to("cpu", self._dtype)
        if not ids.numel():  # none: the table holds no rows
            self._held_ids, self._held_hashed, self._held_state = None, None, {}
            self._fused = None
            return
        state = {}
        if optimizer_state is not None:
            state = self._checked_state(optimizer_state, ids.numel(), self._dtype)
            state = {k: t.cpu() for k, t in state.items()}
        self._held_ids, self._held_hashed, self._held_state = ids, rows, state
        self._fused = None  # built again, with these rows, by the next forward here

    def held(self) -> Held | None:
        """What this module holds itself, taken once: a fixed table's weight (unless on the
        meta device) and the optimizer state given with it (:meth:`give_optimizer_state`); a
        hashed table's rows with their ids and optimizer state, as local training left them
        once a forward pass here has used it (the rows given by :meth:`load_rows` among them),
        or as given before. ``None`` for an attached table, one on the meta device, or a hashed
        one that holds none. A job given the model starts the table from it."""
        if self._source is not None:
            return None
        if self.num_embeddings is not None:
            weight = self._parameters.get("weight")
            if weight is None or weight.is_meta:
                return None
            return Held(weight.detach(), dict(self._held_state), None)
        if self._fused is not None:
            snap = self._fused.store.snapshot()
            if not snap["ids"].numel():
                return None
            state = {
                k.removeprefix(STATE_PREFIX): t
                for k, t in snap.items()
                if k.startswith(STATE_PREFIX)
            }
            return Held(snap["values"], state, snap["ids"])
        if self._held_ids is None or self._held_hashed is None:
            return None
        return Held(self._held_hashed, dict(self._held_state), self._held_ids)

    def held_ids(self) -> torch.Tensor | None:
        """The ids of :meth:`held_rows` for a hashed table; ``None`` for a fixed table, or a
        hashed one that holds none."""
        held = self.held()
        return None if held is None else held.ids

    def held_state(self) -> dict[str, torch.Tensor]:
        """The row-wise optimizer state of :meth:`held_rows`; empty when there is none."""
        held = self.held()
        return {} if held is None else held.state

    def held_rows(self) -> torch.Tensor | None:
        """The rows this module holds itself, detached (see :meth:`held`)."""
        held = self.held()
        return None if held is None else held.rows

    # -- a hashed table in a state dict ------------------------------------------------------

    _ROW_KEYS = ("ids", "rows")
    _STATE_KEY = "opt."

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        """A hashed table held here saves its rows as ``<prefix>ids`` (int64) and
        ``<prefix>rows`` (``[len(ids), dim]``), and their row-wise optimizer state as
        ``<prefix>opt.<state>``; empty ones when it holds none. Attached, it saves nothing: the
        rows are on the ps (as a fixed table saves no ``weight`` then)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.num_embeddings is not None or self._source is not None or self._on_meta:
            return
        held = self.held()
        if held is None:
            held = Held(torch.empty(0, self.embedding_dim, dtype=self._dtype), {}, None)
        rows, state = held.rows, held.state
        ids = held.ids if held.ids is not None else torch.empty(0, dtype=torch.int64)
        destination[prefix + "ids"] = ids
        destination[prefix + "rows"] = rows
        for key, tensor in state.items():
            destination[prefix + self._STATE_KEY + key] = tensor

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """A hashed table takes ``<prefix>ids`` and ``<prefix>rows`` as :meth:`load_rows`
        does, with the ``<prefix>opt.<state>`` entries as their optimizer state if there are
        any (fresh state otherwise: ``psflow checkpoint export`` writes none)."""
        if self.num_embeddings is None:
            ours = {prefix + k for k in self._ROW_KEYS}
            mine = {k for k in state_dict if k in ours or k.startswith(prefix + self._STATE_KEY)}
            rest = {k: v for k, v in state_dict.items() if k not in mine}
        else:
            mine, rest = set(), state_dict
        super()._load_from_state_dict(
            rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if self.num_embeddings is None:
            self._load_held(state_dict, prefix, mine, missing_keys, error_msgs)

    def _load_held(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        mine: set[str],
        missing_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        absent = [prefix + k for k in self._ROW_KEYS if prefix + k not in mine]
        if absent:
            if not mine and (self._source is not None or self._on_meta):
                return  # it saves none either
            missing_keys.extend(absent)
            return
        state = {
            k.removeprefix(prefix + self._STATE_KEY): state_dict[k]
            for k in mine
            if k.startswith(prefix + self._STATE_KEY)
        }
        try:
            if self._source is not None:
                raise ValueError(
                    f"{self._label()} is attached: its rows are on the ps, and a state dict "
                    "does not change them (a job restores its tables from its checkpoint)"
                )
            wrong = sorted(k for k in mine if not isinstance(state_dict[k], torch.Tensor))
            if wrong:
                raise ValueError(f"{self._label()}: {', '.join(wrong)} are not tensors")
            self.load_rows(state_dict[prefix + "ids"], state_dict[prefix + "rows"], state or None)
        except ValueError as e:
            error_msgs.append(str(e))
