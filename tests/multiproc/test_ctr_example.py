"""examples/ctr.py end to end on a tiny synth-ctr set: alone (a cluster of one), and as a job of
2 ps and 2 workers whose hashed table lives on the ps, with an evaluator task that scores each
checkpoint (hashed tables loaded with no ps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.train import CheckpointDir
from tests.fault_matrix import PRELOAD
from tests.paths import ROOT

from .support import CLI_MAIN, run_forked

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

EXAMPLE = ROOT / "examples" / "ctr.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ctr")
    cmd = ["-c", CLI_MAIN, "data", "synth-ctr", str(out)]
    cmd += ["--examples", "6000", "--test-examples", "2000", "--scale", "0.001"]
    made = run_forked(cmd, timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    return out


def _result(stdout: str) -> dict[str, object]:
    lines = [ln for ln in stdout.splitlines() if "RESULT " in ln]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0].split("RESULT ", 1)[1])  # type: ignore[no-any-return]


def test_alone_it_learns_checkpoints_and_logs_its_score(data: Path, tmp_path: Path) -> None:
    args = ["--data", str(data), "--train_steps", "150", "--batch_size", "128"]
    args += ["--logdir", str(tmp_path), "--warmup_steps", "50"]
    proc = run_forked([str(EXAMPLE), *args], timeout=200)  # python EXAMPLE ..., forked
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _result(proc.stdout)
    assert result["global_step"] == 150
    assert "100 steps, " in proc.stdout  # the rate's: the first 50 left out
    best = json.loads((data / "_synth_ctr.json").read_text())["best_auc"]
    assert result["best_auc"] == best
    assert 0.55 < float(result["test_auc"]) <= 1.0, result  # type: ignore[arg-type]
    # A cluster of one: the job's checkpoint, hashed table included, and the chief's score.
    d = CheckpointDir(str(tmp_path))
    assert d.latest() == "ckpt-150" and d.manifest("ckpt-150").tables["embedding"]["rows"] > 0
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    [score] = acc.Scalars("eval/auc")
    assert score.step == 150 and abs(score.value - float(result["test_auc"])) < 1e-4  # type: ignore[arg-type]
    assert [e.step for e in acc.Scalars("eval/loss")] == [150]
    # The checkpoint exported loads into the example's own model, strictly (its buffers are
    # constants of the shape, not saved), and scores in one process what the chief scored.
    out = tmp_path / "model.safetensors"
    made = run_forked(
        ["-c", CLI_MAIN, "checkpoint", "export", str(tmp_path), str(out)], timeout=120
    )
    assert made.returncode == 0, made.stderr[-3000:]
    scored = run_forked(["-c", _SCORE, str(data), str(out), str(EXAMPLE.parent)], timeout=120)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert round(float(scored.stdout.split()[-1]), 4) == result["test_auc"], scored.stdout


_SCORE = """
import sys
sys.path.insert(0, sys.argv[3])
from safetensors.torch import load_file
import psflow.nn as pnn
from ctr import evaluate, parse
from dlrm import DLRM
args = parse(["--data", sys.argv[1]])
table = pnn.RowOptimizerSpec.of("Adagrad", lr=args.table_lr)
sizes = [[int(s) for s in f.split(",")] for f in (args.bottom, args.top)]
model = DLRM(args.dim, *sizes, table, pnn.RowOptimizerSpec.of("Ftrl"), args.min_count)
model.load_state_dict(load_file(sys.argv[2]))
print(evaluate(model, sys.argv[1] + "/test-*")["auc"])
"""


def test_launched_on_two_ps_it_trains_checkpoints_and_is_evaluated(
    data: Path, tmp_path: Path
) -> None:
    logdir = tmp_path / "run"
    args = ["--data", str(data), "--train_steps", "60", "--batch_size", "64"]
    args += ["--save_checkpoint_steps", "30"]
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--ps", "2", "--workers", "2"]
    cmd += ["--evaluator", "--preload", PRELOAD]
    proc = subprocess.run(
        [*cmd, str(EXAMPLE), *args, "--logdir", str(logdir)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = _result(proc.stdout)
    assert int(result["global_step"]) >= 60  # type: ignore[call-overload]
    assert 0.0 <= float(result["test_auc"]) <= 1.0  # type: ignore[arg-type]
    assert proc.stdout.count("samples/s (this worker)") == 2
    d = CheckpointDir(str(logdir))
    latest = d.latest()
    assert latest is not None and int(latest.split("-")[1]) >= 60
    table = d.manifest(latest).tables["embedding"]
    assert table["rows"] > 0 and table["spec"]["num_embeddings"] is None
    # The evaluator scored every checkpoint once, at its global step, and stopped at the final.
    manifests = [d.manifest(c.name) for c in d.checkpoints() if c.complete]
    assert len(manifests) >= 2 and manifests[-1].final
    acc = EventAccumulator(str(logdir / "eval"), size_guidance={"scalars": 0})
    acc.Reload()
    aucs = acc.Scalars("eval/auc")
    assert [e.step for e in aucs] == [m.global_step for m in manifests]
    assert [e.step for e in acc.Scalars("eval/loss")] == [m.global_step for m in manifests]
    # Its model, loaded from the final checkpoint with no ps, scores as the chief's did on the
    # ps's values at the end (the other worker's last updates may fall in between).
    assert abs(aucs[-1].value - float(result["test_auc"])) < 0.02, (aucs, result)  # type: ignore[arg-type]
