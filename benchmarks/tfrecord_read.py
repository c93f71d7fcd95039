"""TFRecord reading speed: raw records and records parsed into tensors, psflow beside TensorFlow.

    python benchmarks/tfrecord_read.py --preset full --compare-tf --tf-python /path/to/tf/python

writes (once, then reuses) a file of about 200 MB of ~1 KB ``tf.train.Example`` records (label
int64, x 200 float32, ids 20 int64, name 64 bytes), then measures, median of ``--repeats`` runs:

- psflow raw: :class:`TFRecordReader` batches (checksums verified), records/s and MB/s;
- psflow raw as ``list[bytes]`` batches of ``--batch-size``;
- psflow parsed: :class:`TFRecordDataset` with a FixedLenFeature spec, torch tensors, batches
  of ``--batch-size``; the same through a shuffle buffer of ten batches;
- with ``--compare-tf``: ``tf.data.TFRecordDataset(...).batch(B)`` and the same followed by
  ``tf.io.parse_example`` (sequential map, and ``num_parallel_calls=AUTOTUNE`` with prefetch),
  and ``.shuffle(10 * B)`` before the batching, run by ``--tf-python`` (default: this
  interpreter) in a subprocess on the same file.

With ``--ctr DIR`` (a ``psflow data synth-ctr`` set), also the CPU a batch of 512 of
``examples/ctr.py``'s reading takes on one thread (``ctr_batches`` of its training files,
shuffle buffer 5,120, no prefetch thread: framing, shuffle, parse and the batch's arrays).

``--preset smoke`` uses a 2 MB file and one run, for the test suite. The last line printed is
one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from psflow.data import proto
from psflow.data.dataset import TFRecordDataset
from psflow.data.features import FixedLenFeature
from psflow.data.pipeline import rebatch
from psflow.data.tfrecord import TFRecordReader, TFRecordWriter

PRESETS = {
    "smoke": {"size_mb": 2, "repeats": 1, "ctr_batches": 10},
    "full": {"size_mb": 200, "repeats": 3, "ctr_batches": 800},
}
SPEC = {
    "label": FixedLenFeature(dtype="int64"),
    "x": FixedLenFeature(dtype="float32", shape=(200,)),
    "ids": FixedLenFeature(dtype="int64", shape=(20,)),
    "name": FixedLenFeature(dtype="bytes"),
}

TF_SCRIPT = r"""
import json, sys, time, statistics
import tensorflow as tf
path, bs, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
spec = {
    "label": tf.io.FixedLenFeature([], tf.int64),
    "x": tf.io.FixedLenFeature([200], tf.float32),
    "ids": tf.io.FixedLenFeature([20], tf.int64),
    "name": tf.io.FixedLenFeature([], tf.string),
}
AUTO = tf.data.AUTOTUNE
def raw():
    return tf.data.TFRecordDataset(path, buffer_size=4 << 20).batch(bs)
def parsed():
    return raw().map(lambda b: tf.io.parse_example(b, spec))
def parsed_parallel():
    return raw().map(lambda b: tf.io.parse_example(b, spec), num_parallel_calls=AUTO).prefetch(AUTO)
def shuffled():
    ds = tf.data.TFRecordDataset(path, buffer_size=4 << 20).shuffle(10 * bs, seed=0).batch(bs)
    return ds.map(lambda b: tf.io.parse_example(b, spec))
def run(make, key):
    rates = []
    for _ in range(repeats):
        t = time.perf_counter(); n = 0
        for b in make():
            n += int((b[key] if isinstance(b, dict) else b).shape[0])
        rates.append(n / (time.perf_counter() - t))
    return statistics.median(rates), n
