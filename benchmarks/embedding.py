"""embedding: sparse tables on the ps: rows pulled and pushed by id, against TensorFlow's.

    .venv/bin/python benchmarks/embedding.py [--workload sparse|ctr|memory] [--compare-tf] [--preset smoke|example] [--wire_dtype float32,bfloat16]

- ``sparse``: one table ``[rows, 64]`` (``psflow.nn.Embedding``, row-wise Adagrad on the ps,
  split ``mod`` over 2 ps), 4,096 unique Zipf-distributed ids per step, one worker: each step
  pulls their rows, computes ``0.5 * sum(rows**2)`` (the gradient of a row is the row) and
  pushes the gradients. Reports rows/s per ps shard and the payload bytes per step, through
  shared memory and through the socket (``PSFLOW_SHM=0``), and with ``--compare-tf`` the same
  workload on TensorFlow's ps runtime (``benchmarks/tf_embedding.py``: a partitioned variable,
  ``embedding_lookup``, sparse Adagrad) in the same run. The full preset adds
  ``shm_bound`` and ``socket_bound``, each task bound to the cores ``psflow launch
  --bind-cores`` deals it, and ``shm_prefetch`` (also bound: ``shm_prefetch_bound``) and
  ``socket_prefetch``: each step's push brings the next step's rows (``prefetch``), one round
  trip a step instead of two; with one worker its rows are those a lookup would get. With
  ``--wire_dtype float32,bfloat16`` (or ``float16``), each path runs once per dtype the rows
  and row gradients travel in (``psflow.nn.TableConfig.wire_dtype``), alternately, reported
  as ``<path>_<dtype>`` with each dtype's payload bytes per step. With ``--ps_threads 1,2``,
  each path runs once per count of a ps's row threads (``PSFLOW_PS_THREADS``), alternately,
  as ``<path>_t<N>``. With ``--row_optimizer Adagrad,RowWiseAdagrad``, each path runs once
  per row optimizer of the table (``Adagrad`` by default: one accumulator an element;
  ``RowWiseAdagrad``: one a row), alternately, as ``<path>_<optimizer>``. Each run also
  reports the rows a shard's core serves a second
  (``<path>_rows_per_shard_cpu_s``): a step's rows over the CPU time the ps tasks' serving
  threads spent handling its lookups and pushes (``ParameterServer.handling_cpu``: not their
  waits, not the worker's, so a 2-core machine shows what a shard does with a core of its
  own; a ps's row threads beyond the serving one are not counted). With ``--against_tree
  DIR`` (a worktree of main), that checkout runs each path too, alternating, as
  ``against_<path>``, with ``<path>_vs_against`` and ``<path>_per_core_vs_against``.
- ``ctr``: ``examples/ctr.py``'s DLRM end to end on a ``psflow data synth-ctr`` set (or
  ``--data``), 2 ps and 2 workers, Adagrad for the dense layers and row-wise for the table:
  samples/s summed over the workers, against the same model in TensorFlow 1.x style
  (``benchmarks/tf_embedding.py``: 26 partitioned tables, ``embedding_lookup``, sparse
  Adagrad on the ps) reading the same files, in the same run, through shared memory and the
  socket, with and without the tasks bound to cores, and with prefetching. Each run reports
  the samples a shard's core serves a second (``<path>_samples_per_shard_cpu_s``, as the
  sparse workload's rows); ``--against_tree DIR`` runs that checkout too, alternating, as
  ``against_<path>``, with ``<path>_vs_against`` and ``<path>_per_core_vs_against``.
- ``memory``: the same job with tables of increasing size (up to 20M x 64 float32, 5 GB, in
  the full preset): the worker's peak resident memory (flat: no worker holds a table), the
  time the ps take to create the table, and how long a checkpoint's snapshot pauses a ps. Its
  table trains with row-wise SGD (no optimizer state), so that two 2.5 GB shards, their
  checkpoint snapshots and the files' page cache fit a 24 GB machine.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # ctr: as benchmarks/tf_embedding.py's presets (the sizes of facebookresearch/dlrm's Kaggle run)
    "full": {
        "sparse": {"rows": 2_000_000, "steps": 300, "warmup": 30, "repeat": 3, "prefetch": True},
        "ctr": {
            "steps": 300,
            "warmup": 30,
            "batch": 2048,
            "bottom": "512,256,64",
            "top": "512,256",
            "examples": 1_000_000,
            "scale": 1.0,
            "repeat": 2,
            "prefetch": True,
        },
        "memory": {"tables": [1_000_000, 20_000_000], "steps": 50, "warmup": 5},
    },
    # ctr: examples/ctr.py's own model (its default sizes: bottom 64, top 64, batch 1,024 per
    # worker), the one its AUC is reported for; sparse and memory as the full preset's.
    "example": {
        "ctr": {
            "steps": 300,
            "warmup": 30,
            "batch": 1024,
            "bottom": "64",
            "top": "64",
            "examples": 1_000_000,
            "scale": 1.0,
            "repeat": 2,
            "prefetch": True,
        },
    },
    "smoke": {
        "sparse": {"rows": 100_000, "steps": 20, "warmup": 5, "repeat": 1, "prefetch": False},
        "ctr": {
            "steps": 20,
            "warmup": 5,
            "batch": 256,
            "bottom": "64",
            "top": "64",
            "examples": 20_000,
            "scale": 0.001,
            "repeat": 1,
            "prefetch": False,  # the suite tests prefetching elsewhere (test_tables)
        },
        "memory": {"tables": [10_000, 1_000_000], "steps": 5, "warmup": 1},
    },
}
# profile: one long run of each path, for a sampling profiler to attach to
# (benchmarks/results/profile.md).
PRESETS["profile"] = {
    "sparse": {"rows": 2_000_000, "steps": 4000, "warmup": 30, "repeat": 1, "prefetch": False},
}
PRESETS["example"] |= {k: v for k, v in PRESETS["full"].items() if k != "ctr"}
DIM = 64
UNIQUE_IDS = 4096
PS = 2


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def serve_shard(ctx: Any) -> None:
    """A ps task: serves until the workers are done, then prints what its serving thread
    spent on the rows (the steps' lookups and pushes, warm-up included) as its ``RESULT``, for
    the rows a shard's core serves a second."""
    import psflow

    server = psflow.ParameterServer(ctx)
    server.join()
    cpu = getattr(server, "handling_cpu", None)  # an older checkout (--against_tree) has none
    if cpu is not None:
        ops = {op: cpu.get(op, 0.0) for op in ("lookup", "push", "push_pull")}
        # How many requests the native path served (psflow/ps/native.py), where there is one.
        native = {
            type(s).__name__: s.native.served
            for s in server.services
            if hasattr(getattr(s, "native", None), "served")
        }
        result = {"handling_cpu_seconds": sum(ops.values()), "by_op": ops, "native": native}
        print("RESULT " + json.dumps(result))


def psflow_task(
    rows: int,
    steps: int,
    warmup: int,
    save_dir: str | None,
    row_opt: str,
    prefetch: bool = False,
    wire_dtype: str = "float32",
) -> None:
    import numpy as np
    import torch

    import psflow
    import psflow.nn as pnn
    from psflow.protocol import Key, RowOptimizerSpec, SaveState
    from psflow.worker.engine import ExchangeEngine

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tf_embedding import unique_zipf_ids  # the same ids as TensorFlow's side

    ctx, _ = psflow.resolve([])
    if ctx.job == "ps":
        return serve_shard(ctx)
    rng = np.random.default_rng(ctx.index)
    batches = [
        torch.from_numpy(unique_zipf_ids(rng, rows, UNIQUE_IDS)) for _ in range(steps + warmup)
    ]
    optimizer = (
        RowOptimizerSpec.of("Adagrad", lr=0.01, initial_accumulator_value=0.1)
        if row_opt == "Adagrad"
        else RowOptimizerSpec.of(row_opt, lr=0.01)
    )
    # On the meta device: the worker never allocates the table (the ps create it).
    wire = getattr(torch, wire_dtype)
    table = pnn.Embedding(
        rows, DIM, init_std=0.01, optimizer=optimizer, device="meta", wire_dtype=wire
    )
    row_bytes = DIM * wire.itemsize  # as the rows and their gradients travel
    created = time.perf_counter()
    with psflow.DistributedOptimizer(table, ctx, optimizer="SGD", lr=0.01) as opt:
        create_seconds = time.perf_counter() - created
        payload = 0
        for i, ids in enumerate(batches):
            if i == warmup:
                start = time.perf_counter()
            opt.zero_grad()
            out = table(ids)
            # Each row's gradient is the row itself (the gradient of 0.5 * sum(row ** 2)),
            # handed to the backward directly, as TensorFlow's side does through grad_loss:
            # the benchmark measures the pull and the push, not either side's loss arithmetic.
            out.backward(out.detach())
            if prefetch and i + 1 < len(batches):  # the next step's rows ride this push
                table.prefetch(batches[i + 1])
            opt.step()
            if i >= warmup:
                # ids and rows pulled, ids and gradients pushed
                payload += 2 * ids.numel() * (8 + row_bytes)
        seconds = time.perf_counter() - start
        pause = None
        if save_dir is not None:
            engine = opt.engine
            assert isinstance(engine, ExchangeEngine)
            url = os.path.join(save_dir, f"ckpt-{opt.global_step}")
            client = engine.client
            replies = client.save({s: url for s in range(client.num_shards)})
            pause = max(float(h[Key.SNAPSHOT_SECONDS]) for h in replies.values())
            while any(
                h.get(Key.STATE) == SaveState.WRITING
                for h in client.save_status({s: url for s in range(client.num_shards)}).values()
            ):
                time.sleep(0.2)
    result = {
        "rows": UNIQUE_IDS * steps,
        "all_rows": UNIQUE_IDS * (steps + warmup),
        "seconds": seconds,
        "bytes_per_step": payload / steps,
        "peak_rss_bytes": _peak_rss_bytes(),
        "create_seconds": create_seconds,
        "snapshot_pause_seconds": pause,
    }
    print("RESULT " + json.dumps(result))


def ctr_task(p: dict[str, Any], data: str, prefetch: bool) -> None:
    import torch
    import torch.nn.functional as F

    import psflow
    from psflow.data.ctr import ctr_batches
    from psflow.protocol import RowOptimizerSpec

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "examples"))
    from dlrm import DLRM  # examples/ctr.py's model, unchanged

    ctx, _ = psflow.resolve([])
    if ctx.job == "ps":
        return serve_shard(ctx)
    trainers = ctx.cluster.trainers
    torch.manual_seed(0)
    adagrad = {"lr": 0.01, "initial_accumulator_value": 0.1}  # TensorFlow's side's
    bottom = [int(x) for x in p["bottom"].split(",")]
    top = [int(x) for x in p["top"].split(",")]
    model = DLRM(16, bottom, top, RowOptimizerSpec.of("Adagrad", **adagrad))
    batches = ctr_batches(
        os.path.join(data, "train-*"),
        batch_size=p["batch"],
        shard_index=trainers.index(ctx.task),
        num_shards=len(trainers),
        num_epochs=None,
    )
    losses = []
    with psflow.DistributedOptimizer(
        model, ctx, optimizer=psflow.OptimizerSpec.of("Adagrad", **adagrad)
    ) as opt:
        batch = next(batches)
        for i in range(p["steps"] + p["warmup"]):
            if i == p["warmup"]:
                start = time.perf_counter()
            following = next(batches)
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(
                model(batch.dense, batch.categorical), batch.label
            )
            loss.backward()
            if prefetch:  # the next batch's rows ride this step
                model.prefetch(following.categorical)
            opt.step()
            batch = following
            losses.append(loss.item())
        seconds = time.perf_counter() - start
    result = {
        "samples": p["batch"] * p["steps"],
        "seconds": seconds,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "peak_rss_bytes": _peak_rss_bytes(),
    }
    print("RESULT " + json.dumps(result))


