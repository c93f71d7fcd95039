"""One shard's part of one sparse table: its rows and their row-wise optimizer state.

:class:`Rows` is what every kind of table provides, and the checks they share:

- :class:`~psflow.sparse.fixed.FixedRows` (``fixed.py``): a table of ``num_embeddings`` rows;
  the shard holds its partition's rows in one dense tensor, all made at once.
- :class:`~psflow.sparse.hashed.HashedRows` (``hashed.py``): a table of any int64 ids; a row is
  made the first time its id is updated (after ``min_count`` pushes), and past ``max_rows`` the
  least recently updated rows go.

:func:`~psflow.sparse.make.make_rows` makes the one a :class:`~psflow.protocol.TableSpec` needs;
:class:`~psflow.sparse.snapshot.RowSnapshot` is a table's rows at one moment (a checkpoint's).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

import psflow.sparse.kernels as kernels
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse.mapped import MappedIds
from psflow.sparse.optim import RowOptimizer
from psflow.sparse.partition import Partition

# STATE_PREFIX and RowSnapshot are imported from here too (psflow.nn.table, psflow.ps.checkpoint).
from psflow.sparse.snapshot import STATE_PREFIX, RowSnapshot

__all__ = ["DTYPES", "STATE_PREFIX", "ExportPart", "RowSnapshot", "Rows"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""A table's dtype names and their torch dtypes."""


class ExportPart(NamedTuple):
    """A shard's part of one table in an export (:meth:`Rows.begin_export`)."""

    rows: RowSnapshot
    """``ids`` and ``values`` of the rows: all held (a base export), or those changed since
    the last export (a delta); each row as it was at the export's moment."""
    tombstones: torch.Tensor
    """The ids evicted (``max_rows``, ``ttl_seconds``) since the last export and not held
    again now (int64, sorted; none in a base export)."""


