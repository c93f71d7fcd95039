"""Deterministic models, data and single-process references for the training-mode tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

DIM = 6


def make_model(kind: str) -> torch.nn.Module:
    """A float64 model with a fixed initialisation (exact comparisons need float64).

    The values come from a private generator: worker threads must not race on the global one.
    """
    if kind == "linear":
        model: torch.nn.Module = torch.nn.Linear(DIM, 1)
    elif kind == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(DIM, 16),
            torch.nn.Tanh(),
            torch.nn.Linear(16, 8),
            torch.nn.Tanh(),
            torch.nn.Linear(8, 1),
        )
    else:
        raise ValueError(kind)
    model = model.double()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / p.shape[-1] ** 0.5)
    return model


def batch(step: int, worker: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch for global step ``step``: a pure function of both."""
    g = torch.Generator().manual_seed(step * 1000 + worker)
    x = torch.randn(size, DIM, generator=g, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(
        size, 1, generator=g, dtype=torch.float64
    )
    return x, y


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def reference(kind: str, lr: float, chosen: list[list[int]], size: int) -> dict[str, torch.Tensor]:
    """One process: for each step, SGD on the concatenated batches of the chosen workers."""
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step, workers in enumerate(chosen):
        parts = [batch(step, w, size) for w in workers]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def run_threads(targets: list[Callable[[], Any]], timeout: float = 60) -> list[Any]:
    """Runs each target in a thread; returns their results, re-raising the first error."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException | None] = [None] * len(targets)

    def run(i: int) -> None:
        try:
            results[i] = targets[i]()
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a worker thread hung"
    for e in errors:
        if e is not None:
            raise e
    return results


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        diff = (got[name] - want[name]).abs().max().item()
        scale = want[name].abs().max().item()
        assert diff <= rtol * max(scale, 1e-12), f"{name}: max diff {diff:.3g}, scale {scale:.3g}"
