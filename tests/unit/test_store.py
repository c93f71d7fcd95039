"""The ps shard store: optimizer specs, validation of pushes, updates."""

from __future__ import annotations

import pytest
import torch

from psflow.protocol import OptimizerSpec
from psflow.ps.store import ShardStore

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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.01},  # plain SGD: the ps's own update
        {"lr": 1},  # an integer learning rate, as a user may write it
        {"lr": 0.01, "weight_decay": 0.1},  # torch.optim's step from here on
        {"lr": 0.01, "maximize": True},
        {"lr": 0.01, "momentum": 0.5, "nesterov": True},
    ],
)
def test_every_sgd_setting_matches_torch_bit_for_bit(kwargs: dict[str, object]) -> None:
    torch.manual_seed(0)
    w0, b0 = torch.randn(4, 3), torch.randn(3)
    store = ShardStore()
    store.initialize([("w", w0), ("b", b0)], OptimizerSpec(name="SGD", kwargs=kwargs))
    ref = [w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)]
    ref_opt = torch.optim.SGD(ref, **kwargs)  # type: ignore[arg-type]
    for step in range(4):
        gw, gb = torch.randn(4, 3), torch.randn(3)
        if step == 2:
            # A learning rate changed in place (a restore, a schedule) is the one used next.
            assert store.optimizer is not None
            store.optimizer.param_groups[0]["lr"] = ref_opt.param_groups[0]["lr"] = 0.003
        # Only the weight this step: a variable without a gradient is left alone.
        grads = [("w", gw)] if step == 1 else [("w", gw), ("b", gb)]
        store.apply(grads)
        ref[0].grad = gw.clone()
        ref[1].grad = None if step == 1 else gb.clone()
        ref_opt.step()
    assert torch.equal(store.variables["w"], ref[0].detach())
    assert torch.equal(store.variables["b"], ref[1].detach())
    assert store.step == 4


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("Adam", {"lr": 0.01}),
        ("Adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
        ("Adam", {"lr": 0.01, "maximize": True, "betas": (0.8, 0.99)}),
        ("AdamW", {"lr": 0.01, "weight_decay": 0.05}),
    ],
)
def test_adam_runs_foreach_with_the_bits_of_torchs_default(
    name: str, kwargs: dict[str, object]
) -> None:
    torch.manual_seed(0)
    w0, b0 = torch.randn(64, 33), torch.randn(33)
    store = ShardStore()
    store.initialize([("w", w0), ("b", b0)], OptimizerSpec(name=name, kwargs=kwargs))
    assert store.optimizer is not None and store.optimizer.param_groups[0]["foreach"] is True
    ref = [w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)]
    ref_opt = getattr(torch.optim, name)(ref, **kwargs)  # torch's default on CPU: one by one
    assert not ref_opt.param_groups[0]["foreach"]
    for step in range(6):
        gw, gb = torch.randn(64, 33), torch.randn(33)
        grads = [("w", gw)] if step == 2 else [("w", gw), ("b", gb)]
        store.apply(grads)
        ref[0].grad, ref[1].grad = gw.clone(), None if step == 2 else gb.clone()
        ref_opt.step()
    assert torch.equal(store.variables["w"], ref[0].detach())
    assert torch.equal(store.variables["b"], ref[1].detach())
    chosen = ShardStore()
    chosen.initialize([("w", w0)], OptimizerSpec(name=name, kwargs={**kwargs, "foreach": False}))
    assert chosen.optimizer is not None and chosen.optimizer.param_groups[0]["foreach"] is False


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
