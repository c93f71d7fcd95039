"""An export's manifest and the format's names: :func:`read_export` reads one export's manifest
and checks every field of it, naming the field that is wrong.

A job given an export directory (``TrainingSession(export_dir=D, export_every=S)``) writes
``D/export-<n>/`` directories, each one export:

- ``shard-<i>-of-<S>.safetensors``, one per ps, written by that ps (temporary name, fsync,
  rename): ``dense/<variable>`` (the dense parameters as that ps holds them, a partition of a
  large one a variable of its own), ``table/<name>/ids`` and ``table/<name>/values`` (a base:
  every row the shard holds; a delta: the rows written since the previous export), and
  ``table/<name>/tombstones`` (a delta: the ids evicted since, by ``max_rows`` or
  ``ttl_seconds``, and not held again). Its metadata ``psflow.export`` (JSON) names the export,
  its base and predecessor, the shard and the step.
- ``manifest.json``, written by the chief once every shard's file is there (atomically, last):
  ``format``, ``seq`` (n), ``kind`` (``base``/``delta``), ``base`` (the base export's n),
  ``since`` (the export a delta follows; ``null`` for a base), ``step``, ``num_shards``,
  ``files``, ``dense`` (each parameter's shape, dtype and the variables that hold it) and
  ``tables`` (each table's spec). An export without its manifest is not one (still being
  written, or abandoned): readers never see half an export.

This module imports torch and fsspec only (no ZeroMQ, no ``torch.distributed``, nothing of
psflow's runtime).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch

FORMAT = "psflow-export/1"
"""The ``format`` of a manifest this module reads."""
MANIFEST = "manifest.json"
"""An export's manifest, in its directory."""
EXPORT_META = "psflow.export"
"""The safetensors metadata key of a shard file's own description (JSON)."""
EXPORT_RE = re.compile(r"^export-(\d+)$")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class ExportError(ValueError):
    """An export that cannot be read or applied: named, with what is wrong."""


def export_dir_name(seq: int) -> str:
    """The directory of export ``seq``: ``export-<seq>``."""
    return f"export-{seq}"


def export_shard_file_name(shard: int, num_shards: int) -> str:
    """The file one ps writes into an export."""
    return f"shard-{shard}-of-{num_shards}.safetensors"


def dense_tensor_name(var: str) -> str:
    """A dense variable's tensor in an export's shard file."""
    return f"dense/{var}"


def table_export_tensor_name(table: str, part: str) -> str:
    """A table's ``ids``, ``values`` or ``tombstones`` in an export's shard file."""
    return f"table/{table}/{part}"


