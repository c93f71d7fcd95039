"""The classic distributed TensorFlow example: learn y = 2x + 0.3 on parameter servers.

    psflow launch --ps 1 --workers 2 examples/linear_regression.py --logdir runs/linreg
    psflow launch --workers 2 --mode allreduce examples/linear_regression.py --logdir runs/ar
    psflow launch --ps 1 --workers 2 --evaluator examples/linear_regression.py --logdir runs/linreg
    python examples/linear_regression.py --logdir runs/alone   # alone: a cluster of one

Every task runs this same script and learns its role from TF_CONFIG (set by the launcher) or
the classic flags (--ps_hosts --worker_hosts --job_name --task_index). The ps tasks hold W and
b and apply SGD; each worker draws one example per step, pushes its gradient and pulls the new
values. The chief restores the latest checkpoint under --logdir (or initialises), saves
checkpoints and TensorBoard summaries there (``tensorboard --logdir runs/linreg``), and prints
the result, `W=... b=...`, once the global step reaches --train_steps. Run the same command
again after killing it (or after it finished) and it resumes from the last checkpoint; SIGTERM
stops it cleanly with a final checkpoint. With `--mode allreduce` there is no ps: the workers
average their gradients with torch.distributed and the chief saves its own copy. With
`--evaluator` an evaluator task scores each checkpoint on 1,000 held-out points (`eval/loss` in
TensorBoard, under runs/linreg/eval) and exits after the final one. Started with no cluster, the
same script trains in its one process, with the same checkpoints and summaries.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F

import psflow
from psflow.train import TrainingSession


def points(n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples of y = 2x + 0.3 plus noise, x uniform in [-1, 1)."""
    x = torch.rand(n, 1, generator=generator) * 2 - 1
    return x, 2 * x + 0.3 + 0.1 * torch.randn(n, 1, generator=generator)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ctx, argv = psflow.resolve_or_alone()  # no cluster given: a cluster of one, this process
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_steps", type=int, default=10000, help="global steps to train")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logdir", default=None, help="checkpoints and TensorBoard summaries")
    parser.add_argument("--save_checkpoint_steps", type=int, default=1000)
    parser.add_argument("--log_step_count_steps", type=int, default=1000, help="progress every")
    parser.add_argument(
        "--replicas_to_aggregate",
        type=int,
        default=None,
        help="with --mode sync: gradients averaged per step (fewer than the workers: backups)",
    )
    args = parser.parse_args(argv)

    if ctx.job == "ps":
        # Saves go only under --logdir: the ps refuses to write its shard anywhere else.
        psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()  # until workers are done
        return

    torch.manual_seed(args.seed + ctx.index)
    model = torch.nn.Linear(1, 1)  # z = w*x + b
    if ctx.is_evaluator:
        x, y = points(1000, torch.Generator().manual_seed(1234))  # held out: never trained on
        psflow.Evaluator(model, lambda m: {"loss": F.mse_loss(m(x), y)}, args.logdir).run()
        return
    with TrainingSession(
        model,
        ctx,
        optimizer="SGD",
        lr=args.lr,
        checkpoint_dir=args.logdir,
        save_checkpoint_steps=args.save_checkpoint_steps,
        last_step=args.train_steps,
        log_step_count_steps=args.log_step_count_steps,
        replicas_to_aggregate=args.replicas_to_aggregate,
    ) as sess:
        while not sess.should_stop():
            x, y = points(1)
            loss = F.mse_loss(model(x), y)
            sess.zero_grad()
            loss.backward()
            sess.step(loss=loss, examples=1)
    # The session's end pulled the final values (the other workers' last updates too).
    if ctx.is_chief:
        print(f"W={model.weight.item():.4f} b={model.bias.item():.4f}")


if __name__ == "__main__":
    main()
