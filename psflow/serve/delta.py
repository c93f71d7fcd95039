"""Incremental exports as a model server reads them: a base, then deltas, applied in order.

The format (an export's directory, its shard files and its manifest) and its reading are
:mod:`psflow.serve.manifest`'s; the exports in a directory and their chains
:mod:`psflow.serve.listing`'s; a shard file's reading :mod:`psflow.serve.shard_file`'s; a
delta's merge into a table :mod:`psflow.serve.merge`'s. Their public names are importable from
here too.

:class:`ExportedModel` applies a base and then each delta, refusing a delta that does not
follow the export it holds or belongs to another base; :meth:`ExportedModel.load` reads the
newest export's chain, :meth:`ExportedModel.follow` what landed since. Whatever does not hold
together is refused with an :class:`ExportError` naming the export and what is wrong (a
manifest field, a non-finite tensor, a dense piece not where the manifest puts it, a
fixed-size table without exactly its rows, a delta that changes a table's spec), never served;
an export whose manifest cannot be read blocks only what needs it (logged once otherwise). An id a table does not
hold reads a row of zeros (:meth:`ExportedModel.lookup`), as ``psflow.nn`` tables do in eval
mode. This module imports torch, safetensors and fsspec only (no ZeroMQ, no
``torch.distributed``, nothing of psflow's runtime).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from psflow.serve.listing import _log_damaged, _scan, chain, damaged_exports, list_exports
from psflow.serve.manifest import (
    _DTYPES,
    EXPORT_META,
    EXPORT_RE,
    FORMAT,
    MANIFEST,
    Export,
    ExportError,
    _join,
    dense_tensor_name,
    export_dir_name,
    export_shard_file_name,
    read_export,
    table_export_tensor_name,
)
from psflow.serve.merge import _merge
from psflow.serve.shard_file import _read_shard_file

__all__ = [
    "EXPORT_META",
    "EXPORT_RE",
    "FORMAT",
    "MANIFEST",
    "Export",
    "ExportError",
    "ExportedModel",
    "chain",
    "damaged_exports",
    "dense_tensor_name",
    "export_dir_name",
    "export_shard_file_name",
    "list_exports",
    "read_export",
    "table_export_tensor_name",
]

_TABLE_PARTS = ("ids", "values", "tombstones")


def _check_1d_ids(t: torch.Tensor | None, what: str) -> torch.Tensor:
    if t is None or t.dtype != torch.int64 or t.dim() != 1:
        raise ExportError(f"{what} must be a 1-D int64 tensor")
    return t


class ExportedModel:
    """A served model's dense parameters and tables, as a base and its deltas made them.

    Example:
        >>> # model = ExportedModel.load("exports/")      # the newest export's chain
        >>> # model.lookup("users", torch.tensor([7, 12]))  # rows; zeros for an id not held
        >>> # model.follow("exports/")                    # apply what landed since
    """

    def __init__(self) -> None:
        self.seq: int | None = None
        """The last export applied."""
        self.base: int | None = None
        """Its base."""
        self.step: int | None = None
        """The global step of the last export applied."""
        self.dense: dict[str, torch.Tensor] = {}
        """Each dense parameter, whole, by its name in the model."""
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """Each table's ids held (sorted) and their rows."""
        self.specs: dict[str, Mapping[str, Any]] = {}
        """Each table's spec (``TableSpec.to_wire()``)."""

    @classmethod
    def load(cls, export_dir: str, upto: int | None = None) -> ExportedModel:
        """The model of the newest complete export (or of export ``upto``): its base and
        every delta up to it, applied in order."""
        model = cls()
        for export in chain(export_dir, upto):
            model.apply(export)
        return model

    def follow(self, export_dir: str) -> list[int]:
        """Applies the complete exports newer than the one held, in order (a newer base's
        chain when the held one was superseded); returns the exports applied.

        Raises:
            ExportError: when an export newer than the one held (after applying what can
                be) cannot be read or applied.
        """
        exports, bad = _scan(export_dir)
        newer = [e for e in exports.values() if self.seq is None or e.seq > self.seq]
        todo: list[Export] = []
        if newer:
            todo = chain(export_dir, newer[-1].seq)
            if self.seq is not None and self.base == todo[0].seq:
                todo = [e for e in todo if e.seq > self.seq]
            for export in todo:
                self.apply(export)
        _log_damaged(bad)
        ahead = [seq for seq in bad if self.seq is None or seq > self.seq]
        if ahead:
            held = "none" if self.seq is None else export_dir_name(self.seq)
            raise ExportError(f"{bad[ahead[-1]]} (the model holds {held})")
        return [e.seq for e in todo]

    def apply(self, export: Export) -> None:
        """Applies one export: a base replaces everything; a delta must follow the export held
        (its ``since``) of the same base. The model is unchanged when it raises.

        Raises:
            ExportError: for a delta out of order or of another base, or an export whose files
                are missing, unreadable or do not match its manifest.
        """
        if export.since is not None:
            if self.seq is None:
                raise ExportError(
                    f"{export.name} is a delta of base {export_dir_name(export.base)}: apply "
                    "that base first"
                )
            if export.base != self.base:
                raise ExportError(
                    f"{export.name} is a delta of base {export_dir_name(export.base)}; this "
                    f"model holds base {export_dir_name(self.base or 0)}: refused"
                )
            if export.since != self.seq:
                raise ExportError(
                    f"{export.name} follows {export_dir_name(export.since)}; this model holds "
                    f"{export_dir_name(self.seq)}: apply the exports in order"
                )
        try:
            self._apply(export)
        except ExportError:
            raise
        except (RuntimeError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # A check missed: still refused, and named.
            raise ExportError(f"{export.url}: cannot be applied: {type(e).__name__}: {e}") from e

    def _apply(self, export: Export) -> None:
        m = export.manifest
        # Where each dense piece is: the ps the manifest names, and only there.
        placed = {(p["shard"], p["var"]) for entry in m["dense"].values() for p in entry["pieces"]}
        pieces: dict[tuple[int, str], torch.Tensor] = {}
        parts: dict[str, list[dict[str, torch.Tensor]]] = {t: [] for t in m["tables"]}
        for shard, name in enumerate(m["files"]):
            url = _join(export.url, str(name))
            tensors, meta = _read_shard_file(url)
            want = {"seq": export.seq, "base": export.base, "since": export.since, "shard": shard}
            got = {k: meta.get(k) for k in want}
            if got != want:
                raise ExportError(f"{url}: the file is of {got}, the manifest of {want}")
            mine: dict[str, dict[str, torch.Tensor]] = {t: {} for t in parts}
            for tname, t in tensors.items():
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise ExportError(
                        f"{url}: tensor {tname!r} is not finite (NaN or infinity): refused"
                    )
                kind, _, rest = tname.partition("/")
                table, _, part = rest.rpartition("/")
                if kind == "dense":
                    if (shard, rest) not in placed:
                        raise ExportError(
                            f"{url}: dense tensor {tname!r} is no piece the manifest places on "
                            f"ps:{shard}"
                        )
                    pieces[(shard, rest)] = t
                elif kind == "table" and table in mine and part in _TABLE_PARTS:
                    mine[table][part] = t
                else:
                    raise ExportError(f"{url}: unexpected tensor {tname!r}")
            for table, got_parts in mine.items():
                parts[table].append(got_parts)
        if export.since is not None:
            lost = sorted(set(self.tables) - set(m["tables"]))
            if lost:
                raise ExportError(
                    f"{export.url}: a delta without table(s) {lost} its base holds: refused"
                )
        dense = self._dense(export, pieces)
        tables = {}
        for table, spec in m["tables"].items():
            tables[table] = self._table(export, table, spec, parts[table])
        self.dense, self.tables, self.specs = dense, tables, dict(m["tables"])
        self.seq, self.base, self.step = export.seq, export.base, export.step

    def _dense(
        self, export: Export, pieces: Mapping[tuple[int, str], torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out = {}
        for param, entry in export.manifest["dense"].items():
            where = f"{export.url}: parameter {param!r}"
            shape, dtype = tuple(entry["shape"]), entry["dtype"]
            held = sorted(entry["pieces"], key=lambda p: (p["rows"] or [0])[0])
            ts = []
            for p in held:
                t = pieces.get((p["shard"], p["var"]))
                if t is None:
                    raise ExportError(
                        f"{where}: its piece {p['var']!r} is not in ps:{p['shard']}'s file"
                    )
                rows = p["rows"]
                want = shape if rows is None else (rows[1] - rows[0], *shape[1:])
                if tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != dtype:
                    raise ExportError(
                        f"{where}: its piece {p['var']!r} of ps:{p['shard']} (rows {rows}) is "
                        f"{list(t.shape)} {t.dtype}, the manifest says {list(want)} {dtype}"
                    )
                ts.append(t)
            out[param] = ts[0] if len(ts) == 1 else torch.cat(ts)
        return out

    def _table(
        self,
        export: Export,
        table: str,
        spec: Mapping[str, Any],
        parts: list[dict[str, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        where = f"{export.url}: table {table!r}"
        dim, dtype = spec["embedding_dim"], _DTYPES[spec["dtype"]]
        size = spec.get("num_embeddings")
        if export.since is not None:
            if table not in self.tables:
                raise ExportError(f"{where}: a delta of a table its base does not hold")
            held = self.specs[table]
            for key in ("embedding_dim", "dtype", "num_embeddings"):
                if held.get(key) != spec.get(key):
                    raise ExportError(
                        f"{where}: the delta's {key!r} is {spec.get(key)!r}, its base's "
                        f"{held.get(key)!r}: a delta cannot change it (export a base)"
                    )
        if len(parts) != export.manifest["num_shards"]:
            raise ExportError(f"{where}: in {len(parts)} files of {export.manifest['num_shards']}")
        ids = torch.cat([_check_1d_ids(p.get("ids"), f"{where} ids") for p in parts])
        gone = torch.cat([_check_1d_ids(p.get("tombstones"), f"{where} tombstones") for p in parts])
        values = [p.get("values") for p in parts]
        if any(v is None or v.dtype != dtype or v.dim() != 2 or v.shape[1] != dim for v in values):
            raise ExportError(f"{where}: values must be [n, {dim}] {dtype}")
        rows = torch.cat(values)  # type: ignore[arg-type]
        if rows.shape[0] != ids.numel() or ids.unique().numel() != ids.numel():
            raise ExportError(f"{where}: {ids.numel()} ids (unique?) for {rows.shape[0]} rows")
        if gone.numel() and bool(torch.isin(gone, ids).any()):
            bad = int(gone[torch.isin(gone, ids)][0])
            raise ExportError(f"{where}: id {bad} is both written and evicted (a tombstone)")
        if size is not None:
            # A fixed-size table holds every id in 0..size-1, always: never fewer, never
            # others, never evicted.
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise ExportError(f"{where}: id {bad} is out of the range of its {size} rows")
            if gone.numel():
                raise ExportError(
                    f"{where}: tombstones (id {int(gone[0])}) for a fixed-size table, which "
                    "evicts nothing"
                )
            if export.since is None and ids.numel() != size:
                raise ExportError(
                    f"{where}: a base of a fixed-size table of {size} rows holds "
                    f"{ids.numel()} of them"
                )
        if export.since is not None:
            return _merge(*self.tables[table], ids, rows, gone)
        order = ids.argsort()
        return ids[order], rows[order]

    def lookup(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` (int64, any shape): the table's, zeros for an id not held."""
        held, rows = self.tables[table]
        flat = ids.reshape(-1)
        at = torch.searchsorted(held, flat).clamp_(max=max(held.numel() - 1, 0))
        out = torch.zeros((flat.numel(), rows.shape[1]), dtype=rows.dtype)
        if held.numel():
            hit = held[at] == flat
            out[hit] = rows[at[hit]]
        return out.reshape(*ids.shape, rows.shape[1])
