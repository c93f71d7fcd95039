"""A table in eval mode, and what tracing and exporting a table may record.

- :class:`FrozenTable`, a base of :class:`~psflow.nn.table.TableModule`: in eval mode a hashed
  table held here reads a :class:`Snapshot` of its rows (zeros for an id it does not hold), and
  a forward pass being recorded (``torch.jit.trace``, ``torch.export``, ONNX) that could not be
  recorded exactly is refused with what to do instead; ``torch.jit.script`` is refused.
- :class:`Snapshot` and :func:`snapshot_index`: a hashed table's rows fixed at one moment, and
  a batch's ids turned into rows of it in plain tensor operations (a sorted search), which
  the tracers and exporters record as they are.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from psflow.nn.config import TableConfig
from psflow.nn.state import TableState
from psflow.sparse import HashedRows


def traced() -> bool:
    """Whether this forward pass is being recorded rather than run: ``torch.jit.trace``
    (and the TorchScript-based ONNX export), ``torch.export`` (and the ONNX export built on
    it), ``torch.compile``. Only plain tensor operations on the inputs, parameters and
    constants are recorded then: no kernel that writes through a data pointer, no decision
    taken on an id's value."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


ABSENT_KEY = torch.iinfo(torch.int64).max
"""The key that closes a :class:`Snapshot`'s ``keys``: every id sorts at or before it."""


class Snapshot(NamedTuple):
    """A hashed table's rows at one moment, as a lookup of plain tensors.

    ``keys`` are the ids held, sorted, then :data:`ABSENT_KEY`; ``table`` their rows in that
    order, then two rows of zeros: row ``len(keys) - 1`` for an id not held, row
    ``len(keys)`` for the padding id (apart, so that ``F.embedding_bag`` can leave the padding
    id out of a bag's mean while an id not held counts as a zero row in it)."""

    keys: torch.Tensor
    table: torch.Tensor

    @property
    def absent(self) -> int:
        """The row of an id the snapshot does not hold (zeros)."""
        return self.keys.numel() - 1

    @property
    def padding(self) -> int:
        """The row of the padding id (zeros)."""
        return self.keys.numel()

    @classmethod
    def of(cls, ids: torch.Tensor | None, rows: torch.Tensor, dim: int) -> Snapshot:
        """The snapshot of ``rows`` (``[len(ids), dim]``) held for ``ids`` (unique; ``None``:
        none held, ``rows`` then gives only the dtype)."""
        if ids is None or not ids.numel():
            keys = torch.tensor([ABSENT_KEY], dtype=torch.int64)
            return cls(keys, rows.new_zeros(2, dim))
        order = torch.argsort(ids)
        # An id equal to ABSENT_KEY itself is found first (searchsorted's left side), before
        # the closing key.
        keys = torch.cat([ids.index_select(0, order), ids.new_tensor([ABSENT_KEY])])
        table = torch.cat([rows.index_select(0, order), rows.new_zeros(2, dim)])
        return cls(keys.contiguous(), table.contiguous())

    def to(self, device: torch.device) -> Snapshot:
        return Snapshot(self.keys.to(device), self.table.to(device))


