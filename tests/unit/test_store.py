"""The ps shard store: optimizer specs, validation of pushes, updates."""

from __future__ import annotations

import pytest
import torch

from psflow.ps.store import OptimizerSpec, ShardStore

pytestmark = pytest.mark.unit


def test_sgd_update_matches_torch() -> None:
    store = ShardStore()
    w0 = torch.randn(3, 2)
    store.initialize([("w", w0)], OptimizerSpec(name="SGD", kwargs={"lr": 0.5, "momentum": 0.9}))
    ref = w0.clone().requires_grad_(True)
    ref_opt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    for i in range(3):
        g = torch.full((3, 2), float(i + 1))
        assert store.apply([("w", g)]) == i + 1
        ref.grad = g.clone()
        ref_opt.step()
    assert torch.equal(store.variables["w"], ref.detach())
    assert store.variables["w"].grad is None


def test_adam_with_list_betas_from_the_wire() -> None:
    spec = OptimizerSpec.from_wire({"name": "Adam", "kwargs": {"lr": 0.1, "betas": [0.8, 0.9]}})
    store = ShardStore()
    store.initialize([("w", torch.zeros(2))], spec)
    store.apply([("w", torch.ones(2))])
    assert torch.allclose(store.variables["w"], torch.full((2,), -0.1))


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("os.system", {}, "unknown optimizer"),
        ("Optimizer", {}, "expected a torch.optim"),  # the base class cannot step
        ("SGD", {"lr": {"x": 1}}, "not a plain value"),
    ],
)
def test_bad_optimizer_spec(name: str, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerSpec(name=name, kwargs=kwargs).build([torch.zeros(1)])


def test_bad_optimizer_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"cannot build torch\.optim\.SGD"):
        OptimizerSpec(name="SGD", kwargs={"lr": 0.1, "warp": 9}).build([torch.zeros(1)])


@pytest.mark.parametrize(
    ("grads", "message"),
    [
        ([("nope", torch.zeros(2))], "unknown variable 'nope'"),
        ([("w", torch.zeros(3))], "shape \\[3\\] does not match the stored \\[2\\]"),
        ([("w", torch.zeros(2, dtype=torch.float64))], "dtype float64 does not match"),
        ([("w", torch.zeros(2)), ("w", torch.zeros(2))], "appears twice"),
    ],
)
def test_bad_pushes_leave_the_variables_alone(
    grads: list[tuple[str, torch.Tensor]], message: str
) -> None:
    store = ShardStore()
    store.initialize([("w", torch.ones(2))], OptimizerSpec())
    with pytest.raises(ValueError, match=message):
        store.apply(grads)
    assert torch.equal(store.variables["w"], torch.ones(2)) and store.step == 0


def test_initialise_rejects_non_finite_and_twice() -> None:
    with pytest.raises(ValueError, match="not finite"):
        ShardStore().initialize([("w", torch.tensor([float("nan")]))], OptimizerSpec())
    store = ShardStore()
    store.initialize([("w", torch.ones(1))], OptimizerSpec())
    with pytest.raises(ValueError, match="already"):
        store.initialize([("w", torch.ones(1))], OptimizerSpec())
