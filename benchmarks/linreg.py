"""linreg: the classic example's workload (1 ps + 2 workers, one example a step, async SGD).

    .venv/bin/python benchmarks/linreg.py [--compare-tf] [--metrics-cost] [--preset smoke]

Prints steps per second summed over the workers, for psflow and (with ``--compare-tf``, when
TensorFlow is installed for ``--tf-python``) TensorFlow's own ps runtime on the same workload:
``tf.distribute.Server`` tasks, ``replica_device_setter`` and ``MonitoredTrainingSession``.
With ``--metrics-cost``, psflow also runs with its Prometheus metrics on (every task recording
and serving them, ``PSFLOW_METRICS_PORT=0``), alternated with the runs without, and the cost
is their difference in percent. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PRESETS = {
    "full": {"steps": 5000, "warmup": 500, "repeat": 3},
    "smoke": {"steps": 200, "warmup": 20, "repeat": 1},
}


def psflow_task(steps: int, warmup: int) -> None:
    import torch
    import torch.nn.functional as F

    import psflow

    ctx, _ = psflow.resolve([])
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()
        return
    torch.manual_seed(ctx.index)
    model = torch.nn.Linear(1, 1)
    xs = torch.rand(steps + warmup, 1, 1) * 2 - 1
    ys = 2 * xs + 0.3 + 0.1 * torch.randn_like(xs)
    with psflow.DistributedOptimizer(model, ctx, optimizer="SGD", lr=0.001) as opt:
        for i in range(steps + warmup):
            if i == warmup:
                start = time.perf_counter()
                cpu = time.process_time()  # every thread of the process: ZeroMQ's, metrics'
            loss = F.mse_loss(model(xs[i]), ys[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu
    result = {"steps": steps, "seconds": elapsed, "cpu_seconds": cpu, "w": model.weight.item()}
    print("RESULT " + json.dumps(result))


def tf_task(steps: int, warmup: int) -> None:
    import numpy as np
    import tensorflow as tf
    from tf_side import start_tf_task

    cluster, server, index, _ = start_tf_task()
    with tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{index}", cluster=cluster
        )
    ):
        x = tf.compat.v1.placeholder(tf.float32, shape=())
        y = tf.compat.v1.placeholder(tf.float32, shape=())
        w = tf.Variable(0.0)
        b = tf.Variable(0.0)
        loss = tf.square(y - (w * x + b))
        global_step = tf.compat.v1.train.get_or_create_global_step()
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.001).minimize(
            loss, global_step=global_step
        )
    rng = np.random.default_rng(index)
    xs = rng.uniform(-1, 1, steps + warmup).astype(np.float32)
    ys = 2 * xs + 0.3 + 0.1 * rng.standard_normal(steps + warmup).astype(np.float32)
    # Without device filters a worker waits on every other worker, finished ones included.
    session_config = tf.compat.v1.ConfigProto(
        device_filters=["/job:ps", f"/job:worker/task:{index}"]
    )
    with tf.compat.v1.train.MonitoredTrainingSession(
        master=server.target,
        is_chief=index == 0,
        config=session_config,
        save_checkpoint_secs=None,
        save_summaries_steps=None,
        save_summaries_secs=None,
        log_step_count_steps=None,
    ) as sess:
        for i in range(steps + warmup):
            if i == warmup:
                start = time.perf_counter()
            sess.run(train_op, feed_dict={x: xs[i], y: ys[i]})
        elapsed = time.perf_counter() - start
        wv = float(sess.run(w))
    print("RESULT " + json.dumps({"steps": steps, "seconds": elapsed, "w": wv}))


def steps_per_second(results: dict[str, dict[str, float]]) -> float:
    return sum(r["steps"] / r["seconds"] for r in results.values())


def worker_cpu_us(results: dict[str, dict[str, float]]) -> float:
    """CPU time of a psflow worker process per step (microseconds, mean over the workers)."""
    return (
        1e6
        * sum(r["cpu_seconds"] for r in results.values())
        / sum(r["steps"] for r in results.values())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--compare-tf", action="store_true", help="also run TensorFlow's ps runtime"
    )
    parser.add_argument(
        "--tf-python", default=sys.executable, help="a Python that imports tensorflow"
    )
    parser.add_argument(
        "--metrics-cost",
        action="store_true",
        help="also run psflow with its metrics on, side by side, and report the difference",
    )
    parser.add_argument(
        "--keys-cost",
        action="store_true",
        help="also run psflow with CurveZMQ keys (PSFLOW_KEYS_DIR), side by side",
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="runs of each side (default: the preset's)"
    )
    parser.add_argument("--role", choices=["psflow", "tf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    if args.role == "psflow":
        return psflow_task(preset["steps"], preset["warmup"])
    if args.role == "tf":
        return tf_task(preset["steps"], preset["warmup"])

    # Imported only here: the TensorFlow tasks run in a Python that may lack psflow and torch.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import (
        emit,
        keys_dir,
        machine,
        median,
        new_cluster,
        run_job,
        run_tf_job,
        smoke_preload,
    )

    me = os.path.abspath(__file__)
    result: dict[str, object] = {
        "benchmark": "linreg",
        "preset": args.preset,
        "workers": args.workers,
    }
    runs: list[float] = []
    tf_runs: list[float] = []
    metrics_runs: list[float] = []
    keys_runs: list[float] = []
    repeat = args.repeat or preset["repeat"]
    cmd = [me, "--role", "psflow", "--preset", args.preset]
    cpu: dict[int, list[float]] = {id(runs): [], id(metrics_runs): [], id(keys_runs): []}
    sides: list[tuple[list[float], dict[str, str] | None]] = [(runs, None)]
    if args.metrics_cost:
        sides.append((metrics_runs, {"PSFLOW_METRICS_PORT": "0"}))
    if args.keys_cost:
        sides.append((keys_runs, {"PSFLOW_KEYS_DIR": keys_dir()}))
    for i in range(repeat):
        # Side by side: the variants alternate, in turn first and last (ABBA), so that both see
        # the same machine conditions and neither always follows the other.
        for out, env in sides if i % 2 == 0 else sides[::-1]:
            res = run_job(
                new_cluster(1, args.workers),
                lambda _t, c=cmd: c,
                env=env,
                preload=smoke_preload(args.preset),
            )
            out.append(steps_per_second(res))
            cpu[id(out)].append(worker_cpu_us(res))
        if args.compare_tf:
            tf_cmd = [me, "--role", "tf", "--preset", args.preset]
            res = run_tf_job(new_cluster(1, args.workers), tf_cmd, args.tf_python)
            tf_runs.append(steps_per_second(res))
    result["psflow_steps_per_s"] = round(median(runs), 1)
    result["psflow_runs"] = [round(r, 1) for r in runs]
    result["psflow_worker_cpu_us_per_step"] = round(median(cpu[id(runs)]), 1)
    print(
        f"psflow: {median(runs):.0f} steps/s (runs: {', '.join(f'{r:.0f}' for r in runs)}); "
        f"a worker's CPU {median(cpu[id(runs)]):.1f} us a step"
    )
    for what, label, on_runs in (
        ("metrics", "metrics on", metrics_runs),
        ("keys", "CurveZMQ keys", keys_runs),
    ):
        if not on_runs:
            continue
        on = median(on_runs)
        result[f"psflow_{what}_on_steps_per_s"] = round(on, 1)
        result[f"psflow_{what}_on_runs"] = [round(r, 1) for r in on_runs]
        result[f"{what}_cost_pct"] = round(100 * (1 - on / median(runs)), 2)
        # Also the median of each repeat's own pair: less moved by the machine's drift.
        paired = median([1 - a / b for a, b in zip(on_runs, runs, strict=True)])
        result[f"{what}_cost_paired_pct"] = round(100 * paired, 2)
        # And in CPU: what a worker process spends a step, every thread counted.
        on_cpu = median(cpu[id(on_runs)])
        result[f"psflow_{what}_on_worker_cpu_us_per_step"] = round(on_cpu, 1)
        result[f"{what}_cpu_cost_pct"] = round(100 * (on_cpu / median(cpu[id(runs)]) - 1), 2)
        print(
            f"psflow, {label}: {on:.0f} steps/s ({result[f'{what}_cost_pct']}% slower; "
            f"median of the pairs {result[f'{what}_cost_paired_pct']}%); a worker's CPU "
            f"{on_cpu:.1f} us a step ({result[f'{what}_cpu_cost_pct']}% more)"
        )
    if tf_runs:
        result["tf_steps_per_s"] = round(median(tf_runs), 1)
        result["tf_runs"] = [round(r, 1) for r in tf_runs]
        result["ratio_vs_tf"] = round(median(runs) / median(tf_runs), 2)
        print(f"tensorflow: {median(tf_runs):.0f} steps/s; psflow/tf = {result['ratio_vs_tf']}x")
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
