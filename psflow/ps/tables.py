"""Embedding tables on a ps shard: the rows it holds of each table, looked up and updated by id.

A table (:class:`~psflow.protocol.TableSpec`) is split by rows over the ps shards (its
``partition``, TensorFlow's ``partition_strategy``); each shard holds its part as a
:class:`~psflow.sparse.Rows` in :attr:`ShardStore.tables <psflow.ps.store.ShardStore.tables>`,
with the row-wise optimizer state beside the values. No worker ever holds a table: a worker
asks for the rows of its batch's ids (:attr:`~psflow.protocol.Op.LOOKUP`) and pushes their
gradients with its dense ones (:attr:`~psflow.protocol.Key.ROWS`), applied in the same update.

Ops (:class:`TableService`): ``lookup`` and ``table_status``. The chief creates the tables with
its ``init`` (:func:`build_tables`; a table starts from the rows the chief's model held, when
it held them, a hashed one's by id: :func:`set_initial_rows`); a restore reads each shard's
rows from every file of the checkpoint (:func:`restore_tables`), so a checkpoint restores into
any number of ps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from psflow.metrics import PsMetrics
from psflow.protocol import Key, Op, TableSpec
from psflow.protocol.messages import (
    ROW_GRADS,
    ROW_IDS,
    ROW_STATE,
    initial_ids_tensor_name,
    initial_rows_tensor_name,
    prefetch_tensor_names,
    row_tensor_names,
)
from psflow.ps import safefile
from psflow.ps.native import NativeLookup
from psflow.ps.row_wire import narrowed, row_dtypes
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.store import RowGrads
from psflow.sparse import FixedRows, HashedRows, Rows, coalesce, make_rows
from psflow.sparse.snapshot import RowSnapshot
from psflow.transport import Request

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

TABLE_PREFIX = "@table/"
"""Tensors of a table in a shard file: ``@table/<name>/ids``, ``.../values``, ``.../opt/<key>``
(no parameter name starts with ``@``, so they never mix with the variables)."""

MAX_TABLES = 4096
"""Tables one init may create (a bound on what a peer can make a ps allocate names for)."""


def table_tensor_name(table: str, part: str) -> str:
    """The name of one of ``table``'s tensors in a shard file (``ids``, ``values``,
    ``opt/<key>``)."""
    return f"{TABLE_PREFIX}{table}/{part}"


def split_table_tensor_name(name: str) -> tuple[str, str] | None:
    """``(table, part)`` of a table tensor's name in a shard file; ``None`` for a variable."""
    if not name.startswith(TABLE_PREFIX):
        return None
    parts = name[len(TABLE_PREFIX) :].split("/")
    if len(parts) == 2 and parts[1] in ("ids", "values"):
        return parts[0], parts[1]
    if len(parts) == 3 and parts[1] == "opt":
        return parts[0], f"opt/{parts[2]}"
    return None


def table_specs(header: Mapping[str, Any]) -> list[TableSpec]:
    """The tables an ``init`` creates (none when it names none).

    Raises:
        ValueError: for a spec that is not valid data, or two tables with one name.
    """
    raw = header.get(Key.TABLES)
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TABLES:
        raise ValueError(f"'{Key.TABLES}' must be a list of at most {MAX_TABLES} table specs")
    specs = [TableSpec.from_wire(t) for t in raw]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    return specs


def build_tables(specs: Sequence[TableSpec], shard: int, num_shards: int) -> dict[str, Rows]:
    """This shard's part of each table, initialised (fixed tables) or empty (hashed)."""
    for spec in specs:
        if spec.optimizer is None:
            raise ValueError(f"table {spec.name!r} comes without its row-wise optimizer")
    return {spec.name: make_rows(spec, shard, num_shards) for spec in specs}


def _table_names(header: Mapping[str, Any], key: Key) -> list[str]:
    """The table names a push lists under ``key`` (none when absent or empty)."""
    tables = header.get(key)
    if not tables:
        return []
    if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
        raise ValueError(f"'{key}' must be a list of table names")
    return tables


