"""The checks every reader of a psflow checkpoint makes, in one place: ``psflow checkpoint
inspect`` and ``export``, the chief's restore, the evaluator and the alone mode's restore all
read a checkpoint through :func:`~psflow.train.checkpoint_read.load_checkpoint`, which makes
them, so none accepts what another refuses.

What is checked, before anything is sized by it:

- the manifest's own fields (:func:`check_manifest`): each parameter's ``shape`` and
  ``dtype``, each variable named once with a known dtype, each table's ``spec`` (a
  :class:`~psflow.protocol.TableSpec`), ``rows`` and ``bytes``;
- the buffers file (:func:`check_buffers`): exactly the buffers the manifest lists, each of
  its dtype and shape;
- each shard file against its place (:func:`check_shard_file`): its shard index and count;
- each parameter's parts (:func:`check_parts`): by intervals, not counts: row ranges that
  tile ``[0, rows)`` exactly once, each part of the rows, dtype and shape its entry and the
  manifest's parameter say;
- each table's rows (:func:`check_tables`): ids 1-D int64, values of the spec's dtype and
  width, every id once over all the shard files, and a fixed-size table's ids exactly
  ``0 .. num_embeddings - 1`` (counted before the table is allocated: the files, not the
  manifest, bound what a reader allocates).

Every error is a ``ValueError`` naming the checkpoint's file and the tensor, table or field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.ps.shard_file import ShardFile
from psflow.ps.tables import TABLE_PREFIX, split_table_tensor_name
from psflow.sparse import kernels
from psflow.sparse.optim import RowOptimizer
from psflow.sparse.partition import Partition
from psflow.train.manifest import Manifest, VariableEntry
from psflow.transport.wire import DTYPES

__all__ = [
    "TableParts",
    "check_buffers",
    "check_manifest",
    "check_parts",
    "check_shard_file",
    "check_tables",
]

TableParts = dict[str, list[dict[str, torch.Tensor]]]
"""Per table, one map (``ids``, ``values``, ``opt/<key>``) per shard file that holds rows."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sizes(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(d) and d >= 0 for d in x)


