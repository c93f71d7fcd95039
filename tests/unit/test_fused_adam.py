"""psflow.ps.fused_adam: a shard's fused Adam step without torch.optim's Python, to the bit of
``Adam.step``; a shard's pushes take it, and a restore's state is the one it steps."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch

from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.ps.fused_adam import FusedAdam
from psflow.ps.optimizer_state import load_optimizer_state
from psflow.ps.store import ShardStore

pytestmark = pytest.mark.unit

SHAPES = [(64, 13), (64,), (32, 64), (1,)]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) * (10.0 ** (step % 3 - 1)) for s in SHAPES]


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def state_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in opt.param_groups[0]["params"]:
        out += [opt.state[p][k] for k in sorted(opt.state[p])]
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"weight_decay": 0.01, "eps": 1e-6},
        {"amsgrad": True},
        {"maximize": True, "betas": (0.8, 0.99)},
    ],
    ids=["plain", "weight_decay", "amsgrad", "maximize"],
)
def test_the_same_bits_as_adam_step(settings: dict[str, Any]) -> None:
    """Steps by Adam.step and by FusedAdam (after Adam.step's first, which makes the state),
    the rate moved between them as a schedule moves it: the same parameters and state."""
    ref_params, fast_params = params(), params()
    ref = torch.optim.Adam(ref_params, lr=0.01, fused=True, **settings)
    opt = torch.optim.Adam(fast_params, lr=0.01, fused=True, **settings)
    fast = FusedAdam.of(opt)
    assert fast is not None
    for step in range(6):
        gs = grads(step)
        if step == 3:
            ref.param_groups[0]["lr"] = opt.param_groups[0]["lr"] = 0.004
        for p, g in zip(ref_params, gs, strict=True):
            p.grad = g
        ref.step()
        took = fast.step([g.clone() for g in gs])
        if not took:
            assert step == 0  # no state yet: Adam.step's
            for p, g in zip(fast_params, gs, strict=True):
                p.grad = g
            opt.step()
    for a, b in zip([*ref_params, *state_of(ref)], [*fast_params, *state_of(opt)], strict=True):
        assert torch.equal(a, b)


def test_a_restored_state_is_the_one_it_steps() -> None:
    """``load_state_dict`` (a restore) replaces the state: the lists are made again from it,
    and the old tensors are left alone."""
    opt = torch.optim.Adam(params(), lr=0.01, fused=True)
    fast = FusedAdam.of(opt)
    assert fast is not None
    for p, g in zip(opt.param_groups[0]["params"], grads(0), strict=True):
        p.grad = g
    opt.step()
    assert fast.step(grads(1))
    old = [t.clone() for t in state_of(opt)]
    old_objects = state_of(opt)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors, the same values
    assert fast.step(grads(2))
    assert all(torch.equal(a, b) for a, b in zip(old_objects, old, strict=True))
    assert not torch.equal(state_of(opt)[0], old[0])


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.01),  # not fused
        lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True, capturable=True),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.01),
        lambda ps: torch.optim.Adam([{"params": ps[:2]}, {"params": ps[2:]}], lr=0.01, fused=True),
    ],
    ids=["foreach", "capturable", "adamw", "sgd", "two_groups"],
)
def test_only_a_plain_fused_adam_is_taken(make: Any) -> None:
    assert FusedAdam.of(make(params())) is None


def test_a_shards_pushes_take_it_with_adam_steps_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard with a fused Adam and a schedule: its pushes (the gradients in another order
    than the variables') step by FusedAdam from the second on, to the bits of a torch Adam
    stepped with the same gradients and rates; a restore of its state goes on from it."""
    taken = []
    step = FusedAdam.step
    monkeypatch.setattr(FusedAdam, "step", lambda self, g: taken.append(step(self, g)) or taken[-1])
    names = [f"v{i}" for i in range(len(SHAPES))]
    store = ShardStore()
    spec = OptimizerSpec.of("Adam", lr=0.01, fused=True)
    schedule = ScheduleSpec(name="StepLR", kwargs={"step_size": 2, "gamma": 0.5})
    store.initialize(list(zip(names, params(), strict=True)), spec, schedule=schedule)
    ref_params = params()
    ref = torch.optim.Adam(ref_params, lr=0.01, fused=True)
    for i in range(5):
        gs = grads(i)
        store.apply(list(zip(names, gs, strict=True))[::-1])
        ref.param_groups[0]["lr"] = store.optimizer.param_groups[0]["lr"]
        for p, g in zip(ref_params, gs, strict=True):
            p.grad = g
        ref.step()
    assert taken == [False, True, True, True, True]
    for name, p in zip(names, ref_params, strict=True):
        assert torch.equal(store.variables[name], p)
    saved = store.optimizer.state_dict()
    tensors = {
        n: {k: v for k, v in saved["state"][i].items() if isinstance(v, torch.Tensor)}
        for i, n in enumerate(names)
    }
    load_optimizer_state(store, tensors, {})
    store.apply(list(zip(names, grads(5), strict=True)))
    for p, g in zip(ref_params, grads(5), strict=True):
        p.grad = g
    ref.param_groups[0]["lr"] = store.optimizer.param_groups[0]["lr"]
    ref.step()
    assert taken[-1] is True
    for name, p in zip(names, ref_params, strict=True):
        assert torch.equal(store.variables[name], p)


@pytest.mark.parametrize(
    ("key", "value"), [("exp_avg", torch.tensor(3.0)), ("step", torch.ones(2))]
)
def test_restored_state_of_the_wrong_shape_is_refused_before_a_kernel_reads_it(
    key: str, value: torch.Tensor
) -> None:
    """A checkpoint's (or an init's) moment as a scalar passed the old check (any scalar went):
    the fused kernels then wrote past it (wrong values, then a heap abort)."""
    names = [f"v{i}" for i in range(len(SHAPES))]
    store = ShardStore()
    store.initialize(list(zip(names, params(), strict=True)), OptimizerSpec.of("Adam", fused=True))
    store.apply(list(zip(names, grads(0), strict=True)))
    saved = store.optimizer.state_dict()
    tensors = {
        n: {k: v for k, v in saved["state"][i].items() if isinstance(v, torch.Tensor)}
        for i, n in enumerate(names)
    }
    tensors["v0"][key] = value
    want = "a scalar" if key == "step" else str(list(SHAPES[0]))
    with pytest.raises(
        ValueError, match=rf"'v0'/'{key}' has shape .*: Adam keeps {re.escape(want)}"
    ):
        load_optimizer_state(store, tensors, {})
