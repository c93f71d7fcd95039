"""checkpoint_pause: how long a checkpoint pauses training (1 ps + the chief, 25M-param MLP).

    .venv/bin/python benchmarks/checkpoint_pause.py [--preset smoke]

The ps pauses serving only to copy its shard in memory; the file is written in the background.
Prints, per save: the ps's copy time (the pause), the chief's save-request round trip, the time
until the checkpoint was complete on disk, and the chief's step time while it was being
written against without. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PRESETS = {
    "full": {"width": 4096, "inputs": 1024, "saves": 3, "steps": 5},
    "smoke": {"width": 64, "inputs": 16, "saves": 1, "steps": 2},
}


def mlp(inputs: int, width: int) -> object:
    import torch

    # inputs=1024, width=4096: 4.2M + 16.8M + 4.2M = 25.2M float32 parameters (about 100 MB).
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, inputs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--role", default="chief", choices=["chief", "ps"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "ps":
        import psflow

        ctx, _ = psflow.resolve([])
        psflow.ParameterServer(ctx).join()
        return

    import torch

    from psflow.cluster.ports import local_cluster
    from psflow.cluster.spec import TaskContext, TaskSpec
    from psflow.train import TrainingSession

    p = PRESETS[args.preset]
    cluster = local_cluster(1, 1)
    env = dict(os.environ, TF_CONFIG=cluster.to_tf_config(TaskSpec(job="ps", index=0)))
    ps = subprocess.Popen([sys.executable, __file__, "--role", "ps"], env=env)
    tmp = tempfile.TemporaryDirectory()
    url = args.dir or tmp.name
    try:
        torch.manual_seed(0)
        model = mlp(p["inputs"], p["width"])
        nparams = sum(t.numel() for t in model.parameters())  # type: ignore[attr-defined]
        ctx = TaskContext(cluster=cluster, task=TaskSpec(job="worker", index=0))
        x = torch.randn(32, p["inputs"])
        with TrainingSession(
            model,  # type: ignore[arg-type]
            ctx,
            lr=0.001,
            checkpoint_dir=url,
            save_checkpoint_secs=1e9,
            log_step_count_steps=None,
            save_summaries_steps=None,
        ) as sess:
            ckpt = sess.checkpointer
            assert ckpt is not None

            def step() -> float:
                t = time.perf_counter()
                sess.zero_grad()
                loss = model(x).pow(2).mean()  # type: ignore[operator]
                loss.backward()
                sess.step(loss=loss)
                return time.perf_counter() - t

            quiet = [step() for _ in range(p["steps"])]
            rows = []
            for _ in range(p["saves"]):
                t0 = time.perf_counter()
                ckpt.save(sess.global_step, wait=False)
                busy = []
                while ckpt.busy:
                    busy.append(step())
                ckpt.wait()
                rows.append(
                    {
                        "ps_pause_ms": ckpt.last_snapshot_seconds * 1e3,
                        "save_request_ms": ckpt.last_pause * 1e3,
                        "complete_s": time.perf_counter() - t0,
                        "steps_during_write": len(busy),
                        "step_ms_during_write": statistics.median(busy) * 1e3 if busy else None,
                    }
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
            step_ms = statistics.median(quiet) * 1e3
        ps.wait(30)
        print(
            json.dumps(
                {
                    "benchmark": "checkpoint_pause",
                    "preset": args.preset,
                    "params": nparams,
                    "ps_pause_ms": statistics.median(r["ps_pause_ms"] for r in rows),
                    "save_request_ms": statistics.median(r["save_request_ms"] for r in rows),
                    "complete_s": statistics.median(r["complete_s"] for r in rows),
                    "step_ms": step_ms,
                    "saves": rows,
                }
            )
        )
    finally:
        if ps.poll() is None:
            ps.kill()
            ps.wait()
        tmp.cleanup()


if __name__ == "__main__":
    main()
