"""shard_load: what a CTR shard's core serves when its workers ask as fast as they can.

    .venv/bin/python benchmarks/shard_load.py [--preset smoke|full] [--ps 4] [--workers 3]
    .venv/bin/python benchmarks/shard_load.py --against_tree .ab/prev   # its psflow, alternating

On 16 cores a CTR job's shards each have a core and serve twelve workers; on this 2-core
machine a shard shares its core with workers' matrix products, sleeps between requests, and
meets each one with cold caches: its serving CPU a request there says little of what a shard
with a core of its own serves. Here the ps tasks get the first core alone
(``os.sched_setaffinity``), and the workers the others, each running a *hollow* DLRM:
``examples/dlrm.py``'s model, its table and dense parameters, whose requests are the job's (every
dense gradient, the batch's rows' gradients, the next batch's ids prefetched; batches of 512 of a
``psflow data synth-ctr`` set read into memory first and cycled, so every id is held after the
first pass, as in a job that reads its set several times), but whose gradients are made without
the MLPs' arithmetic (the loss is the sum of the rows and the parameters, times a small factor).
What is left of a worker's step is psflow's part of it.

Printed per run: the job's steps a second; a worker's CPU a step (``worker_us_a_step``: psflow's
part of a step, and the hollow loss's sums and their backward, about a fifth of it); each
shard's serving CPU a request (``ParameterServer.handling_cpu`` over its push_pull requests, in
microseconds), the requests a second one core would serve at that CPU (``per_core``: the
capacity of a shard's core), and the shards' core's busy share (that CPU times the requests a
second the timed steps made: an estimate, the warm-up's requests in the CPU, which can pass 1
in a short run). The job has CurveZMQ keys unless ``--insecure``, as ``psflow
launch`` gives them: through the socket (``--socket``) every byte is encrypted. The last line is
one JSON object. A 16-core job of issue 35's target (60% of 16 plain-torch cores: about 500
steps a second of 512) asks each of 4 shards for 500 requests a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "examples": 200_000,
        "batches": 100,
        "batch": 512,
        "steps": 1500,
        "warmup": 200,
        "bottom": "512,256,64",
        "top": "512,256",
        "rounds": 2,
    },
    "smoke": {
        "examples": 3_000,
        "batches": 4,
        "batch": 64,
        "steps": 10,
        "warmup": 2,
        "bottom": "16",
        "top": "16",
        "rounds": 1,
    },
}
SCALE = 1e-3
"""The hollow loss's factor: every gradient is this (a row's, each of its values)."""


def _pin(ps: bool) -> None:
    """The ps tasks on the first core, the workers on the others (all cores on one core's host)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, cores[:1] if ps else cores[1:])


def serve(ctx: Any) -> None:
    """A ps task: serves until the workers are done, then prints its serving thread's CPU for
    the push_pull requests and their count."""
    import psflow

    _pin(ps=True)
    server = psflow.ParameterServer(ctx)
    server.join()
    cpu = server.handling_cpu.get("push_pull", 0.0)
    served = {}  # the pushes each service's native path served (psflow/ps/native_push.py)
    for service in server.services:
        native = getattr(service, "native", None)
        if native is not None and hasattr(native, "served"):
            served[type(service).__name__] = native.served
    result = {"push_pull_cpu_seconds": cpu, "native": served}
    print("RESULT " + json.dumps(result), flush=True)


def work(ctx: Any, p: dict[str, Any], data: str, profile: str | None) -> None:
    """A worker task: the hollow DLRM's steps (see the module docstring)."""
    import torch

    import psflow
    import psflow.nn as pnn
    from psflow.data.ctr import ctr_batches

    _pin(ps=False)
    sys.path.insert(0, str(ROOT / "examples"))
    from dlrm import DLRM  # examples/ctr.py's model, unchanged

    torch.manual_seed(0)
    table = pnn.RowOptimizerSpec.of("Adagrad", lr=0.01, initial_accumulator_value=0.1)
    bottom = [int(x) for x in p["bottom"].split(",")]
    top = [int(x) for x in p["top"].split(",")]
    model = DLRM(16, bottom, top, table)
    dense = [q for name, q in model.named_parameters() if not name.startswith("embedding")]
    reader = ctr_batches(
        os.path.join(data, "train-*"),
        batch_size=p["batch"],
        shard_index=ctx.worker_index,
        num_shards=ctx.num_workers,
        num_epochs=None,
    )
    batches = [
        model.table_ids(next(reader).categorical).reshape(-1, 1) for _ in range(p["batches"])
    ]
    total = p["steps"] + p["warmup"]
    profiler = None
    if profile is not None and ctx.worker_index == 0:
        import cProfile

        profiler = cProfile.Profile()
    with psflow.TrainingSession(
        model, ctx, optimizer=psflow.OptimizerSpec.of("Adam", lr=1e-3, fused=True)
    ) as sess:
        for i in range(total):
            if i == p["warmup"]:
                start, cpu = time.perf_counter(), time.process_time()
                if profiler is not None:
                    profiler.enable()
            ids = batches[i % len(batches)]
            sess.zero_grad()
            loss = model.embedding(ids).sum() + sum(q.sum() for q in dense)
            (loss * SCALE).backward()
            model.embedding.prefetch(batches[(i + 1) % len(batches)])
            sess.step()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        if profiler is not None and profile is not None:
            profiler.disable()
            profiler.dump_stats(profile)
    result = {"steps": p["steps"], "seconds": seconds, "cpu_seconds": cpu}
    print("RESULT " + json.dumps(result), flush=True)


def run(args: argparse.Namespace, p: dict[str, Any], data: str, tree: str | None) -> dict[str, Any]:
    """One job of the hollow workers against the shards; its figures."""
    from common import keys_dir, new_cluster, run_job, smoke_preload

    script = str(HERE / "shard_load.py")  # another tree: its psflow, this hollow worker
    cmd = [script, "--role", "task", "--preset", args.preset, "--data", data]
    if args.profile:
        cmd += ["--profile", os.path.abspath(args.profile)]
    env = {"PSFLOW_SHM": "0" if args.socket else "1"}
    if not args.insecure:  # as psflow launch: every job its CurveZMQ keys
        env["PSFLOW_KEYS_DIR"] = keys_dir()
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))
    shards: dict[str, dict[str, Any]] = {}
    began = time.perf_counter()
    workers = run_job(
        new_cluster(args.ps, args.workers),
        lambda _task: cmd,
        env=env,
        ps_results=shards,
        preload=smoke_preload(args.preset) if tree is None else (),
    )
    wall = time.perf_counter() - began
    steps_s = sum(w["steps"] / w["seconds"] for w in workers.values())
    requests = args.workers * (p["steps"] + p["warmup"])  # each worker's every step, each shard
    cpu = [s["push_pull_cpu_seconds"] for s in shards.values()]
    if len(cpu) != args.ps or not all(cpu):
        raise RuntimeError(f"a shard gave no serving CPU: {shards}")
    us = sum(cpu) / len(cpu) / requests * 1e6
    native = sum(s["native"].get("ExchangeService", 0) for s in shards.values())
    worker_us = sum(w["cpu_seconds"] for w in workers.values()) / (args.workers * p["steps"]) * 1e6
    return {
        "steps_per_s": round(steps_s),
        "worker_us_a_step": round(worker_us, 1),
        "us_a_request": round(us, 1),
        "per_core": round(1e6 / us),
        # Each step asks each shard once: the shards' core's load while the steps were timed.
        "ps_core_busy": round(us * steps_s * args.ps / 1e6, 3),
        "native_share": round(native / (requests * args.ps), 3),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--ps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--data", help="a `psflow data synth-ctr` directory (default: new)")
    parser.add_argument("--socket", action="store_true", help="PSFLOW_SHM=0")
    parser.add_argument(
        "--insecure", action="store_true", help="no CurveZMQ keys (psflow launch --insecure)"
    )
    parser.add_argument(
        "--against_tree",
        help="another psflow checkout (a worktree of main, kernels built) run alternately",
    )
    parser.add_argument(
        "--profile", help="a file for cProfile's statistics of worker 0's timed steps"
    )
    parser.add_argument("--role", choices=["main", "task"], default="main", help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = PRESETS[args.preset]
    if args.role == "task":
        import psflow

        ctx, _ = psflow.resolve([])
        return serve(ctx) if ctx.job == "ps" else work(ctx, p, args.data, args.profile)

    sys.path.insert(0, str(HERE))
    from common import emit, machine

    trees: list[tuple[str, str | None]] = [("", None)]
    if args.against_tree:
        tree = os.path.abspath(args.against_tree)
        if not Path(tree, "psflow", "__init__.py").is_file():
            raise SystemExit(f"--against_tree: no psflow under {tree}")
        trees.append(("against_", tree))
    out: dict[str, Any] = {
        "benchmark": "shard_load",
        "machine": machine(),
        "preset": args.preset,
        "ps": args.ps,
        "workers": args.workers,
        "path": "socket" if args.socket else "shm",
        "keys": not args.insecure,
    }
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in trees}
    with tempfile.TemporaryDirectory(prefix="shard-load-") as tmp:
        data = args.data or tmp
        if args.data is None:
            import subprocess

            cmd = [sys.executable, "-m", "psflow.cli", "data", "synth-ctr", tmp]
            cmd += ["--examples", str(p["examples"]), "--test-examples", "100"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        data = os.path.abspath(data)
        for _ in range(p["rounds"]):
            for label, tree in trees:
                r = run(args, p, data, tree)
                runs[label].append(r)
                print(f"run {label or 'this'}: {json.dumps(r)}", flush=True)
    from common import median

    for label, rs in runs.items():
        keys = ("steps_per_s", "worker_us_a_step", "us_a_request", "per_core", "ps_core_busy")
        for key in (*keys, "native_share"):
            out[f"{label}{key}"] = median([r[key] for r in rs])
    if args.against_tree:
        out["us_a_request_vs_against"] = round(out["us_a_request"] / out["against_us_a_request"], 3)
    emit(out)


if __name__ == "__main__":
    main()
