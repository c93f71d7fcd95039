"""A dense optimizer's first state given by the script (psflow.worker.opt_state): checked
against what torch's optimizer keeps, placed on the shards with the parameters' pieces."""

from __future__ import annotations

import pytest
import torch

import psflow.nn as pnn
from psflow.protocol import OptimizerSpec
from psflow.worker.opt_state import (
    check_optimizer_state,
    load_optimizer_state,
    place_optimizer_state,
)
from psflow.worker.placement import Piece, dense_parameters

pytestmark = pytest.mark.unit


def _model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    model.add_module("emb", pnn.Embedding(10, 4))
    return model


def _adam_state(shape: tuple[int, ...], step: int | torch.Tensor = 5) -> dict[str, object]:
    return {"step": step, "exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape)}


def test_state_is_checked_and_normalised() -> None:
    model = _model()
    spec = OptimizerSpec.of("Adam", lr=0.1)
    given = {"0.weight": _adam_state((4, 3), step=torch.tensor([7.0]))}
    state = check_optimizer_state(spec, dense_parameters(model), given)
    assert sorted(state["0.weight"]) == ["exp_avg", "exp_avg_sq", "step"]
    step = state["0.weight"]["step"]
    assert step.dim() == 0 and step.item() == 7.0 and step.dtype == torch.float32
    assert torch.equal(state["0.weight"]["exp_avg"], given["0.weight"]["exp_avg"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "name", "given", "match"),
    [
        ("Adam", {}, "nope", {}, r"no trained parameter 'nope' \(it has \['0.bias'"),
        ("Adam", {}, "emb.weight", {}, "embedding table 'emb'.*from_pretrained"),
        ("Adam", {}, "0.weight", {"exp_avg": 0}, r"keeps \['exp_avg', 'exp_avg_sq', 'step'\]"),
        ("Adagrad", {}, "0.weight", _adam_state((4, 3)), r"not its \['exp_avg', 'exp_avg_sq'\]"),
        ("Adam", {}, "0.weight", _adam_state((3, 4)), r"shape \[3, 4\], the parameter \[4, 3\]"),
        ("Adam", {}, "0.weight", _adam_state((4, 3), step=torch.ones(2)), "must be a scalar"),
        ("Adam", {}, "0.weight", {**_adam_state((4, 3)), "exp_avg": 1.0}, "must be a tensor"),
        ("SGD", {}, "0.weight", {}, "keeps no state"),
        ("SGD", {"momentum": 0.9}, "0.weight", {"momentum": 1}, r"keeps \['momentum_buffer'\]"),
        ("Adam", {}, "0.weight", [1, 2], "must map state keys"),
    ],
)
def test_bad_state_is_named(
    optimizer: str, kwargs: dict[str, float], name: str, given: object, match: str
) -> None:
    spec = OptimizerSpec.of(optimizer, **kwargs)
    model = _model()
    with pytest.raises(ValueError, match=match):
        check_optimizer_state(spec, dense_parameters(model), {name: given}, tables=["emb"])  # type: ignore[dict-item]


def test_a_frozen_parameter_takes_no_state() -> None:
    model = _model()
    model[1].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'1\.bias' does not train"):
        check_optimizer_state(
            OptimizerSpec.of("SGD", momentum=0.9),
            dense_parameters(model),
            {"1.bias": {"momentum_buffer": torch.zeros(1)}},
        )


def test_a_partitioned_parameter_takes_its_rows_of_the_state() -> None:
    state = {
        "w": {"step": torch.tensor(3.0), "exp_avg": torch.arange(12.0).view(6, 2)},
        "b": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)},
    }
    pieces = [
        Piece(var="w/part_0", param="w", shard=0, rows=(0, 4)),
        Piece(var="w/part_1", param="w", shard=1, rows=(4, 6)),
        Piece(var="b", param="b", shard=1),
        Piece(var="c", param="c", shard=0),  # no state given
    ]
    tensors, header = place_optimizer_state(pieces, state)
    assert header == {0: {"w/part_0": {}}, 1: {"w/part_1": {}, "b": {}}}
    got = {s: dict(ts) for s, ts in tensors.items()}
    assert torch.equal(got[0]["w/part_0/opt/exp_avg"], torch.arange(8.0).view(4, 2))
    assert torch.equal(got[1]["w/part_1/opt/exp_avg"], torch.arange(8.0, 12.0).view(2, 2))
    assert got[1]["w/part_1/opt/step"].item() == 3.0 and "b/opt/exp_avg" in got[1]


def test_loaded_state_takes_the_step_a_single_process_run_takes() -> None:
    """All-reduce mode's path: the state loaded into a fresh optimizer makes the next step
    the one the optimizer that kept the state takes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(8, 3)
    first = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(3):
        first.zero_grad()
        model(x).square().sum().backward()
        first.step()
    twin.load_state_dict(model.state_dict())
    spec = OptimizerSpec.of("Adam", lr=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    given = {names[id(p)]: s for p, s in first.state.items()}
    fresh = spec.build(list(twin.parameters()))
    load_optimizer_state(
        fresh,
        dict(twin.named_parameters()),
        check_optimizer_state(spec, dict(twin.named_parameters()), given),
    )
    for opt, m in ((first, model), (fresh, twin)):
        opt.zero_grad()
        m(x).square().sum().backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_state_keys_are_torchs_for_the_arguments() -> None:
    adam = OptimizerSpec.of("Adam", lr=0.1).state_keys()
    assert adam == {
        "step": (False, torch.float32),
        "exp_avg": (True, torch.float32),
        "exp_avg_sq": (True, torch.float32),
    }
    assert "max_exp_avg_sq" in OptimizerSpec.of("Adam", amsgrad=True).state_keys()
    assert OptimizerSpec.of("SGD").state_keys() == {}
    assert OptimizerSpec.of("SGD", momentum=0.9).state_keys(torch.float64) == {
        "momentum_buffer": (True, torch.float64)
    }
    with pytest.raises(ValueError, match="LBFGS does not step without a closure"):
        OptimizerSpec.of("LBFGS").state_keys()
