"""The base of psflow's embedding modules: a table that can live on this process or elsewhere.

- local, fixed size: a ``weight`` parameter, as in torch.
- **attached** (:meth:`TableModule.attach`): the module drops its weight and asks a
  :class:`RowSource` (the worker's, backed by the ps) for the rows of the ids each batch uses;
  the gradient per id is left on those rows for the worker to push.
- **hashed** (``num_embeddings=None``): any int64 id is a row, created on first update. Kept on
  this process, the rows live in a :class:`psflow.sparse.HashedRows` and are updated in the
  backward pass by a row-wise optimizer (TorchRec's fused backward and optimizer).

The table itself is a :class:`~psflow.nn.config.TableConfig` (``config.py``); what the module
holds on this process and saves, :class:`~psflow.nn.state.TableState` (``state.py``); its eval
mode and what tracing and exporting may record, :class:`~psflow.nn.frozen.FrozenTable`
(``frozen.py``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from psflow.nn.config import DTYPES, TableConfig
from psflow.nn.frozen import FrozenTable, traced
from psflow.protocol import TableSpec
from psflow.sparse import initial_rows


class RowSourceReplaced(Exception):
    """Raised by a row source that was replaced while it served a lookup: the worker's job
    recovered from a lost ps and attached a new source to the model's tables. The table asks
    again, of the source attached now."""


@runtime_checkable
class RowSource(Protocol):
    """Where an attached table's rows come from: set on the module by the worker.

    The module asks once per forward pass, with the unique ids of the batch; the rows it gets
    back stand in for ``weight[ids]``. A source may also define ``batch_rows(table, ids)``,
    taking the batch's ids as they are and giving its rows in its own order (see
    :func:`batch_rows`); the module then asks that instead. And ``batch_parts(table, ids)``
    (the worker's :meth:`~psflow.worker.tables.TableClient.batch_parts`), for a module that
    gathers the rows at once: the rows left where they came in, in parts. Either is given ids
    not yet checked for range: the source checks them (:meth:`TableModule.check_range`) as it
    groups them.
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
    the leaf's on the way out. Such a source is given the ids unchecked for range and checks
    them itself (:meth:`TableModule.check_range`) as it groups them: on an accelerator, where it
    reads them back anyway, that spares the forward a wait for the device. Any other source is
    asked :meth:`RowSource.rows` for the batch's unique ids, in sorted order, checked.
    """
    own = getattr(source, "batch_rows", None)
    if own is not None:
        rows, positions = own(table, ids)
        return rows, positions
    unique, positions = torch.unique(ids, return_inverse=True)
    return source.rows(table, unique), positions


class TableModule(FrozenTable):
    """What :class:`Embedding` and :class:`EmbeddingBag` share: a table that a worker can place
    on the parameter servers, built from its :class:`~psflow.nn.config.TableConfig`.

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

    In eval mode (``module.eval()``) a local hashed table is read-only, as a served model is:
    its rows are read from a :class:`~psflow.nn.frozen.Snapshot` of what it holds, an id it
    does not hold reads a row of zeros (as the padding id does), and nothing is trained in the
    backward pass. In training mode an id not held reads its initial row, as on the ps.

    Tracing and exporting (``torch.jit.trace``, ``torch.export``, ONNX) record the local forward
    pass exactly: a fixed table's ``F.embedding``, a hashed table's snapshot lookup (eval mode
    only). What cannot be recorded is refused with an error that says what to do instead: an
    attached table (its rows are on the ps), a hashed table in training mode, any table under
    ``torch.jit.script``.

    Ids out of range (negative, or ``>= num_embeddings``) are refused with the table and the
    id named, before any row is asked for (not when traced: there ``F.embedding`` checks).
    ``max_norm`` is refused: it renormalises rows in place in the forward pass, which a table
    held by the ps cannot do.

    Args:
        config: the table.
        max_norm, norm_type, scale_grad_by_freq, sparse, device: torch's.
        _weight: the rows (``[num_embeddings, embedding_dim]``, of the config's dtype),
            instead of seeded ones.
        _freeze: whether ``_weight`` stays out of training (``from_pretrained``).

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

    max_norm: float | None
    norm_type: float
    scale_grad_by_freq: bool
    sparse: bool
    weight: nn.Parameter
    _source: RowSource | None

    def __init__(
        self,
        config: TableConfig,
        *,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        kind = type(self).__name__
        if max_norm is not None:
            raise ValueError(
                f"{kind}(max_norm={max_norm!r}) is not supported: max_norm renormalises the "
                "rows it looks up in place, during the forward pass, and a table held by the "
                "parameter servers cannot be written by a worker's forward pass; leave "
                "max_norm=None (renormalise the looked-up rows in the model if needed)"
            )
        n, dim, dtype = config.num_embeddings, config.embedding_dim, config.dtype
        if _weight is not None:
            if n is None:
                raise ValueError(f"{kind}: a hashed table (num_embeddings=None) takes no _weight")
            if list(_weight.shape) != [n, dim]:
                raise ValueError(
                    f"{kind}: _weight has shape {list(_weight.shape)}, expected "
                    f"[num_embeddings, embedding_dim] = [{n}, {dim}]"
                )
            if _weight.dtype != dtype:
                raise ValueError(f"{kind}: _weight is {_weight.dtype}, its config says {dtype}")
        on_meta = (
            _weight.is_meta if _weight is not None else torch.device(device or "cpu").type == "meta"
        )
        super().__init__(config, on_meta)
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        if n is None:
            return
        if _weight is None:
            weight = torch.empty(n, dim, device=device, dtype=dtype)
            self.weight = nn.Parameter(weight, requires_grad=not _freeze)
            self.reset_parameters()
        else:
            self.weight = nn.Parameter(_weight, requires_grad=not _freeze)

    # -- placing the table -------------------------------------------------------------------

    def spec(self, name: str) -> TableSpec:
        """The table as a ps creates it, called ``name`` (the module's path in the model): its
        config's :meth:`~psflow.nn.config.TableConfig.spec`, with the rows' dtype as they are
        now (``module.double()`` changes a weight's).

        The name is remembered: errors about this table's ids use it.
        """
        self._name = name
        weight = self._parameters.get("weight")
        if weight is not None and weight.dtype not in DTYPES:
            raise ValueError(
                f"{self._label()}: its weight is {weight.dtype}; a table on the ps holds "
                "float32 or float64"
            )
        return self.config.spec(name, dtype=self._dtype if weight is None else weight.dtype)

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
            self.config.seed,
            ids,
            self.embedding_dim,
            std=self.config.init_std,
            dtype=self._dtype,
            padding_idx=self.padding_idx,
        )
        with torch.no_grad():
            weight.copy_(values)

    # -- the forward pass's parts ----------------------------------------------------------

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
        if traced():  # a value-dependent check is not recorded; F.embedding's own index is
            return
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
        # A source that groups the ids itself checks their range (see ``batch_rows``).
        grouping = getattr(self._source, "batch_rows", None) is not None
        flat = self._batch_ids(ids, check_range=not grouping)
        if not flat.numel():  # nothing to ask for
            rows = torch.zeros(
                0, self.embedding_dim, dtype=self._dtype, device=ids.device, requires_grad=True
            )
            return flat.reshape(ids.shape), rows, None
        while True:
            try:
                rows, positions = batch_rows(self._row_source(), self, flat)
                break
            except RowSourceReplaced:
                continue  # asked again, of the source attached now
        # On CPU only: on an accelerator, reading the positions' largest back would wait for
        # the device every forward; there a position past the rows meets torch's own
        # (asynchronous) index check in the lookup.
        unique = int(positions.max()) + 1 if positions.device.type == "cpu" else rows.shape[0]
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
        try:
            rows, parts, positions = parts_of(self, flat)
        except RowSourceReplaced:
            return self._gather_parts(ids)  # the source attached now (it may have no parts)
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
        flat = self._batch_ids(ids, check_range=False)  # the source checks (see batch_rows)
        if flat.numel():
            fetch(self, flat)

    def _row_source(self) -> RowSource:
        if self._source is not None:
            return self._source
        if self._on_meta:
            raise RuntimeError(
                f"{self._label()} was built on the meta device and holds no rows: "
                "attach() it to a row source (the worker does) before using it"
            )
        if torch.is_grad_enabled() and self._row_optimizer is None:
            raise ValueError(
                f"{self._label()}: a hashed table (num_embeddings=None) kept on this "
                "process updates its rows in the backward pass with its own row-wise "
                "optimizer: give one, e.g. optimizer='Adagrad' (or 'SGD', 'Adam', 'Ftrl', "
                "or a RowOptimizerSpec), or look rows up with gradients off (torch.no_grad())"
            )
        return self._fused_rows()

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
        optimizer = self._row_optimizer
        if self.num_embeddings is None and optimizer is not None:
            return f", optimizer={optimizer.name!r}"
        return ""
