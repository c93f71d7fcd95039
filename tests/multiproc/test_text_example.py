"""examples/text_classifier.py end to end on a tiny subset of the real 20 Newsgroups files:
alone in one process, as a job whose workers split each batch over towers (with an evaluator
task scoring its checkpoints), and as a
synchronous job whose workers split the model into stages (trained through the ps)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.data.text import TextConfig, corpus_files, prepare_text, read_tsv
from psflow.train import CheckpointDir
from tests.multiproc.support import launch_cmd, run_forked
from tests.paths import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

EXAMPLE = ROOT / "examples" / "text_classifier.py"
SMALL = ["--batch_size", "16", "--max_length", "60", "--dim", "16", "--hidden", "16"]
FAST = ["--lr", "0.01", "--table_lr", "0.1"]  # a few hundred documents, a hundred steps


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every 40th training document (all 20 groups: the file is sorted by group) and every
    60th test document of the shipped files."""
    tmp = tmp_path_factory.mktemp("20news")
    train, test = corpus_files("20newsgroups")
    for name, path, every in (("train.tsv", train, 40), ("test.tsv", test, 60)):
        rows = list(read_tsv(path))[::every]
        (tmp / name).write_text("".join(f"{label}\t{text}\n" for label, text in rows))
    out = tmp / "data"
    prepare_text(str(tmp / "train.tsv"), str(tmp / "test.tsv"), str(out), TextConfig(shards=2))
    return out


def _result(stdout: str) -> dict[str, float]:
    lines = [ln for ln in stdout.splitlines() if "RESULT " in ln]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0].split("RESULT ", 1)[1])  # type: ignore[no-any-return]


def _run(cmd: list[str], *, forked: bool = False) -> str:
    """Runs ``cmd``; ``forked``: ``cmd`` is a script and its arguments, forked from the server
    that imported torch (``run_forked``) rather than started with ``python``."""
    if forked:
        proc = run_forked(cmd, timeout=200)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_alone_it_learns_and_logs_its_scores(data: Path, tmp_path: Path) -> None:
    args = ["--data", str(data), "--encoder", "bag", "--train_steps", "120", *SMALL]
    args += ["--eval_steps", "60", "--logdir", str(tmp_path)]
    result = _result(_run([str(EXAMPLE), *args, *FAST], forked=True))
    assert result["global_step"] == 120
    # 20 groups: chance is 0.05 and a uniform guess's loss ln(20) = 3.0.
    assert result["test_accuracy"] > 0.12, result
    assert result["test_loss"] < math.log(20) - 0.2, result
    # A cluster of one writes the job's summaries: at --eval_steps, then the final score.
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    accuracy = acc.Scalars("eval/accuracy")
    assert [e.step for e in accuracy] == [60, 120, 120]
    assert accuracy[-1].value == pytest.approx(result["test_accuracy"], abs=1e-4)
    assert [e.step for e in acc.Scalars("eval/loss")] == [60, 120, 120]
    assert CheckpointDir(str(tmp_path)).latest() == "ckpt-120"


def test_towers_job_trains_and_writes_test_accuracy(data: Path, tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    args = ["--data", str(data), "--train_steps", "30", "--eval_steps", "10", *SMALL]
    cmd = launch_cmd(EXAMPLE, *args, "--towers", "cpu,cpu", "--logdir", str(logdir), preload=True)
    cmd.insert(cmd.index(str(EXAMPLE)), "--evaluator")
    stdout = _run(cmd)
    result = _result(stdout)
    assert result["global_step"] >= 30
    assert 0.0 <= result["test_accuracy"] <= 1.0
    assert stdout.count("documents/s (this worker)") == 2
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    accuracy = acc.Scalars("eval/accuracy")
    # Every 10 of the chief's own steps, then the final score.
    assert len(accuracy) >= 2 and all(0.0 <= e.value <= 1.0 for e in accuracy)
    assert accuracy[-1].value == pytest.approx(result["test_accuracy"], abs=1e-4)
    assert len(acc.Scalars("eval/loss")) == len(accuracy)
    d = CheckpointDir(str(logdir))
    latest = d.latest()
    assert latest is not None
    table = d.manifest(latest).tables
    assert table["embedding"]["spec"]["num_embeddings"] > 2  # the table lived on the ps
    # The evaluator task scored every checkpoint once, at its step, table rows loaded with no ps.
    manifests = [d.manifest(c.name) for c in d.checkpoints() if c.complete]
    assert manifests and manifests[-1].final
    scored = EventAccumulator(str(logdir / "eval"), size_guidance={"scalars": 0})
    scored.Reload()
    assert [e.step for e in scored.Scalars("eval/accuracy")] == [m.global_step for m in manifests]
    assert all(0.0 <= e.value <= 1.0 for e in scored.Scalars("eval/accuracy"))
    assert [e.step for e in scored.Scalars("eval/loss")] == [m.global_step for m in manifests]


def test_stages_train_through_the_ps_in_sync_mode(data: Path) -> None:
    args = ["--data", str(data), "--encoder", "bag", "--train_steps", "60", *SMALL]
    args += ["--stages", "cpu,cpu", "--micro_batches", "3", *FAST]
    cmd = launch_cmd(EXAMPLE, *args, preload=True)
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = ["--mode", "sync"]
    result = _result(_run(cmd))
    assert result["global_step"] == 60  # synchronous: one step per pair of gradients
    assert result["test_loss"] < math.log(20) - 0.2, result