def _synthesize(out: str, p: dict[str, Any]) -> None:
    import subprocess

    cmd = [sys.executable, "-m", "psflow.cli", "data", "synth-ctr", out]
    cmd += ["--examples", str(p["examples"]), "--test-examples", "1000"]
    subprocess.run([*cmd, "--scale", str(p["scale"])], check=True, stdout=subprocess.DEVNULL)


def run_ctr(args: argparse.Namespace, p: dict[str, Any], base: list[str]) -> dict[str, Any]:
    """The ctr workload, both runtimes side by side (see the module docstring)."""
    from common import median, new_cluster, run_job, run_tf_job, smoke_preload

    tf_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_embedding.py")
    out: dict[str, Any] = {"batch": p["batch"], "workers": 2, "ps": PS}
    settings = args.native_requests.split(",") if args.native_requests else [None]
    chosen = _variants(p)
    if args.paths:
        chosen = [v for v in chosen if v[0] in args.paths.split(",")]
    trees: list[tuple[str, str | None]] = [("", None)]
    if args.against_tree:
        tree = os.path.abspath(args.against_tree)
        if not os.path.isfile(os.path.join(tree, "benchmarks", "embedding.py")):
            raise SystemExit(f"--against_tree: no benchmarks/embedding.py under {tree}")
        trees.append(("against_", tree))
    variants = [
        (label + ("python_" + path if native == "0" else path), shm, extra, bind, native, tree)
        for path, shm, extra, bind in chosen
        for native in settings
        for label, tree in trees
    ]
    runs: dict[str, list[float]] = {path: [] for path, *_ in variants}
    runs["tf"] = []
    per_core: dict[str, list[float]] = {path: [] for path, *_ in variants}
    with tempfile.TemporaryDirectory(prefix="ctr-") as tmp:
        data = args.data or tmp
        if args.data is None:
            _synthesize(tmp, p)
        for _ in range(p["repeat"]):
            for path, shm, extra, bind, native, tree in variants:
                script = (
                    base[0] if tree is None else os.path.join(tree, "benchmarks", "embedding.py")
                )
                cmd = [script, *base[1:], "--data", os.path.abspath(data), *extra]
                env = {"PSFLOW_SHM": shm}
                if native is not None:
                    env["PSFLOW_NATIVE_REQUESTS"] = native
                if tree is not None:  # that checkout's psflow, not this one's
                    env["PYTHONPATH"] = os.pathsep.join(
                        filter(None, [tree, os.environ.get("PYTHONPATH")])
                    )
                shards: dict[str, dict[str, Any]] = {}
                r = run_job(
                    new_cluster(PS, 2),
                    lambda _t, c=cmd: c,
                    env=env,
                    bind_cores=bind,
                    ps_results=shards,
                    # Another checkout's tasks import its own psflow: never this one's server.
                    preload=smoke_preload(args.preset) if tree is None else (),
                )
                runs[path].append(sum(x["samples"] / x["seconds"] for x in r.values()))
                out["psflow_last_loss"] = round(max(x["last_loss"] for x in r.values()), 4)
                line = f"run {path}: {runs[path][-1]:,.0f} samples/s"
                cpu = sum(x["handling_cpu_seconds"] for x in shards.values())
                if len(shards) == PS and cpu > 0:
                    # Every step of every worker (warm-up included) reaches every shard once.
                    steps = len(r) * (p["steps"] + p["warmup"])
                    per_core[path].append(steps * p["batch"] * PS / cpu)
                    line += (
                        f", {per_core[path][-1]:,.0f} samples per second of a shard's serving "
                        f"CPU ({cpu / steps / PS * 1e6:,.0f} us a step a shard)"
                    )
                    served = sum(
                        x.get("native", {}).get("ExchangeService", 0) for x in shards.values()
                    )
                    line += f"; {served / steps / PS:.0%} of the pushes native"
                print(line, flush=True)
            if args.compare_tf:
                argv = [tf_script, "--role", "tf", "--workload", "ctr", "--preset", args.preset]
                argv += ["--data", os.path.abspath(data)]
                r = run_tf_job(new_cluster(PS, 2), argv, args.tf_python)
                runs["tf"].append(sum(x["samples"] / x["seconds"] for x in r.values()))
                out["tf_last_loss"] = round(max(x["last_loss"] for x in r.values()), 4)
    out.update(summarize(runs, "samples_per_s"))
    for path, values in per_core.items():
        if values:
            out[f"{path}_samples_per_shard_cpu_s"] = round(median(values))
            for other in ("python_", "against_"):
                them = per_core.get(other + path)
                if them and not path.startswith(other):
                    key = other.rstrip("_")
                    out[f"{path}_per_core_vs_{key}"] = round(median(values) / median(them), 3)
                    out[f"{path}_vs_{key}"] = round(
                        median(runs[path]) / median(runs[other + path]), 3
                    )
    if args.against_tree:
        out["against_tree"] = trees[1][1]
    return out


