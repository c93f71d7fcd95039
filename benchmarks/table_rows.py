"""A CTR shard's table work on one core: a hashed table's updates and lookups as the ps does
them for ``examples/ctr.py``, without the wire, against another checkout's in the same run.

    python benchmarks/table_rows.py [--data DIR] [--against_tree DIR]  # 600 batches of 512
    python benchmarks/table_rows.py --preset smoke                      # what the tests run

The batches are a ``psflow data synth-ctr`` set's (made in a temporary directory unless
``--data`` names one), their 26 columns' ids as the DLRM's table sees them (``examples/dlrm.py``:
the column in the high bits), unique per batch as a worker pushes them. Each step applies
Adagrad to the batch's rows (``HashedRows.apply``: the id map, new rows made and admitted, the
row-wise update) and looks up the next batch's (``HashedRows.lookup``, as a push that prefetches
them): ``first`` is the first pass over the batches, where a good share of each batch's ids are
new (as in a stream of clicks), ``seen`` a second pass over the same batches, every id held.
Figures are microseconds a step and new rows a step. With ``--against_tree``, each round runs
this checkout and the other alternately, each in its own process (the other's psflow on
``PYTHONPATH``), and reports both with their ratios (alone, it measures in its own process).
One JSON line last.
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PRESETS: dict[str, dict[str, Any]] = {
    "full": {"examples": 400_000, "batches": 600, "rounds": 3},
    "smoke": {"examples": 3_000, "batches": 4, "rounds": 1},
}
COLUMN_BITS = 48  # examples/dlrm.py's


def measure(data: str, batches: int) -> dict[str, float]:
    """One process's figures: this interpreter's psflow, one thread."""
    import torch

    from psflow.data.ctr import ctr_batches
    from psflow.protocol import RowOptimizerSpec, TableSpec
    from psflow.sparse import make_rows

    torch.set_num_threads(1)
    adagrad = RowOptimizerSpec.of("Adagrad", lr=0.05, initial_accumulator_value=0.1)
    spec = TableSpec(
        name="t", embedding_dim=16, num_embeddings=None, init_std=0.01, seed=1, optimizer=adagrad
    )
    rows = make_rows(spec, 0, 1)
    columns = torch.arange(26, dtype=torch.int64) << COLUMN_BITS
    ids = []
    for batch in ctr_batches(os.path.join(data, "train-*"), batch_size=512, num_epochs=1):
        ids.append(((batch.categorical & ((1 << COLUMN_BITS) - 1)) | columns).view(-1).unique())
        if len(ids) > batches:
            break
    out: dict[str, float] = {"unique_ids_per_step": statistics.fmean(i.numel() for i in ids)}
    for label in ("first", "seen"):
        apply_s = lookup_s = 0.0
        before = rows.num_rows
        for i in range(len(ids) - 1):
            grads = torch.full((ids[i].numel(), 16), 0.01)
            start = time.perf_counter()
            rows.apply(ids[i], grads)
            mid = time.perf_counter()
            rows.lookup(ids[i + 1])
            apply_s += mid - start
            lookup_s += time.perf_counter() - mid
        steps = len(ids) - 1
        out[f"{label}_apply_us"] = round(apply_s / steps * 1e6, 1)
        out[f"{label}_lookup_us"] = round(lookup_s / steps * 1e6, 1)
        out[f"{label}_new_rows_per_step"] = round((rows.num_rows - before) / steps, 1)
    return out


def run_one(tree: Path, data: str, batches: int) -> dict[str, float]:
    """:func:`measure` in a fresh process with ``tree``'s psflow."""
    from common import run_in_tree

    result: dict[str, float] = run_in_tree(
        __file__, tree, ["--role", "measure", "--data", data, "--batches", str(batches)]
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--data", help="a `psflow data synth-ctr` directory (default: new)")
    parser.add_argument("--against_tree", type=Path, help="another psflow checkout, alternating")
    parser.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=["measure"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = PRESETS[args.preset]
    if args.role == "measure":
        print(json.dumps(measure(args.data, args.batches)))
        return

    sys.path.insert(0, str(HERE))
    from common import emit, machine

    trees = [("", ROOT)]
    if args.against_tree is not None:
        trees.append(("against_", args.against_tree.resolve()))
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    with tempfile.TemporaryDirectory(prefix="psflow-table-rows-") as tmp:
        data = args.data or os.path.join(tmp, "ctr")
        if not args.data:
            cmd = [sys.executable, "-m", "psflow.cli", "data", "synth-ctr", data]
            cmd += ["--examples", str(p["examples"]), "--test-examples", "100"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=600, cwd=ROOT)
        for _ in range(p["rounds"]):
            for label, tree in trees:
                if len(trees) == 1:  # nothing to alternate with: this process
                    runs[label].append(measure(data, p["batches"]))
                else:
                    runs[label].append(run_one(tree, data, p["batches"]))
                print(label or "this", json.dumps(runs[label][-1]), flush=True)
    result: dict[str, Any] = {"benchmark": "table_rows", "preset": args.preset}
    for label, _ in trees:
        for key in runs[label][0]:
            # The least time of the rounds: what the code costs when the machine lets it run.
            values = [r[key] for r in runs[label]]
            result[f"{label}{key}"] = min(values) if key.endswith("_us") else values[0]
    if args.against_tree is not None:
        result["against_tree"] = str(args.against_tree)
        for key in [k for k in runs[""][0] if k.endswith("_us")]:
            result[f"{key}_against_over_this"] = round(result[f"against_{key}"] / result[key], 2)
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
