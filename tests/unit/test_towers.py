"""Towers: the gradient of a batch split across replicas equals the full-batch gradient."""

from __future__ import annotations

import copy

import pytest
import torch

import psflow.nn as pnn
from psflow.worker import Towers


def _model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return (
        torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
        .double()
        .to(device)
    )


def _loss(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(x), y)


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def _full_batch_grads(x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
    ref = _model()
    loss = _loss(ref, x, y)
    loss.backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}, loss.item()  # type: ignore[union-attr]


@pytest.mark.parametrize(("towers", "n"), [(2, 8), (3, 10), (4, 3)])
def test_cpu_towers_equal_the_full_batch_gradient(towers: int, n: int) -> None:
    x, y = _data(n)
    want, want_loss = _full_batch_grads(x, y)
    model = _model()
    t = Towers(model, ["cpu"] * towers)
    for _ in range(2):  # twice: the gradients are overwritten, not accumulated
        loss = t.backward(_loss, x, y)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    for name, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(p.grad, want[name], rtol=1e-10, atol=1e-12)


def test_towers_follow_the_main_model_after_an_update() -> None:
    x, y = _data(6)
    model = _model()
    t = Towers(model, ["cpu", "cpu"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # what a pull from the ps does
    t.backward(_loss, x, y)
    ref = _model()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.5)
    _loss(ref, x, y).backward()
    for (name, p), rp in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_bad_towers_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        Towers(_model(), [])
    with pytest.raises(ValueError, match="unknown reduction"):
        Towers(_model(), ["cpu"], reduction="max")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda:0 is not available"):
            Towers(_model(), ["cuda:0"])
    with_table = torch.nn.Sequential(pnn.Embedding(10, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"'0' is a psflow\.nn table: look its rows up once"):
        Towers(with_table, ["cpu", "cpu"])
    t = Towers(_model(), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="differ in batch size"):
        t.backward(_loss, torch.zeros(4, 5, dtype=torch.float64), torch.zeros(3, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_towers_equal_the_full_batch_gradient() -> None:
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] * (
        2 if torch.cuda.device_count() == 1 else 1
    )
    x, y = _data(16)
    want, _ = _full_batch_grads(x, y)
    model = _model()
    Towers(model, devices).backward(_loss, x, y)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.device.type == "cpu"
        torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-11)


def test_buffers_a_forward_changes_are_the_first_towers() -> None:
    """BatchNorm's running statistics: the main model kept its initial ones for good (eval
    mode, the evaluator and exports used them), and each batch reset the replicas' to them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )
    first = copy.deepcopy(model)  # one device, fed what the first tower is fed
    towers = Towers(model, ["cpu", "cpu"])
    for _ in range(5):
        x, y = torch.randn(8, 3) * 3 + 5, torch.randn(8, 1)
        towers.backward(lambda m, a, b: ((m(a) - b) ** 2).mean(), x, y)
        first(torch.chunk(x, 2)[0])
    for name, b in first.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], b), name
    assert int(model[1].num_batches_tracked) == 5
