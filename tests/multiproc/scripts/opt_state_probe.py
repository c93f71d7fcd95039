"""A script for the optimizer-state tests: a job that goes on from a torch run's Adam.

    psflow launch [--ps N | --mode allreduce] --workers 2 opt_state_probe.py

Each worker trains the same small MLP for three steps with torch's Adam in-process (the
"earlier run"), then starts a ``TrainingSession`` from that run's values and optimizer state
and takes one step on the batch the earlier run's fourth step uses (the same batch on every
worker, so the averaged gradient is that batch's). It prints the largest difference between
the session's parameters and the earlier run's after its own fourth step:
``[worker:<i>] max diff <d>``.
"""

from __future__ import annotations

import logging

import torch

import psflow
from psflow.train import TrainingSession


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    return x, x.sum(1, keepdim=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, _ = psflow.resolve()
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()
        return

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    earlier = mlp()
    adam = torch.optim.Adam(earlier.parameters(), lr=0.05)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer | TrainingSession, i: int) -> None:
        x, y = batch(i)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()

    for i in range(3):
        step(earlier, adam, i)
    model = mlp()
    model.load_state_dict(earlier.state_dict())
    names = {id(p): n for n, p in earlier.named_parameters()}
    state = {names[id(p)]: s for p, s in adam.state.items()}
    with TrainingSession(
        model,
        ctx,
        optimizer="Adam",
        lr=0.05,
        optimizer_state=state,
        log_step_count_steps=None,
        save_summaries_steps=None,
    ) as sess:
        step(model, sess, 3)
    step(earlier, adam, 3)
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(model.parameters(), earlier.parameters(), strict=True)
    )
    print(f"[{ctx.task}] max diff {diff:.3g}", flush=True)


if __name__ == "__main__":
    main()
