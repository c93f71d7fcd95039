"""One shard's part of one sparse table: its rows and their row-wise optimizer state.

- :class:`FixedRows`: a table of ``num_embeddings`` rows; the shard holds its partition's rows
  in one dense tensor, all made at once.
- :class:`HashedRows`: a table of any int64 ids; a row is made the first time its id is updated
  (after ``min_count`` pushes), and past ``max_rows`` the least recently updated rows go.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

import torch

import psflow.sparse.kernels as kernels
from psflow import allocator
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse.idmap import IdMap
from psflow.sparse.init import initial_rows, splitmix64
from psflow.sparse.optim import RowOptimizer
from psflow.sparse.partition import Partition

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""A table's dtype names and their torch dtypes."""

STATE_PREFIX = "opt/"
"""Snapshot keys of the optimizer state: ``opt/<state name>``."""


class RowSnapshot:
    """A shard's rows of one table as they were at one moment, taken without a pause.

    Taking it copies nothing: it keeps references to the live tensors. Before the shard writes
    rows it has not copied yet, :meth:`preserve` copies those rows (what one update touches,
    a few thousand rows); :meth:`result`, in the thread that writes the checkpoint, copies the
    rest chunk by chunk. Each row's value and optimizer state are copied together, so they
    belong to the same moment (DeepRec-AI/DeepRec#1023 is what happens otherwise). A shard
    whose storage is replaced (a hashed table growing) leaves the old tensors unchanged, which
    is all a snapshot needs of them.
    """

    CHUNK_ROWS = 1 << 16
    """Rows copied at a time by :meth:`result`: how long the serving thread may wait on it."""

    def __init__(self, live: dict[str, torch.Tensor], rows: int, fixed: dict[str, torch.Tensor]):
        self._live = live
        self._rows = rows
        self._out = {k: torch.empty((rows, *t.shape[1:]), dtype=t.dtype) for k, t in live.items()}
        self._copied = torch.zeros(rows, dtype=torch.bool)
        self._fixed = fixed
        self._lock = threading.Lock()
        self.done = False

    def preserve(self, slots: torch.Tensor) -> None:
        """Copies the rows at ``slots`` that are not copied yet (call before writing them)."""
        if self.done:
            return
        with self._lock:
            if self.done:
                return
            slots = slots[slots < self._rows]
            fresh = slots[~self._copied[slots]]
            if fresh.numel():
                for key, live in self._live.items():
                    self._out[key][fresh] = live.index_select(0, fresh)
                self._copied[fresh] = True

    def result(self) -> dict[str, torch.Tensor]:
        """The snapshot, complete: copies the rows not copied yet (any thread)."""
        for start in range(0, self._rows, self.CHUNK_ROWS):
            stop = min(start + self.CHUNK_ROWS, self._rows)
            with self._lock:
                todo = ~self._copied[start:stop]
                if bool(todo.all()):
                    for key, live in self._live.items():
                        self._out[key][start:stop] = live[start:stop]
                elif bool(todo.any()):
                    where = todo.nonzero().squeeze(1).add_(start)
                    for key, live in self._live.items():
                        self._out[key][where] = live.index_select(0, where)
                self._copied[start:stop] = True
        with self._lock:
            self.done = True
            self._live = {}
        return {**self._fixed, **self._out}


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

    def begin_snapshot(self) -> RowSnapshot:
        """The rows as they are now, copied as they change and completed by
        :meth:`RowSnapshot.result` (see :class:`RowSnapshot`): serving does not pause."""
        snap = self._begin_snapshot()
        self._snapshots = [s for s in self._snapshots if not s.done] + [snap]
        return snap

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy: ``ids`` (the global ids held), ``values``, and ``opt/<state>``."""
        return self.begin_snapshot().result()

    def _preserve(self, slots: torch.Tensor) -> None:
        """Before rows at ``slots`` of the storage change: snapshots in progress keep them."""
        if self._snapshots:
            for snap in self._snapshots:
                snap.preserve(slots)
            self._snapshots = [s for s in self._snapshots if not s.done]

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
    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows of ``ids`` (unique, on this shard): a new ``[len(ids), dim]`` tensor, or
        ``out`` (of that shape and the table's dtype) filled."""

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

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.gather(self.values, kernels.local_index(ids, self.partition), out)

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