def snapshot_index(snap: Snapshot, ids: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """Each of ``ids`` (any shape, int64 or int32) as its row of ``snap.table``: the row
    held for it, :attr:`Snapshot.absent` where none is, :attr:`Snapshot.padding` for the
    padding id. Shaped as ``ids``, int64."""
    flat = ids.reshape(-1).to(torch.int64)
    keys = snap.keys
    if torch.onnx.is_in_onnx_export():
        pos = _lower_bound(keys, flat)  # ONNX has no sorted search: a fixed-step bisection
    else:
        pos = torch.searchsorted(keys, flat)
    # pos <= len(keys) - 1 always: nothing sorts after the closing ABSENT_KEY.
    hit = keys.index_select(0, pos) == flat
    index = torch.where(hit, pos, snap.absent)
    if padding_idx is not None:
        index = torch.where(flat == padding_idx, snap.padding, index)
    return index.view(ids.shape)


def _lower_bound(keys: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``torch.searchsorted(keys, flat)`` (``keys`` sorted, closed by ``ABSENT_KEY``) as
    ``log2(len(keys))`` gathers and compares, ops every ONNX runtime has."""
    count = int(keys.shape[0])  # an int, also where a tracer records sizes
    size = 1 << max(0, (count - 1).bit_length())
    padded = torch.cat([keys, keys.new_full((size - count,), ABSENT_KEY)])
    pos = torch.zeros_like(flat)
    step = size >> 1
    while step:
        cand = pos + step
        pos = torch.where(padded.index_select(0, cand - 1) < flat, cand, pos)
        step >>= 1
    return pos


class FrozenTable(TableState):
    """A table's eval mode, and its checks for a forward pass that is recorded (see the module
    docstring); :class:`~psflow.nn.table.TableModule` adds the lookups.

    Args:
        config: the table.
        on_meta: whether the module was built on the meta device (it holds no rows).
    """

    def __init__(self, config: TableConfig, on_meta: bool) -> None:
        super().__init__(config, on_meta)
        self._frozen: tuple[Any, ...] | None = None
        """The last eval-mode snapshot of a hashed table, with what it was taken from."""
        self._frozen_moved: tuple[Snapshot, torch.device, Snapshot] | None = None

    def _snapshot(self, device: torch.device) -> Snapshot | None:
        """The rows of a local hashed table in eval mode as a :class:`Snapshot`; ``None``
        where the forward pass goes on as usual. A traced or exported forward pass that cannot
        be recorded exactly is refused here."""
        if traced():
            self._check_traceable()
        if self.num_embeddings is not None or self.training or self._source is not None:
            return None
        if self._on_meta:
            return None  # the usual path says it holds no rows
        snap = self._current_snapshot()
        if snap is None:
            if torch.compiler.is_compiling():
                # Taken here, the sort of every row would be recorded into the program.
                raise RuntimeError(
                    f"{self._label()}: its rows changed since model.eval(); call model.eval() "
                    "again (it takes their snapshot) before exporting or compiling"
                )
            recording = torch._C._get_tracing_state()
            torch._C._set_tracing_state(None)  # type: ignore[attr-defined]  # taken, not recorded
            try:
                snap = self._take_snapshot()
            finally:
                torch._C._set_tracing_state(recording)  # type: ignore[attr-defined]
        if device.type == "cpu":
            return snap
        moved = self._frozen_moved  # the copy on the batch's device, made once a snapshot
        if moved is None or moved[0] is not snap or moved[1] != device:
            self._frozen_moved = moved = (snap, device, snap.to(device))
        return moved[2]

    def _snapshot_key(self) -> tuple[Any, ...]:
        fused = self._fused
        store = None if fused is None else fused.store
        version = store.version if isinstance(store, HashedRows) else None
        return (fused, version, self._held_ids)

    def _current_snapshot(self) -> Snapshot | None:
        """The snapshot taken last, if the rows have not changed since."""
        cached = self._frozen
        if cached is None:
            return None
        key = self._snapshot_key()
        fresh = cached[0] is key[0] and cached[1] == key[1] and cached[2] is key[2]
        return cached[3] if fresh else None

    def _take_snapshot(self) -> Snapshot:
        held = self.held()
        if held is None:
            empty = torch.empty(0, self.embedding_dim, dtype=self._dtype)
            snap = Snapshot.of(None, empty, self.embedding_dim)
        else:
            snap = Snapshot.of(held.ids, held.rows.to(self._dtype), self.embedding_dim)
        self._frozen = (*self._snapshot_key(), snap)
        return snap

    def _refresh_snapshot(self) -> None:
        """Takes the eval-mode snapshot now, so that a forward pass recorded later reads it
        (and does not record taking it)."""
        if (
            self.num_embeddings is None
            and not self.training
            and self._source is None
            and not self._on_meta
            and self._current_snapshot() is None
        ):
            self._take_snapshot()

    def train(self, mode: bool = True) -> FrozenTable:
        """torch's; going to eval mode, a local hashed table takes its rows' snapshot."""
        super().train(mode)
        self._refresh_snapshot()
        return self

    def load_rows(
        self,
        ids: torch.Tensor,
        rows: torch.Tensor,
        optimizer_state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().load_rows(ids, rows, optimizer_state)
        self._refresh_snapshot()

    def _check_traceable(self) -> None:
        """Refuses a traced or exported forward pass that could not be recorded exactly."""
        doing = "traced or exported (torch.jit.trace, torch.export, torch.onnx, torch.compile)"
        if self._source is not None:
            raise RuntimeError(
                f"{self._label()} cannot be {doing}: it is attached, its rows are on the "
                "parameter servers and each batch asks them for its own; trace a model "
                "built without a job that holds the rows (load a checkpoint's state dict "
                "into it, e.g. one from `psflow checkpoint export`), in eval mode"
            )
        if self._on_meta:
            raise RuntimeError(
                f"{self._label()} cannot be {doing}: it was built on the meta device and "
                "holds no rows; load them first (load_state_dict)"
            )
        if self.num_embeddings is None and self.training:
            raise RuntimeError(
                f"{self._label()} cannot be {doing} in training mode: a hashed table then "
                "makes rows for new ids and trains them in the backward pass, which a "
                "recorded graph cannot do; call model.eval() first (the recorded lookup "
                "reads the rows held, zeros for an id not held)"
            )

    def __prepare_scriptable__(self) -> FrozenTable:
        """``torch.jit.script`` calls this on every module it is given: refused, with what to
        use instead (the lookup is Python that TorchScript cannot compile)."""
        raise RuntimeError(
            f"{self._label()} cannot be compiled by torch.jit.script: its lookup (hashed ids, "
            "row sources, TensorFlow's combiners) is Python that TorchScript does not take. "
            "Record the model instead, in eval mode: torch.jit.trace(model.eval(), example) "
            "or torch.export.export(model.eval(), example) (or torch.onnx.export), which give "
            "its eager outputs exactly; script the rest of a model around a traced part"
        )
