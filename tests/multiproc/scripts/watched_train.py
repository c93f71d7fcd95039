"""A job to watch: trains, then holds still until told to finish.

    psflow launch --ps 1 --workers 2 watched_train.py --logdir DIR --steps N --hold DIR

Each worker trains until the global step reaches ``--steps`` (batches of ``--batch``
examples, a checkpoint every 10 steps), writes ``<hold>/<task>.trained`` (JSON: its last
global step, its last loss, its steps) and waits, still in its session, for
``<hold>/release`` (at most 120 s), so that the job's metrics can be read while nothing moves.
"""

import argparse
import json
import os
import time

import torch

import psflow
from psflow.train import TrainingSession

ctx, argv = psflow.resolve()
parser = argparse.ArgumentParser()
parser.add_argument("--logdir", required=True)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--hold", required=True)
args = parser.parse_args(argv)

if ctx.job == "ps":
    psflow.ParameterServer(ctx, checkpoint_dir=args.logdir).join()
else:
    torch.manual_seed(ctx.index)
    model = torch.nn.Linear(32, 32)
    steps = 0
    with TrainingSession(
        model,
        ctx,
        optimizer="SGD",
        lr=0.01,
        checkpoint_dir=args.logdir,
        save_checkpoint_steps=10,
        last_step=args.steps,
    ) as sess:
        # At least one step each: a worker that starts after the chief has reached last_step
        # (a loaded machine) trains once too, so that it has a loss to show.
        while True:
            x = torch.randn(args.batch, 32)
            sess.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), x)
            loss.backward()
            step = sess.step(loss=loss, examples=args.batch)
            steps += 1
            if steps == 1 and sess.is_chief:
                # One save whatever the other worker did meanwhile: the every-10-steps ones
                # may all fall to it on a loaded machine (its steps reach 40 first), and the
                # test reads the ps's pause for a snapshot.
                sess.save()
            if sess.should_stop():
                break
        trained = {"global_step": step, "loss": loss.item(), "steps": steps}
        path = os.path.join(args.hold, f"{ctx.task}.trained")
        with open(path + ".tmp", "w") as f:
            json.dump(trained, f)
        os.replace(path + ".tmp", path)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(args.hold, "release")):
            if time.monotonic() > deadline:
                raise TimeoutError("nobody released the job within 120 s")
            time.sleep(0.05)
    print(f"{ctx.task} done", flush=True)
