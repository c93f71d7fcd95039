"""A training script for the cross-mode checkpoint tests: a small MLP trained with Adam.

    psflow launch [--ps N | --mode allreduce] --workers 2 adam_probe.py --logdir D --steps S
        [--dump DIR]

Every task runs it (the ps tasks serve). The chief restores the latest checkpoint under D,
trains until global step S and saves a final checkpoint. With ``--dump``, each worker writes
what it ends with to ``DIR/worker-<i>.safetensors``: its parameters (``param/<name>``) and, in
all-reduce mode, where the optimizer lives on the worker, the optimizer's state tensors
(``opt/<name>/<key>``), with the global step in the metadata.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import psflow
from psflow.train import TrainingSession
from psflow.worker.allreduce import AllReduceEngine


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, argv = psflow.resolve()
    parser = argparse.ArgumentParser()
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--dump", default=None)
    args = parser.parse_args(argv)
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()
        return

    torch.manual_seed(ctx.index)  # different on each worker: the chief's values win
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = torch.Generator().manual_seed(100 + ctx.index)
    with TrainingSession(
        model,
        ctx,
        optimizer="Adam",
        lr=0.01,
        checkpoint_dir=args.logdir,
        save_checkpoint_steps=10**6,  # the final checkpoint only
        last_step=args.steps,
        log_step_count_steps=None,
        save_summaries_steps=None,
    ) as sess:
        while not sess.should_stop():
            x = torch.randn(8, 4, generator=data)
            loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
            sess.zero_grad()
            loss.backward()
            sess.step(loss=loss)
    if args.dump is None:
        return
    state = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    engine = sess.opt.engine
    if isinstance(engine, AllReduceEngine):
        names = [n for n, _ in model.named_parameters()]
        for index, entry in engine.optimizer.state_dict()["state"].items():
            for key, value in entry.items():
                state[f"opt/{names[index]}/{key}"] = value
    out = Path(args.dump) / f"{ctx.task.job}-{ctx.task.index}.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={"global_step": str(sess.global_step)})


if __name__ == "__main__":
    main()