def split_rows(
    header: Mapping[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]
) -> tuple[Tensors, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Splits a push's tensors into dense gradients and row gradients per table
    (:attr:`Key.ROWS` names the tables; each has an ids and a gradients tensor).

    Raises:
        ValueError: when a named table's tensors are missing, or ``rows`` is not a list of names.
    """
    tables = _table_names(header, Key.ROWS)
    if not tables:
        return list(tensors), {}
    wanted = {}
    for table in tables:
        ids_name, grads_name = row_tensor_names(table)
        wanted[ids_name] = (table, 0)
        wanted[grads_name] = (table, 1)
    dense: Tensors = []
    parts: dict[str, list[torch.Tensor | None]] = {t: [None, None] for t in tables}
    for name, t in tensors:
        slot = wanted.get(name)
        if slot is None:
            dense.append((name, t))
        elif parts[slot[0]][slot[1]] is not None:
            raise ValueError(f"{name!r} appears twice in one push")
        else:
            parts[slot[0]][slot[1]] = t
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for table, (ids, grads) in parts.items():
        if ids is None or grads is None:
            raise ValueError(
                f"the push names table {table!r} but lacks its {ROW_IDS} or {ROW_GRADS} tensor"
            )
        rows[table] = (ids, grads)
    return dense, rows


def split_prefetch(
    header: Mapping[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]
) -> tuple[Tensors, dict[str, torch.Tensor]]:
    """Splits a push's tensors into the rest and the ids to prefetch per table
    (:attr:`Key.PREFETCH` names the tables).

    Raises:
        ValueError: when a named table's ids are missing, or ``prefetch`` is not a list of names.
    """
    return _split_per_table(
        header, Key.PREFETCH, tensors, lambda t: prefetch_tensor_names(t)[0], "push", "ids"
    )


class FirstRows(NamedTuple):
    """A shard's first rows of a table, given by an init, and maybe its optimizer state; a
    hashed table's with their ids."""

    values: torch.Tensor
    state: dict[str, torch.Tensor]
    ids: torch.Tensor | None = None


def split_initial_rows(
    header: Mapping[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]
) -> tuple[Tensors, dict[str, FirstRows]]:
    """Splits an init's tensors into the rest and this shard's first rows per table, with
    their row-wise optimizer state where the init carries it (:attr:`Key.ROWS` names the
    tables: the chief's model held their rows).

    Raises:
        ValueError: when a named table's rows are missing, state comes for a table not named,
            or ``rows`` is not a list of names.
    """
    rest, values = _split_per_table(
        header, Key.ROWS, tensors, initial_rows_tensor_name, "init", "rows"
    )
    out = {table: FirstRows(v, {}) for table, v in values.items()}
    ids_of = {initial_ids_tensor_name(table): table for table in out}
    others: Tensors = []
    for name, t in rest:
        table, infix, key = name.partition(ROW_STATE)
        if name in ids_of:
            first = out[ids_of[name]]
            if first.ids is not None:
                raise ValueError(f"{name!r} appears twice in one init")
            out[ids_of[name]] = first._replace(ids=t)
        elif not infix:
            others.append((name, t))
        elif table not in out:
            raise ValueError(f"the init carries {name!r} but not the first rows of {table!r}")
        elif key in out[table].state:
            raise ValueError(f"{name!r} appears twice in one init")
        else:
            out[table].state[key] = t
    return others, out


def _split_per_table(
    header: Mapping[str, Any],
    key: Key,
    tensors: Sequence[tuple[str, torch.Tensor]],
    name_of: Callable[[str], str],
    message: str,
    what: str,
) -> tuple[Tensors, dict[str, torch.Tensor]]:
    """The tensors of the tables ``header[key]`` names (one each, called ``name_of(table)``)
    per table, and the rest."""
    tables = _table_names(header, key)
    if not tables:
        return list(tensors), {}
    wanted = {name_of(t): t for t in tables}
    rest: Tensors = []
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        table = wanted.get(name)
        if table is None:
            rest.append((name, t))
        elif table in out:
            raise ValueError(f"{name!r} appears twice in one {message}")
        else:
            out[table] = t
    missing = sorted(set(tables) - set(out))
    if missing:
        raise ValueError(f"the {message} names tables {missing} but lacks their {what}")
    return rest, out


def set_initial_rows(tables: Mapping[str, Rows], first: Mapping[str, FirstRows]) -> None:
    """Makes ``first`` (this shard's rows per table and maybe their optimizer state: a fixed
    table's all of them in its storage order, a hashed one's with their ids) the tables' rows:
    the chief's model held them (a pretrained table, a loaded state dict, a model trained
    elsewhere, a hashed table's rows given by id). Checks every one before any changes.

    Raises:
        ValueError: for a table the init does not create, ids given for a fixed table or not
            for a hashed one, bad ids, rows of the wrong shape or dtype, or state that is not
            the table's optimizer's.
    """
    for name, (values, state, ids) in first.items():
        table = tables.get(name)
        if table is None:
            raise ValueError(f"the init carries first rows of {name!r}, which it does not create")
        if isinstance(table, FixedRows) and ids is not None:
            raise ValueError(
                f"the init gives ids with the first rows of table {name!r}, a fixed one: it "
                "takes all its rows, in its storage order"
            )
        if not isinstance(table, FixedRows) and ids is None:
            raise ValueError(f"the init gives first rows of hashed table {name!r} without ids")
        if ids is not None:
            table.check_ids(ids)
        rows = table.num_rows if ids is None else ids.numel()
        want = (rows, table.dim)
        if tuple(values.shape) != want or values.dtype != table.dtype:
            raise ValueError(
                f"the first rows of table {name!r} are {list(values.shape)} {values.dtype}; "
                f"this shard holds {list(want)} {table.dtype}"
            )
        fresh = table.optimizer.new_state(1, table.dim, table.dtype)  # the keys, shapes, dtypes
        if state and set(state) != set(fresh):
            raise ValueError(
                f"the init gives table {name!r} optimizer state {sorted(state)}; its "
                f"{table.optimizer.spec.name} keeps {sorted(fresh)}"
            )
        for key, t in state.items():
            want_state = [rows, *fresh[key].shape[1:]]
            if list(t.shape) != want_state or t.dtype != fresh[key].dtype:
                raise ValueError(
                    f"the optimizer state {key!r} of table {name!r} is {list(t.shape)} "
                    f"{t.dtype}; this shard holds {want_state} {fresh[key].dtype}"
                )
    for name, (values, state, ids) in first.items():
        table = tables[name]
        if isinstance(table, HashedRows):
            assert ids is not None
            table.give(ids, values, state)
            continue
        assert isinstance(table, FixedRows)
        table.values.copy_(values)
        for key, t in state.items():
            table.state[key].copy_(t)


def check_lookup(tables: Mapping[str, Rows], ids: Mapping[str, torch.Tensor]) -> None:
    """Raises ``ValueError`` unless every table is known and its ids fit it."""
    for name, table_ids in ids.items():
        table = tables.get(name)
        if table is None:
            raise ValueError(f"unknown embedding table {name!r}")
        table.check_ids(table_ids)


def lookup_rows(
    tables: Mapping[str, Rows],
    ids: Mapping[str, torch.Tensor],
    out: Sequence[torch.Tensor] | None = None,
    *,
    absent_zeros: bool = False,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> Tensors:
    """The rows of ``ids`` (checked by :func:`check_lookup`) per table, as ``(table, rows)``;
    into ``out`` (one tensor per table, as :func:`row_specs` describes them) when given; with
    ``absent_zeros``, zeros for ids a hashed table does not hold (:attr:`Key.ABSENT_ZEROS`);
    in ``dtypes[table]`` where given (:func:`row_dtypes`).

    Raises:
        ValueError: naming the table when a row is not finite in the dtype asked (a value
            beyond float16's range): the rows would reach the worker as inf.
    """
    dtypes = dtypes or {}
    places: Iterable[torch.Tensor | None] = [None] * len(ids) if out is None else out
    got = []
    for (name, table_ids), place in zip(ids.items(), places, strict=True):
        wire = dtypes.get(name)
        table = tables[name]
        if wire is None or wire == table.dtype:
            got.append((name, table.lookup(table_ids, place, absent_zeros=absent_zeros)))
            continue
        rows = table.lookup(table_ids, absent_zeros=absent_zeros)
        got.append((name, narrowed(name, rows, wire, place)))
    return got


def row_specs(
    tables: Mapping[str, Rows],
    ids: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> list[tuple[torch.dtype, tuple[int, int]]]:
    """The dtype and shape of each table's rows that :func:`lookup_rows` gives for ``ids``
    (in ``dtypes[table]`` where given)."""
    dtypes = dtypes or {}
    return [(dtypes.get(n, tables[n].dtype), (t.numel(), tables[n].dim)) for n, t in ids.items()]


def widened(grads: torch.Tensor) -> torch.Tensor:
    """Row gradients that came narrower than float32 (:data:`~psflow.protocol.tables.
    WIRE_DTYPES`), cast up to it; others as they are (a table's own dtype is checked later)."""
    return grads.float() if grads.dtype in (torch.float16, torch.bfloat16) else grads


def sum_rows(
    rows: Iterable[RowGrads], scale: float = 1.0
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Several pushes' row gradients summed per table and id (then times ``scale``): the
    synchronous step's aggregate."""
    per_table: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for push in rows:
        for name, (ids, grads) in push.items():
            acc = per_table.setdefault(name, ([], []))
            acc[0].append(ids)
            acc[1].append(widened(grads))  # summed at float32 at least
    out = {}
    for name, (id_list, grad_list) in per_table.items():
        unique, summed = coalesce(torch.cat(id_list), torch.cat(grad_list))
        if scale != 1.0:
            summed.mul_(scale)
        out[name] = (unique, summed)
    return out


def count_rows(m: PsMetrics, ids: Mapping[str, Any], *, pushed: bool) -> None:
    """Counts the embedding rows ``ids`` names per table (``(ids, grads)`` pairs for a push,
    id tensors for a lookup) as pushed or pulled."""
    if not m.on:
        return
    for table, t in ids.items():
        n = int((t[0] if isinstance(t, tuple) else t).numel())
        (m.rows_pushed(table) if pushed else m.rows_pulled(table)).inc(n)


def begin_table_snapshots(tables: Mapping[str, Rows]) -> dict[str, RowSnapshot]:
    """Every table's rows and row-wise optimizer state at this moment, for a checkpoint: taken
    without copying (rows are copied as they change, the rest by :func:`finish_table_snapshots`
    in the writing thread); each row's value and state are of the same moment."""
    return {name: table.begin_snapshot() for name, table in tables.items()}


def finish_table_snapshots(snapshots: Mapping[str, RowSnapshot]) -> dict[str, torch.Tensor]:
    """The tables' tensors as a shard file holds them (``@table/<name>/...``)."""
    out: dict[str, torch.Tensor] = {}
    for name, snap in snapshots.items():
        for part, t in snap.result().items():
            out[table_tensor_name(name, part)] = t
    return out


def read_table_tensors(
    urls: Sequence[str], root: str | None = None, metadata: list[dict[str, str]] | None = None
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Every table's tensors in the shard files at ``urls`` (under ``root``, as
    :func:`~psflow.ps.safefile.read` checks): per table, one map (``ids``, ``values``,
    ``opt/<key>``) per file that holds part of it; each file's metadata appended to
    ``metadata`` when given."""
    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for url in urls:
        tensors, meta = safefile.read(url, root)
        if metadata is not None:
            metadata.append(meta)
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            split = split_table_tensor_name(name)
            if split is not None:
                parts.setdefault(split[0], {})[split[1]] = t
        for table, part in parts.items():
            out.setdefault(table, []).append(part)
    return out


def restore_tables(
    tables: Mapping[str, Rows], urls: Sequence[str], root: str | None = None
) -> list[dict[str, str]] | None:
    """Loads each table's rows of this shard from the checkpoint files at ``urls`` (written
    by any number of shards, under ``root``); returns each file's metadata as read with them
    (``None`` without tables: no file was read).

    Raises:
        ValueError: when a table is missing from the checkpoint, or a file is unreadable.
    """
    if not tables:
        return None
    metadata: list[dict[str, str]] = []
    saved = read_table_tensors(urls, root, metadata)
    missing = sorted(set(tables) - set(saved))
    if missing:
        raise ValueError(f"the checkpoint holds no table {missing}")
    for name, table in tables.items():
        for part in saved[name]:
            if "ids" not in part or "values" not in part:
                raise ValueError(f"table {name!r}: a shard file lacks its ids or values")
            state = {k[len("opt/") :]: v for k, v in part.items() if k.startswith("opt/")}
            table.load(part["ids"], part["values"], state)
    return metadata


class TableService(Service):
    """The ``lookup`` and ``table_status`` ops of one ps server."""

    def __init__(self, host: ServiceHost) -> None:
        self.host = host
        self.native = NativeLookup(host)
        """Lookups served from the request's bytes to the reply's (:mod:`psflow.ps.native`)."""

    def handlers(self) -> Mapping[Op, Handler]:
        return {Op.LOOKUP: self._lookup, Op.TABLE_STATUS: self._status}

    def _lookup(self, request: Request) -> None:
        self.host.require_initialized()
        if self.native.serve(request):
            return
        zeros = request.header.get(Key.ABSENT_ZEROS, False)
        if not isinstance(zeros, bool):
            raise ValueError(f"'{Key.ABSENT_ZEROS}' must be true or false, got {zeros!r}")
        ids = dict(self.host.tensors(request))  # copies: the rows may go where they were
        tables = self.host.store.tables
        check_lookup(tables, ids)
        dtypes = row_dtypes(request.header, tables, ids)
        # Gathered straight into the lane that carries the reply, where there is one.
        out = self.host.reply_tensors(request, row_specs(tables, ids, dtypes))
        rows = lookup_rows(tables, ids, out, absent_zeros=zeros, dtypes=dtypes)
        self.host.reply(request, {}, rows)
        count_rows(self.host.metrics, ids, pushed=False)

    def _status(self, request: Request) -> None:
        self.host.require_initialized()
        self.host.reply(
            request,
            {Key.TABLES: {n: t.stats for n, t in self.host.store.tables.items()}},
        )
