"""serving: psflow.serve's latency and throughput at batch 1 and 256 while deltas apply.

    .venv/bin/python benchmarks/serving.py [--preset smoke]

Writes a base export (two hashed tables) and a dense head as ONNX, starts
``python -m psflow.serve`` as its own process, and sends requests from one keep-alive
connection, one after the other, at batch 1 and then 256 (each example a bag of ids per
feature, some not held), while a thread here writes a delta (rows rewritten and new ones) every
``delta_every`` seconds, which the server applies between requests. Prints per batch size p50
and p99 latency, requests/s and examples/s, and how many deltas the server applied while it
was measured. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import emit, machine  # noqa: E402

PRESETS = {
    "full": {"rows": 1_000_000, "dim": 32, "delta_rows": 20_000, "delta_every": 1.0,
             "seconds": 10.0, "bag": 8},
    "smoke": {"rows": 2_000, "dim": 8, "delta_rows": 200, "delta_every": 0.1,
              "seconds": 0.5, "bag": 4},
}  # fmt: skip
TABLES = ("items", "users")


class Exports:
    """Writes exports in psflow's format (psflow.serve.delta), as a 1-ps job would."""

    def __init__(self, root: Path, rows: int, dim: int, hidden: int) -> None:
        import torch

        self.root, self.rows, self.dim, self.seq = root, rows, dim, -1
        self.gen = torch.Generator().manual_seed(0)
        self.dense_shapes = {
            "head.0.weight": (hidden, 2 * dim), "head.0.bias": (hidden,),
            "head.2.weight": (1, hidden), "head.2.bias": (1,),
        }  # fmt: skip

    def write(self, ids_per_table: int) -> int:
        import torch
        from safetensors.torch import save_file

        from psflow.serve.delta import (
            EXPORT_META,
            FORMAT,
            MANIFEST,
            dense_tensor_name,
            export_dir_name,
            export_shard_file_name,
            table_export_tensor_name,
        )  # fmt: skip

        self.seq += 1
        since = None if self.seq == 0 else self.seq - 1
        d = self.root / export_dir_name(self.seq)
        d.mkdir(parents=True)
        tensors = {
            dense_tensor_name(n): torch.randn(s, generator=self.gen)
            for n, s in self.dense_shapes.items()
        }
        for table in TABLES:
            if since is None:
                ids = torch.arange(ids_per_table, dtype=torch.int64)
            else:  # rows rewritten and a few new ones
                ids = torch.randint(0, self.rows * 2, (ids_per_table,), generator=self.gen)
                ids = ids.unique()
            tensors[table_export_tensor_name(table, "ids")] = ids
            tensors[table_export_tensor_name(table, "values")] = torch.randn(
                ids.numel(), self.dim, generator=self.gen
            )
            tensors[table_export_tensor_name(table, "tombstones")] = torch.empty(
                0, dtype=torch.int64
            )
        meta = {"seq": self.seq, "base": 0, "since": since, "shard": 0, "num_shards": 1,
                "step": self.seq}  # fmt: skip
        name = export_shard_file_name(0, 1)
        save_file(tensors, str(d / (name + ".tmp")), {EXPORT_META: json.dumps(meta)})
        os.replace(d / (name + ".tmp"), d / name)
        spec = {"embedding_dim": self.dim, "num_embeddings": None, "dtype": "float32"}
        manifest = {
            "format": FORMAT, "seq": self.seq, "kind": "base" if since is None else "delta",
            "base": 0, "since": since, "step": self.seq, "num_shards": 1, "files": [name],
            "dense": {n: {"shape": list(s), "dtype": "float32",
                          "pieces": [{"var": n, "shard": 0, "rows": None}]}
                      for n, s in self.dense_shapes.items()},
            "tables": {t: dict(spec, name=t) for t in TABLES},
        }  # fmt: skip
        (d / (MANIFEST + ".tmp")).write_text(json.dumps(manifest))
        os.replace(d / (MANIFEST + ".tmp"), d / MANIFEST)
        return self.seq


