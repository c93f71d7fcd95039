"""A shard's row work on several threads: one request's row-wise update and gather, its rows in
stripes (``psflow.sparse.stripes``), against one thread, alternating in one run.

    python benchmarks/row_threads.py                 # 1M x 64 float32, 4,096 rows a request
    python benchmarks/row_threads.py --preset smoke  # what the tests run

The rows of a request are Zipf-distributed ids of a large table (scattered through memory, as a
ps sees them); each round times ``--requests`` Adagrad updates and gathers on 1 thread, then on
``--threads``, so both meet the same machine. What it shows is the kernels' own scaling: a ps
task adds the wire, and the threads need cores no other task uses. One JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from psflow.protocol import RowOptimizerSpec
from psflow.sparse import RowOptimizer, kernels, stripes

PRESETS = {
    "full": {"rows": 1_000_000, "requests": 200, "rounds": 7},
    "smoke": {"rows": 50_000, "requests": 10, "rounds": 2},
}


def zipf_ids(rows: int, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` unique ids of ``rows``, the low ones most likely (as hashed features are)."""
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64)
    return torch.multinomial(weights, n, replacement=False, generator=g)


def timed(
    threads: int, work: list[tuple[torch.Tensor, torch.Tensor]], table: dict[str, Any]
) -> float:
    """Seconds for every request's update then gather, on ``threads``."""
    stripes.set_threads(threads)
    opt, values, state = table["opt"], table["values"], table["state"]
    start = time.perf_counter()
    for ids, grad in work:
        opt.apply(values, state, ids, grad)
        kernels.gather(values, ids)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096, help="unique rows a request")
    args = p.parse_args()
    if kernels.KERNELS is None:
        raise SystemExit("the row kernels were not built: nothing to measure")
    cfg = PRESETS[args.preset]
    g = torch.Generator().manual_seed(0)
    opt = RowOptimizer(RowOptimizerSpec.of("Adagrad", lr=0.05, initial_accumulator_value=0.1))
    values = torch.randn(cfg["rows"], args.dim, generator=g)
    state = opt.new_state(cfg["rows"], args.dim, values.dtype)
    table: dict[str, Any] = {"opt": opt, "values": values, "state": state}
    work = [
        (zipf_ids(cfg["rows"], args.batch, g), torch.randn(args.batch, args.dim, generator=g))
        for _ in range(cfg["requests"])
    ]
    timed(args.threads, work[:2], table)  # the pool's threads started, pages touched
    one, many = [], []
    for _ in range(cfg["rounds"]):
        one.append(timed(1, work, table))
        many.append(timed(args.threads, work, table))
    stripes.set_threads(1)
    rows = cfg["requests"] * args.batch
    rate_one, rate_many = rows / statistics.median(one), rows / statistics.median(many)
    ratios = sorted(a / b for a, b in zip(one, many, strict=True))
    print(f"1 thread: {rate_one / 1e6:.2f}M rows/s (update + gather), median of {len(one)}")
    print(f"{args.threads} threads: {rate_many / 1e6:.2f}M rows/s; pair ratios {ratios}")
    print(
        json.dumps(
            {
                "rows_per_s_1": round(rate_one),
                f"rows_per_s_{args.threads}": round(rate_many),
                "speedup_median": round(statistics.median(ratios), 3),
                "threads": args.threads,
                "rows": cfg["rows"],
                "dim": args.dim,
                "batch": args.batch,
                "cores": len(os.sched_getaffinity(0)),
            }
        )
    )


if __name__ == "__main__":
    main()
