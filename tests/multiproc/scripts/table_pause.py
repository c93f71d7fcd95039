"""A worker that trains an embedding table and, once, stops between two steps until told to go
on: the test kills a ps meanwhile, so that the next forward pass's lookup meets it lost.

    TF_CONFIG=... python table_pause.py --logdir DIR --steps N --pause_at K --go FILE

At step ``K`` (after its update; the chief after its checkpoint of that step is written) the
worker writes ``FILE.paused-<index>`` and waits for ``FILE`` to exist, at most 120 s. Ps tasks
serve until the workers are done. The last line a worker prints is ``<task> done step=<global
step>``.
"""

import argparse
import os
import sys
import time

import torch

import psflow
from psflow.train import TrainingSession

ctx, argv = psflow.resolve()
parser = argparse.ArgumentParser()
parser.add_argument("--logdir", required=True)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--pause_at", type=int, default=20)
parser.add_argument("--go", required=True)
args = parser.parse_args(argv)

if ctx.job == "ps":
    psflow.ParameterServer(ctx).join()
    sys.exit(0)


class Scores(torch.nn.Module):
    """DLRM's order: a dense layer's output before the lookup, both in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = torch.nn.Linear(4, 8)
        self.big = torch.nn.Linear(256, 256)  # values that do not travel inline
        self.rows = psflow.nn.Embedding(512, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense) + 1e-3 * self.big(torch.ones(1, 256)).mean()
        return self.out(x * self.rows(ids)).squeeze(-1)


torch.manual_seed(ctx.index)
model = Scores()
with TrainingSession(
    model,
    ctx,
    optimizer="SGD",
    lr=0.05,
    checkpoint_dir=args.logdir,
    save_checkpoint_steps=args.pause_at,
    last_step=args.steps,
    log_step_count_steps=None,
    save_summaries_steps=None,
) as sess:
    paused = False
    while not sess.should_stop():
        ids = torch.randint(0, 512, (64,))  # rows on every shard: each lookup asks them all
        sess.zero_grad()
        dense = torch.randn(64, 4)
        torch.nn.functional.mse_loss(model(dense, ids), torch.ones(64)).backward()
        sess.step()
        if not paused and sess.global_step >= args.pause_at:
            paused = True
            if sess.checkpointer is not None:
                sess.checkpointer.wait()  # the checkpoint a lost ps comes back from
            open(f"{args.go}.paused-{ctx.index}", "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(args.go):
                if time.monotonic() > deadline:
                    sys.exit(f"{ctx.task}: no {args.go} within 120 s")
                time.sleep(0.02)
print(f"{ctx.task} done step={sess.global_step}", flush=True)