class Head:
    """The dense part: cat(items, users) -> Linear -> ReLU -> Linear."""

    @staticmethod
    def export(path: Path, dim: int, hidden: int) -> None:
        import torch

        from psflow.serve.dense import export_dense

        class Dense(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.head = torch.nn.Sequential(
                    torch.nn.Linear(2 * dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
                )

            def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
                return self.head(torch.cat([items, users], 1)).squeeze(1)

        export_dense(Dense(), {"items": dim, "users": dim}, path, output_names=["score"])


def start_server(export_dir: Path, onnx: Path, timeout: float = 60.0) -> tuple[Any, str]:
    cmd = [
        sys.executable, "-m", "psflow.serve", "--export_dir", str(export_dir),
        "--onnx", str(onnx), "--feature", "items=items:sum", "--feature", "users=users:mean",
        "--poll_seconds", "0.05",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if line.startswith("serving "):
            return proc, line.split()[1]
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before serving")
    proc.kill()
    raise TimeoutError(f"the server did not say it serves within {timeout}s")


def request(conn: http.client.HTTPConnection, body: bytes) -> dict[str, Any]:
    conn.request("POST", "/predict", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    if resp.status != 200:
        raise RuntimeError(f"POST /predict: {resp.status} {data}")
    return data  # type: ignore[no-any-return]


def status(url: str) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/status")
        return json.loads(conn.getresponse().read())  # type: ignore[no-any-return]
    finally:
        conn.close()


def measure(url: str, batch: int, seconds: float, rows: int, bag: int) -> dict[str, float]:
    rng = random.Random(batch)

    def bags() -> list[list[int]]:  # about 1 id in 10 not held
        return [[rng.randrange(int(rows * 1.1)) for _ in range(bag)] for _ in range(batch)]

    bodies = [json.dumps({"features": {"items": bags(), "users": bags()}}).encode()
              for _ in range(16)]  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    latencies = []
    try:
        for body in bodies[:4]:  # warm up
            request(conn, body)
        start = time.perf_counter()
        exports: set[int] = set()
        # Until `seconds` are up and a delta has been applied while measuring (bounded).
        while time.perf_counter() - start < seconds or len(latencies) < 20 or len(exports) < 2:
            if time.perf_counter() - start > seconds + 60:
                raise TimeoutError(f"no delta applied in {seconds + 60:.0f}s of requests")
            t0 = time.perf_counter()
            exports.add(request(conn, bodies[len(latencies) % len(bodies)])["export"])
            latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - start
    finally:
        conn.close()
    latencies.sort()
    n = len(latencies)
    return {
        "p50_ms": latencies[n // 2] * 1e3,
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3,
        "requests_per_s": n / elapsed,
        "examples_per_s": n * batch / elapsed,
        "requests": float(n),
        "exports_served": float(len(exports)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    args = parser.parse_args()
    p = PRESETS[args.preset]
    hidden = 64
    root = Path(tempfile.mkdtemp(prefix="psflow-bench-serving-"))
    try:  # the exports, the head and the deltas: removed however the run ends
        exports = Exports(root / "exports", p["rows"], p["dim"], hidden)
        exports.write(p["rows"])
        Head.export(root / "head.onnx", p["dim"], hidden)
        proc, url = start_server(root / "exports", root / "head.onnx")
        stop = threading.Event()

        def write_deltas() -> None:
            while not stop.wait(p["delta_every"]):
                exports.write(p["delta_rows"])

        writer = threading.Thread(target=write_deltas, daemon=True)
        result: dict[str, Any] = {"benchmark": "serving", "preset": args.preset, **p}
        try:
            writer.start()
            for batch in (1, 256):
                before = status(url)["served_total"]
                figures = measure(url, batch, p["seconds"], p["rows"], p["bag"])
                figures["deltas_applied"] = float(status(url)["served_total"] - before)
                for key, value in figures.items():
                    result[f"batch_{batch}_{key}"] = value
                print(f"batch {batch}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
            last = status(url)
            if last["last_error"]:
                raise RuntimeError(f"the server refused an export: {last['last_error']}")
            result["exports_written"] = exports.seq + 1
        finally:
            stop.set()
            writer.join(10)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["machine"] = machine()
    emit(result)


if __name__ == "__main__":
    main()