class Rows(ABC):
    """One shard's part of one table: values and row-wise optimizer state.

    Callers pass ids that :meth:`check_ids` accepts (1-D int64, unique, in range, on this
    shard) and gradients already summed per id; :meth:`lookup` and :meth:`apply` do not check
    the ids again (the ps checks each request once).

    Args:
        spec: the table.
        shard: this shard's index.
        num_shards: how many shards the table is split over.
        optimizer: the row optimizer when ``spec.optimizer`` is ``None`` (the job's row-wise
            default); ``RowOptimizerSpec()`` (Adagrad) when both are ``None``.
    """

    values: torch.Tensor
    """The rows, one per storage slot."""
    state: dict[str, torch.Tensor]
    """Their row-wise optimizer state (:meth:`RowOptimizer.new_state`), one row per slot."""

    def __init__(
        self,
        spec: TableSpec,
        shard: int,
        num_shards: int,
        *,
        optimizer: RowOptimizerSpec | None = None,
    ) -> None:
        self.spec = spec
        self.shard = shard
        self.num_shards = num_shards
        self.partition = Partition(spec.partition, spec.num_embeddings, num_shards)
        if not 0 <= shard < num_shards:
            raise ValueError(
                f"table {spec.name!r}: shard must be in [0, {num_shards}), got {shard}"
            )
        self.dim = spec.embedding_dim
        self.dtype = DTYPES[spec.dtype]
        self.optimizer = RowOptimizer(spec.optimizer or optimizer or RowOptimizerSpec())
        self.updates = 0
        """Calls of :meth:`apply`."""
        self._snapshots: list[RowSnapshot] = []
        self._changed: torch.Tensor | None = None
        """Per storage slot: written since the last export. ``None`` until the first export
        (nothing to track before it: that one holds every row), so a job without exports
        pays nothing for it."""
        self._evicted: list[torch.Tensor] = []
        """Ids evicted since the last export (while :attr:`_changed` tracks)."""
        self.mapped: MappedIds | None = None
        """Each task's last native lookup, its ids' rows kept for its push of the same ids
        (``psflow.ps.native``): a hashed table's, whose id map costs more than keeping them."""

    def begin_snapshot(self) -> RowSnapshot:
        """The rows as they are now, copied as they change and completed by
        :meth:`RowSnapshot.result` (see :class:`RowSnapshot`): serving does not pause. Rows
        past their ``ttl_seconds`` are evicted first: a snapshot never holds one."""
        self._expire_now()
        snap = self._begin_snapshot()
        self._snapshots = [s for s in self._snapshots if not s.done] + [snap]
        return snap

    @property
    def tracking(self) -> bool:
        """Whether changes since the last export are being tracked (an export has been taken)."""
        return self._changed is not None

    def begin_export(self, *, base: bool) -> ExportPart:
        """The rows for an export, taken as :meth:`begin_snapshot` takes them (no pause; each
        row's value of this moment): every row held (``base``), or the rows written since the
        last export and the ids evicted since (a delta). From now on, changes are tracked
        since this export.

        Raises:
            ValueError: for a delta when no export was taken before (nothing was tracked).
        """
        if not base and self._changed is None:
            raise ValueError(
                f"table {self.spec.name!r}: no export was taken on this shard yet (it may have "
                "restarted): nothing to take a delta from, export a base"
            )
        self._expire_now()
        live, ids = self._export_live()
        n = self.num_rows
        slots = None
        if not base:
            assert self._changed is not None
            slots = self._changed[:n].nonzero().squeeze(1)
        fixed = {} if ids is None else {"ids": ids if slots is None else ids[slots]}
        snap = RowSnapshot(live, n, fixed, slots=slots)
        tombstones = self._tombstones() if not base else torch.empty(0, dtype=torch.int64)
        self._snapshots = [s for s in self._snapshots if not s.done] + [snap]
        self._changed = torch.zeros(self._slot_capacity(), dtype=torch.bool)
        self._evicted = []
        return ExportPart(snap, tombstones)

    def _export_live(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The live tensors an export copies rows of, and the ids of every slot when they are
        not among them (a fixed table's, known by position)."""
        return {"values": self.values}, self.partition.ids_on(self.shard)

    def _slot_capacity(self) -> int:
        """Storage slots (what :attr:`_changed` marks)."""
        return self.num_rows

    def _tombstones(self) -> torch.Tensor:
        """The ids evicted since the last export that are not held now, sorted."""
        return torch.empty(0, dtype=torch.int64)

    def _expire_now(self) -> None:
        """Evicts the rows past their time to live (hashed tables with ``ttl_seconds``)."""
        return  # rows that never expire

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy: ``ids`` (the global ids held), ``values``, and ``opt/<state>``."""
        return self.begin_snapshot().result()

    @property
    def keeping(self) -> bool:
        """Whether a snapshot or an export is being taken: rows copied before they change."""
        return bool(self._snapshots)

    def before_update(self, slots: torch.Tensor) -> None:
        """Before the kernels update the rows at ``slots`` (an :meth:`apply_job`'s): snapshots
        and exports being taken keep them as they are, as :meth:`apply` has them kept."""
        self._preserve(slots)

    def _preserve(self, slots: torch.Tensor) -> None:
        """Before rows at ``slots`` of the storage change: snapshots in progress keep them, and
        the next export counts them as changed."""
        if self._changed is not None:
            kernels.fill_rows(self._changed, slots, True)
        if self._snapshots:
            for snap in self._snapshots:
                snap.preserve(slots)
            self._snapshots = [s for s in self._snapshots if not s.done]

    # -- the native request path (psflow.ps.native) --------------------------------------------

    def _native_map(self) -> tuple[int, int, int, int, int] | None:
        """How the kernels find an id's row: the rows held, the table's size (-1: hashed), and
        a hashed table's id map (its keys' and values' addresses and mask; zeros: a fixed
        table's rows are found by the partition). ``None`` where they cannot serve it."""
        return None

    @property
    def map_version(self) -> int:
        """A number new whenever a held id's row may change or go (a hashed table's eviction,
        expiry, or its rows moved): while it stays, every id held at one time keeps its row,
        and an id not held then may be held now (:class:`~psflow.sparse.mapped.MappedIds`). A
        fixed table's ids always have the same rows."""
        return 0

    def expire_due(self) -> None:
        """A native request's start, before its jobs are made and its ids mapped: what
        :meth:`apply` and :meth:`lookup` do first (a hashed table's time to live:
        :class:`~psflow.sparse.HashedRows`); nothing here."""
        return None

    def lookup_job(
        self, src: Any, src_offset: int, n: int, dst: Any, dst_offset: int
    ) -> tuple[Any, ...] | None:
        """What :func:`kernels.lookup_rows` takes to look up ``n`` ids that lie at byte
        ``src_offset`` of buffer ``src`` (int64, unchecked), their rows to go to byte
        ``dst_offset`` of buffer ``dst``; ``None`` where the kernels cannot (not built, the
        rows not one contiguous CPU tensor, a hashed table's time to live)."""
        v = self.values
        found = self._native_map()
        if kernels.KERNELS is None or found is None or not v.is_contiguous() or not v.is_cpu:
            return None
        rows, n_emb, keys, vals, mask = found
        div, shards, q, r, boundary = self.partition.rule()
        row_bytes = self.dim * v.element_size()
        return (
            src, src_offset, n, dst, dst_offset, v.data_ptr(), rows, row_bytes,
            n_emb, div, shards, self.shard, q, r, boundary, keys, vals, mask,
        )  # fmt: skip

    def apply_job(
        self, ids: Any, ids_offset: int, n: int, grads: Any, grads_offset: int
    ) -> tuple[Any, ...] | None:
        """What :func:`kernels.map_rows` and :func:`kernels.apply_mapped` take to apply the gradients of ``n`` ids that lie
        at byte ``ids_offset`` of buffer ``ids`` (int64, unchecked), their gradients (``[n,
        dim]`` of the table's dtype) at byte ``grads_offset`` of buffer ``grads``; ``None``
        where only :meth:`apply` can: the kernels cannot (as :meth:`lookup_job`). With a
        ``padding_idx``, the caller drops that id's gradient once the ids are checked (its row
        never changes, as in :meth:`apply`); while a snapshot or an export is being taken, the
        caller has it keep the rows first (:meth:`before_update`). The kernel marks the rows it
        changes for the next export. :meth:`applied` counts the update it made."""
        v = self.values
        found = self._native_map()
        changed = self._changed
        if (
            found is None
            or (
                changed is not None and (changed.dtype != torch.bool or not changed.is_contiguous())
            )
            or not kernels.fused(v, self.state, v, self.optimizer.one_a_row)
        ):
            return None
        rows, n_emb, keys, vals, mask = found
        kind, names, settings = self.optimizer.settings()
        state = [self.state[k].data_ptr() for k in names] + [0] * (3 - len(names))
        div, shards, q, r, boundary = self.partition.rule()
        stamps, stamp, times, time = self._native_stamps()
        return (
            ids, ids_offset, n, grads, grads_offset, kind, kernels.is_double(v), v.data_ptr(),
            *state, rows, self.dim, n_emb, div, shards, self.shard, q, r, boundary, *settings,
            keys, vals, mask, stamps, stamp, 0 if changed is None else changed.data_ptr(),
            times, time,
        )  # fmt: skip

    def _native_stamps(self) -> tuple[int, int, int, float]:
        """Where the kernel marks each updated row and with what (an int64 a row), and where it
        notes when (a float64 a row, a time to live's); addresses 0: nowhere."""
        return 0, 0, 0, 0.0

    def applied(self) -> None:
        """Counts an update the kernels made with :meth:`apply_job`'s job."""
        self.updates += 1

    # -- checks ------------------------------------------------------------------------------

    def check_ids(self, ids: Any) -> None:
        """Raises ``ValueError`` naming the table and the first bad id unless ``ids`` is a 1-D
        int64 tensor of unique ids, each in range (fixed tables) and on this shard."""
        name = self.spec.name
        if not isinstance(ids, torch.Tensor):
            raise ValueError(f"table {name!r}: ids must be a tensor, got {type(ids).__name__}")
        if ids.dtype != torch.int64:
            raise ValueError(f"table {name!r}: ids must be int64, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"table {name!r}: ids must be 1-D, got shape {list(ids.shape)}")
        if ids.numel() == 0:
            return
        if kernels.KERNELS is not None and ids.device.type == "cpu":
            self._check_ids_fused(ids.contiguous())
            return
        n = self.spec.num_embeddings
        bad = None
        if n is not None:
            bad = (ids < 0) | (ids >= n)
        if self.num_shards > 1:
            wrong = self.partition.shard_of(ids) != self.shard
            bad = wrong if bad is None else bad | wrong
        if bad is not None and bool(bad.any()):
            first = int(ids[bad.nonzero()[0, 0]])
            if n is not None and not 0 <= first < n:
                raise ValueError(f"table {name!r}: id {first} is out of range [0, {n})")
            raise ValueError(
                f"table {name!r}: id {first} is not on shard {self.shard} of {self.num_shards} "
                f"(it is on shard {int(self.partition.shard_of(ids.new_tensor([first]))[0])})"
            )
        if ids.numel() > 1:
            ordered = ids.sort().values
            same = ordered[1:] == ordered[:-1]
            if bool(same.any()):
                first = int(ordered[1:][same][0])
                raise ValueError(f"table {name!r}: id {first} appears more than once")

    def _check_ids_fused(self, ids: torch.Tensor) -> None:
        """:meth:`check_ids`' range, shard and uniqueness checks in one pass of the kernels,
        with the same errors."""
        k, p, name, n = kernels.KERNELS, self.partition, self.spec.name, self.spec.num_embeddings
        assert k is not None
        div, shards, q, r, boundary = p.rule()
        code, at = k.check_ids(
            ids.data_ptr(), ids.numel(), -1 if n is None else n, div, shards, self.shard, q, r,
            boundary,
        )  # fmt: skip
        if code == 0:
            return
        bad = int(ids[at])
        if code == 1:
            raise ValueError(f"table {name!r}: id {bad} is out of range [0, {n})")
        if code == 2:
            raise ValueError(
                f"table {name!r}: id {bad} is not on shard {self.shard} of {self.num_shards} "
                f"(it is on shard {int(p.shard_of(ids.new_tensor([bad]))[0])})"
            )
        raise ValueError(f"table {name!r}: id {bad} appears more than once")

    def _check_grads(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        name = self.spec.name
        if not isinstance(grads, torch.Tensor):
            raise ValueError(f"table {name!r}: gradients must be a tensor")
        if grads.dtype != self.dtype:
            raise ValueError(
                f"table {name!r}: gradients are {grads.dtype}, the table is {self.spec.dtype}"
            )
        if grads.shape != (ids.numel(), self.dim):
            raise ValueError(
                f"table {name!r}: gradients of shape {list(grads.shape)} for {ids.numel()} ids "
                f"of dim {self.dim}: expected {[ids.numel(), self.dim]}"
            )

    def _without_padding(
        self, ids: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pad = self.spec.padding_idx
        if pad is None:
            return ids, grads
        keep = ids != pad
        if bool(keep.all()):
            return ids, grads
        return ids[keep], grads[keep]

    def _snapshot_rows(
        self, ids: torch.Tensor, values: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Checks a snapshot's parts and keeps the rows of this shard."""
        name = self.spec.name
        state = {k.removeprefix(STATE_PREFIX): v for k, v in state.items()}
        expected = set(self.optimizer.state_names)
        if set(state) != expected:
            raise ValueError(
                f"table {name!r}: snapshot state {sorted(state)} does not match the "
                f"optimizer's {sorted(expected)}"
            )
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"table {name!r}: snapshot ids must be 1-D int64")
        rows = ids.numel()
        if values.shape != (rows, self.dim) or values.dtype != self.dtype:
            raise ValueError(
                f"table {name!r}: snapshot values {values.dtype} {list(values.shape)}, expected "
                f"{self.dtype} {[rows, self.dim]}"
            )
        fresh = self.optimizer.new_state(1, self.dim, self.dtype)
        for key, tensor in state.items():
            want = (rows, *fresh[key].shape[1:])
            if tensor.shape != want or tensor.dtype != fresh[key].dtype:
                raise ValueError(
                    f"table {name!r}: snapshot state {key!r} {tensor.dtype} "
                    f"{list(tensor.shape)}, expected {fresh[key].dtype} {list(want)}"
                )
        n = self.spec.num_embeddings
        if n is not None and rows and (bool((ids < 0).any()) or bool((ids >= n).any())):
            raise ValueError(f"table {name!r}: snapshot ids out of range [0, {n})")
        mine = self.partition.shard_of(ids) == self.shard
        if bool(mine.all()):
            return ids, values, state
        return ids[mine], values[mine], {k: v[mine] for k, v in state.items()}

    # -- the interface -----------------------------------------------------------------------

    @abstractmethod
    def lookup(
        self, ids: torch.Tensor, out: torch.Tensor | None = None, *, absent_zeros: bool = False
    ) -> torch.Tensor:
        """The rows of ``ids`` (unique, on this shard): a new ``[len(ids), dim]`` tensor, or
        ``out`` (of that shape and the table's dtype) filled. An id the table holds no row of
        (a hashed table's) reads its seeded initial row, or zeros with ``absent_zeros``."""

    @abstractmethod
    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Updates the rows of ``ids`` (unique, on this shard) with ``grads`` ``[n, dim]``,
        summed per id. The padding row is never updated."""

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows held."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Memory held: values, optimizer state and bookkeeping."""

    @property
    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: ``rows``, ``updates``, and for hashed tables ``admitted``,
        ``not_admitted``, ``evicted``, ``dropped_full``."""

    @abstractmethod
    def _begin_snapshot(self) -> RowSnapshot:
        """A :class:`RowSnapshot` of the storage's rows in use."""

    @abstractmethod
    def load(self, ids: torch.Tensor, values: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Takes the rows of this shard from a snapshot of any shard of any shard count
        (``state`` keyed by state name, with or without the ``opt/`` prefix); other rows stay."""