def _each(
    variants: list[tuple[str, str, list[str], bool]], flag: str, values: list[str], default: str
) -> list[tuple[str, str, list[str], bool]]:
    """Each variant once per value of ``flag`` (a wire dtype, a row optimizer), one after
    another (``<path>_<value>`` when there are several), so that the values alternate as the
    runtimes do."""
    if values == [default]:
        return variants
    return [
        (f"{path}_{value}" if len(values) > 1 else path, shm, [*extra, flag, value], bind)
        for path, shm, extra, bind in variants
        for value in values
    ]


def _variants(p: dict[str, Any]) -> list[tuple[str, str, list[str], bool]]:
    """psflow's runs of a workload: ``(path, PSFLOW_SHM, extra flags, bind cores)``. The full
    preset adds the tasks bound to cores (``psflow launch --bind-cores``) and ``prefetch``
    (each step's push brings the next step's rows: one round trip a step)."""
    out: list[tuple[str, str, list[str], bool]] = [
        ("shm", "1", [], False),
        ("socket", "0", [], False),
    ]
    if p["prefetch"]:
        out += [("shm_bound", "1", [], True), ("socket_bound", "0", [], True)]
        out.append(("shm_prefetch", "1", ["--prefetch"], False))
        out.append(("socket_prefetch", "0", ["--prefetch"], False))
        out.append(("shm_prefetch_bound", "1", ["--prefetch"], True))
    return out