def _join(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


@dataclass(frozen=True, kw_only=True)
class Export:
    """One complete export, as its manifest describes it."""

    url: str
    """Its directory."""
    seq: int
    base: int
    since: int | None
    """The export a delta follows; ``None`` for a base."""
    step: int
    manifest: dict[str, Any] = field(repr=False)

    @property
    def kind(self) -> str:
        """``"base"`` or ``"delta"``."""
        return "base" if self.since is None else "delta"

    @property
    def name(self) -> str:
        return export_dir_name(self.seq)


def _is_count(value: Any, low: int = 0) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= low


def read_export(url: str) -> Export:
    """The export in directory ``url``, from its manifest.

    Raises:
        ExportError: naming the manifest, when it is missing, unreadable or inconsistent.
    """
    where = _join(url, MANIFEST)
    fs, path = fsspec.core.url_to_fs(where)
    try:
        data = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        raise ExportError(
            f"{where}: no manifest (an export still being written, or none)"
        ) from None
    except (OSError, ValueError, RecursionError) as e:
        raise ExportError(f"{where}: unreadable manifest: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExportError(f"{where}: not a {FORMAT} manifest")
    for key in ("seq", "base", "step", "num_shards"):
        value = data.get(key)
        if not _is_count(value, 1 if key == "num_shards" else 0):
            low = 1 if key == "num_shards" else 0
            raise ExportError(f"{where}: {key!r} must be an integer >= {low}, got {value!r}")
    since = data.get("since")
    if since is not None and not _is_count(since):
        raise ExportError(f"{where}: 'since' must be an integer >= 0 or null, got {since!r}")
    match = EXPORT_RE.match(url.rstrip("/").rsplit("/", 1)[-1])
    if match is None or int(match.group(1)) != data["seq"]:
        raise ExportError(f"{where}: export {data['seq']} is not in its directory")
    seq, base = data["seq"], data["base"]
    if (since is None) != (data.get("kind") == "base") or (since is None and base != seq):
        raise ExportError(f"{where}: kind {data.get('kind')!r}, base {base}, since {since}")
    if since is not None and not base <= since < seq:
        # A delta follows an earlier export of its own chain: anything else is a cycle.
        raise ExportError(
            f"{where}: a delta must follow an earlier export of its base (base <= since < "
            f"seq), got seq {seq}, base {base}, since {since}"
        )
    _check_files(where, data)
    _check_dense(where, data)
    _check_tables(where, data)
    return Export(
        url=url.rstrip("/"),
        seq=seq,
        base=base,
        since=since,
        step=data["step"],
        manifest=data,
    )


def _check_files(where: str, m: dict[str, Any]) -> None:
    files, n = m.get("files"), m["num_shards"]
    if not isinstance(files, list) or len(files) != n:
        raise ExportError(f"{where}: 'files' is {files!r}, not one file per ps ({n})")
    for shard, name in enumerate(files):
        if name != export_shard_file_name(shard, n):
            raise ExportError(
                f"{where}: 'files'[{shard}] is {name!r}, not "
                f"{export_shard_file_name(shard, n)!r} (each ps's file, in its directory)"
            )


def _check_dense(where: str, m: dict[str, Any]) -> None:
    dense = m.get("dense")
    if not isinstance(dense, dict):
        raise ExportError(f"{where}: 'dense' must be a map of parameters, got {dense!r}")
    placed: set[tuple[Any, str]] = set()
    for param, entry in dense.items():
        at = f"{where}: 'dense'[{param!r}]"
        if not isinstance(entry, dict):
            raise ExportError(f"{at} must be a map (shape, dtype, pieces), got {entry!r}")
        shape, dtype, pieces = entry.get("shape"), entry.get("dtype"), entry.get("pieces")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise ExportError(f"{at}: 'shape' must be a list of sizes >= 0, got {shape!r}")
        if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ExportError(f"{at}: 'dtype' must be a torch dtype's name, got {dtype!r}")
        if not isinstance(pieces, list) or not pieces:
            raise ExportError(f"{at}: 'pieces' must be a non-empty list, got {pieces!r}")
        spans = []
        for i, piece in enumerate(pieces):
            pat = f"{at}: 'pieces'[{i}]"
            if not isinstance(piece, dict):
                raise ExportError(f"{pat} must be a map (var, shard, rows), got {piece!r}")
            var, shard, rows = piece.get("var"), piece.get("shard"), piece.get("rows")
            if not isinstance(var, str) or not var:
                raise ExportError(f"{pat}: 'var' must be a variable's name, got {var!r}")
            if not _is_count(shard) or shard >= m["num_shards"]:
                raise ExportError(
                    f"{pat}: 'shard' must be a ps in 0..{m['num_shards'] - 1}, got {shard!r}"
                )
            if (shard, var) in placed:
                raise ExportError(f"{pat}: variable {var!r} of ps:{shard} is named twice")
            placed.add((shard, var))
            if rows is None:
                if len(pieces) != 1:
                    raise ExportError(f"{pat}: 'rows' null (the whole parameter) in {len(pieces)} "
                                      "pieces")  # fmt: skip
                continue
            if (
                not isinstance(rows, list)
                or len(rows) != 2
                or not all(_is_count(r) for r in rows)
                or rows[0] >= rows[1]
            ):
                raise ExportError(f"{pat}: 'rows' must be [start, stop) or null, got {rows!r}")
            spans.append((rows[0], rows[1]))
        if spans:
            spans.sort()
            ends = [0] + [stop for _, stop in spans]
            if (
                not shape
                or any(start != ends[i] for i, (start, _) in enumerate(spans))
                or (ends[-1] != shape[0])
            ):
                raise ExportError(
                    f"{at}: the pieces' rows {spans} do not cover the rows of {shape} once each"
                )


def _check_tables(where: str, m: dict[str, Any]) -> None:
    tables = m.get("tables")
    if not isinstance(tables, dict):
        raise ExportError(f"{where}: 'tables' must be a map of table specs, got {tables!r}")
    for table, spec in tables.items():
        at = f"{where}: 'tables'[{table!r}]"
        if not isinstance(spec, dict):
            raise ExportError(f"{at} must be a table's spec (a map), got {spec!r}")
        dim, size, dtype = spec.get("embedding_dim"), spec.get("num_embeddings"), spec.get("dtype")
        if not _is_count(dim, 1):
            raise ExportError(f"{at}: 'embedding_dim' must be an integer >= 1, got {dim!r}")
        if size is not None and not _is_count(size, 1):
            raise ExportError(
                f"{at}: 'num_embeddings' must be an integer >= 1 or null, got {size!r}"
            )
        if dtype not in _DTYPES:
            raise ExportError(f"{at}: 'dtype' must be one of {sorted(_DTYPES)}, got {dtype!r}")
