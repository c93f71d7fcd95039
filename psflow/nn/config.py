"""A table described once: :class:`TableConfig`.

:class:`~psflow.nn.Embedding` and :class:`~psflow.nn.EmbeddingBag` are built from one (given,
or made from torch's keywords by :func:`table_config`), and the
:class:`~psflow.protocol.TableSpec` a ps creates the table from is derived from it
(:meth:`TableConfig.spec`), as TorchRec's modules, sharders and checkpoints all read one
``EmbeddingBagConfig``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal, TypeGuard

import torch

from psflow.protocol import ROW_OPTIMIZERS, RowOptimizerSpec, TableSpec

DTYPES: dict[torch.dtype, str] = {torch.float32: "float32", torch.float64: "float64"}
"""The dtypes a table may hold, with their names in a :class:`TableSpec`."""

WIRE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
"""The dtypes a table's rows may travel in between a worker and the ps (``wire_dtype``)."""

_NOT_SPEC = ("wire_dtype",)
"""Fields of a config that are not the ps's table (:class:`TableSpec`): how this worker talks
to it."""

_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}

_CHECKED = "<config>"
"""The name of the spec a config checks itself with (a config has no name of its own)."""


@dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table: its size, how its rows start, how the ps shards and updates them.

    The fields are :class:`~psflow.protocol.TableSpec`'s, the table the ps creates, less its
    ``name`` (the module's path in the model, known when a worker places it) and ``scheduled``
    (set by the worker when the table takes the job's optimizer), in torch's terms: a
    ``torch.dtype``, an optimizer by name. Checked by the spec's own rules when made, so a bad
    value is named where the model is built. Frozen: modules built from one config share it.

    What a module does with the rows (``mode``, ``scale_grad_by_freq``, ``sparse``) and where
    this process builds it (``device``) are the module's arguments, not the table's.

    Example:
        >>> from psflow.nn import EmbeddingBag, TableConfig
        >>> users = TableConfig(num_embeddings=None, embedding_dim=16, optimizer="Adagrad")
        >>> bag = EmbeddingBag(config=users, mode="sum")
        >>> bag.config is users, bag.spec("users") == users.spec("users")
        (True, True)
        >>> TableConfig.from_spec(users.spec("users")) == users
        True
        >>> users.optimizer.settings["lr"]   # a name is kept as its RowOptimizerSpec
        0.01
    """

    num_embeddings: int | None
    """Rows (ids ``0 .. num_embeddings - 1``); ``None``: a hashed table, any int64 id a row,
    created on its first update."""
    embedding_dim: int
    """Columns of a row (>= 1)."""
    padding_idx: int | None = None
    """A row that stays zero and gets no gradient; negative counts from the end (fixed-size
    tables), as in torch, and is kept as the id it names."""
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    """The rows' dtype, ``torch.float32`` or ``torch.float64``; by default torch's default
    dtype when the config is made (as a module built with torch's arguments takes it then)."""
    partition: str = "mod"
    """How the ps shards the rows, TensorFlow's ``partition_strategy``: ``"mod"`` (id ``i`` on
    shard ``i % S``) or ``"div"`` (contiguous ranges; fixed-size tables only)."""
    seed: int = 0
    """Seeds the initial rows: row ``i`` starts the same on every process and shard."""
    init_std: float = 1.0
    """Rows start ``N(0, init_std²)`` (torch's ``N(0, 1)`` by default)."""
    optimizer: RowOptimizerSpec | str | None = None
    """The rows' row-wise optimizer: a name (``"SGD"``, ``"Adagrad"``, ``"RowWiseAdagrad"``,
    ``"Adam"``, ``"Ftrl"``, kept as its :class:`~psflow.protocol.RowOptimizerSpec`) or a spec
    with arguments; ``None``: the job's optimizer, in row-wise form. A hashed table trained on
    this process needs one."""
    min_count: int = 0
    """Hashed tables: an id is given a row at its ``min_count``-th update (0 and 1: at once);
    the gradients of an id seen fewer times are dropped."""
    max_rows: int | None = None
    """Hashed tables: rows kept per ps shard; past it the least recently updated are evicted.
    A hard cap: no checkpoint or export of a shard holds more."""
    ttl_seconds: float | None = None
    """Hashed tables: a row not updated for this many seconds is evicted (its id becomes a
    tombstone in the next incremental export); ``None``: rows never expire."""
    wire_dtype: torch.dtype | None = None
    """The dtype the table's rows and row gradients travel in between a worker and the ps:
    ``torch.bfloat16`` or ``torch.float16`` halves the bytes of a lookup and of a push's
    rows; ``None`` (or the rows' own dtype): as the table holds them. The ps keeps its rows
    and their optimizer state in :attr:`dtype` and casts a gradient up before applying it;
    the worker casts the rows it gets back to :attr:`dtype`. ``bfloat16`` is the one to
    choose: float32's range, 8 bits of mantissa. ``float16`` keeps 11 bits but tops out at
    65504 and flushes gradients under about 6e-8 to zero: a row or gradient that does not fit
    is refused with an error naming the table, never sent. A table held on this process (no
    ps, a cluster of one) has no wire and ignores it. Not part of the table the ps holds
    (:meth:`spec`): checkpoints and exports are the same whatever it is."""

    def __post_init__(self) -> None:
        optimizer = self.optimizer
        if isinstance(optimizer, str):
            try:
                optimizer = RowOptimizerSpec.of(optimizer)
            except ValueError as e:
                raise ValueError(f"TableConfig: optimizer={self.optimizer!r}: {e}") from None
            object.__setattr__(self, "optimizer", optimizer)
        elif optimizer is not None and not isinstance(optimizer, RowOptimizerSpec):
            raise ValueError(
                f"TableConfig: optimizer must be one of {sorted(ROW_OPTIMIZERS)}, a "
                f"RowOptimizerSpec or None, got {optimizer!r}"
            )
        if self.dtype not in _BY_NAME.values():
            raise ValueError(
                f"TableConfig: dtype {self.dtype} is not supported: a table holds "
                "torch.float32 or torch.float64"
            )
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"TableConfig: wire_dtype={self.wire_dtype!r} is not supported: rows travel as "
                "torch.bfloat16, torch.float16 or torch.float32 (None: as the table holds them)"
            )
        n, padding = self.num_embeddings, self.padding_idx
        if _is_int(padding) and padding < 0 and n is None:
            raise ValueError(
                f"TableConfig: padding_idx={padding} counts from the end of the table, and a "
                "hashed table (num_embeddings=None) has no end: give the id itself"
            )
        if _is_int(padding) and _is_int(n):
            if not -n <= padding < n:
                raise ValueError(
                    f"TableConfig: padding_idx={padding} is not within num_embeddings={n}"
                )
            object.__setattr__(self, "padding_idx", padding % n)
        # Every other rule is the spec's, the one the ps applies.
        try:
            self.spec(_CHECKED)
        except ValueError as e:
            message = str(e).removeprefix(f"table {_CHECKED!r}: ")
            raise ValueError(f"TableConfig: {message}") from None

    @property
    def hashed(self) -> bool:
        """Whether any int64 id is a row (``num_embeddings=None``)."""
        return self.num_embeddings is None

    def spec(self, name: str, *, dtype: torch.dtype | None = None) -> TableSpec:
        """The table as a ps creates it, called ``name``.

        Args:
            name: the module's path in the model.
            dtype: the rows' dtype if not the config's (a module's weight, which ``.double()``
                may have changed since).
        """
        dtype = self.dtype if dtype is None else dtype
        if dtype not in DTYPES:
            raise ValueError(
                f"table {name!r}: its rows are {dtype}; a table on the ps holds float32 or float64"
            )
        settings = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SPEC}
        return TableSpec(**{**settings, "name": name, "dtype": DTYPES[dtype]})

    def wire_name(self, dtype: torch.dtype | None = None) -> str | None:
        """The name of :attr:`wire_dtype` when the rows travel narrower than they are held
        (``dtype``, the module's, if not the config's); ``None`` when they travel as held."""
        held = DTYPES.get(self.dtype if dtype is None else dtype)
        wire = None if self.wire_dtype is None else WIRE_DTYPES[self.wire_dtype]
        return None if wire is None or wire == held else wire

    @classmethod
    def from_spec(cls, spec: TableSpec) -> TableConfig:
        """The config ``spec`` was derived from: its fields less ``name`` and ``scheduled``."""
        settings = {f.name: getattr(spec, f.name) for f in fields(cls) if f.name not in _NOT_SPEC}
        return cls(**{**settings, "dtype": _BY_NAME[spec.dtype]})


class _Unset(enum.Enum):
    UNSET = "unset"

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Final = _Unset.UNSET
"""A table setting a module's constructor was not given: the config's (or its default)."""

Unset = Literal[_Unset.UNSET]


def table_config(
    kind: str, config: TableConfig | None, weight: torch.Tensor | None, **given: Any
) -> TableConfig:
    """The config a module of class ``kind`` is built from: ``config``, or one made of the
    table settings it was given (torch's ``num_embeddings``, ``embedding_dim``,
    ``padding_idx``, ``dtype``, and psflow's), left :data:`UNSET` where not given. A
    ``weight`` (torch's ``_weight``) gives the rows' dtype, as in torch.

    Raises:
        TypeError: for settings given beside ``config``, neither a config nor the table's
            size, or a ``config`` that is no :class:`TableConfig`.
        ValueError: for a bad setting (:class:`TableConfig` names it).
    """
    settings = {k: v for k, v in given.items() if v is not UNSET}
    if "dtype" in settings and settings["dtype"] is None:  # torch's: the default dtype
        del settings["dtype"]
    if config is not None:
        if not isinstance(config, TableConfig):
            raise TypeError(f"{kind}: config must be a TableConfig, got {config!r}")
        if settings:
            raise TypeError(
                f"{kind}: {', '.join(sorted(settings))} given beside config=: set them in the "
                "TableConfig (dataclasses.replace(config, ...) makes one that differs)"
            )
        return config
    missing = [k for k in ("num_embeddings", "embedding_dim") if k not in settings]
    if missing:
        raise TypeError(
            f"{kind}() needs {' and '.join(missing)}, or config=TableConfig(...) to build from"
        )
    if weight is not None:
        settings["dtype"] = weight.dtype
    return TableConfig(**settings)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)
