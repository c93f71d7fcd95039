"""TensorFlow's side of the embedding benchmarks: partitioned embeddings on TF 1.x's ps runtime.

    .venv-tf/bin/python benchmarks/tf_embedding.py --workload sparse [--preset smoke]
    .venv-tf/bin/python benchmarks/tf_embedding.py --workload ctr --data DIR [--preset smoke]
    .venv/bin/python benchmarks/tf_embedding.py --workload ctr --tf-python .venv-tf/bin/python

Graph mode with real ``tf.distribute.Server`` ps and worker processes on 127.0.0.1,
``replica_device_setter``, the chief initialising the variables on the ps: what a TensorFlow 1.x
recommendation job runs.

- ``sparse``: one table ``[rows, 64]`` as a partitioned variable (``fixed_size_partitioner``
  over the ps tasks), ``tf.compat.v1.nn.embedding_lookup(partition_strategy="mod")`` of 4,096 unique
  Zipf-distributed ids per step, and sparse Adagrad (``tf.compat.v1.train.AdagradOptimizer``)
  applying the ``IndexedSlices`` gradient on the ps: each step pulls and pushes 4,096 rows.
  Reports rows/s (all workers) and rows/s per ps shard.
- ``ctr``: the DLRM model of Criteo Kaggle (facebookresearch/dlrm's ``dlrm_s_criteo_kaggle.sh``
  sizes: 13 dense features -> bottom MLP 512-256-64-16, 26 embedding lookups of dim 16 in
  partitioned variables, pairwise dot interaction, top MLP 512-256-1, sigmoid cross-entropy,
  Adagrad) reading the TFRecord files that ``psflow data synth-ctr`` writes (or real Criteo
  files of that layout) with ``tf.data``, each worker its share of the files. Ids go to a table
  of the column's cardinality (from ``_synth_ctr.json``, capped by ``--table-rows``) modulo
  its size, as TensorFlow needs a fixed-size table. Reports samples/s (all workers).

Without ``--role`` the script runs the whole job itself (free ports, one process per task, the
ps tasks killed at the end: they never exit, tensorflow#25858); with ``--role tf`` it is one
task, its place in the job read from ``TF_CONFIG`` (how ``benchmarks/common.py``'s
``run_tf_job`` starts it). Without ``--data``, the ``ctr`` workload writes a set first with
``python -m psflow.cli data synth-ctr`` when the Python running the script has psflow. Each
worker prints ``RESULT {json}``; the last line of a whole run is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "sparse": {"rows": 2_000_000, "steps": 300, "warmup": 30},
        "ctr": {
            "steps": 300,
            "warmup": 30,
            "batch": 2048,
            "bottom": [512, 256, 64],
            "top": [512, 256],
            "table_rows": 10_000_000,
            "examples": 1_000_000,
        },
    },
    "example": {  # examples/ctr.py's own sizes (benchmarks/embedding.py's example preset)
        "sparse": {"rows": 2_000_000, "steps": 300, "warmup": 30},
        "ctr": {
            "steps": 300,
            "warmup": 30,
            "batch": 1024,
            "bottom": [64],
            "top": [64],
            "table_rows": 10_000_000,
            "examples": 1_000_000,
        },
    },
    "smoke": {
        "sparse": {"rows": 100_000, "steps": 20, "warmup": 5},
        "ctr": {
            "steps": 20,
            "warmup": 5,
            "batch": 256,
            "bottom": [64],
            "top": [64],
            "table_rows": 20_000,
            "examples": 20_000,
        },
    },
}
DIM = 64
UNIQUE_IDS = 4096
ZIPF = 1.1
CTR_DIM = 16
DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]


def unique_zipf_ids(rng: Any, rows: int, n: int) -> Any:
    """``n`` distinct ids in ``[0, rows)``, the first ``n`` distinct ones of a Zipf stream."""
    import numpy as np

    if n > rows:
        raise ValueError(f"cannot draw {n} distinct ids from {rows} rows")
    seen: dict[int, None] = {}
    while len(seen) < n:
        draw = rng.zipf(ZIPF, 4 * n)
        draw = draw[draw <= rows] - 1
        for v in draw.tolist():
            seen.setdefault(v, None)
            if len(seen) == n:
                break
    return np.fromiter(seen, dtype=np.int64, count=n)


@contextlib.contextmanager
def _session(server: Any, index: int) -> Iterator[Any]:
    """A session on the cluster, the variables initialised by the chief (worker 0).

    What ``MonitoredTrainingSession`` does, less its 30 s sleeps: a non-chief worker checks
    again for the chief's initialisation only every 30 s (``SessionManager``'s
    ``recovery_wait_secs``), which would make a smoke run wait half a minute for nothing.
    """
    import tensorflow as tf

    # Without device filters a worker waits on every other worker, finished ones included.
    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", f"/job:worker/task:{index}"])
    uninitialized = tf.compat.v1.report_uninitialized_variables()
    init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(server.target, config=config) as sess:
        if index == 0:
            sess.run(init)
        deadline = time.monotonic() + 300
        while len(sess.run(uninitialized)):
            if time.monotonic() > deadline:
                raise TimeoutError("the chief did not initialise the variables in 300 s")
            time.sleep(0.05)
        yield sess


def sparse_task(p: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf
    from tf_side import start_tf_task

    cluster, server, index, _ = start_tf_task()
    num_ps = cluster.num_tasks("ps")
    rng = np.random.default_rng(index)
    batches = [unique_zipf_ids(rng, p["rows"], UNIQUE_IDS) for _ in range(p["steps"] + p["warmup"])]
    with tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{index}", cluster=cluster
        )
    ):
        table = tf.compat.v1.get_variable(
            "table",
            [p["rows"], DIM],
            initializer=tf.compat.v1.random_normal_initializer(stddev=0.01),
            partitioner=tf.compat.v1.fixed_size_partitioner(num_ps),
        )
        ids = tf.compat.v1.placeholder(tf.int64, [UNIQUE_IDS])
        rows = tf.compat.v1.nn.embedding_lookup(table, ids, partition_strategy="mod")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.AdagradOptimizer(0.01, initial_accumulator_value=0.1)
        # Each row's gradient is the row itself (the gradient of 0.5 * sum(rows ** 2)), given
        # as grad_loss, as psflow's side hands it to its backward: no loss arithmetic on either.
        train_op = opt.minimize(rows, global_step=global_step, grad_loss=tf.stop_gradient(rows))
    with _session(server, index) as sess:
        for i, batch in enumerate(batches):
            if i == p["warmup"]:
                start = time.perf_counter()
            sess.run(train_op, feed_dict={ids: batch})
        seconds = time.perf_counter() - start
    return {"rows": UNIQUE_IDS * p["steps"], "seconds": seconds, "ps": num_ps}


def _read_meta(data: str) -> dict[str, Any]:
    path = os.path.join(data, "_synth_ctr.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)  # type: ignore[no-any-return]
    return {}


def _dense(x: Any, size: int, name: str, relu: bool = True) -> Any:
    """A fully connected layer from ``get_variable`` (``tf.compat.v1.layers`` needs Keras 2)."""
    import tensorflow as tf

    fan_in = int(x.shape[-1])
    w = tf.compat.v1.get_variable(
        f"{name}/w", [fan_in, size], initializer=tf.compat.v1.glorot_uniform_initializer()
    )
    b = tf.compat.v1.get_variable(f"{name}/b", [size], initializer=tf.compat.v1.zeros_initializer())
    y = tf.matmul(x, w) + b
    return tf.nn.relu(y) if relu else y


def _mlp(x: Any, sizes: list[int], name: str) -> Any:
    for i, size in enumerate(sizes):
        x = _dense(x, size, f"{name}{i}")
    return x


def ctr_task(p: dict[str, Any], data: str) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf
    from tf_side import start_tf_task

    cluster, server, index, _ = start_tf_task()
    num_ps = cluster.num_tasks("ps")
    num_workers = cluster.num_tasks("worker")
    meta = _read_meta(data)
    cards = meta.get("cardinalities") or [p["table_rows"]] * len(CATEGORICAL)
    table_rows = [max(1, min(int(k), p["table_rows"])) for k in cards]
    files = sorted(glob.glob(os.path.join(data, "train-*")))
    if not files:
        raise FileNotFoundError(f"no train-* files in {data}")
    batch = p["batch"]

    spec = {"label": tf.io.FixedLenFeature([], tf.int64)}
    spec.update({n: tf.io.FixedLenFeature([], tf.int64, default_value=0) for n in DENSE})
    spec.update({n: tf.io.FixedLenFeature([], tf.int64, default_value=0) for n in CATEGORICAL})

    def parse(records: Any) -> Any:
        f = tf.io.parse_example(records, spec)
        dense = tf.stack([tf.cast(f[n], tf.float32) for n in DENSE], axis=1)
        dense = tf.math.log1p(tf.maximum(dense, 0.0))
        cat = tf.stack([f[n] for n in CATEGORICAL], axis=1)
        return dense, cat, tf.cast(f["label"], tf.float32)

    with tf.device(f"/job:worker/task:{index}"):
        ds = tf.data.Dataset.from_tensor_slices(files).shard(num_workers, index)
        ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=2, block_length=16)
        ds = ds.repeat().batch(batch, drop_remainder=True)
        ds = ds.map(parse, num_parallel_calls=2).prefetch(2)
        dense, cat, label = tf.compat.v1.data.make_one_shot_iterator(ds).get_next()

    with tf.compat.v1.device(
        tf.compat.v1.train.replica_device_setter(
            worker_device=f"/job:worker/task:{index}", cluster=cluster
        )
    ):
        bottom = _mlp(dense, [*p["bottom"], CTR_DIM], "bottom")
        vectors = [bottom]
        for c, rows in enumerate(table_rows):
            table = tf.compat.v1.get_variable(
                f"emb{c}",
                [rows, CTR_DIM],
                initializer=tf.compat.v1.random_uniform_initializer(
                    -1.0 / np.sqrt(rows), 1.0 / np.sqrt(rows)
                ),
                partitioner=tf.compat.v1.fixed_size_partitioner(min(num_ps, rows)),
            )
            ids = tf.math.floormod(cat[:, c], rows)
            vectors.append(tf.compat.v1.nn.embedding_lookup(table, ids, partition_strategy="mod"))
        t = tf.stack(vectors, axis=1)  # [B, 27, 16]
        z = tf.matmul(t, t, transpose_b=True)  # [B, 27, 27]
        n = len(vectors)
        lower = [i * n + j for i in range(n) for j in range(i)]
        pairs = tf.gather(tf.reshape(z, [-1, n * n]), lower, axis=1)  # [B, 351]
        top = _mlp(tf.concat([bottom, pairs], axis=1), p["top"], "top")
        logit = tf.squeeze(_dense(top, 1, "logit", relu=False), axis=1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=label, logits=logit))
        global_step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.AdagradOptimizer(0.01, initial_accumulator_value=0.1)
        train_op = opt.minimize(loss, global_step=global_step)
    losses = []
    with _session(server, index) as sess:
        for i in range(p["steps"] + p["warmup"]):
            if i == p["warmup"]:
                start = time.perf_counter()
            _, value = sess.run([train_op, loss])
            losses.append(float(value))
        seconds = time.perf_counter() - start
    return {
        "samples": batch * p["steps"],
        "seconds": seconds,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "table_rows": sum(table_rows),
    }


# -- the whole job, when not started as one task ---------------------------------------------


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_job(argv: list[str], ps: int, workers: int, python: str, timeout: float) -> list[dict]:
    """Every task of a ``ps`` x ``workers`` job as a process; the workers' ``RESULT``s."""
    ports = _free_ports(ps + workers)
    cluster = {
        "ps": [f"127.0.0.1:{port}" for port in ports[:ps]],
        "worker": [f"127.0.0.1:{port}" for port in ports[ps:]],
    }
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    procs = []
    try:
        for job, count in (("ps", ps), ("worker", workers)):
            for i in range(count):
                task = {"cluster": cluster, "task": {"type": job, "index": i}}
                procs.append(
                    (
                        job,
                        i,
                        subprocess.Popen(
                            [python, os.path.abspath(__file__), *argv],
                            env=dict(env, TF_CONFIG=json.dumps(task)),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                        ),
                    )
                )
        results = []
        deadline = time.monotonic() + timeout
        for job, i, proc in procs:
            if job != "worker":
                continue
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"worker {i} failed ({proc.returncode}):\n{err[-3000:]}")
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            results.append(json.loads(lines[-1][len("RESULT ") :]))
        return results
    finally:
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def _synthesize(out: str, examples: int, scale: float) -> None:
    cmd = [sys.executable, "-m", "psflow.cli", "data", "synth-ctr", out]
    cmd += ["--examples", str(examples), "--test-examples", "1000", "--scale", str(scale)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's psflow
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    try:
        subprocess.run(
            cmd, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=path)
        )
    except subprocess.CalledProcessError as e:
        raise SystemExit(
            f"could not write a CTR set with {' '.join(cmd)} ({e}); pass --data DIR "
            "(written by `psflow data synth-ctr DIR`)"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["sparse", "ctr"], default="sparse")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=None, help="default: sparse 1, ctr 2")
    parser.add_argument("--data", help="ctr: a directory written by `psflow data synth-ctr`")
    parser.add_argument("--rows", type=int, help="sparse: table rows (default by preset)")
    parser.add_argument("--table-rows", type=int, help="ctr: cap on each table's rows")
    parser.add_argument("--tf-python", default=sys.executable, help="a Python with tensorflow")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--role", choices=["tf"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = dict(PRESETS[args.preset][args.workload])
    if args.rows:
        p["rows"] = args.rows
    if args.table_rows:
        p["table_rows"] = args.table_rows

    if args.role == "tf":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        res = sparse_task(p) if args.workload == "sparse" else ctr_task(p, args.data)
        print("RESULT " + json.dumps(res))
        return

    workers = args.workers or (1 if args.workload == "sparse" else 2)
    task_argv = ["--role", "tf", "--workload", args.workload, "--preset", args.preset]
    task_argv += [f"--rows={p.get('rows', 0)}", f"--table-rows={p.get('table_rows', 0)}"]
    result: dict[str, Any] = {
        "benchmark": f"tf_embedding_{args.workload}",
        "preset": args.preset,
        "ps": args.ps,
        "workers": workers,
    }
    with tempfile.TemporaryDirectory(prefix="tf-ctr-") as tmp:
        if args.workload == "ctr":
            data = args.data
            if data is None:
                data = tmp
                _synthesize(tmp, p["examples"], 0.001 if args.preset == "smoke" else 1.0)
            task_argv += ["--data", os.path.abspath(data)]
        results = run_job(task_argv, args.ps, workers, args.tf_python, args.timeout)
    if args.workload == "sparse":
        rate = sum(r["rows"] / r["seconds"] for r in results)
        result.update(
            rows=p["rows"],
            dim=DIM,
            unique_ids_per_step=UNIQUE_IDS,
            tf_rows_per_s=round(rate, 1),
            tf_rows_per_s_per_shard=round(rate / args.ps, 1),
        )
        print(f"tensorflow sparse pull+push: {rate:,.0f} rows/s ({rate / args.ps:,.0f} per ps)")
    else:
        rate = sum(r["samples"] / r["seconds"] for r in results)
        result.update(
            batch=p["batch"],
            table_rows=results[0]["table_rows"],
            tf_samples_per_s=round(rate, 1),
            losses=[[round(r["first_loss"], 4), round(r["last_loss"], 4)] for r in results],
        )
        print(f"tensorflow ctr: {rate:,.0f} samples/s")
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