def summarize(runs: dict[str, list[float]], unit: str) -> dict[str, Any]:
    """Each runtime's median and runs as ``<path>_<unit>`` and ``<path>_runs``, and each
    psflow path against TensorFlow (``<path>_vs_tf``) when it ran."""
    from common import median

    out: dict[str, Any] = {}
    for path, values in runs.items():
        if values:
            out[f"{path}_{unit}"] = round(median(values))
            out[f"{path}_runs"] = [round(v) for v in values]
            print(f"{path}: {median(values):,.0f} {unit.replace('_per_', '/')}")
    if runs["tf"]:
        tf = median(runs["tf"])
        for path, values in runs.items():
            if path != "tf" and values:
                out[f"{path}_vs_tf"] = round(median(values) / tf, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["sparse", "ctr", "memory"], default="sparse")
    parser.add_argument("--data", help="ctr: a `psflow data synth-ctr` directory (default: new)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--compare-tf", action="store_true", help="also run TensorFlow's")
    parser.add_argument("--tf-python", default=sys.executable, help="a Python with tensorflow")
    parser.add_argument("--role", choices=["psflow"], help=argparse.SUPPRESS)
    parser.add_argument(
        "--rows", type=int, help="sparse: the table's rows (default: the preset's; >= 4096)"
    )
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prefetch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--wire_dtype",
        default="float32",
        help="sparse: the dtypes rows travel in, comma-separated (float32,bfloat16,float16), "
        "each path run once per dtype, alternately",
    )
    parser.add_argument(
        "--row_optimizer",
        default="Adagrad",
        help="sparse: the table's row optimizers, comma-separated (Adagrad,RowWiseAdagrad), each "
        "path run once per optimizer, alternately",
    )
    parser.add_argument(
        "--paths", help="only these of the preset's paths, comma-separated (shm,socket)"
    )
    parser.add_argument(
        "--against_tree",
        help="sparse, ctr: another psflow checkout (a worktree of main, kernels built) whose "
        "benchmark and psflow run each path too, alternating, reported as against_<path> with "
        "<path>_vs_against",
    )
    parser.add_argument(
        "--native_requests",
        help="ctr: PSFLOW_NATIVE_REQUESTS settings, comma-separated (1,0), each path run once "
        "per setting, alternately; 0's reported as python_<path>, with <path>_vs_python and "
        "<path>_per_core_vs_python (samples per second of a shard's serving CPU)",
    )
    parser.add_argument(
        "--ps_threads",
        help="sparse: each ps's row threads (PSFLOW_PS_THREADS), comma-separated (1,2), each "
        "path run once per count, alternately, reported as <path>_t<N>",
    )
    args = parser.parse_args()
    dtypes = args.wire_dtype.split(",")
    if not dtypes or any(d not in ("float32", "bfloat16", "float16") for d in dtypes):
        parser.error(f"--wire_dtype: float32, bfloat16 or float16, got {args.wire_dtype!r}")
    from psflow.protocol import ROW_OPTIMIZERS

    row_opts = args.row_optimizer.split(",")
    if not all(o in ROW_OPTIMIZERS for o in row_opts):
        parser.error(f"--row_optimizer: of {sorted(ROW_OPTIMIZERS)}, got {args.row_optimizer!r}")
    p = PRESETS[args.preset][args.workload]
    if args.role == "psflow":
        if args.workload == "ctr":
            return ctr_task(p, args.data, args.prefetch)
        row_opt = "SGD" if args.workload == "memory" else row_opts[0]
        return psflow_task(
            args.rows,
            p["steps"],
            p["warmup"],
            args.save_dir,
            row_opt,
            args.prefetch,
            dtypes[0],
        )

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import emit, machine, median, new_cluster, run_job, run_tf_job, smoke_preload

    me = os.path.abspath(__file__)
    tf_script = os.path.join(os.path.dirname(me), "tf_embedding.py")
    result: dict[str, Any] = {"benchmark": "embedding", "workload": args.workload}
    result["preset"] = args.preset
    base = [me, "--role", "psflow", "--workload", args.workload, "--preset", args.preset]

    if args.workload == "ctr":
        result.update(run_ctr(args, p, base))
        result["machine"] = machine()
        emit(result)
        return

    if args.workload == "memory":
        sizes = []
        for rows in p["tables"]:
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [*base, "--rows", str(rows), "--save-dir", tmp]
                job = run_job(
                    new_cluster(PS, 1), lambda _t, c=cmd: c, preload=smoke_preload(args.preset)
                )
                r = next(iter(job.values()))
            entry = {
                "table_rows": rows,
                "table_gb": round(rows * DIM * 4 / 1e9, 2),
                "worker_peak_rss_mb": round(r["peak_rss_bytes"] / 2**20, 1),
                "create_seconds": round(r["create_seconds"], 2),
                "snapshot_pause_seconds": round(r["snapshot_pause_seconds"], 3),
                "rows_per_s_per_shard": round(r["rows"] / r["seconds"] / PS),
            }
            print(json.dumps(entry))
            sizes.append(entry)
        result["tables"] = sizes
        result["machine"] = machine()
        emit(result)
        return

    chosen = _variants(p)
    if args.paths:
        known = [v[0] for v in chosen]
        wanted = args.paths.split(",")
        if any(w not in known for w in wanted):
            parser.error(f"--paths: the preset's paths are {known}, got {args.paths!r}")
        chosen = [v for v in chosen if v[0] in wanted]
    variants = _each(
        _each(chosen, "--wire_dtype", dtypes, "float32"), "--row_optimizer", row_opts, "Adagrad"
    )
    threads: list[str | None] = [None]
    if args.ps_threads:
        threads = [t.strip() for t in args.ps_threads.split(",")]
        if not all(t.isdigit() and int(t) >= 1 for t in threads):
            parser.error(f"--ps_threads: counts >= 1, comma-separated, got {args.ps_threads!r}")
    table_rows = args.rows or p["rows"]
    if table_rows < UNIQUE_IDS:
        parser.error(f"--rows: at least {UNIQUE_IDS} (the unique ids of a step), got {table_rows}")
    trees: list[tuple[str, str | None]] = [("", None)]
    if args.against_tree:
        tree = os.path.abspath(args.against_tree)
        if not os.path.isfile(os.path.join(tree, "benchmarks", "embedding.py")):
            parser.error(f"--against_tree: no benchmarks/embedding.py under {tree}")
        trees.append(("against_", tree))
    runs_of = [
        (label + (path if t is None else f"{path}_t{t}"), shm, extra, bind, t, tree)
        for path, shm, extra, bind in variants
        for t in threads
        for label, tree in trees
    ]
    runs: dict[str, list[float]] = {path: [] for path, *_ in runs_of}
    runs["tf"] = []
    per_core: dict[str, list[float]] = {path: [] for path, *_ in runs_of}
    bytes_per_step = 0.0
    wire_bytes: dict[str, float] = {}
    for _ in range(p["repeat"]):
        # Side by side: alternate the runtimes so that all see the same machine conditions.
        for path, shm, extra, bind, t, tree in runs_of:
            script = me if tree is None else os.path.join(tree, "benchmarks", "embedding.py")
            cmd = [script, *base[1:], "--rows", str(table_rows), *extra]
            env = {"PSFLOW_SHM": shm} | ({} if t is None else {"PSFLOW_PS_THREADS": t})
            if tree is not None:  # that checkout's psflow, not this one's
                env["PYTHONPATH"] = os.pathsep.join(
                    filter(None, [tree, os.environ.get("PYTHONPATH")])
                )
            shards: dict[str, dict[str, Any]] = {}
            r = run_job(
                new_cluster(PS, 1),
                lambda _t, c=cmd: c,
                env=env,
                bind_cores=bind,
                ps_results=shards,
                # Another checkout's tasks import its own psflow: never this one's server.
                preload=smoke_preload(args.preset) if tree is None else (),
            )
            (only,) = r.values()
            runs[path].append(only["rows"] / only["seconds"] / PS)
            line = f"run {path}: {runs[path][-1]:,.0f} rows/s per shard"
            cpu = sum(x["handling_cpu_seconds"] for x in shards.values())
            if len(shards) == PS and cpu > 0:
                # Every unique id of a step is looked up and pushed once, on its one shard.
                per_core[path].append(only["all_rows"] / cpu)
                line += f", {per_core[path][-1]:,.0f} rows per second of a shard's serving CPU"
                steps = only["all_rows"] / UNIQUE_IDS * PS  # requests of each op, all shards
                by_op: dict[str, float] = {}
                for x in shards.values():
                    for op, seconds in x.get("by_op", {}).items():
                        by_op[op] = by_op.get(op, 0.0) + seconds
                line += (
                    " ("
                    + ", ".join(
                        f"{op} {seconds / steps * 1e6:,.0f} us"
                        for op, seconds in by_op.items()
                        if seconds
                    )
                    + " a request)"
                )
            print(line, flush=True)
            bytes_per_step = only["bytes_per_step"]
            wire_bytes[
                extra[extra.index("--wire_dtype") + 1] if "--wire_dtype" in extra else "float32"
            ] = bytes_per_step
        if args.compare_tf:
            argv = [tf_script, "--role", "tf", "--workload", "sparse", "--preset", args.preset]
            r = run_tf_job(new_cluster(PS, 1), [*argv, f"--rows={p['rows']}"], args.tf_python)
            runs["tf"].append(sum(x["rows"] / x["seconds"] for x in r.values()) / PS)
    result.update(
        {
            "table_rows": table_rows,
            "dim": DIM,
            "unique_ids_per_step": UNIQUE_IDS,
            "ps": PS,
            "payload_bytes_per_step": round(bytes_per_step),
            "row_optimizer": args.row_optimizer,
        }
    )
    if len(dtypes) > 1:
        result["payload_bytes_per_step"] = {d: round(b) for d, b in wire_bytes.items()}
    result.update(summarize(runs, "rows_per_s_per_shard"))
    for path, values in per_core.items():
        if values:
            result[f"{path}_rows_per_shard_cpu_s"] = round(median(values))
            result[f"{path}_per_core_runs"] = [round(v) for v in values]
    if args.against_tree:
        result["against_tree"] = trees[1][1]
        for path, *_ in runs_of:
            if path.startswith("against_") or not runs.get(f"against_{path}"):
                continue
            ratio = median(runs[path]) / median(runs[f"against_{path}"])
            result[f"{path}_vs_against"] = round(ratio, 3)
            new_cpu, old_cpu = per_core[path], per_core[f"against_{path}"]
            if new_cpu and old_cpu:
                result[f"{path}_per_core_vs_against"] = round(median(new_cpu) / median(old_cpu), 3)
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
