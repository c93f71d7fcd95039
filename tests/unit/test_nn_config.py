"""psflow.nn.TableConfig: a table described once, the modules built from it, the spec from it.

A config builds the module its settings as arguments build (same config, spec and first rows);
a misspelt setting or a bad value is named where the model is built; and the spec a worker sends
the ps for a module comes back to the module's config.
"""

from __future__ import annotations

import dataclasses
import doctest
from typing import Any

import pytest
import torch

import psflow.nn.config
import psflow.protocol
from psflow.nn import Embedding, EmbeddingBag, RowOptimizerSpec, TableConfig
from psflow.protocol import OptimizerSpec, TableSpec
from psflow.sparse import initial_rows
from psflow.worker.tables import table_specs

pytestmark = pytest.mark.unit

N, DIM = 13, 5

FIXED: dict[str, Any] = {
    "num_embeddings": N,
    "embedding_dim": DIM,
    "padding_idx": -2,
    "dtype": torch.float64,
    "partition": "div",
    "seed": 3,
    "init_std": 0.1,
    "optimizer": "Adagrad",
}
HASHED: dict[str, Any] = {
    "num_embeddings": None,
    "embedding_dim": DIM,
    "padding_idx": 7,
    "seed": 2,
    "init_std": 0.5,
    "optimizer": RowOptimizerSpec.of("Ftrl", lr=0.05, l1=1.0),
    "min_count": 5,
    "max_rows": 100,
}


def built(cls: type, settings: dict[str, Any], **module: Any) -> tuple[Any, Any]:
    """The module ``cls`` built from ``settings`` as arguments, and from them as a config."""
    return cls(**settings, **module), cls(config=TableConfig(**settings), **module)


@pytest.mark.parametrize("cls", [Embedding, EmbeddingBag])
def test_a_fixed_table_from_a_config_is_the_one_from_arguments(cls: type) -> None:
    by_args, by_config = built(cls, FIXED)
    assert by_args.config == by_config.config
    assert by_args.spec("t") == by_config.spec("t")
    assert by_config.spec("t") == TableSpec(
        name="t",
        embedding_dim=DIM,
        num_embeddings=N,
        partition="div",
        dtype="float64",
        seed=3,
        init_std=0.1,
        padding_idx=N - 2,  # counted from the end, as torch counts it
        optimizer=RowOptimizerSpec(name="Adagrad"),
    )
    assert by_config.padding_idx == by_config.config.padding_idx == N - 2
    assert torch.equal(by_args.weight, by_config.weight)
    want = initial_rows(3, torch.arange(N), DIM, std=0.1, dtype=torch.float64, padding_idx=N - 2)
    assert torch.equal(by_config.weight.detach(), want)


@pytest.mark.parametrize("cls", [Embedding, EmbeddingBag])
def test_a_hashed_table_from_a_config_is_the_one_from_arguments(cls: type) -> None:
    module = {"mode": "sum"} if cls is EmbeddingBag else {}
    by_args, by_config = built(cls, HASHED, **module)
    assert by_args.config == by_config.config
    assert by_args.spec("users") == by_config.spec("users")
    assert (by_config.spec("users").min_count, by_config.spec("users").max_rows) == (5, 100)
    ids = torch.tensor([[1, 10**12], [7, 3]])
    with torch.no_grad():  # their first rows, as the ps would make them
        first = by_config(ids)
        assert torch.equal(by_args(ids), first)
    if cls is Embedding:
        want = initial_rows(2, ids.reshape(-1), DIM, std=0.5, dtype=torch.float32, padding_idx=7)
        assert torch.equal(first.reshape(-1, DIM), want)


def test_modules_built_from_one_config_share_it() -> None:
    table = TableConfig(num_embeddings=None, embedding_dim=DIM, optimizer="SGD")
    emb, bag = Embedding(config=table), EmbeddingBag(config=table, mode="max", device="meta")
    assert emb.config is table and bag.config is table
    assert bag.mode == "max" and emb.spec("a") == bag.spec("a")
    assert Embedding(N, DIM).config == TableConfig(num_embeddings=N, embedding_dim=DIM)


def test_a_misspelt_setting_is_named_at_construction() -> None:
    with pytest.raises(TypeError, match="optimiser"):
        Embedding(N, DIM, optimiser="Adagrad")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="mdoe"):
        EmbeddingBag(N, DIM, mdoe="sum")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="init_stddev"):
        TableConfig(num_embeddings=N, embedding_dim=DIM, init_stddev=0.1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"optimizer='adagrad'.*unknown row optimizer"):
        Embedding(None, DIM, optimizer="adagrad")
    with pytest.raises(ValueError, match=r"partition must be one of \('mod', 'div'\), got 'Mod'"):
        EmbeddingBag(config=TableConfig(num_embeddings=N, embedding_dim=DIM, partition="Mod"))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"embedding_dim": 0}, "embedding_dim must be an integer >= 1, got 0"),
        ({"embedding_dim": 2.0}, "embedding_dim must be an integer >= 1, got 2.0"),
        ({"num_embeddings": 0}, "num_embeddings must be an integer >= 1, got 0"),
        ({"num_embeddings": "13"}, "num_embeddings must be an integer >= 1, got '13'"),
        ({"padding_idx": N}, f"padding_idx={N} is not within num_embeddings={N}"),
        ({"padding_idx": -N - 1}, f"padding_idx={-N - 1} is not within num_embeddings={N}"),
        ({"num_embeddings": None, "padding_idx": -1}, r"padding_idx=-1 .*hashed.*no end"),
        ({"dtype": torch.float16}, "dtype torch.float16 is not supported"),
        ({"dtype": "float32"}, "dtype float32 is not supported"),
        ({"partition": "range"}, "partition must be one of"),
        ({"num_embeddings": None, "partition": "div"}, "partition 'div' needs num_embeddings"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"init_std": -1.0}, r"init_std must be a number >= 0, got -1\.0"),
        ({"num_embeddings": None, "min_count": -1}, "min_count must be an integer >= 0, got -1"),
        ({"num_embeddings": None, "max_rows": 0}, "max_rows must be an integer >= 1, got 0"),
        ({"min_count": 2}, "min_count and max_rows are for hashed tables"),
        ({"optimizer": "Adadelta"}, "optimizer='Adadelta': unknown row optimizer"),
        ({"optimizer": 0.1}, "optimizer must be one of .*, got 0.1"),
    ],
)
def test_a_bad_value_is_named(settings: dict[str, Any], match: str) -> None:
    table = {"num_embeddings": N, "embedding_dim": DIM, **settings}
    with pytest.raises(ValueError, match=f"^TableConfig: {match}"):
        TableConfig(**table)
    with pytest.raises(ValueError, match=match):  # the same from the arguments
        EmbeddingBag(**table)


