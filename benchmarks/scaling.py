"""scaling: the CTR job at growing sizes against what its cores do without communication.

    .venv/bin/python benchmarks/scaling.py [--preset smoke|full] [--jobs 1x1,2x4,4x8,4x12]

The model is ``examples/ctr.py``'s DLRM in DeepRec's shape (embedding dim 16, bottom MLP
512-256-64-16, top MLP 512-256-1, batch 512 per worker, no wide term, every id admitted), on a
``psflow data synth-ctr`` set (made in a temporary directory unless ``--data`` names one).

- **Ceiling** (no communication): the same model in plain torch (``torch.nn.EmbeddingBag``
  over the hashed ids modulo ``--ceiling_rows``, sparse Adagrad on it, Adam on the MLPs), its
  batches read into memory first, one thread per process. ``procs``: one such process per core,
  all at once, their samples/s summed (so the machine's shared memory bandwidth and clocks
  count, as they do for the job); ``threads``: one process with a thread per core.
- **Jobs**: ``psflow launch --ps P --workers W examples/ctr.py ...`` for each ``PxW`` of
  ``--jobs`` (default: by the host's cores), through shared memory and through the socket
  (``PSFLOW_SHM=0``), alternately; each worker's own samples/s line, summed. With
  ``--args ARGS``, every run of every job takes those example arguments too. With
  ``--against ARGS``, each job also runs with those example arguments, alternating, for an A/B
  on one machine (``--against=--no-fused``: torch's Adam loop against the fused form); with
  ``--against_tree DIR``, that run is another checkout's psflow and example (a worktree of
  main: the code before a change against the code after it, alternating in one run); with
  ``--against_env K=V,...``, that run's tasks get those environment variables
  (``--against_env PSFLOW_FLUSH_DENORMALS=0``: a setting against its default). A job
  ``PxWtN`` gives its ps tasks N threads (``psflow launch --ps-threads``), ``PxWb`` binds every
  task to its cores (``--bind-cores``), ``PxWi`` runs it without CurveZMQ keys (``--insecure``:
  ``--jobs 1x3,1x3i`` gives the socket path's cipher its own figure).

Printed per job and path: samples/s, samples/s per core (the cores the job's processes may
use: ``min(P + W, cores)``), and efficiency: the job's samples/s over the ``procs`` ceiling of
that many cores (each process's rate times the cores; measured once on all of them, so a
machine whose clock drops with load is not flattered); and against the ``threads`` ceiling
(``vs_threads``: issue 35's yardstick on a small host), read again after each job in the full
preset on a host of up to :data:`SMALL_HOST` cores and taken as the mean of the readings before
and after it (on 2 cores one reading moved by a fifth within an hour). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "examples": 1_000_000,
        "dim": 16,
        "bottom": "512,256,64",
        "top": "512,256",
        "batch": 512,
        "steps_per_worker": 600,
        "ceiling_steps": 300,
        "ceiling_batches": 40,
        "repeat": 1,
        # The 2-thread yardstick moved 33k-43k samples/s between runs of one hour on 2 cores:
        # read again after each job on a small host (SMALL_HOST), each job's ratio taken
        # against the readings around it.
        "yardstick_each": True,
    },
    # The suite's: the plumbing of every part on a tiny model, one job of each path.
    "smoke": {
        "examples": 4_000,
        "dim": 8,
        "bottom": "16",
        "top": "16",
        "batch": 64,
        "steps_per_worker": 15,
        "ceiling_steps": 10,
        "ceiling_batches": 4,
        "repeat": 1,
        "jobs": "1x1",
        "cores": 2,
        # The suite's time: the single process's ceiling and the socket path are the same code
        # with other arguments (PSFLOW_SHM=0); the full preset runs both.
        "one_process": False,
        "paths": ["shm"],
    },
}

SMALL_HOST = 4
"""Cores up to which the 2-thread yardstick is issue 35's (and read again after each job):
on a larger host the target is the single-thread processes' ceiling, and a device's minutes
are too few to spend on re-reading it."""

WORKER_LINE = re.compile(r"\[worker:(\d+)\] (\d+) steps, ([\d,]+) samples/s \(this worker\)")


def default_jobs(cores: int) -> str:
    """``PxW`` sizes up to the host's cores: as many processes as cores at the largest, with
    roughly one ps to every two or three workers (the shapes of the 16-core figures in
    ``docs/`` and issue 35)."""
    if cores <= 2:
        return "1x1,2x2"
    sizes = [(1, 1), (1, 2), (2, 4), (2, 6), (3, 9), (4, 12), (5, 15), (8, 24)]
    return ",".join(f"{p}x{w}" for p, w in sizes if p + w <= cores + cores // 4)


JOB = re.compile(r"(\d+)x([1-9]\d*)(?:t([1-9]\d*))?(b?)(i?)")


class Job(NamedTuple):
    """One job's shape: ``PSxWORKERS``, ``tN`` its ps tasks on N threads (``--ps-threads``),
    ``b`` every task bound to its cores (``--bind-cores``), ``i`` without keys
    (``--insecure``: nothing encrypted)."""

    ps: int
    workers: int
    ps_threads: int | None = None
    bind: bool = False
    insecure: bool = False

    @property
    def name(self) -> str:
        threads = "" if self.ps_threads is None else f"t{self.ps_threads}"
        return f"{self.ps}x{self.workers}{threads}{'b' if self.bind else ''}{'i' * self.insecure}"


def parse_jobs(text: str) -> list[Job]:
    """``PSxWORKERS[tTHREADS][b][i]`` sizes, comma-separated (:class:`Job`)."""
    out = []
    for item in text.split(","):
        m = JOB.fullmatch(item.strip())
        if m is None:
            raise SystemExit(
                f"--jobs: {item!r} is not PSxWORKERS[tTHREADS][b][i] "
                "(for example 2x4, 2x12t2, 4x12b, 1x3i)"
            )
        threads = None if m[3] is None else int(m[3])
        out.append(Job(int(m[1]), int(m[2]), threads, m[4] == "b", m[5] == "i"))
    return out


# --- the ceiling: plain torch, no communication --------------------------------------------


def ceiling_task(p: dict[str, Any], data: str, threads: int, rows: int) -> None:
    """One process of the ceiling: trains the plain-torch model on batches held in memory;
    prints ``RESULT {"samples": ..., "seconds": ...}``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from psflow.data.ctr import ctr_batches

    torch.set_num_threads(threads)
    # As a ps task does (PSFLOW_FLUSH_DENORMALS): the ceiling is what plain torch can do.
    torch.set_flush_denormal(True)
    sys.path.insert(0, str(ROOT / "examples"))
    import psflow.nn as pnn

    from dlrm import DLRM

    class PlainTable(nn.Module):
        """The hashed ids' rows from a plain ``torch.nn.EmbeddingBag`` of ``rows`` rows."""

        def __init__(self, dim: int) -> None:
            super().__init__()
            self.bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
            nn.init.normal_(self.bag.weight, std=0.01)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.bag(ids.remainder(rows))

    torch.manual_seed(0)
    bottom = [int(x) for x in p["bottom"].split(",")]
    top = [int(x) for x in p["top"].split(",")]
    model = DLRM(p["dim"], bottom, top, pnn.RowOptimizerSpec.of("Adagrad", lr=0.05))
    model.embedding = PlainTable(p["dim"])
    table = list(model.embedding.parameters())
    dense = [q for n, q in model.named_parameters() if not n.startswith("embedding.")]
    # The example's dense optimizer: Adam in its fused form (``examples/ctr.py --fused``).
    opts = [torch.optim.Adam(dense, lr=1e-3, fused=True), torch.optim.Adagrad(table, lr=0.05)]
    # Its sparse Adagrad's gradients come from torch's own EmbeddingBag: left unchecked, torch's
    # default, said explicitly so that torch does not warn in every ceiling process's output.
    torch.sparse.check_sparse_tensor_invariants.disable()
    source = ctr_batches(f"{data}/train-*", batch_size=p["batch"], num_epochs=None)
    batches = [next(source) for _ in range(p["ceiling_batches"])]
    warmup = 3
    for i in range(warmup + p["ceiling_steps"]):
        if i == warmup:
            start = time.perf_counter()
        batch = batches[i % len(batches)]
        for opt in opts:
            opt.zero_grad()
        logits = model(batch.dense, batch.categorical)
        F.binary_cross_entropy_with_logits(logits, batch.label).backward()
        for opt in opts:
            opt.step()
    seconds = time.perf_counter() - start
    print("RESULT " + json.dumps({"samples": p["ceiling_steps"] * p["batch"], "seconds": seconds}))