INITIAL_CAPACITY = 1024
"""Rows a hashed shard makes room for at first; it doubles as rows come (up to ``max_rows``)."""

_SKETCH_DEPTH = 4
_SKETCH_SALT = 0x632BE59BD9B4E019


class HashedRows(Rows):
    """The rows of a hashed table that one shard holds: any int64 id, rows made on demand.

    A row is created the first time its id is updated (a lookup of an unknown id returns its
    initial row without storing it). With ``min_count > 1`` an id's pushes are counted in a
    count-min sketch (fixed memory, conservative update, counts never under-estimated) and its
    gradients dropped until it has been pushed ``min_count`` times; the counts halve each time
    the sketch's width in pushes of unknown ids has gone by (TinyLFU's aging), so that an id
    has to come back while about ``16 * max_rows`` newcomers stream past, and the sketch never
    fills up (which would admit everything). With ``max_rows`` the shard keeps at most that
    many rows, evicting the least recently updated (never one the same push updates). The
    id -> row map is an :class:`~psflow.sparse.idmap.IdMap`, asked once per request with all
    its ids; everything is tensor operations.

    Example:
        >>> spec = TableSpec(name="ids", embedding_dim=4, num_embeddings=None, max_rows=2)
        >>> rows = HashedRows(spec, shard=0, num_shards=1)
        >>> for i in (7, 8, 9):
        ...     rows.apply(torch.tensor([i]), torch.ones(1, 4))
        >>> rows.num_rows, rows.stats["evicted"]
        (2, 1)
    """

    values: torch.Tensor
    state: dict[str, torch.Tensor]
    slot_ids: torch.Tensor
    """The global id in each slot (the first :attr:`num_rows` are used)."""
    last_update: torch.Tensor
    """The update count at which each slot was last updated (least recent: evicted first)."""

    def __init__(
        self,
        spec: TableSpec,
        shard: int,
        num_shards: int,
        *,
        optimizer: RowOptimizerSpec | None = None,
    ) -> None:
        if spec.num_embeddings is not None:
            raise ValueError(f"table {spec.name!r} has num_embeddings: use FixedRows")
        super().__init__(spec, shard, num_shards, optimizer=optimizer)
        self.max_rows = spec.max_rows
        capacity = (
            INITIAL_CAPACITY if self.max_rows is None else min(INITIAL_CAPACITY, self.max_rows)
        )
        self._n = 0
        self._index = IdMap()
        self._tick = 0
        self._alloc(capacity)
        self.counts = {"admitted": 0, "not_admitted": 0, "evicted": 0, "dropped_full": 0}
        self._sketch: torch.Tensor | None = None
        if spec.min_count > 1:
            target = 16 * (self.max_rows or 1 << 16)
            width = 1 << max(12, min(20, (target - 1).bit_length()))
            self._sketch = torch.zeros(_SKETCH_DEPTH * width, dtype=torch.int32)
            self._sketch_width = width
            self._sketch_pushes = 0
            self._sketch_salts = torch.arange(1, _SKETCH_DEPTH + 1, dtype=torch.int64) * (
                _SKETCH_SALT
            )
            self._sketch_rows = torch.arange(_SKETCH_DEPTH, dtype=torch.int64) * width

    # -- storage -----------------------------------------------------------------------------

    def _alloc(self, capacity: int) -> None:
        """Storage for ``capacity`` rows, the first ``self._n`` copied from the current one.
        The rest is left as allocated: a slot gets its row and state as it is taken
        (:meth:`_store` writes fresh ones; :meth:`load` every state key, as its check
        requires), and the pages of slots never taken stay untouched (a table that just
        doubled its capacity does not fill the new half)."""
        n = self._n
        values = allocator.table_empty((capacity, self.dim), self.dtype)
        state = self.optimizer.new_state(capacity, self.dim, self.dtype, filled=False)
        slot_ids = torch.empty(capacity, dtype=torch.int64)
        last = torch.zeros(capacity, dtype=torch.int64)
        if n:
            values[:n] = self.values[:n]
            for key, tensor in state.items():
                tensor[:n] = self.state[key][:n]
            slot_ids[:n] = self.slot_ids[:n]
            last[:n] = self.last_update[:n]
        self.values = values
        self.state = state
        self.slot_ids = slot_ids
        self.last_update = last

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, -1 for ids not held."""
        return self._index.get(ids)

    def _take_slots(self, count: int) -> torch.Tensor:
        """``count`` slots for new rows: free ones, by growing, or by evicting the least
        recently updated rows (the caller has marked the rows it is updating as recent)."""
        n = self._n
        evict = 0 if self.max_rows is None else max(0, n + count - self.max_rows)
        assert evict <= n
        parts = []
        if evict:
            old = torch.topk(self.last_update[:n], evict, largest=False, sorted=False).indices
            self._index.remove(self.slot_ids.index_select(0, old))
            self.counts["evicted"] += evict
            parts.append(old)
        fresh = count - evict
        if n + fresh > self.capacity:
            capacity = self.capacity
            while capacity < n + fresh:
                capacity *= 2
            if self.max_rows is not None:
                capacity = min(capacity, self.max_rows)
            self._alloc(capacity)
        parts.append(torch.arange(n, n + fresh, dtype=torch.int64))
        self._n = n + fresh
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _store(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Makes ``slots`` hold the initial rows of ``ids`` and fresh state."""
        self._preserve(slots)
        spec = self.spec
        self.values.index_copy_(
            0,
            slots,
            initial_rows(
                spec.seed,
                ids,
                self.dim,
                std=spec.init_std,
                dtype=self.dtype,
                padding_idx=spec.padding_idx,
            ),
        )
        self.optimizer.reset_rows(self.state, slots)
        self.slot_ids.index_copy_(0, slots, ids)
        self._index.put(ids, slots)

    def _admit(self, ids: torch.Tensor) -> torch.Tensor:
        """Counts one push of each of ``ids`` (unique); which have now been pushed
        ``min_count`` times (count-min estimate)."""
        sketch = self._sketch
        assert sketch is not None
        h = splitmix64(ids[None, :] + self._sketch_salts[:, None])
        cells = (h & (self._sketch_width - 1)).add_(self._sketch_rows[:, None])
        # Conservative update: each cell rises to the id's new estimate, no further; counts
        # saturate at min_count, all that admission needs.
        count = sketch[cells].amin(0).add_(1).clamp_(max=self.spec.min_count)
        sketch.scatter_reduce_(0, cells.view(-1), count.repeat(_SKETCH_DEPTH), reduce="amax")
        self._sketch_pushes += ids.numel()
        if self._sketch_pushes >= self._sketch_width:
            sketch.bitwise_right_shift_(1)
            self._sketch_pushes = 0
        return count >= self.spec.min_count

    # -- the interface -----------------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        slots = self._slots(ids)
        known = slots >= 0
        if bool(known.all()):
            return kernels.gather(self.values, slots, out)
        spec = self.spec
        rows = initial_rows(
            spec.seed,
            ids,
            self.dim,
            std=spec.init_std,
            dtype=self.dtype,
            padding_idx=spec.padding_idx,
        )
        if bool(known.any()):
            where = known.nonzero().squeeze(1)
            rows.index_copy_(0, where, kernels.gather(self.values, slots[where]))
        if out is None:
            return rows
        return out.copy_(rows)

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self._check_grads(ids, grads)
        ids, grads = self._without_padding(ids, grads)
        self._tick += 1
        self.updates += 1
        slots = self._slots(ids)
        unknown = slots < 0
        if bool(unknown.any()):
            known_slots = slots[~unknown]
            # Marked now, so that making room for the new rows never evicts these.
            self.last_update.index_fill_(0, known_slots, self._tick)
            new_pos = unknown.nonzero().squeeze(1)
            if self._sketch is not None:
                admitted = self._admit(ids[new_pos])
                self.counts["not_admitted"] += int(admitted.numel() - admitted.sum())
                new_pos = new_pos[admitted]
            if self.max_rows is not None:
                room = self.max_rows - known_slots.numel()
                if new_pos.numel() > room:
                    self.counts["dropped_full"] += new_pos.numel() - room
                    new_pos = new_pos[:room]
            if new_pos.numel():
                new_slots = self._take_slots(new_pos.numel())
                self._store(ids[new_pos], new_slots)
                slots[new_pos] = new_slots
                self.counts["admitted"] += new_pos.numel()
            keep = slots >= 0
            if not bool(keep.all()):
                slots, grads = slots[keep], grads[keep]
        self._preserve(slots)
        self.optimizer.apply(self.values, self.state, slots, grads)
        self.last_update.index_fill_(0, slots, self._tick)

    @property
    def num_rows(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        tensors = [self.values, self.slot_ids, self.last_update, *self.state.values()]
        if self._sketch is not None:
            tensors.append(self._sketch)
        return sum(t.nbytes for t in tensors) + self._index.nbytes

    @property
    def stats(self) -> dict[str, int]:
        return {"rows": self._n, "capacity": self.capacity, "updates": self.updates, **self.counts}

    def _begin_snapshot(self) -> RowSnapshot:
        live = {
            "ids": self.slot_ids,
            "values": self.values,
            **{STATE_PREFIX + k: v for k, v in self.state.items()},
        }
        return RowSnapshot(live, self._n, {})

    def give(
        self, ids: torch.Tensor, values: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Rows given by id (``TableModule.load_rows``): :meth:`load` with ``state``, or with
        a fresh row's state when none is given."""
        if not state:
            state = self.optimizer.new_state(ids.numel(), self.dim, self.dtype)
        self.load(ids, values, state)

    def load(self, ids: torch.Tensor, values: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        ids, values, state = self._snapshot_rows(ids, values, state)
        if ids.numel() == 0:
            return
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"table {self.spec.name!r}: snapshot ids repeat")
        self._tick += 1
        slots = self._slots(ids)
        unknown = slots < 0
        if bool(unknown.any()):
            self.last_update.index_fill_(0, slots[~unknown], self._tick)
            new_pos = unknown.nonzero().squeeze(1)
            if self.max_rows is not None:
                room = self.max_rows - int((~unknown).sum())
                if new_pos.numel() > room:
                    self.counts["dropped_full"] += new_pos.numel() - room
                    new_pos = new_pos[:room]
            new_slots = self._take_slots(new_pos.numel())
            new_ids = ids[new_pos]
            self._preserve(new_slots)
            self.slot_ids.index_copy_(0, new_slots, new_ids)
            self._index.put(new_ids, new_slots)
            slots[new_pos] = new_slots
            keep = slots >= 0
            if not bool(keep.all()):
                slots, values = slots[keep], values[keep]
                state = {k: v[keep] for k, v in state.items()}
        self._preserve(slots)
        self.values.index_copy_(0, slots, values)
        for key, tensor in state.items():
            self.state[key].index_copy_(0, slots, tensor)
        self.last_update.index_fill_(0, slots, self._tick)


def make_rows(
    spec: TableSpec, shard: int, num_shards: int, *, optimizer: RowOptimizerSpec | None = None
) -> Rows:
    """:class:`FixedRows` or :class:`HashedRows`, as the spec says."""
    cls = HashedRows if spec.hashed else FixedRows
    return cls(spec, shard, num_shards, optimizer=optimizer)
