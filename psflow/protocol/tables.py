"""Sparse embedding tables as data: what a table is and how its rows learn.

- :data:`ROW_OPTIMIZERS`: the row-wise optimizers a table may name, with their defaults.
- :class:`RowOptimizerSpec`: one of them with its arguments.
- :data:`PARTITIONS`: how a fixed-size table's ids map to ps shards (TensorFlow's
  ``partition_strategy``).
- :class:`TableSpec`: one table (its name in the model, its size, how it starts, where its rows
  live and how they are updated).

Both travel on the wire (``to_wire``/``from_wire``) and import nothing of psflow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

ROW_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "SGD": {"lr": 0.01},
    # 0.1: TensorFlow's default initial accumulator (torch.optim.Adagrad's is 0).
    "Adagrad": {"lr": 0.01, "initial_accumulator_value": 0.1, "eps": 1e-10},
    # TorchRec's RowWiseAdagrad (FBGEMM's exact row-wise Adagrad): one accumulator a row.
    "RowWiseAdagrad": {"lr": 0.01, "initial_accumulator_value": 0.0, "eps": 1e-10},
    # Lazy: a row's moments move only when the row has a gradient (torch.optim.SparseAdam).
    "Adam": {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8},
    # tf.compat.v1.train.FtrlOptimizer (no l2_shrinkage).
    "Ftrl": {"lr": 0.01, "lr_power": -0.5, "initial_accumulator_value": 0.1, "l1": 0.0, "l2": 0.0},
}
"""The row-wise optimizers, by name, with their default arguments."""

_STATE_NAMES: dict[str, tuple[str, ...]] = {
    "SGD": (),
    "Adagrad": ("sum",),
    "RowWiseAdagrad": ("sum",),
    "Adam": ("exp_avg", "exp_avg_sq", "step"),
    "Ftrl": ("accum", "linear"),
}

PARTITIONS = ("mod", "div")
"""``mod``: id ``i`` on shard ``i % S``; ``div``: contiguous ranges, the first ``N % S`` shards
one row longer (TensorFlow's ``partition_strategy="div"``)."""

TABLE_DTYPES = ("float32", "float64")
"""The dtypes a table's rows may have (their names on the wire)."""

WIRE_DTYPES = ("float32", "float16", "bfloat16")
"""The dtypes a table's rows and row gradients may travel in instead of the table's own
(:attr:`~psflow.protocol.Key.ROW_DTYPES`), none wider than a table's: the ps keeps the table's
rows and optimizer state in its own dtype, and casts a gradient up before applying it."""


def check_wire_dtype(table: str, wire: Any) -> str:
    """``wire`` when the rows of ``table`` may travel in it: one of :data:`WIRE_DTYPES` (each
    no wider than any table's dtype).

    Raises:
        ValueError: naming the table and the dtype, otherwise.
    """
    if not isinstance(wire, str) or wire not in WIRE_DTYPES:
        raise ValueError(f"table {table!r}: rows travel as one of {WIRE_DTYPES}, not {wire!r:.60}")
    return wire


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class RowOptimizerSpec:
    """A row-wise optimizer named with its arguments: how a sparse table's rows are updated.

    Only the rows a step touches are updated, each from its own state, so a row's state
    travels with it (resharding, eviction).

    Example:
        >>> spec = RowOptimizerSpec.of("Adagrad", lr=0.05)
        >>> spec.settings["initial_accumulator_value"], spec.state_names
        (0.1, ('sum',))
    """

    name: str = "Adagrad"
    """One of :data:`ROW_OPTIMIZERS` (``SGD``, ``Adagrad``, ``RowWiseAdagrad``, ``Adam``,
    ``Ftrl``)."""
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Arguments that differ from the defaults: only keys of that optimizer's defaults, numbers
    (``betas``: a pair of numbers)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in ROW_OPTIMIZERS:
            raise ValueError(
                f"unknown row optimizer {self.name!r}: expected one of {sorted(ROW_OPTIMIZERS)}"
            )
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"row optimizer arguments must be a mapping, got {self.kwargs!r}")
        defaults = ROW_OPTIMIZERS[self.name]
        kwargs: dict[str, Any] = {}
        for key, value in self.kwargs.items():
            if key not in defaults:
                raise ValueError(
                    f"row optimizer {self.name} takes no argument {key!r}: it takes "
                    f"{sorted(defaults)}"
                )
            kwargs[key] = _check_arg(self.name, key, value)
        # Normalised (betas a tuple of floats), so that a spec equals itself back from the wire.
        object.__setattr__(self, "kwargs", kwargs)

    @classmethod
    def of(cls, optimizer: str | RowOptimizerSpec, **kwargs: Any) -> RowOptimizerSpec:
        """``optimizer`` itself, or the row optimizer it names with ``kwargs``.

        Raises:
            ValueError: for an unknown name or argument, or arguments given beside a spec.
        """
        if isinstance(optimizer, RowOptimizerSpec):
            if kwargs:
                raise ValueError(f"give {sorted(kwargs)} in the RowOptimizerSpec, not beside it")
            return optimizer
        return cls(name=optimizer, kwargs=kwargs)

    @property
    def settings(self) -> dict[str, Any]:
        """Every argument: the defaults updated with :attr:`kwargs`."""
        return {**ROW_OPTIMIZERS[self.name], **self.kwargs}

    @property
    def state_names(self) -> tuple[str, ...]:
        """The per-row state it keeps (``Adagrad``: ``("sum",)``)."""
        return _STATE_NAMES[self.name]

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in self.kwargs.items()},
        }

    @classmethod
    def from_wire(cls, data: Any) -> RowOptimizerSpec:
        if not isinstance(data, dict):
            raise ValueError(f"row optimizer spec must be a map, got {data!r}")
        unknown = set(data) - {"name", "kwargs"}
        if unknown:
            raise ValueError(f"row optimizer spec has unknown keys {sorted(map(str, unknown))}")
        return cls(name=data.get("name", ""), kwargs=data.get("kwargs", {}))


