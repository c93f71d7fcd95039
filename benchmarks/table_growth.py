"""A hashed table growing from empty: how long its longest pushes stall the shard, and the
memory it ends with, against another checkout's in the same run.

    python benchmarks/table_growth.py [--against_tree DIR]   # 4M rows of 64, Adagrad
    python benchmarks/table_growth.py --preset smoke          # what the tests run

One shard's ``HashedRows`` (row-wise Adagrad, one thread, ``max_rows`` = ``--rows``) takes
pushes of ``--batch`` ids, half of them new and half ids it holds, until it holds ``--rows``
rows: a stream of new users or items. Every push that outgrows the table's storage pays for
the growth (and the id map's rebuild) before the shard serves anything else, so its workers all
wait for it. Figures: each push's wall time (median, 99th percentile, longest, and the five
longest), the total, and the process's peak resident memory (``ru_maxrss``) against the bytes
the rows and their state need; then, the table full, 50 more pushes, each evicting as many
least recently updated rows as it makes (``evicting_push_*``).
Each run is a fresh process; with ``--against_tree``, each round runs this checkout and the
other alternately (the other's psflow on ``PYTHONPATH``) and reports both with their ratios.
One JSON line last.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

EVICTING_PUSHES = 50
"""Pushes timed once the table is full (its ``max_rows``): each evicts as many rows as it
makes, the least recently updated."""
PRESETS: dict[str, dict[str, Any]] = {
    "full": {"rows": 4_000_000, "dim": 64, "batch": 8192, "rounds": 3},
    "smoke": {"rows": 20_000, "dim": 8, "batch": 1024, "rounds": 1},
}


def measure(rows_wanted: int, dim: int, batch: int) -> dict[str, Any]:
    """One process's figures: this interpreter's psflow, one thread."""
    import torch

    from psflow import allocator
    from psflow.protocol import RowOptimizerSpec, TableSpec
    from psflow.sparse import make_rows

    allocator.tune()  # as a ps task does
    torch.set_num_threads(1)
    adagrad = RowOptimizerSpec.of("Adagrad", lr=0.05, initial_accumulator_value=0.1)
    spec = TableSpec(
        name="t", embedding_dim=dim, num_embeddings=None, seed=1, optimizer=adagrad,
        max_rows=rows_wanted,
    )  # fmt: skip
    rows = make_rows(spec, 0, 1)
    gen = torch.Generator().manual_seed(0)
    new, held = batch // 2, batch - batch // 2
    grads = torch.full((batch, dim), 0.01)
    times: list[float] = []
    evicting: list[float] = []
    start = time.perf_counter()
    made, total = 0, 0.0
    while len(evicting) < EVICTING_PUSHES:
        fresh = torch.arange(made, made + new, dtype=torch.int64) * 7919 + 1
        made += new
        old = (torch.randint(0, max(1, made - new), (held,), generator=gen) * 7919 + 1).unique()
        ids = torch.cat([fresh, old]) if made > new else fresh
        full = rows.num_rows == rows_wanted
        t = time.perf_counter()
        rows.apply(ids, grads[: ids.numel()])
        (evicting if full else times).append(time.perf_counter() - t)
        if not full:
            total = time.perf_counter() - start
    times_ms = sorted(1e3 * t for t in times)
    evicting_ms = sorted(1e3 * t for t in evicting)
    row_bytes = 2 * dim * 4 + 16  # the row, Adagrad's sum, its id and its last update
    return {
        "rows": rows.num_rows,
        "pushes": len(times),
        "push_median_ms": round(statistics.median(times_ms), 2),
        "push_p99_ms": round(times_ms[int(0.99 * (len(times_ms) - 1))], 2),
        "push_longest_ms": round(times_ms[-1], 2),  # as the others: 1.04 and 1.0 read out of order
        "longest_five_ms": [round(t, 1) for t in times_ms[-5:]],
        "total_s": round(total, 2),
        "evicting_push_median_ms": round(statistics.median(evicting_ms), 2),
        "evicting_push_longest_ms": round(evicting_ms[-1], 2),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "rows_need_mb": rows.num_rows * row_bytes // (1 << 20),
    }


def run_one(tree: Path, p: dict[str, Any]) -> dict[str, Any]:
    """:func:`measure` in a fresh process with ``tree``'s psflow."""
    from common import run_in_tree

    args = ["--role", "measure", "--rows", str(p["rows"]), "--dim", str(p["dim"])]
    result: dict[str, Any] = run_in_tree(__file__, tree, [*args, "--batch", str(p["batch"])])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--against_tree", type=Path, help="another psflow checkout, alternating")
    parser.add_argument("--rows", type=int, help="rows to grow to (default: the preset's)")
    parser.add_argument("--dim", type=int, help="the rows' width (default: the preset's)")
    parser.add_argument("--batch", type=int, help="ids a push (default: the preset's)")
    parser.add_argument("--rounds", type=int, help="rounds (default: the preset's)")
    parser.add_argument("--role", choices=["measure"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = dict(PRESETS[args.preset])
    for key in ("rows", "dim", "batch", "rounds"):
        value = getattr(args, key)
        if value is not None:
            if value < 1:
                parser.error(f"--{key} must be at least 1, not {value}")
            p[key] = value
    if args.role == "measure":
        print(json.dumps(measure(p["rows"], p["dim"], p["batch"])))
        return

    sys.path.insert(0, str(HERE))
    from common import emit, machine

    trees = [("", ROOT)]
    if args.against_tree is not None:
        tree = args.against_tree.resolve()
        if not (tree / "psflow").is_dir():
            parser.error(f"--against_tree: no psflow package under {tree}")
        trees.append(("against_", tree))
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in trees}
    for _ in range(p["rounds"]):
        for label, tree in trees:
            runs[label].append(run_one(tree, p))
            print(label or "this", json.dumps(runs[label][-1]), flush=True)
    result: dict[str, Any] = {"benchmark": "table_growth", "preset": args.preset, **p}
    lower = ("push_median_ms", "push_p99_ms", "push_longest_ms", "total_s", "peak_rss_mb")
    lower += ("evicting_push_median_ms", "evicting_push_longest_ms")
    for label, _ in trees:
        for key in lower:
            # The least of the rounds: what the code costs when the machine lets it run.
            result[f"{label}{key}"] = min(r[key] for r in runs[label])
        result[f"{label}push_longest_ms_each"] = [r["push_longest_ms"] for r in runs[label]]
        result[f"{label}rows_need_mb"] = runs[label][0]["rows_need_mb"]
    if args.against_tree is not None:
        result["against_tree"] = str(args.against_tree)
        for key in lower:
            ratio = result[f"against_{key}"] / max(result[key], 1e-9)
            result[f"{key}_against_over_this"] = round(ratio, 2)
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