out = {"tf_version": tf.__version__}
out["tf_raw_rps"], n = run(raw, None)
out["tf_parse_rps"], _ = run(parsed, "x")
out["tf_parse_parallel_rps"], _ = run(parsed_parallel, "x")
out["tf_shuffle_parse_rps"], _ = run(shuffled, "x")
out["tf_records"] = n
print(json.dumps(out))
"""


def make_file(path: Path, size_mb: float) -> int:
    """Writes ~``size_mb`` MB of ~1 KB Examples; returns the record count."""
    rng = np.random.default_rng(0)
    n = int(size_mb * 1e6 / 1000)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with TFRecordWriter(str(tmp), compression="") as w:
        for _ in range(n):
            ex = proto.Example()
            f = ex.features.feature
            f["label"].int64_list.value.append(int(rng.integers(0, 1000)))
            f["x"].float_list.value.extend(rng.standard_normal(200).astype(np.float32).tolist())
            f["ids"].int64_list.value.extend(rng.integers(0, 1 << 20, 20).tolist())
            f["name"].bytes_list.value.append(rng.bytes(64))
            w.write(ex.SerializeToString())
    os.replace(tmp, path)
    return n


def median_rate(fn: Any, repeats: int) -> tuple[float, float, int]:
    """(records/s, MB/s, records) of ``fn() -> (records, bytes)``, median over repeats."""
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        n, nbytes = fn()
        dt = time.perf_counter() - t
        runs.append((n / dt, nbytes / dt / 1e6, n))
    runs.sort()
    return runs[len(runs) // 2]


def ctr_batch_cpu(data: Path, batches: int, repeats: int) -> float:
    """Microseconds of this thread's CPU a batch of 512 of ``examples/ctr.py``'s reader takes,
    median of ``repeats`` runs of ``batches`` batches after 20."""
    from psflow.data.ctr import ctr_batches

    runs = []
    for _ in range(repeats):
        reader = ctr_batches(
            f"{data}/train-*", batch_size=512, shuffle_buffer=10 * 512, seed=0,
            num_epochs=None, prefetch=0,
        )  # fmt: skip
        for _ in range(20):
            next(reader)
        start = time.thread_time()
        for _ in range(batches):
            next(reader)
        runs.append((time.thread_time() - start) / batches * 1e6)
        reader.close()
    runs.sort()
    return round(runs[len(runs) // 2], 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="full")
    ap.add_argument("--file", type=Path, help="benchmark file (made if missing)")
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--ctr", type=Path, help="a synth-ctr set: also examples/ctr.py's reading")
    ap.add_argument("--compare-tf", action="store_true", help="also run tf.data on the same file")
    ap.add_argument("--tf-python", default=sys.executable, help="interpreter with tensorflow")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    repeats = args.repeats or int(preset["repeats"])
    path = args.file or Path(tempfile.gettempdir()) / f"psflow-bench-{preset['size_mb']}mb.tfrecord"
    if not path.exists():
        t = time.perf_counter()
        count = make_file(path, preset["size_mb"])
        print(f"wrote {path} ({count:,} records) in {time.perf_counter() - t:.1f}s", flush=True)
    size = path.stat().st_size
    bs = args.batch_size

    def raw() -> tuple[int, int]:
        n = nbytes = 0
        with TFRecordReader(path, compression="") as r:
            for b in r.iter_batches():
                n += len(b)
                nbytes += b.nbytes
        return n, nbytes

    def raw_lists() -> tuple[int, int]:
        n = nbytes = 0
        with TFRecordReader(path, compression="") as r:
            for b in rebatch(r.iter_batches(), bs, drop_remainder=False):
                recs = b.tolist()
                n += len(recs)
                nbytes += b.nbytes
        return n, nbytes

    def parsed(shuffle_buffer: int = 0) -> tuple[int, int]:
        n = 0
        ds = TFRecordDataset(
            str(path), SPEC, batch_size=bs, compression="", backend="torch",
            shuffle_buffer=shuffle_buffer,
        )  # fmt: skip
        for b in ds:
            n += int(b["x"].shape[0])
        return n, size

    result: dict[str, Any] = {
        "benchmark": "tfrecord_read",
        "preset": args.preset,
        "file_mb": round(size / 1e6, 1),
        "batch_size": bs,
        "repeats": repeats,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }
    rps, mbps, n = median_rate(raw, repeats)
    result.update(psflow_raw_rps=round(rps), psflow_raw_mbps=round(mbps, 1), records=n)
    rps, mbps, _ = median_rate(raw_lists, repeats)
    result.update(psflow_raw_list_rps=round(rps), psflow_raw_list_mbps=round(mbps, 1))
    rps, _, _ = median_rate(parsed, repeats)
    result.update(psflow_parse_rps=round(rps))
    rps, _, _ = median_rate(lambda: parsed(10 * bs), repeats)
    result.update(psflow_shuffle_parse_rps=round(rps))
    if args.ctr is not None:
        result["ctr_us_a_batch"] = ctr_batch_cpu(args.ctr, int(preset["ctr_batches"]), repeats)
        print(f"examples/ctr.py's reading: {result['ctr_us_a_batch']} us of CPU a batch of 512")
    print(
        f"psflow raw: {result['psflow_raw_rps']:,} records/s, {result['psflow_raw_mbps']} MB/s; "
        f"as list[bytes] batches: {result['psflow_raw_list_rps']:,} records/s; "
        f"parsed to tensors: {result['psflow_parse_rps']:,} records/s "
        f"({result['psflow_shuffle_parse_rps']:,} through a shuffle buffer of {10 * bs:,})",
        flush=True,
    )
    if args.compare_tf:
        proc = subprocess.run(
            [args.tf_python, "-c", TF_SCRIPT, str(path), str(bs), str(repeats)],
            capture_output=True,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
            timeout=1800,
        )
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"--compare-tf: {args.tf_python} failed (exit {proc.returncode})")
        tf = json.loads(proc.stdout.strip().splitlines()[-1])
        result.update({k: (round(v) if isinstance(v, float) else v) for k, v in tf.items()})
        result["tf_raw_mbps"] = round(
            tf["tf_raw_rps"] * result["psflow_raw_mbps"] / result["psflow_raw_rps"], 1
        )
        best_tf_parse = max(tf["tf_parse_rps"], tf["tf_parse_parallel_rps"])
        result["raw_vs_tf"] = round(result["psflow_raw_rps"] / tf["tf_raw_rps"], 2)
        result["raw_list_vs_tf"] = round(result["psflow_raw_list_rps"] / tf["tf_raw_rps"], 2)
        result["parse_vs_tf"] = round(result["psflow_parse_rps"] / tf["tf_parse_rps"], 2)
        result["parse_vs_tf_parallel"] = round(result["psflow_parse_rps"] / best_tf_parse, 2)
        result["shuffle_parse_vs_tf"] = round(
            result["psflow_shuffle_parse_rps"] / tf["tf_shuffle_parse_rps"], 2
        )
        print(
            f"tensorflow {tf['tf_version']}: raw batched {result['tf_raw_rps']:,} records/s; "
            f"parse_example {result['tf_parse_rps']:,} records/s "
            f"(parallel map + prefetch {result['tf_parse_parallel_rps']:,}); "
            f"psflow/TF raw {result['raw_vs_tf']}x, parse {result['parse_vs_tf']}x "
            f"({result['parse_vs_tf_parallel']}x vs parallel); shuffled and parsed "
            f"{result['tf_shuffle_parse_rps']:,} records/s ({result['shuffle_parse_vs_tf']}x)",
            flush=True,
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
