"""A sparse job whose pushes and lookups are large enough to stripe (2,048 rows each), for
``psflow launch --ps-threads``: prints each task's thread settings, saves a final checkpoint.

    psflow launch --ps 1 --workers 1 --ps-threads 2 striped_rows.py --logdir L
"""

from __future__ import annotations

import argparse
import os

import torch

import psflow


def main() -> None:
    ctx, argv = psflow.resolve()
    p = argparse.ArgumentParser()
    p.add_argument("--logdir", required=True)
    args = p.parse_args(argv)
    print(
        f"{ctx.task} PSFLOW_PS_THREADS={os.environ.get('PSFLOW_PS_THREADS')} "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        flush=True,
    )
    if ctx.job == "ps":
        psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()
        return
    torch.manual_seed(0)
    table = psflow.nn.Embedding(50_000, 32, optimizer="Adagrad")
    with psflow.TrainingSession(
        table, ctx, optimizer="SGD", lr=0.1, checkpoint_dir=args.logdir
    ) as sess:  # fmt: skip
        for _ in range(8):
            ids = torch.randperm(50_000)[:2048]
            sess.zero_grad()
            table(ids).pow(2).sum().backward()
            sess.step()


if __name__ == "__main__":
    main()