def run_ceiling(
    args: argparse.Namespace, p: dict[str, Any], data: str, procs: int, threads: int
) -> float:
    """Samples/s of ``procs`` ceiling processes of ``threads`` threads each, started at once
    and summed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--role", "ceiling", "--preset", args.preset, "--data", data]
    cmd += ["--threads", str(threads), "--ceiling_rows", str(args.ceiling_rows)]
    running = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(procs)
    ]
    total = 0.0
    for proc in running:
        out, _ = proc.communicate(timeout=args.timeout)
        if proc.returncode != 0:
            raise SystemExit(f"a ceiling process exited with {proc.returncode}")
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        r = json.loads(line[len("RESULT ") :])
        total += r["samples"] / r["seconds"]
    return total


# --- psflow jobs -----------------------------------------------------------------------------


def job_command(
    p: dict[str, Any],
    data: str,
    job: Job,
    steps: int,
    extra: Sequence[str] = (),
    root: Path = ROOT,
) -> list[str]:
    """``psflow launch`` of ``examples/ctr.py`` with the preset's model in ``job``'s shape,
    ``steps`` in all, and ``extra`` arguments for the example; the example of the checkout at
    ``root``."""
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--ps", str(job.ps), "--workers"]
    cmd += [str(job.workers)]
    if job.ps_threads is not None:
        cmd += ["--ps-threads", str(job.ps_threads)]
    if job.bind:
        cmd.append("--bind-cores")
    if job.insecure:
        cmd.append("--insecure")
    cmd += [str(root / "examples" / "ctr.py"), "--data", data]
    cmd += ["--train_steps", str(steps), "--dim", str(p["dim"]), "--bottom", p["bottom"]]
    cmd += ["--top", p["top"], "--batch_size", str(p["batch"]), "--no-wide", "--min_count", "0"]
    return [*cmd, "--prefetch", *extra]


def run_psflow(
    args: argparse.Namespace,
    p: dict[str, Any],
    data: str,
    job: Job,
    shm: bool,
    extra: Sequence[str] = (),
    root: Path = ROOT,
    env_extra: Mapping[str, str] | None = None,
) -> float:
    """The job's samples/s: each worker's own line (``examples/ctr.py``), summed; the psflow
    of the checkout at ``root``, its tasks given ``env_extra`` besides."""
    steps = p["steps_per_worker"] * job.workers
    cmd = job_command(p, data, job, steps, extra, root)
    env = dict(os.environ, **(env_extra or {}), PSFLOW_SHM="1" if shm else "0")
    if root != ROOT:  # its package first: the launcher and every task import that one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=root
    )
    rates = {int(m[1]): float(m[3].replace(",", "")) for m in WORKER_LINE.finditer(proc.stdout)}
    if proc.returncode != 0 or len(rates) != job.workers:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise SystemExit(f"psflow job {job.name} failed ({proc.returncode}):\n{tail}")
    return sum(rates.values())


def parse_env(parser: argparse.ArgumentParser, text: str | None) -> dict[str, str]:
    """``K=V,...`` as a mapping (``--against_env``); an empty one for ``None``."""
    env: dict[str, str] = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            parser.error(f"--against_env: K=V pairs, comma-separated, got {item!r}")
        env[key.strip()] = value
    return env


def synthesize(out: str, p: dict[str, Any]) -> None:
    cmd = [sys.executable, "-m", "psflow.cli", "data", "synth-ctr", out]
    cmd += ["--examples", str(p["examples"]), "--test-examples", "1000"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--data", help="a `psflow data synth-ctr` directory (default: new)")
    parser.add_argument("--jobs", help="PSxWORKERS sizes, comma-separated (default: by cores)")
    parser.add_argument("--cores", type=int, help="cores to count on (default: this host's)")
    parser.add_argument("--ceiling_rows", type=int, default=1 << 20, help="plain table rows")
    parser.add_argument(
        "--args",
        help="example arguments for every run of every job, both sides of an A/B "
        "(e.g. '--wide': the example's wide term, which the preset leaves out)",
    )
    parser.add_argument(
        "--against",
        help="example arguments for a second run of each job, alternating with the first "
        "(an A/B on one machine, e.g. '--no-fused'); its figures are prefixed against_",
    )
    parser.add_argument(
        "--against_tree",
        type=Path,
        help="another psflow checkout for the second run of each job (with --against's "
        "arguments, if any): the code before a change, alternating with this one",
    )
    parser.add_argument(
        "--against_env",
        help="K=V,... environment of the second run of each job (with --against's arguments "
        "and tree, if any), e.g. PSFLOW_FLUSH_DENORMALS=0",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--role", choices=["ceiling"], help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = PRESETS[args.preset]
    if args.role == "ceiling":
        return ceiling_task(p, args.data, args.threads, args.ceiling_rows)

    sys.path.insert(0, str(HERE))
    from common import emit, machine

    cores = args.cores or p.get("cores") or len(os.sched_getaffinity(0))
    jobs = parse_jobs(args.jobs or p.get("jobs") or default_jobs(cores))
    with tempfile.TemporaryDirectory(prefix="psflow-scaling-") as tmp:
        data = args.data or os.path.join(tmp, "ctr")
        if not args.data:
            synthesize(data, p)
        one = run_ceiling(args, p, data, 1, 1) if p.get("one_process", True) else None
        ceiling_procs = run_ceiling(args, p, data, cores, 1)
        ceiling_threads = run_ceiling(args, p, data, 1, cores)
        per_core = ceiling_procs / cores
        alone = "-" if one is None else f"{one:,.0f}"
        print(
            f"ceiling: 1 process {alone} samples/s; {cores} processes {ceiling_procs:,.0f} "
            f"({per_core:,.0f} a core); 1 process of {cores} threads {ceiling_threads:,.0f}",
            flush=True,
        )
        rows = []
        yardsticks = [ceiling_threads]
        common = shlex.split(args.args or "")
        variants: list[tuple[str, list[str], Path, dict[str, str]]] = [("", common, ROOT, {})]
        against = bool(args.against or args.against_tree or args.against_env)
        if against:
            tree = (args.against_tree or ROOT).resolve()
            env = parse_env(parser, args.against_env)
            variants.append(("against_", common + shlex.split(args.against or ""), tree, env))
        for job in jobs:
            used = min(job.ps * (job.ps_threads or 1) + job.workers, cores)
            entry: dict[str, Any] = {"job": job.name, "ps": job.ps, "workers": job.workers}
            entry["cores"] = used
            if job.ps_threads is not None:
                entry["ps_threads"] = job.ps_threads
            if job.bind:
                entry["bind_cores"] = True
            for _ in range(p["repeat"]):
                for path, shm in (("shm", True), ("socket", False)):
                    if path not in p.get("paths", ("shm", "socket")):
                        continue
                    for label, extra, root, env in variants:
                        rate = run_psflow(args, p, data, job, shm, extra, root, env)
                        print(f"run {job.name} {label}{path}: {rate:,.0f} samples/s", flush=True)
                        entry.setdefault(f"{label}{path}_runs", []).append(round(rate))
            for path in p.get("paths", ("shm", "socket")):
                for label, *_ in variants:
                    runs = sorted(entry[f"{label}{path}_runs"])
                    rate = runs[len(runs) // 2]
                    entry[f"{label}{path}_samples_per_s"] = rate
                    entry[f"{label}{path}_per_core"] = round(rate / used)
                    entry[f"{label}{path}_efficiency"] = round(rate / (per_core * used), 3)
                if against:
                    ratio = entry[f"{path}_samples_per_s"] / entry[f"against_{path}_samples_per_s"]
                    entry[f"{path}_vs_against"] = round(ratio, 3)
            if p.get("yardstick_each") and cores <= SMALL_HOST:
                yardsticks.append(run_ceiling(args, p, data, 1, cores))
                print(f"1 process of {cores} threads again: {yardsticks[-1]:,.0f}", flush=True)
            around = yardsticks[-2:]  # the readings before and after this job
            entry["threads_around"] = [round(y) for y in around]
            yardstick = sum(around) / len(around)
            for path in p.get("paths", ("shm", "socket")):
                for label, *_ in variants:
                    rate = entry[f"{label}{path}_samples_per_s"]
                    entry[f"{label}{path}_vs_threads"] = round(rate / yardstick, 3)
            print(json.dumps(entry), flush=True)
            rows.append(entry)
    result = {
        "benchmark": "scaling",
        "preset": args.preset,
        "args": args.args,
        "against": args.against,
        "against_tree": None if args.against_tree is None else str(args.against_tree),
        "against_env": args.against_env,
        "cores": cores,
        "model": {k: p[k] for k in ("dim", "bottom", "top", "batch")},
        "ceiling_one_process": None if one is None else round(one),
        "ceiling_procs": round(ceiling_procs),
        "ceiling_per_core": round(per_core),
        "ceiling_threads": round(ceiling_threads),
        "ceiling_threads_runs": [round(y) for y in yardsticks],
        "jobs": rows,
        # On a small host the yardstick: the job against one process of all threads,
        # as read before and after that job (the full preset reads it after each).
        "vs_threads": {
            r["job"]: {path: r[f"{path}_vs_threads"] for path in p.get("paths", ("shm", "socket"))}
            for r in rows
        },
        "machine": machine(),
    }
    emit(result)


if __name__ == "__main__":
    main()
