"""A worker of the learning-rate schedule tests: trains sync_support's MLP until a global step.

    python lr_worker.py STEPS '{"mode": "allreduce", "lr_schedule": ["StepLR", {...}]}'

The JSON holds ``DistributedOptimizer`` keywords. Prints ``RESULT {json}`` last: the final
parameters and the learning rate after each step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sync_support import batch, loss_fn, make_model

import psflow

SIZE = 4


def main() -> None:
    ctx, _ = psflow.resolve([])
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()
        return
    steps = int(sys.argv[1])
    kwargs = json.loads(sys.argv[2])
    if "lr_schedule" in kwargs:
        kwargs["lr_schedule"] = tuple(kwargs["lr_schedule"])
    model = make_model("mlp")
    lrs = []
    with psflow.DistributedOptimizer(model, ctx, **kwargs) as opt:
        while opt.global_step < steps:
            x, y = batch(opt.global_step, ctx.index, SIZE)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
            lrs.append(opt.learning_rate)
    params = {n: p.detach().reshape(-1).tolist() for n, p in model.state_dict().items()}
    print("RESULT " + json.dumps({"step": opt.global_step, "lrs": lrs, "params": params}))


if __name__ == "__main__":
    main()
