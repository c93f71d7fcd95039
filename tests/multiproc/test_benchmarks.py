"""Every benchmark's smoke preset runs, so that none rots; each prints its figures as JSON last."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.paths import ROOT

from .support import run_benchmark_smoke


def _tf_python() -> str | None:
    """A Python with tensorflow: this one, or the ``.venv-tf`` of the checkout; else None."""
    if importlib.util.find_spec("tensorflow") is not None:
        return sys.executable
    venv = ROOT / ".venv-tf" / "bin" / "python"
    return str(venv) if venv.exists() else None


@pytest.mark.parametrize(
    ("script", "args"), [("linreg.py", ("--metrics-cost",)), ("transport.py", ())]
)
def test_runtime_benchmarks(script: str, args: tuple[str, ...]) -> None:
    result = run_benchmark_smoke(script, *args)
    assert result["preset"] == "smoke"
    figures = [v for k, v in result.items() if k.endswith(("steps_per_s", "gbps"))]
    assert figures and all(isinstance(v, float) and v > 0 for v in figures)
    if args:  # metrics on and off, side by side
        assert result["psflow_metrics_on_steps_per_s"] > 0
        assert isinstance(result["metrics_cost_pct"], float)


@pytest.mark.timeout(240)
def test_mlp_benchmark_runs_every_mode_and_ddp() -> None:
    # Four jobs one after the other (three modes, DDP): on a loaded machine more than 110 s.
    result = run_benchmark_smoke("mlp.py", timeout=220)
    assert result["preset"] == "smoke"
    for key in ("async_psflow", "sync_psflow", "allreduce_psflow", "allreduce_ddp"):
        for unit in ("steps_per_s", "gbps"):
            assert result[f"{key}_{unit}"] > 0, key


@pytest.mark.timeout(130)
def test_checkpoint_pause_benchmark() -> None:
    # 5 s alone; 34-50 s under the suite's load (it once ran out of 50 after its last line).
    result = run_benchmark_smoke("checkpoint_pause.py", timeout=120)
    assert result["benchmark"] == "checkpoint_pause" and result["ps_pause_ms"] >= 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("workload", "figure"), [("sparse", "tf_rows_per_s"), ("ctr", "tf_samples_per_s")]
)
def test_tensorflow_embedding_benchmark(workload: str, figure: str) -> None:
    tf_python = _tf_python()
    if tf_python is None:
        pytest.skip("no tensorflow here: pip install 'psflow[bench]' (or a .venv-tf)")
    result = run_benchmark_smoke(
        "tf_embedding.py", "--workload", workload, "--tf-python", tf_python, timeout=220
    )
    assert result["benchmark"] == f"tf_embedding_{workload}" and result["preset"] == "smoke"
    assert isinstance(result[figure], float) and result[figure] > 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("workload", ["sparse", "ctr", "memory"])
def test_embedding_benchmark(workload: str) -> None:
    """psflow's side of the embedding benchmarks (``--compare-tf`` adds TensorFlow's)."""
    result = run_benchmark_smoke("embedding.py", "--workload", workload, timeout=220)
    assert result["benchmark"] == "embedding" and result["workload"] == workload
    if workload == "sparse":
        assert result["shm_rows_per_s_per_shard"] > 0 and result["socket_rows_per_s_per_shard"] > 0
        # What a shard's core serves, from the ps tasks' own serving CPU (handling_cpu).
        assert result["shm_rows_per_shard_cpu_s"] > result["shm_rows_per_s_per_shard"]
        assert result["payload_bytes_per_step"] == 2 * 4096 * (8 + 64 * 4)
    elif workload == "ctr":
        assert result["shm_samples_per_s"] > 0 and result["socket_samples_per_s"] > 0
    else:
        small, large = result["tables"]
        assert large["table_rows"] > small["table_rows"]
        # No worker holds a table: its memory does not grow with the table's size.
        assert large["worker_peak_rss_mb"] < small["worker_peak_rss_mb"] + 64


@pytest.mark.timeout(240)
def test_scaling_benchmark() -> None:
    # Two ceiling runs and one launched job (the full preset adds a ceiling and the socket path).
    result = run_benchmark_smoke("scaling.py", timeout=220)
    assert result["benchmark"] == "scaling" and result["cores"] == 2
    assert result["ceiling_procs"] > 0 and result["ceiling_threads"] > 0
    (job,) = result["jobs"]
    assert (job["ps"], job["workers"]) == (1, 1)
    assert job["shm_samples_per_s"] > 0 and "socket_samples_per_s" not in job
    share = job["shm_samples_per_s"] / (result["ceiling_per_core"] * job["cores"])
    assert job["shm_efficiency"] == pytest.approx(share, abs=2e-3)
    # Against the 2-thread process as read around the job (once before it, in this preset).
    assert job["threads_around"] == [result["ceiling_threads"]]
    vs = job["shm_samples_per_s"] / result["ceiling_threads"]
    assert (
        job["shm_vs_threads"] == result["vs_threads"]["1x1"]["shm"] == pytest.approx(vs, abs=2e-3)
    )


def test_dense_optimizer_benchmark() -> None:
    result = run_benchmark_smoke("dense_optimizer.py", timeout=60)
    assert result["benchmark"] == "dense_optimizer"
    # The forms the ps takes (psflow.ps.store.FOREACH_SAME_BITS) give the loop's bits.
    assert result["Adam_foreach_same_bits"] and result["AdamW_foreach_same_bits"]
    assert all(result[f"{n}_per_tensor_us"] > 0 for n in ("Adam", "AdamW", "Adagrad", "SGD"))


@pytest.mark.timeout(60)
def test_serving_benchmark() -> None:
    # The server as its own process, deltas landing while each batch size is measured.
    result = run_benchmark_smoke("serving.py", timeout=50)
    assert result["benchmark"] == "serving" and result["preset"] == "smoke"
    for batch in (1, 256):
        assert 0 < result[f"batch_{batch}_p50_ms"] <= result[f"batch_{batch}_p99_ms"]
        assert result[f"batch_{batch}_requests_per_s"] > 0
        assert result[f"batch_{batch}_exports_served"] >= 2  # a delta applied while measured
