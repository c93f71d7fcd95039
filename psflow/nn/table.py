"""The base of psflow's embedding modules: a table that can live on this process or elsewhere.

- local, fixed size: a ``weight`` parameter, as in torch.
- **attached** (:meth:`TableModule.attach`): the module drops its weight and asks a
  :class:`RowSource` (the worker's, backed by the ps) for the rows of the ids each batch uses;
  the gradient per id is left on those rows for the worker to push.
- **hashed** (``num_embeddings=None``): any int64 id is a row, created on first update. Kept on
  this process, the rows live in a :class:`psflow.sparse.HashedRows` and are updated in the
  backward pass by a row-wise optimizer (TorchRec's fused backward and optimizer).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn

from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse import HashedRows, RowOptimizer, Rows, initial_rows, make_rows
from psflow.sparse.rows import STATE_PREFIX

_DTYPES = {torch.float32: "float32", torch.float64: "float64"}
"""The dtypes a table may hold, with their names in a :class:`TableSpec`."""


@runtime_checkable
class RowSource(Protocol):
    """Where an attached table's rows come from: set on the module by the worker.

    The module asks once per forward pass, with the unique ids of the batch; the rows it gets
    back stand in for ``weight[ids]``. A source may also define ``batch_rows(table, ids)``,
    taking the batch's ids as they are and giving its rows in its own order (see
    :func:`batch_rows`); the module then asks that instead. And ``batch_parts(table, ids)``
    (the worker's :meth:`~psflow.worker.tables.TableClient.batch_parts`), for a module that
    gathers the rows at once: the rows left where they came in, in parts; its ids are not yet
    checked for range (the source does, :meth:`TableModule.check_range`, as it groups them).
    """

    def rows(self, table: TableModule, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` in ``table``.

        Args:
            table: the module asking (the source knows it by the name it gave to
                :meth:`TableModule.spec`).
            ids: 1-D, unique, int64, each a valid id of the table.

        Returns:
            ``[len(ids), embedding_dim]``: a leaf with ``requires_grad=True``, whose ``.grad``
            after the backward pass is the gradient of each id's row.
        """
        ...


def batch_rows(
    source: RowSource, table: TableModule, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a batch's ids (1-D int64, in range, repeats allowed) from ``source``:
    ``(rows, positions)``, the rows of the unique ids and, for each id, which row is its.

    A source whose rows come from several places (the worker's, from each ps) may define
    ``batch_rows(table, ids)`` itself and give the rows in its own order, grouped by where they
    came from: no copy into sorted order on the way in, and each place's gradients a slice of
    the leaf's on the way out. Any other source is asked :meth:`RowSource.rows` for the
    batch's unique ids, in sorted order.
    """
    own = getattr(source, "batch_rows", None)
    if own is not None:
        rows, positions = own(table, ids)
        return rows, positions
    unique, positions = torch.unique(ids, return_inverse=True)
    return source.rows(table, unique), positions


class Held(NamedTuple):
    """A table's rows as the module holds them (:meth:`TableModule.held`): ``rows``, their
    row-wise optimizer ``state`` (empty when none was given), and for a hashed table the
    ``ids`` of the rows (``None`` for a fixed one: its rows are ``0..num_embeddings-1``)."""

    rows: torch.Tensor
    state: dict[str, torch.Tensor]
    ids: torch.Tensor | None


class _FusedRows:
    """The row source of a hashed table kept on this process.

    Rows come from a :class:`psflow.sparse.Rows`; a hook on them applies the table's row-wise
    optimizer as soon as their gradient is known, so that no optimizer step and no dense
    gradient are needed (TorchRec's fused backward and optimizer). A table with no optimizer
    named looks rows up (with gradients off: a model loaded to serve) but cannot train here.
    """

    def __init__(self, rows: Rows) -> None:
        self.store = rows

    def rows(self, table: TableModule, ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.store.spec.optimizer is None:
            raise ValueError(
                f"{table._label()}: a hashed table (num_embeddings=None) kept on this "
                "process updates its rows in the backward pass with its own row-wise "
                "optimizer: give one, e.g. optimizer='Adagrad' (or 'SGD', 'Adam', 'Ftrl', "
                "or a RowOptimizerSpec), or look rows up with gradients off (torch.no_grad())"
            )
        on_cpu = ids.cpu()
        values = self.store.lookup(on_cpu).to(ids.device).requires_grad_(True)
        if torch.is_grad_enabled():
            values.register_hook(partial(self._apply, on_cpu))
        return values

    def _apply(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self.store.apply(ids, grad.detach().to("cpu"))


class TableModule(nn.Module):
    """What :class:`Embedding` and :class:`EmbeddingBag` share: a table that a worker can place
    on the parameter servers.

    Three states, one forward pass's arithmetic:

    - local, fixed size: ``self.weight`` is an ``nn.Parameter`` as in torch, trained by the
      optimizer the script gives it. Its rows start as :func:`psflow.sparse.initial_rows` gives
      them for ``seed``, the same values a ps gives the table it creates from :meth:`spec`.
      Built with ``device="meta"``, it holds no memory (for a table only the ps will hold).
    - local, hashed (``num_embeddings=None``): rows created on first update, kept in this
      process, updated in the backward pass by ``optimizer`` (created at the first forward pass;
      a hashed table used locally needs an ``optimizer``).
    - attached (:meth:`attach`): no weight; each forward pass asks the :class:`RowSource` for the
      rows of the unique ids of its batch.

    Ids out of range (negative, or ``>= num_embeddings``) are refused with the table and the
    id named, before any row is asked for. ``max_norm`` is refused: it renormalises rows in place
    in the forward pass, which a table held by the ps cannot do.

    Example:
        >>> import torch
        >>> from psflow.nn import Embedding
        >>> class Source:  # a worker's source asks the ps; this one serves a local tensor
        ...     def __init__(self, weight):
        ...         self.weight = weight
        ...     def rows(self, table, ids):
        ...         return self.weight[ids].clone().requires_grad_(True)
        >>> emb = Embedding(10, 3)
        >>> ids = torch.tensor([4, 4, 1])
        >>> want = emb(ids)
        >>> emb.spec("emb").num_embeddings
        10
        >>> emb.attach(Source(emb.weight.detach()))
        >>> torch.equal(emb(ids), want), list(emb.parameters())
        (True, [])
    """

    num_embeddings: int | None
    embedding_dim: int
    padding_idx: int | None
    max_norm: float | None
    norm_type: float
    scale_grad_by_freq: bool
    sparse: bool
    weight: nn.Parameter

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        *,
        padding_idx: int | None,
        max_norm: float | None,
        norm_type: float,
        scale_grad_by_freq: bool,
        sparse: bool,
        _weight: torch.Tensor | None,
        _freeze: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        partition: str,
        seed: int,
        init_std: float,
        optimizer: str | RowOptimizerSpec | None,
        min_count: int,
        max_rows: int | None,
    ) -> None:
        super().__init__()
        kind = type(self).__name__
        if max_norm is not None:
            raise ValueError(
                f"{kind}(max_norm={max_norm!r}) is not supported: max_norm renormalises the "
                "rows it looks up in place, during the forward pass, and a table held by the "
                "parameter servers cannot be written by a worker's forward pass; leave "
                "max_norm=None (renormalise the looked-up rows in the model if needed)"
            )
        if num_embeddings is None:
            if _weight is not None:
                raise ValueError(f"{kind}: a hashed table (num_embeddings=None) takes no _weight")
            if padding_idx is not None and padding_idx < 0:
                raise ValueError(
                    f"{kind}: padding_idx={padding_idx} counts from the end of the table, and "
                    "a hashed table (num_embeddings=None) has no end: give the id itself"
                )
        elif padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"{kind}: padding_idx={padding_idx} is not within num_embeddings="
                    f"{num_embeddings}"
                )
            padding_idx %= num_embeddings
        if _weight is not None:
            if list(_weight.shape) != [num_embeddings, embedding_dim]:
                raise ValueError(
                    f"{kind}: _weight has shape {list(_weight.shape)}, expected "
                    f"[num_embeddings, embedding_dim] = [{num_embeddings}, {embedding_dim}]"
                )
            dtype = _weight.dtype
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in _DTYPES:
            raise ValueError(
                f"{kind}: dtype {dtype} is not supported: a table holds float32 or float64"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        self._dtype = dtype
        self._name: str | None = None
        self._source: RowSource | None = None
        self._held_state: dict[str, torch.Tensor] = {}
        self._held_ids: torch.Tensor | None = None
        self._held_hashed: torch.Tensor | None = None
        """A hashed table's rows given by :meth:`load_rows`, and their ids: sent by a job's
        chief as the table's first rows, as a fixed table's weight is."""
        self._fused: _FusedRows | None = None
        # Checked now, so that a bad argument is named where the model is built rather than
        # where a worker first places the table.
        self._spec = TableSpec(
            name=kind.lower(),
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            partition=partition,
            dtype=_DTYPES[dtype],
            seed=seed,
            init_std=init_std,
            padding_idx=padding_idx,
            min_count=min_count,
            max_rows=max_rows,
            optimizer=None if optimizer is None else RowOptimizerSpec.of(optimizer),
        )
        self._on_meta = (
            _weight.is_meta if _weight is not None else torch.device(device or "cpu").type == "meta"
        )
        if num_embeddings is None:
            return
        if _weight is None:
            weight = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            self.weight = nn.Parameter(weight, requires_grad=not _freeze)
            self.reset_parameters()
        else:
            self.weight = nn.Parameter(_weight, requires_grad=not _freeze)

    # -- placing the table -------------------------------------------------------------------

    def spec(self, name: str) -> TableSpec:
        """The table as a ps creates it, called ``name`` (the module's path in the model).

        The name is remembered: errors about this table's ids use it.
        """
        self._name = name
        weight = self._parameters.get("weight")
        dtype = self._spec.dtype
        if weight is not None:  # its dtype may have changed since (module.double())
            if weight.dtype not in _DTYPES:
                raise ValueError(
                    f"{self._label()}: its weight is {weight.dtype}; a table on the ps holds "
                    "float32 or float64"
                )
            dtype = _DTYPES[weight.dtype]
        return replace(self._spec, name=name, dtype=dtype)

    def attach(self, source: RowSource) -> None:
        """Take rows from ``source`` from now on, and drop the local weight (or local hashed
        rows): the table lives elsewhere (on the ps), and this process never holds it.

        Raises:
            ValueError: if the weight is frozen (``requires_grad=False``): a frozen table is a
                plain tensor of the model, left on the worker.
        """
        if not isinstance(source, RowSource):
            raise TypeError(f"{self._label()}: {source!r} has no rows(table, ids) method")
        weight = self._parameters.get("weight")
        if self.frozen:
            raise ValueError(
                f"{self._label()} is frozen (weight.requires_grad=False): a frozen table is "
                "not trained, so it stays on the worker as a plain weight; attach only "
                "tables that train"
            )
        if weight is not None:
            self._dtype = weight.dtype  # the rows the source gives will have it
            del self._parameters["weight"]
        self._held_state = {}
        self._held_ids = self._held_hashed = None
        self._fused = None
        self._source = source

    def give_optimizer_state(self, state: dict[str, torch.Tensor]) -> None:
        """The row-wise optimizer's state for every row, kept with the weight for a job to
        start the table from (see :meth:`Embedding.from_pretrained`): the keys and shapes of
        the table's ``optimizer`` (``"Adagrad"``: ``sum``; ``"Ftrl"``: ``accum`` and
        ``linear``; ``"Adam"``: ``exp_avg``, ``exp_avg_sq`` and ``step``, one count a row).

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
        spec = self._spec.optimizer
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

    @property
    def frozen(self) -> bool:
        """Whether the module holds a weight that does not train (``requires_grad=False``,
        ``from_pretrained``'s default): a job leaves it on each worker as a plain weight."""
        weight = self._parameters.get("weight")
        return weight is not None and not weight.requires_grad

    def held_rows(self) -> torch.Tensor | None:
        """The rows this module holds itself, detached (see :meth:`held`)."""
        held = self.held()
        return None if held is None else held.rows

    @property
    def attached(self) -> bool:
        """Whether the rows come from a :class:`RowSource` (see :meth:`attach`)."""
        return self._source is not None

    def reset_parameters(self) -> None:
        """Start the rows again from :func:`psflow.sparse.initial_rows` (no-op when attached,
        or on the meta device)."""
        self._fused = None
        weight = self._parameters.get("weight")
        if weight is None or weight.is_meta:
            return
        assert self.num_embeddings is not None
        ids = torch.arange(self.num_embeddings, dtype=torch.int64)
        values = initial_rows(
            self._spec.seed,
            ids,
            self.embedding_dim,
            std=self._spec.init_std,
            dtype=self._dtype,
            padding_idx=self.padding_idx,
        )
        with torch.no_grad():
            weight.copy_(values)

    # -- the forward pass's parts ----------------------------------------------------------

    def _label(self) -> str:
        shape = f"{type(self).__name__}({self.num_embeddings}, {self.embedding_dim})"
        return shape if self._name is None else f"table {self._name!r} ({shape})"

    def _check_dtype(self, ids: torch.Tensor) -> None:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{self._label()}: ids must be int64 or int32, got {ids.dtype}")

    def check_range(self, low: torch.Tensor | int, high: torch.Tensor | int) -> None:
        """Refuses ids outside ``[0, num_embeddings)``, given the smallest and largest
        (``IndexError`` naming the table and the id; a hashed table takes any id)."""
        n = self.num_embeddings
        if n is None:
            return
        for bad in (int(low), int(high)):
            if not 0 <= bad < n:
                raise IndexError(
                    f"{self._label()}: id {bad} is out of range: ids must be in [0, {n})"
                )

    def _local_ids(self, ids: torch.Tensor) -> None:
        """Check the ids of a batch for the local weight."""
        self._check_dtype(ids)
        # On CPU only: on an accelerator, reading the extremes back would stall every forward
        # pass of a module meant to cost what torch's costs; there torch's own (asynchronous)
        # index check reports a bad id, without the table's name.
        if self.num_embeddings is not None and ids.numel() and ids.device.type == "cpu":
            self.check_range(*torch.aminmax(ids))

    def _batch_ids(self, ids: torch.Tensor, *, check_range: bool = True) -> torch.Tensor:
        """A batch's ids (any shape) checked (dtype; range, when there are some, unless the
        caller leaves that to the row source) and flat."""
        self._check_dtype(ids)
        flat = ids.reshape(-1).to(torch.int64)
        if check_range and flat.numel() and self.num_embeddings is not None:
            self.check_range(*torch.aminmax(flat))
        return flat

    def _gather(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """For the ids of a batch (any shape): ``(positions, rows, padding position)``, where
        ``rows`` holds the rows of the batch's unique ids, ``positions`` (shaped as ``ids``)
        says which row each id is, and the padding position is the row of ``padding_idx`` if
        the batch uses it. ``F.embedding(positions, rows)`` is then ``F.embedding(ids, weight)``.
        """
        flat = self._batch_ids(ids)
        if not flat.numel():  # nothing to ask for
            rows = torch.zeros(
                0, self.embedding_dim, dtype=self._dtype, device=ids.device, requires_grad=True
            )
            return flat.reshape(ids.shape), rows, None
        rows, positions = batch_rows(self._row_source(), self, flat)
        unique = int(positions.max()) + 1
        if rows.shape != (unique, self.embedding_dim):
            raise RuntimeError(
                f"{self._label()}: the row source gave rows of shape {list(rows.shape)} for "
                f"{unique} ids, expected [{unique}, {self.embedding_dim}]"
            )
        padding = None
        if self.padding_idx is not None:
            at = (flat == self.padding_idx).nonzero()
            if at.numel():
                padding = int(positions[at[0, 0]])
        return positions.reshape(ids.shape), rows, padding

    def _gather_parts(
        self, ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor] | None:
        """For the ids of a batch on the CPU, when the row source keeps the rows where they
        came in (``batch_parts``, the worker's): ``(rows, parts, positions)``, ``rows`` the leaf
        that stands for the unique ids' rows in autograd (it holds no values), ``parts`` the
        rows themselves in pieces, valid until the source's next request (gather from them at
        once), ``positions`` as :meth:`_gather` gives them. ``None``: use :meth:`_gather`."""
        parts_of = getattr(self._source, "batch_parts", None)
        if parts_of is None or ids.device.type != "cpu":
            return None
        flat = self._batch_ids(ids, check_range=False)  # the source checks, as it groups them
        if not flat.numel():
            return None
        rows, parts, positions = parts_of(self, flat)
        held = sum(p.shape[0] for p in parts)
        if rows.shape != (held, self.embedding_dim) or any(
            p.shape[1:] != (self.embedding_dim,) for p in parts
        ):
            raise RuntimeError(
                f"{self._label()}: the row source gave rows in parts of shapes "
                f"{[list(p.shape) for p in parts]} for a leaf of shape {list(rows.shape)}, "
                f"expected [*, {self.embedding_dim}] adding up to [{rows.shape[0]}, "
                f"{self.embedding_dim}]"
            )
        return rows, parts, positions.reshape(ids.shape)

    def prefetch(self, ids: torch.Tensor) -> None:
        """Asks for the rows of a coming batch's ``ids`` (what its forward will be given) to
        ride the next ``step()``'s round trip to the ps, instead of a request at that forward.

        The rows are read right after that step's update is applied, as the dense parameters
        the same reply brings: they miss what other workers push between that step and the
        forward that uses them (one step's staleness, as asynchronous training has for every
        parameter). Only for an attached table in an asynchronous mode; elsewhere nothing
        happens, and the forward asks as usual.

        Example:
            >>> # batch = next(data); nxt = next(data)
            >>> # model.embedding.prefetch(nxt.ids)   # its rows come back with opt.step()
        """
        fetch = getattr(self._source, "prefetch", None)
        if fetch is None:
            return
        flat = self._batch_ids(ids)
        if flat.numel():
            fetch(self, flat)

    def _row_source(self) -> RowSource:
        if self._source is not None:
            return self._source
        if self._fused is None:
            if self._on_meta:
                raise RuntimeError(
                    f"{self._label()} was built on the meta device and holds no rows: "
                    "attach() it to a row source (the worker does) before using it"
                )
            store = make_rows(self._spec, 0, 1)
            if self._held_ids is not None and self._held_hashed is not None:
                assert isinstance(store, HashedRows)
                store.give(self._held_ids, self._held_hashed, self._held_state)
            self._fused = _FusedRows(store)
        return self._fused

    @property
    def _uses_rows(self) -> bool:
        """Whether the forward pass gathers rows (attached or hashed) or reads ``weight``."""
        return self._source is not None or self.num_embeddings is None

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name != "weight":
                raise
            where = (
                "it is attached to a row source (the table lives on the parameter servers)"
                if self._source is not None
                else "it is a hashed table (num_embeddings=None), held as rows, not a tensor"
            )
            raise AttributeError(f"{self._label()} has no weight: {where}") from None

    def _extra(self) -> str:
        if self._source is not None:
            return ", attached"
        if self.num_embeddings is None and self._spec.optimizer is not None:
            return f", optimizer={self._spec.optimizer.name!r}"
        return ""