def check_manifest(manifest: Manifest, source: str) -> dict[str, TableSpec]:
    """The manifest's parameters, variables and tables checked; its tables' specs, by name.

    Raises:
        ValueError: naming ``source`` (the manifest) and the field.
    """
    for param, meta in manifest.params.items():
        shape, dtype = meta.get("shape"), meta.get("dtype")
        if shape is not None and not _sizes(shape):
            raise ValueError(f"{source}: params.{param}.shape = {shape!r} is not a list of sizes")
        if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPES):
            raise ValueError(f"{source}: params.{param}.dtype = {dtype!r} is not a dtype")
    for buffer, meta in (manifest.buffers or {}).items():
        shape, dtype = meta.get("shape"), meta.get("dtype")
        if not _sizes(shape):
            raise ValueError(f"{source}: buffers.{buffer}.shape = {shape!r} is not a list of sizes")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"{source}: buffers.{buffer}.dtype = {dtype!r} is not a dtype")
    seen: set[str] = set()
    for v in manifest.variables:
        if v.var in seen:
            raise ValueError(f"{source}: variable {v.var!r} is listed twice")
        seen.add(v.var)
        if not isinstance(v.dtype, str) or v.dtype not in DTYPES:
            raise ValueError(f"{source}: variable {v.var!r} has dtype {v.dtype!r}")
    specs = {}
    for table, entry in manifest.tables.items():
        where = f"{source}: tables.{table}"
        if "spec" not in entry:
            raise ValueError(f"{where} has no spec")
        try:
            spec = TableSpec.from_wire(entry["spec"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{where}.spec: {e}") from None
        if spec.name != table:
            raise ValueError(f"{where}.spec names table {spec.name!r}")
        for key in ("rows", "bytes"):
            if not _is_int(entry.get(key)) or entry[key] < 0:
                raise ValueError(f"{where}.{key} = {entry.get(key)!r} is not a count")
        specs[table] = spec
    return specs


def check_buffers(
    tensors: dict[str, torch.Tensor], manifest: Manifest, url: str, manifest_url: str
) -> None:
    """The buffers file read from ``url`` holds exactly the manifest's buffers, each of the
    dtype and shape the manifest gives it.

    Raises:
        ValueError: naming the file and the buffer.
    """
    listed = manifest.buffers or {}
    missing = sorted(set(listed) - set(tensors))
    if missing:
        raise ValueError(f"{url} lacks buffers {missing}, which {manifest_url} lists")
    extra = sorted(set(tensors) - set(listed))
    if extra:
        raise ValueError(f"{url} holds buffers {extra}, which {manifest_url} does not list")
    for name, t in tensors.items():
        meta = listed[name]
        if list(t.shape) != meta["shape"] or _name_of(t.dtype) != meta["dtype"]:
            raise ValueError(
                f"{url}: buffer {name!r} is {_name_of(t.dtype)}{list(t.shape)}, the manifest "
                f"says {meta['dtype']}{meta['shape']}"
            )


def check_shard_file(shard: ShardFile, index: int, num_shards: int, url: str) -> None:
    """A shard file's own account of its place agrees with its name and the manifest's, and
    its floating-point values are finite, as a ps saves them (it refuses to save others)."""
    if (shard.shard, shard.num_shards) != (index, num_shards):
        raise ValueError(
            f"{url}: the file says it is shard {shard.shard} of {shard.num_shards}; the "
            f"manifest and its name, {index} of {num_shards}"
        )
    for name, t in shard.tensors.items():
        if t.is_floating_point() and not _finite(t):
            raise ValueError(
                f"{url}: {name!r} holds a value that is not finite, which no ps saves "
                "(a damaged or altered file)"
            )


def _finite(t: torch.Tensor) -> bool:
    finite = kernels.native_finite(t)  # at reading speed where the kernels take it
    return bool(torch.isfinite(t).all()) if finite is None else finite


def check_parts(
    param: str,
    entries: list[VariableEntry],
    values: list[torch.Tensor],
    manifest: Manifest,
    where: str,
) -> None:
    """The parts of ``param`` (entries sorted by their first row) fit it exactly once.

    Raises:
        ValueError: naming ``where`` (the files) and the variable.
    """
    meta = manifest.params.get(param, {})
    for e, value in zip(entries, values, strict=True):
        dtype = _name_of(value.dtype)
        if list(value.shape) != list(e.shape):
            raise ValueError(
                f"{where}: {e.var!r} has shape {list(value.shape)}, the manifest says {e.shape}"
            )
        if dtype != e.dtype or dtype != meta.get("dtype", dtype):
            raise ValueError(
                f"{where}: {e.var!r} is {dtype}, the manifest says {e.dtype}"
                + (f" (parameter {param!r}: {meta['dtype']})" if "dtype" in meta else "")
            )
    whole = [e for e in entries if e.rows is None]
    if whole and len(entries) > 1:
        raise ValueError(
            f"{where}: {param!r} is saved whole ({whole[0].var!r}) and in {len(entries) - 1} "
            "other parts"
        )
    shape = meta.get("shape")
    if whole:
        if shape is not None and list(whole[0].shape) != list(shape):
            raise ValueError(
                f"{where}: {whole[0].var!r} has shape {whole[0].shape}, the manifest's "
                f"parameter {param!r} {shape}"
            )
        return
    end = 0
    for e in entries:
        assert e.rows is not None
        begin, stop = e.rows
        if begin != end:
            gap = "overlap" if begin < end else "leave rows out between them"
            raise ValueError(
                f"{where}: the parts of {param!r} {gap}: {e.var!r} holds rows {begin}:{stop}, "
                f"the part before ended at row {end}"
            )
        if not e.shape or e.shape[0] != stop - begin:
            raise ValueError(
                f"{where}: {e.var!r} holds rows {begin}:{stop} of {param!r} in shape {e.shape}"
            )
        end = stop
    if shape is not None and (not shape or shape[0] != end):
        raise ValueError(
            f"{where}: the parts of {param!r} hold rows 0:{end}, the manifest's shape is {shape}"
        )


def _name_of(dtype: torch.dtype) -> str:
    return next((n for n, d in DTYPES.items() if d == dtype), str(dtype))


def check_tables(
    name: str, specs: dict[str, TableSpec], files: list[tuple[str, ShardFile]]
) -> TableParts:
    """Every table's rows in the shard ``files`` (``(url, file)``), checked against the
    manifest's ``specs``; per table, one map per file that holds rows of it.

    Raises:
        ValueError: naming the file and the table (and an id) of the first problem.
    """
    check = TableCheck(name, specs)
    for url, shard in files:
        check.add(url, shard)
    return check.result()


class TableCheck:
    """:func:`check_tables` a file at a time: each file's rows checked as it comes
    (:meth:`add`), then every table's ids over all of them (:meth:`result`). With
    ``keep_rows=False`` only the ids are kept of each file, so a reader that does not need the
    rows (the chief restoring a job whose ps read their own) never holds a table whole."""

    def __init__(self, name: str, specs: dict[str, TableSpec], *, keep_rows: bool = True) -> None:
        self.name, self.specs, self.keep_rows = name, specs, keep_rows
        self.parts: TableParts = {table: [] for table in specs}
        self.urls: dict[str, list[str]] = {table: [] for table in specs}

    def add(self, url: str, shard: ShardFile) -> None:
        """Checks the rows ``shard`` (read from ``url``) holds of every table.

        Raises:
            ValueError: naming the file and the table of the first problem.
        """
        name, specs = self.name, self.specs
        saved_specs = _saved_specs(shard, url)
        lacking = sorted(set(saved_specs) - set(specs))
        if lacking:
            raise ValueError(f"{url}: holds tables {lacking}, which {name}'s manifest lacks")
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in shard.tensors.items():
            if not key.startswith(TABLE_PREFIX):
                continue
            split = split_table_tensor_name(key)
            if split is None:
                raise ValueError(f"{url}: {key!r} is no table's ids, values or opt/<state>")
            grouped.setdefault(split[0], {})[split[1]] = tensor
        for table, part in grouped.items():
            spec = specs.get(table)
            if spec is None:
                raise ValueError(f"{url}: rows of table {table!r}, which {name}'s manifest lacks")
            saved = saved_specs.get(table)
            if saved != spec:
                raise ValueError(f"{url}: table {table!r}: {_differ(saved, spec)}")
            _check_part(part, spec, f"{url}: table {table!r}")
            _check_placement(part["ids"], spec, shard, f"{url}: table {table!r}")
            self.parts[table].append(part if self.keep_rows else {"ids": part["ids"]})
            self.urls[table].append(url)

    def result(self) -> TableParts:
        """The tables' parts (only their ids without ``keep_rows``), once every id is checked
        over all the files.

        Raises:
            ValueError: for an id held twice, or a fixed table's ids not its whole range.
        """
        for table, spec in self.specs.items():
            _check_ids(table, spec, self.parts[table], self.urls[table], self.name)
        return self.parts


def _saved_specs(shard: ShardFile, url: str) -> dict[str, TableSpec]:
    """The specs a shard file's own metadata gives its tables."""
    out = {}
    for table, wire in shard.tables.items():
        try:
            out[table] = TableSpec.from_wire(wire)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{url}: psflow.tables.{table}: {e}") from None
    return out


def _differ(saved: TableSpec | None, spec: TableSpec) -> str:
    """How the file's own spec of a table differs from the manifest's."""
    if saved is None:
        return "the file's metadata (psflow.tables) has no spec of it"
    diff = [
        f"{f.name} {getattr(saved, f.name)!r} in the file's metadata, "
        f"{getattr(spec, f.name)!r} in the manifest"
        for f in dataclasses.fields(spec)
        if getattr(saved, f.name) != getattr(spec, f.name)
    ]
    return "; ".join(diff)


def _check_placement(ids: torch.Tensor, spec: TableSpec, shard: ShardFile, where: str) -> None:
    """A ps saves only the rows it holds: each id of shard ``s``'s file maps to ``s``."""
    if not ids.numel() or shard.num_shards == 1:
        return
    if spec.num_embeddings is not None:
        bad = (ids < 0) | (ids >= spec.num_embeddings)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            raise ValueError(f"{where}: id {int(ids[at])} out of range [0, {spec.num_embeddings})")
    partition = Partition(spec.partition, spec.num_embeddings, shard.num_shards)
    wrong = partition.shard_of(ids) != shard.shard
    if bool(wrong.any()):
        at = int(wrong.nonzero()[0])
        raise ValueError(
            f"{where}: id {int(ids[at])} belongs to shard "
            f"{int(partition.shard_of(ids[at : at + 1])[0])} ({spec.partition} over "
            f"{shard.num_shards}), not this file's {shard.shard}"
        )


def _check_part(part: dict[str, torch.Tensor], spec: TableSpec, where: str) -> None:
    ids, values = part.get("ids"), part.get("values")
    if ids is None or values is None:
        raise ValueError(f"{where}: the file lacks its ids or values")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"{where}: ids are {_name_of(ids.dtype)} {list(ids.shape)}, not 1-D int64")
    n = ids.numel()
    want = [n, spec.embedding_dim]
    if values.dtype != DTYPES[spec.dtype] or list(values.shape) != want:
        raise ValueError(
            f"{where}: values are {_name_of(values.dtype)} {list(values.shape)}, the manifest's "
            f"spec says {spec.dtype} {want}"
        )
    # The row-wise optimizer's state, as the ps that restores it checks it (sparse.rows).
    optimizer = RowOptimizer(spec.optimizer or RowOptimizerSpec())
    fresh = optimizer.new_state(1, spec.embedding_dim, DTYPES[spec.dtype])
    state = {k.removeprefix("opt/"): t for k, t in part.items() if k.startswith("opt/")}
    if set(state) != set(optimizer.state_names):
        raise ValueError(
            f"{where}: optimizer state {sorted(state)}, its row optimizer "
            f"{optimizer.spec.name} keeps {sorted(optimizer.state_names)}"
        )
    for key, tensor in state.items():
        want_shape = [n, *fresh[key].shape[1:]]
        if list(tensor.shape) != want_shape or tensor.dtype != fresh[key].dtype:
            raise ValueError(
                f"{where}: opt/{key} is {_name_of(tensor.dtype)} {list(tensor.shape)}, its row "
                f"optimizer keeps {_name_of(fresh[key].dtype)} {want_shape}"
            )


def _check_ids(
    table: str, spec: TableSpec, parts: list[dict[str, torch.Tensor]], urls: list[str], name: str
) -> None:
    """Each id once over every file; a fixed table's exactly ``0 .. num_embeddings - 1``."""
    ids = torch.cat([p["ids"] for p in parts]) if parts else torch.empty(0, dtype=torch.int64)
    n = spec.num_embeddings
    where = f"{name}: table {table!r}"
    pad = spec.padding_idx
    if n is None and pad is not None and bool((ids == pad).any()):
        # A hashed table keeps no row for its padding id (always zero): one saved is forged,
        # and a model's load_state_dict of the export would refuse it.
        at = int((ids == pad).nonzero()[0])
        raise ValueError(
            f"{_url_of(at, parts, urls)}: table {table!r} holds a row for its padding id {pad}"
        )
    if n is not None:
        # Counted first: num_embeddings is a manifest's word, the rows are what the files hold.
        if ids.numel() != n:
            raise ValueError(
                f"{where}: the spec says {n} rows (num_embeddings); its shard files hold "
                f"{ids.numel()}"
            )
        bad = (ids < 0) | (ids >= n)
        if bool(bad.any()):
            at = int(bad.nonzero()[0])
            raise ValueError(
                f"{_url_of(at, parts, urls)}: table {table!r}: id {int(ids[at])} out of range "
                f"[0, {n})"
            )
    if not ids.numel():
        return
    order = torch.sort(ids, stable=True)
    same = order.values[1:] == order.values[:-1]
    if bool(same.any()):
        at = int(same.nonzero()[0])
        first, second = int(order.indices[at]), int(order.indices[at + 1])
        raise ValueError(
            f"{where}: id {int(ids[first])} is held twice (in {_url_of(first, parts, urls)} and "
            f"{_url_of(second, parts, urls)})"
        )


def _url_of(position: int, parts: list[dict[str, torch.Tensor]], urls: list[str]) -> str:
    """The file that holds the id at ``position`` of the parts' ids put together."""
    for part, url in zip(parts, urls, strict=True):
        if position < part["ids"].numel():
            return url
        position -= part["ids"].numel()
    return urls[-1]
