"""A worker of the training-mode tests: trains the MLP of sync_support until a global step.

    python sync_worker.py STEPS [kill_at=TASK@STEP] [KEY=VALUE ...]   (KEY: mode, ...)

``kill_at=worker:1@7``: that worker SIGKILLs itself there, after printing ``KILLED AT <step>``
to stderr (the fault schedule). Honours SYNC_WORKER_BARRIER=DIR:N (each worker waits, once its
model is ready, until N workers have checked in under DIR, so that none starts late). Prints
``RESULT {json}`` last: final parameters, first and last loss, the mode's counters.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sync_support import batch, loss_fn, make_model

import psflow


def barrier(spec: str, me: str) -> None:
    """Checks in under DIR and waits (60 s at most) until N workers have."""
    where, _, count = spec.rpartition(":")
    (Path(where) / me).touch()
    deadline = time.monotonic() + 60
    while len(list(Path(where).iterdir())) < int(count):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {spec}: only {sorted(os.listdir(where))} checked in")
        time.sleep(0.01)


def main() -> None:
    ctx, _ = psflow.resolve([])
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()
        return
    steps = int(sys.argv[1])
    kwargs: dict[str, object] = {}
    kill_at = None
    for item in sys.argv[2:]:
        key, _, value = item.partition("=")
        if key == "kill_at":
            who, _, at = value.partition("@")
            kill_at = int(at) if who == str(ctx.task) else None
            continue
        kwargs[key] = value if key == "mode" else float(value) if "." in value else int(value)
    model = make_model("mlp")
    losses = []
    ex, ey = batch(10**6, 0, 512)  # held out: the same for every worker
    with psflow.DistributedOptimizer(model, ctx, lr=0.1, **kwargs) as opt:  # type: ignore[arg-type]
        eval_first = loss_fn(model, ex, ey).item()
        if os.environ.get("SYNC_WORKER_BARRIER"):
            barrier(os.environ["SYNC_WORKER_BARRIER"], str(ctx.task).replace(":", "-"))
        while opt.global_step < steps:
            if kill_at is not None and opt.global_step >= kill_at:
                print(f"KILLED AT {opt.global_step}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(opt.global_step, ctx.index, 4)
            opt.zero_grad()
            loss = loss_fn(model, x, y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
        stats = opt.stats()
        eval_last = loss_fn(model, ex, ey).item()
    params = {n: p.detach().reshape(-1).tolist() for n, p in model.state_dict().items()}
    result = {
        "step": opt.global_step,
        "losses": losses,
        "eval_first": eval_first,
        "eval_last": eval_last,
        "stats": stats,
        "params": params,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
