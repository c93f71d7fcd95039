"""mlp: the ~25M-parameter MLP (batch 32, 1 ps + 2 workers) in each training mode.

    .venv/bin/python benchmarks/mlp.py [--mode async|sync|allreduce|all] [--compare-tf]
        [--tf-python /work/tfvenv/bin/python] [--metrics-cost] [--preset smoke]

Modes, each side by side with its reference in the same run:

- ``async``: psflow's asynchronous ps; with ``--compare-tf`` TensorFlow's TF1 ps runtime
  (``replica_device_setter``, ``MonitoredTrainingSession``).
- ``sync``: psflow's synchronous ps (``replicas_to_aggregate`` = 2); with ``--compare-tf``
  TensorFlow's ``SyncReplicasOptimizer`` on the same cluster.
- ``allreduce``: psflow's ``mode="allreduce"`` (gloo, no ps) and plain
  ``torch.nn.parallel.DistributedDataParallel`` (gloo), always.

Figures: steps/s (async: summed over the workers; the others: global steps/s) and parameter
GB/s, the traffic a ps job moves for that rate (worker-steps/s x 2 x model bytes: a gradient
up and the parameters down per worker step), so the modes compare on one scale. With
``--metrics-cost``, psflow also runs with its Prometheus metrics on (every task recording and
serving them, ``PSFLOW_METRICS_PORT=0``), alternated with the runs without; the cost is their
difference in percent. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from itertools import pairwise

PRESETS = {
    # 1024 -> 4096 -> 4096 -> 1024 -> 10: 25.2M float32 parameters, 101 MB.
    "full": {"dims": [1024, 4096, 4096, 1024, 10], "steps": 40, "warmup": 5, "repeat": 3},
    "smoke": {"dims": [32, 64, 10], "steps": 10, "warmup": 2, "repeat": 1},
}
BATCH = 32
LR = 0.01


def _num_params(dims: list[int]) -> int:
    return sum(a * b + b for a, b in pairwise(dims))


def _torch_model(dims: list[int]):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(pairwise(dims)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _torch_batch(dims: list[int], index: int):  # type: ignore[no-untyped-def]
    import torch

    g = torch.Generator().manual_seed(index)
    return torch.randn(BATCH, dims[0], generator=g), torch.randint(
        0, dims[-1], (BATCH,), generator=g
    )


def psflow_task(mode: str, dims: list[int], steps: int, warmup: int) -> None:
    import torch
    import torch.nn.functional as F

    import psflow

    ctx, _ = psflow.resolve([])
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()  # default threads, like TensorFlow's ps
        return
    torch.set_num_threads(1)  # two workers share two cores (TensorFlow's: intra_op 1)
    model = _torch_model(dims)
    x, y = _torch_batch(dims, ctx.index)
    with psflow.DistributedOptimizer(model, ctx, mode=mode, lr=LR) as opt:
        for i in range(steps + warmup):
            if i == warmup:
                start, step0 = time.perf_counter(), opt.global_step
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        elapsed = time.perf_counter() - start
        global_steps = opt.global_step - step0
    print(
        "RESULT " + json.dumps({"steps": steps, "seconds": elapsed, "global_steps": global_steps})
    )


def ddp_task(dims: list[int], steps: int, warmup: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import psflow

    torch.set_num_threads(1)
    ctx, _ = psflow.resolve([])
    trainers = ctx.cluster.trainers
    chief = ctx.cluster.address(ctx.cluster.chief)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{chief}",
        rank=trainers.index(ctx.task),
        world_size=len(trainers),
        timeout=datetime.timedelta(seconds=120),
    )
    model = torch.nn.parallel.DistributedDataParallel(_torch_model(dims))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _torch_batch(dims, ctx.index)
    for i in range(steps + warmup):
        if i == warmup:
            start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    del model, opt
    gc.collect()  # torch 2.13 aborts now and then when Gloo's objects die at interpreter exit
    print("RESULT " + json.dumps({"steps": steps, "seconds": elapsed, "global_steps": steps}))


def tf_task(sync: bool, dims: list[int], steps: int, warmup: int) -> None:
    import numpy as np
    import tensorflow as tf
    from tf_side import start_tf_task

    cluster, server, index, config = start_tf_task()
    workers = len(config["cluster"]["worker"])
    with tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{index}", cluster=cluster
        )
    ):
        x = tf.compat.v1.placeholder(tf.float32, shape=(BATCH, dims[0]))
        y = tf.compat.v1.placeholder(tf.int64, shape=(BATCH,))
        h = x
        init = tf.compat.v1.glorot_uniform_initializer(seed=0)
        for i, (a, b) in enumerate(pairwise(dims)):
            w = tf.compat.v1.get_variable(f"w{i}", [a, b], initializer=init)
            bias = tf.compat.v1.get_variable(f"b{i}", [b], initializer=tf.zeros_initializer())
            h = tf.matmul(h, w) + bias
            if i < len(dims) - 2:
                h = tf.nn.relu(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.GradientDescentOptimizer(LR)
        hooks = []
        if sync:
            opt = tf.compat.v1.train.SyncReplicasOptimizer(
                opt, replicas_to_aggregate=workers, total_num_replicas=workers
            )
            hooks.append(opt.make_session_run_hook(index == 0))
        train_op = opt.minimize(loss, global_step=global_step)
    rng = np.random.default_rng(index)
    xs = rng.standard_normal((BATCH, dims[0])).astype(np.float32)
    ys = rng.integers(0, dims[-1], BATCH)
    session_config = tf.compat.v1.ConfigProto(
        device_filters=["/job:ps", f"/job:worker/task:{index}"],
        intra_op_parallelism_threads=1,
        inter_op_parallelism_threads=1,
    )
    done, elapsed, global_steps = 0, 1.0, 0  # kept when the session ends early
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target,
        is_chief=index == 0,
        config=session_config,
        hooks=hooks,
        save_checkpoint_secs=None,
        save_summaries_steps=None,
        save_summaries_secs=None,
        log_step_count_steps=None,
    ) as sess:
        start = time.perf_counter()
        step0 = 0
        # SyncReplicasOptimizer takes any replicas_to_aggregate gradients, several from one
        # worker included, and the token queue closes when the chief leaves: the chief's
        # global-step rate is the figure; a non-chief may stop early (OutOfRangeError).
        while done < steps + warmup and not sess.should_stop():
            if done == warmup:
                start = time.perf_counter()
                step0 = int(sess.run(global_step))
            sess.run(train_op, feed_dict={x: xs, y: ys})
            done += 1
        elapsed = time.perf_counter() - start
        global_steps = int(sess.run(global_step)) - step0 if done == steps + warmup else 0
    print(
        "RESULT " + json.dumps({"steps": steps, "seconds": elapsed, "global_steps": global_steps})
    )
    sys.stdout.flush()
    os._exit(0)  # a sync worker's queue runners can keep the process alive


def figures(
    mode: str, results: dict[str, dict[str, float]], model_bytes: int
) -> tuple[float, float]:
    """(steps/s, parameter GB/s) of one run."""
    if mode == "async":
        rate = sum(r["steps"] / r["seconds"] for r in results.values())
        return rate, rate * 2 * model_bytes / 1e9
    # Global steps, as the chief saw them; each takes one gradient per worker.
    chief = results["worker:0"]
    rate = chief["global_steps"] / chief["seconds"]
    return rate, rate * len(results) * 2 * model_bytes / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--mode", choices=["async", "sync", "allreduce", "all"], default="all")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compare-tf", action="store_true", help="also run TensorFlow")
    parser.add_argument("--tf-python", default=sys.executable, help="a Python with tensorflow")
    parser.add_argument(
        "--metrics-cost",
        action="store_true",
        help="also run psflow with its metrics on (PSFLOW_METRICS_PORT=0), side by side",
    )
    parser.add_argument(
        "--keys-cost",
        action="store_true",
        help="also run psflow with CurveZMQ keys (PSFLOW_KEYS_DIR), side by side",
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="runs of each side (default: the preset's)"
    )
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    dims, steps, warmup = preset["dims"], preset["steps"], preset["warmup"]
    if args.role:
        kind, _, mode = args.role.partition(":")
        if kind == "psflow":
            return psflow_task(mode, dims, steps, warmup)
        if kind == "ddp":
            return ddp_task(dims, steps, warmup)
        return tf_task(mode == "sync", dims, steps, warmup)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import emit, keys_dir, machine, median, new_cluster, run_job, smoke_preload

    me = os.path.abspath(__file__)
    model_bytes = _num_params(dims) * 4
    modes = ["async", "sync", "allreduce"] if args.mode == "all" else [args.mode]
    result: dict[str, object] = {
        "benchmark": "mlp",
        "preset": args.preset,
        "workers": args.workers,
        "batch": BATCH,
        "parameters": _num_params(dims),
    }
    tf_env = {"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}

    def run(runtime: str, mode: str) -> tuple[float, float]:
        cmd = [me, "--role", f"{runtime.split('+')[0]}:{mode}", "--preset", args.preset]
        ps = 0 if mode == "allreduce" else 1
        # All-reduce's tasks (gloo) start fresh: forked from the preloaded server, they hung.
        kwargs: dict[str, object] = {"preload": smoke_preload(args.preset) if ps else ()}
        if runtime == "tf":
            kwargs = {"python": args.tf_python, "ps_exit_timeout": None, "env": tf_env}
        if runtime == "psflow+metrics":  # every task records and serves its metrics
            kwargs["env"] = {"PSFLOW_METRICS_PORT": "0"}
        if runtime == "psflow+keys":  # CurveZMQ: every socket message encrypted
            kwargs["env"] = {"PSFLOW_KEYS_DIR": keys_dir()}
        res = run_job(new_cluster(ps, args.workers), lambda _t, c=cmd: c, **kwargs)  # type: ignore[arg-type]
        return figures(mode, res, model_bytes)

    for mode in modes:
        pairs = {"psflow": "psflow"}
        if args.metrics_cost:
            pairs["metrics_on"] = "psflow+metrics"
        if args.keys_cost:
            pairs["keys_on"] = "psflow+keys"
        if mode == "allreduce":
            pairs["ddp"] = "ddp"
        elif args.compare_tf:
            pairs["tf"] = "tf"
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in pairs}
        for _ in range(args.repeat or preset["repeat"]):
            for key, runtime in pairs.items():  # alternated: both see the same machine
                runs[key].append(run(runtime, mode))
        line = []
        for key, values in runs.items():
            sps = median([v[0] for v in values])
            gbps = median([v[1] for v in values])
            result[f"{mode}_{key}_steps_per_s"] = round(sps, 2)
            result[f"{mode}_{key}_gbps"] = round(gbps, 3)
            result[f"{mode}_{key}_runs"] = [round(v[0], 2) for v in values]
            line.append(f"{key} {sps:.2f} steps/s, {gbps:.2f} GB/s")
        for what in ("metrics", "keys"):
            if f"{what}_on" not in runs:
                continue
            off = result[f"{mode}_psflow_steps_per_s"]
            on = result[f"{mode}_{what}_on_steps_per_s"]
            cost = round(100 * (1 - on / off), 2)  # type: ignore[operator]
            result[f"{mode}_{what}_cost_pct"] = cost
            line.append(f"{what} cost {cost}%")
        other = next((k for k in runs if k not in ("psflow", "metrics_on", "keys_on")), None)
        if other is not None:
            ratio = result[f"{mode}_psflow_steps_per_s"] / result[f"{mode}_{other}_steps_per_s"]  # type: ignore[operator]
            result[f"{mode}_ratio_vs_{other}"] = round(ratio, 2)
            line.append(f"psflow/{other} = {ratio:.2f}x")
        print(f"{mode}: " + "; ".join(line))
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
