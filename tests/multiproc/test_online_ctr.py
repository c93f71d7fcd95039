"""``examples/online_ctr.py`` end to end: a real broker (Tansu), ``psflow data produce`` into it,
the job (2 ps, 2 workers) training from the topic and exporting, and ``--score``: a real model
server following the exports and scoring each on records that arrived after it."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fault_matrix import PRELOAD
from tests.paths import ROOT

from .kafka_broker import Broker, running_broker
from .support import CLI_MAIN, run_forked

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

EXAMPLE = str(ROOT / "examples" / "online_ctr.py")
SCORED = re.compile(r"^export-(\d+) \(step (\d+)\): AUC ([\d.]+) on the ([\d,]+) records", re.M)


@pytest.fixture(scope="module")
def broker() -> Iterator[Broker]:
    with running_broker() as b:
        yield b


def test_the_job_trains_from_the_topic_and_the_server_scores_each_export(
    broker: Broker, tmp_path: Path
) -> None:
    data, exports = tmp_path / "ctr", tmp_path / "exports"
    cli = [sys.executable, "-m", "psflow.cli"]
    made = run_forked(["-c", CLI_MAIN, "data", "synth-ctr", str(data), "--examples", "60000",
                       "--test-examples", "100"], timeout=60)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    topic = ["--brokers", broker.address, "--topic", "clicks"]
    producer = subprocess.Popen(
        # --loop: records keep arriving whenever the job and the scorer get there (a loaded
        # machine starts them late); the test checks the loop, not the AUC's worth.
        [*cli, "data", "produce", str(data / "train-*"), *topic, "--rate", "2000", "--loop"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    job = subprocess.Popen(
        [*cli, "launch", "--ps", "2", "--workers", "2", "--preload", PRELOAD, EXAMPLE, *topic, "--export_dir",
         str(exports), "--export_every", "3", "--train_seconds", "20", "--dim", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # The scorer forked from the server that imported torch (:mod:`.forked`): it serves
        # sooner, while the job's exports still come.
        score = run_forked(
            [EXAMPLE, "--score", str(exports), *topic, "--score_records", "10000"], timeout=120
        )
        out, _ = job.communicate(timeout=120)
    finally:
        for proc in (producer, job):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert job.returncode == 0, out[-3000:]
    assert score.returncode == 0, score.stderr[-3000:]
    scored = [(int(e), int(s), float(a), int(n.replace(",", ""))) for e, s, a, n in
              SCORED.findall(score.stdout)]  # fmt: skip
    # Each export once, in order, each on records of its own; exports every 3 s and at least 5 s
    # of records (2,000 a second): the server followed at least one new export.
    assert len(scored) >= 2, score.stdout[-2000:]
    assert [e for e, *_ in scored] == sorted({e for e, *_ in scored}), scored
    assert sum(n for *_, n in scored) >= 10000
    assert all(0.5 < a <= 1.0 for _, _, a, _ in scored), scored  # the model learned the clicks
    written = sorted(p.name for p in exports.iterdir())
    assert "dense.onnx" in written and "export-0" in written and "export-1" in written
