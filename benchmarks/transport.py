"""transport: push a 64 MB gradient and pull 64 MB of parameters, beside the raw socket.

    .venv/bin/python benchmarks/transport.py [--compare-tf] [--preset smoke]

Three measurements in one run, each between two processes on loopback:

- raw: a plain TCP socket sends 64 MB and the peer sends 64 MB back (the physical limit);
- psflow: ``DistributedOptimizer.step()`` on a one-tensor model against a ps process, which
  receives the gradient, applies SGD with torch and replies with the parameters, through the
  socket (``PSFLOW_SHM=0``: what crosses a network, compared with the raw socket);
- psflow-shm: the same through a shared-memory lane, what psflow does when worker and ps share
  a host (the default there);
- tensorflow (``--compare-tf``): the same push and pull on TensorFlow's ps runtime.

GB/s counts both directions (128 MB a round trip). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

PRESETS = {
    "full": {"mb": 64, "iters": 10, "warmup": 2, "repeat": 3},
    "smoke": {"mb": 4, "iters": 3, "warmup": 1, "repeat": 1},
}


def raw_server(port: int, nbytes: int, rounds: int) -> None:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("127.0.0.1", port)) as srv:
        conn, _ = srv.accept()
        with conn:
            for _ in range(rounds):
                got = 0
                while got < nbytes:
                    got += conn.recv_into(view[got:])
                conn.sendall(view)


def raw_client(port: int, nbytes: int, iters: int, warmup: int) -> float:
    buf = bytearray(os.urandom(1024) * (nbytes // 1024))
    view = memoryview(buf)
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        for i in range(warmup + iters):
            if i == warmup:
                start = time.perf_counter()
            conn.sendall(view)
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:])
        return time.perf_counter() - start


def run_raw(mb: int, iters: int, warmup: int) -> float:
    from psflow.cluster.ports import free_ports

    (port,) = free_ports(1)
    nbytes = mb << 20
    srv = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--role",
            "raw-server",
            "--port",
            str(port),
            "--nbytes",
            str(nbytes),
            "--rounds",
            str(iters + warmup),
        ]
    )
    try:
        seconds = raw_client(port, nbytes, iters, warmup)
    finally:
        srv.wait(timeout=60)
    return 2 * nbytes * iters / seconds / 1e9


def psflow_worker(mb: int, iters: int, warmup: int) -> None:
    import torch

    import psflow

    ctx, _ = psflow.resolve([])
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()
        return

    class OneTensor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros((mb << 20) // 4))

    model = OneTensor()
    with psflow.DistributedOptimizer(model, ctx, lr=1e-6, partition_bytes=None) as opt:
        model.w.grad = torch.randn_like(model.w)
        for i in range(warmup + iters):
            if i == warmup:
                start = time.perf_counter()
            opt.step()
        seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({"seconds": seconds, "bytes": 2 * (mb << 20) * iters}))


def tf_worker(mb: int, iters: int, warmup: int) -> None:
    import tensorflow as tf
    from tf_side import start_tf_task

    _, server, index, _ = start_tf_task()
    n = (mb << 20) // 4
    with tf.compat.v1.device("/job:ps/task:0"):
        w = tf.Variable(tf.zeros([n]))
    with tf.compat.v1.device(f"/job:worker/task:{index}"):
        g = tf.Variable(tf.random.normal([n]))  # the gradient lives on the worker
        push = tf.compat.v1.train.GradientDescentOptimizer(1e-6).apply_gradients([(g, w)])
        with tf.control_dependencies([push]):
            pulled = tf.identity(w.read_value())  # the new parameters, back on the worker
        step = tf.reduce_sum(pulled[:1])  # fetch a scalar: the 64 MB stays in the worker
    session_config = tf.compat.v1.ConfigProto(
        device_filters=["/job:ps", f"/job:worker/task:{index}"]
    )
    with tf.compat.v1.Session(server.target, config=session_config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for i in range(warmup + iters):
            if i == warmup:
                start = time.perf_counter()
            sess.run(step)
        seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({"seconds": seconds, "bytes": 2 * (mb << 20) * iters}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--compare-tf", action="store_true")
    parser.add_argument(
        "--tf-python", default=sys.executable, help="a Python that imports tensorflow"
    )
    parser.add_argument("--role", choices=["raw-server", "psflow", "tf"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = PRESETS[args.preset]
    if args.role == "raw-server":
        return raw_server(args.port, args.nbytes, args.rounds)
    if args.role == "psflow":
        return psflow_worker(p["mb"], p["iters"], p["warmup"])
    if args.role == "tf":
        return tf_worker(p["mb"], p["iters"], p["warmup"])

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import emit, machine, median, new_cluster, run_job, run_tf_job, smoke_preload

    me = os.path.abspath(__file__)
    raw, ours, lanes, theirs = [], [], [], []
    for _ in range(p["repeat"]):
        # Side by side, interleaved, so that all of them see the same machine conditions.
        raw.append(run_raw(p["mb"], p["iters"], p["warmup"]))
        cmd = [me, "--role", "psflow", "--preset", args.preset]
        for shm, out in (("0", ours), ("1", lanes)):
            r = run_job(
                new_cluster(1, 1),
                lambda _t, c=cmd: c,
                env={"PSFLOW_SHM": shm},
                preload=smoke_preload(args.preset),
            )
            out.append(r["worker:0"]["bytes"] / r["worker:0"]["seconds"] / 1e9)
        if args.compare_tf:
            cmd = [me, "--role", "tf", "--preset", args.preset]
            r = run_tf_job(new_cluster(1, 1), cmd, args.tf_python)["worker:0"]
            theirs.append(r["bytes"] / r["seconds"] / 1e9)
    result: dict[str, object] = {
        "benchmark": "transport",
        "preset": args.preset,
        "megabytes_each_way": p["mb"],
        "raw_socket_gbps": round(median(raw), 3),
        "psflow_gbps": round(median(ours), 3),
        "psflow_vs_raw": round(median(ours) / median(raw), 3),
        "raw_runs": [round(x, 3) for x in raw],
        "psflow_runs": [round(x, 3) for x in ours],
        "psflow_shm_gbps": round(median(lanes), 3),
        "psflow_shm_runs": [round(x, 3) for x in lanes],
    }
    print(
        f"raw socket: {median(raw):.2f} GB/s; psflow through the socket: {median(ours):.2f} GB/s "
        f"({100 * median(ours) / median(raw):.0f}% of raw); through shared memory: "
        f"{median(lanes):.2f} GB/s"
    )
    if theirs:
        result["tf_gbps"] = round(median(theirs), 3)
        result["tf_runs"] = [round(x, 3) for x in theirs]
        result["psflow_vs_tf"] = round(median(ours) / median(theirs), 2)
        print(f"tensorflow: {median(theirs):.2f} GB/s; psflow/tf = {result['psflow_vs_tf']}x")
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
