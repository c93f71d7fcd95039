"""A first training script, as a TensorFlow user writes it: no logging setup of its own.

    psflow launch --ps 1 --workers 2 plain_train.py --logdir DIR [--steps N]
        [--basic-config before|after] [--pid-dir DIR] [--ps-no-shm]

The chief initialises (or restores) and saves a checkpoint every 20 steps; every task writes
its pid to ``--pid-dir/<task>.pid`` when given; ``--ps-no-shm`` starts the ps with shared
memory off (``PSFLOW_SHM=0`` on the ps only); ``--basic-config`` calls
``logging.basicConfig(level=INFO)`` before or after :func:`psflow.resolve`.
"""

import argparse
import logging
import os
import sys

import torch

import psflow
from psflow import env as envvars
from psflow.train import TrainingSession

if "--basic-config=before" in sys.argv:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
ctx, argv = psflow.resolve()
parser = argparse.ArgumentParser()
parser.add_argument("--logdir", required=True)
parser.add_argument("--steps", type=int, default=100)
parser.add_argument("--basic-config", choices=("before", "after"))
parser.add_argument("--pid-dir")
parser.add_argument("--ps-no-shm", action="store_true")
args = parser.parse_args(argv)
if args.basic_config == "after":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
if args.pid_dir:
    with open(os.path.join(args.pid_dir, f"{ctx.task}.pid"), "w") as f:
        f.write(str(os.getpid()))

if ctx.job == "ps":
    if args.ps_no_shm:
        os.environ[envvars.PSFLOW_SHM] = "0"
    psflow.ParameterServer(ctx).join()
else:
    torch.manual_seed(ctx.index)
    model = torch.nn.Linear(32, 32)
    with TrainingSession(
        model,
        ctx,
        optimizer="SGD",
        lr=0.01,
        checkpoint_dir=args.logdir,
        save_checkpoint_steps=20,
        last_step=args.steps,
    ) as sess:
        while not sess.should_stop():
            x = torch.randn(4, 32)
            sess.zero_grad()
            torch.nn.functional.mse_loss(model(x), x).backward()
            sess.step()
    print(f"{ctx.task} done", flush=True)