def test_settings_go_in_the_config_or_beside_it_never_both() -> None:
    table = TableConfig(num_embeddings=N, embedding_dim=DIM)
    with pytest.raises(TypeError, match=r"init_std, seed given beside config="):
        Embedding(config=table, seed=3, init_std=0.1)
    with pytest.raises(TypeError, match="num_embeddings given beside config="):
        EmbeddingBag(N, config=table)
    with pytest.raises(TypeError, match=r"Embedding\(\) needs num_embeddings and embedding_dim"):
        Embedding()
    with pytest.raises(TypeError, match=r"needs embedding_dim, or config="):
        EmbeddingBag(None, mode="sum")
    with pytest.raises(TypeError, match="config must be a TableConfig"):
        Embedding(config=table.spec("t"))  # type: ignore[arg-type]
    # The module's own arguments go beside it.
    emb = Embedding(config=table, scale_grad_by_freq=True, sparse=True, device="meta")
    assert emb.scale_grad_by_freq and emb.sparse and emb.weight.is_meta


def test_a_weight_gives_its_dtype_and_a_config_checks_it() -> None:
    rows = torch.randn(N, DIM, dtype=torch.float64)
    emb = Embedding(N, DIM, _weight=rows)
    assert emb.config.dtype == torch.float64 and emb.spec("t").dtype == "float64"
    assert Embedding.from_pretrained(rows).config.dtype == torch.float64
    Embedding(
        config=TableConfig(num_embeddings=N, embedding_dim=DIM, dtype=torch.float64), _weight=rows
    )
    wrong = TableConfig(num_embeddings=N, embedding_dim=DIM)  # torch's default, float32
    with pytest.raises(
        ValueError, match=r"_weight is torch.float64, its config says torch.float32"
    ):
        Embedding(config=wrong, _weight=rows)


def test_the_spec_the_worker_sends_comes_back_to_the_config() -> None:
    own = TableConfig(**FIXED)
    hashed = TableConfig(**{**HASHED, "optimizer": None})  # takes the job's optimizer
    model = torch.nn.ModuleDict({"goods": Embedding(config=own), "users": Embedding(config=hashed)})
    job = OptimizerSpec(name="Adagrad", kwargs={"lr": 0.1})
    sent = {s.name: s for s in table_specs(dict(model.items()), job)}  # type: ignore[arg-type]
    received = {n: TableSpec.from_wire(s.to_wire()) for n, s in sent.items()}
    assert received == sent
    assert received["goods"] == own.spec("goods")
    assert TableConfig.from_spec(received["goods"]) == own
    assert received["users"].scheduled  # the worker's doing, not the table's
    back = TableConfig.from_spec(received["users"])
    assert back == dataclasses.replace(hashed, optimizer=received["users"].optimizer)
    assert back.spec("users") == dataclasses.replace(received["users"], scheduled=False)


def test_the_config_has_the_specs_fields_but_its_name_and_the_workers() -> None:
    config = {f.name for f in dataclasses.fields(TableConfig)}
    spec = {f.name for f in dataclasses.fields(TableSpec)}
    # wire_dtype: how a worker's rows travel to and from the ps, not the table the ps holds.
    assert config - {"wire_dtype"} == spec - {"name", "scheduled"}


def test_a_config_is_frozen_and_replace_checks_again() -> None:
    table = TableConfig(num_embeddings=N, embedding_dim=DIM, optimizer="Adam")
    assert table.optimizer == RowOptimizerSpec(name="Adam")
    with pytest.raises(dataclasses.FrozenInstanceError):
        table.seed = 1  # type: ignore[misc]
    assert dataclasses.replace(table, seed=4).seed == 4
    with pytest.raises(ValueError, match="TableConfig: seed must be an integer"):
        dataclasses.replace(table, seed="4")  # type: ignore[arg-type]


def test_row_optimizer_spec_is_reachable_from_psflow_nn() -> None:
    assert psflow.nn.RowOptimizerSpec is psflow.protocol.RowOptimizerSpec
    assert {"TableConfig", "RowOptimizerSpec"} <= set(psflow.nn.__all__)


def test_the_docstring_examples_run() -> None:
    result = doctest.testmod(psflow.nn.config, optionflags=doctest.ELLIPSIS)
    assert result.attempted and result.failed == 0