def _check_arg(name: str, key: str, value: Any) -> Any:
    where = f"row optimizer {name}: {key}={value!r}"
    if key == "betas":
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ValueError(f"{where} must be a pair of numbers in [0, 1)")
        if not all(_is_number(b) and 0.0 <= b < 1.0 for b in value):
            raise ValueError(f"{where} must be a pair of numbers in [0, 1)")
        return (float(value[0]), float(value[1]))
    if not _is_number(value):
        raise ValueError(f"{where} must be a finite number")
    if key == "lr" and value <= 0:
        raise ValueError(f"{where} must be > 0")
    if key == "lr_power" and value > 0:
        raise ValueError(f"{where} must be <= 0")
    if key in ("eps", "initial_accumulator_value", "l1", "l2") and value < 0:
        raise ValueError(f"{where} must be >= 0")
    return value


@dataclass(frozen=True, kw_only=True)
class TableSpec:
    """One sparse embedding table: its rows live on the ps, split over the shards.

    Example:
        >>> spec = TableSpec(name="emb", embedding_dim=16, num_embeddings=1000)
        >>> TableSpec.from_wire(spec.to_wire()) == spec
        True
    """

    name: str
    """The module's path in the model (``"emb"``, ``"tables.3"``)."""
    embedding_dim: int
    """Columns of a row (>= 1)."""
    num_embeddings: int | None
    """Rows (ids ``0 .. num_embeddings - 1``); ``None``: a hashed table, any int64 id, rows
    created on their first update."""
    partition: str = "mod"
    """How ids map to shards: ``mod`` (``id % S``) or ``div`` (contiguous ranges; fixed-size
    tables only)."""
    dtype: str = "float32"
    """The rows' dtype: ``float32`` or ``float64``."""
    seed: int = 0
    """Seeds the initial rows: row ``i`` starts the same whatever the shard count."""
    init_std: float = 1.0
    """Rows start ``N(0, init_std^2)`` (``torch.nn.Embedding``'s default is ``N(0, 1)``)."""
    padding_idx: int | None = None
    """That row is zero and never updated."""
    min_count: int = 0
    """Hashed tables: pushes of an id before its row is created (0 and 1: at once); the
    gradients of an id seen fewer times are dropped."""
    max_rows: int | None = None
    """Hashed tables: rows kept per shard; past it the least recently updated are evicted. A
    hard cap: no update, restore, checkpoint or export of the shard ever holds more."""
    ttl_seconds: float | None = None
    """Hashed tables: a row not updated for this many seconds is evicted (expired); a
    checkpoint or export never holds an expired row. ``None``: rows never expire."""
    optimizer: RowOptimizerSpec | None = None
    """How the rows are updated; ``None``: the job's row-wise default."""
    scheduled: bool = False
    """The rows' learning rate follows the job's learning-rate schedule, when it has one. The
    worker sets it for a table that names no optimizer: its ``optimizer`` is then the job's in
    row-wise form, and the ps gives each update the schedule's learning rate at that step, as
    one TensorFlow optimizer applies one decayed rate to dense and sparse updates alike. A table
    with its own optimizer keeps its own learning rate."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"table name must be a non-empty string, got {self.name!r}")
        where = f"table {self.name!r}:"

        def count(key: str, value: Any, low: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{where} {key} must be an integer >= {low}, got {value!r}")

        count("embedding_dim", self.embedding_dim, 1)
        hashed = self.num_embeddings is None
        if not hashed:
            count("num_embeddings", self.num_embeddings, 1)
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"{where} partition must be one of {PARTITIONS}, got {self.partition!r}"
            )
        if hashed and self.partition != "mod":
            raise ValueError(
                f"{where} partition {self.partition!r} needs num_embeddings (a hashed table's "
                "ids have no range to divide: it is partitioned by 'mod')"
            )
        if self.dtype not in TABLE_DTYPES:
            raise ValueError(f"{where} dtype must be one of {TABLE_DTYPES}, got {self.dtype!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"{where} seed must be an integer, got {self.seed!r}")
        if not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError(f"{where} seed must fit in 64 bits, got {self.seed!r}")
        if not _is_number(self.init_std) or self.init_std < 0:
            raise ValueError(f"{where} init_std must be a number >= 0, got {self.init_std!r}")
        if self.padding_idx is not None:
            count("padding_idx", self.padding_idx, 0)
            if not hashed and self.padding_idx >= self.num_embeddings:  # type: ignore[operator]
                raise ValueError(
                    f"{where} padding_idx must be in [0, {self.num_embeddings}), got "
                    f"{self.padding_idx}"
                )
        count("min_count", self.min_count, 0)
        if self.max_rows is not None:
            count("max_rows", self.max_rows, 1)
        if not hashed and (self.min_count > 1 or self.max_rows is not None):
            raise ValueError(
                f"{where} min_count and max_rows are for hashed tables (num_embeddings=None), "
                f"got min_count={self.min_count}, max_rows={self.max_rows}"
            )
        if self.ttl_seconds is not None:
            if not _is_number(self.ttl_seconds) or self.ttl_seconds <= 0:
                raise ValueError(
                    f"{where} ttl_seconds must be a number > 0 or None, got {self.ttl_seconds!r}"
                )
            if not hashed:
                raise ValueError(
                    f"{where} ttl_seconds is for hashed tables (num_embeddings=None), got "
                    f"ttl_seconds={self.ttl_seconds}"
                )
        if self.optimizer is not None and not isinstance(self.optimizer, RowOptimizerSpec):
            raise ValueError(
                f"{where} optimizer must be a RowOptimizerSpec or None, got {self.optimizer!r}"
            )
        if not isinstance(self.scheduled, bool):
            raise ValueError(f"{where} scheduled must be true or false, got {self.scheduled!r}")

    @property
    def hashed(self) -> bool:
        """Whether ids are any int64 (rows created on first update) rather than a range."""
        return self.num_embeddings is None

    def to_wire(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["optimizer"] = None if self.optimizer is None else self.optimizer.to_wire()
        return data

    @classmethod
    def from_wire(cls, data: Any) -> TableSpec:
        if not isinstance(data, dict):
            raise ValueError(f"table spec must be a map, got {data!r}")
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"table spec has unknown keys {sorted(map(str, unknown))}")
        missing = {"name", "embedding_dim", "num_embeddings"} - set(data)
        if missing:
            raise ValueError(f"table spec lacks {sorted(missing)}")
        kwargs = dict(data)
        optimizer = kwargs.get("optimizer")
        kwargs["optimizer"] = None if optimizer is None else RowOptimizerSpec.from_wire(optimizer)
        return cls(**kwargs)
