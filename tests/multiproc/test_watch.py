"""Watching a real job: its metrics over HTTP agree with it, ``psflow launch`` on a terminal
shows its progress line, and ``psflow top`` renders it, in a real terminal (tmux).

One job for the module: ``psflow launch`` runs in a tmux pane (its stdout a terminal), trains
to global step 40 and holds still (``scripts/watched_train.py``) until the module is done, so
that what the tests read cannot move under them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from psflow import metrics
from psflow.cluster import jobs

from .support import launch_cmd

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).parent / "scripts" / "watched_train.py"
STEPS, BATCH, WORKERS = 40, 4, 2
MODEL_BYTES = (32 * 32 + 32) * 4  # torch.nn.Linear(32, 32), float32


@dataclass
class Job:
    tmux: list[str]
    run_dir: Path
    hold: Path
    trained: dict[str, dict[str, float]]
    targets: dict[str, str]
    env: dict[str, str]

    def screen(self, window: str) -> str:
        return subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", window],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def size(self, window: str) -> str:
        return subprocess.run(
            [*self.tmux, "display", "-p", "-t", window, "#{pane_width}x#{pane_height}"],
            capture_output=True,
            text=True,
        ).stdout.strip()


def _until(what: str, check, timeout: float = 60.0, shows=None):  # type: ignore[no-untyped-def]
    """``check()``'s first true value; after ``timeout`` seconds, an error with ``shows()``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            seen = "" if shows is None else f"; it shows:\n{shows()}"
            raise AssertionError(f"timed out waiting for {what}{seen}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (bash scripts/setup-venv.sh test installs it as root)")
    tmp = tmp_path_factory.mktemp("watch")
    run_dir, hold = tmp / "run", tmp / "hold"
    run_dir.mkdir(mode=0o700)
    hold.mkdir()
    env = {
        "XDG_RUNTIME_DIR": str(run_dir),  # this job's own job file directory
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "PATH": os.environ.get("PATH", ""),
        "TERM": "xterm-256color",
    }
    exit_file = tmp / "launch.exit"
    conf = tmp / "tmux.conf"  # a wide terminal, whatever the machine's tmux defaults are
    conf.write_text("set -g default-size 160x40\n")
    tmux = ["tmux", "-L", f"psflow-test-{os.getpid()}", "-f", str(conf)]
    cmd = launch_cmd(
        SCRIPT,
        "--logdir",
        str(tmp / "log"),
        "--steps",
        str(STEPS),
        "--batch",
        str(BATCH),
        "--hold",
        str(hold),
        workers=WORKERS,
    )
    env_flags = [f"-e{k}={v}" for k, v in env.items()]
    # The pane's size is the terminal's, not what COLUMNS/LINES of this process say.
    server_env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    size = ["-x", "160", "-y", "40"]
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-s",
            "job",
            "-n",
            "launch",
            *size,
            *env_flags,
            # The exit status in a file: tmux 3.3 sometimes shows the pane dead with no status.
            f"{shlex.join(cmd)}; echo $? > {shlex.quote(str(exit_file))}",
        ],
        check=True,
        env=server_env,
    )
    subprocess.run([*tmux, "set-option", "-t", "job", "remain-on-exit", "on"], check=True)
    try:

        def pane() -> str:
            return subprocess.run(
                [*tmux, "capture-pane", "-p", "-S", "-200", "-t", "job:launch"],
                capture_output=True,
                text=True,
            ).stdout

        def all_trained() -> dict[str, dict[str, float]] | None:
            files = sorted(hold.glob("*.trained"))
            if len(files) < WORKERS:
                return None
            return {f.name.removesuffix(".trained"): json.loads(f.read_text()) for f in files}

        try:
            trained = _until("the workers to train", all_trained, timeout=120)
        except AssertionError:
            raise AssertionError(f"the job did not train; its terminal:\n{pane()}") from None
        (running,) = jobs.running_jobs(run_dir / "psflow" / "jobs")
        yield Job(tmux, run_dir, hold, trained, dict(running.metrics), env)
        (hold / "release").touch()

        def launch_exit() -> str | None:
            text = exit_file.read_text() if exit_file.exists() else ""
            return text.strip() if text.endswith("\n") else None

        try:
            code = _until("psflow launch to exit", launch_exit, timeout=60)
        except AssertionError:
            raise AssertionError(f"psflow launch did not exit; its terminal:\n{pane()}") from None
        assert code == "0"
        assert jobs.running_jobs(run_dir / "psflow" / "jobs") == []
        assert not list((run_dir / "psflow" / "jobs").glob("*.json")), "job file left behind"
    finally:
        (hold / "release").touch()
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def test_metrics_over_http_agree_with_the_job(job: Job) -> None:
    assert set(job.targets) == {"ps:0", "worker:0", "worker:1"}
    for address in job.targets.values():
        assert address.startswith("127.0.0.1:")  # the task's own address, not all interfaces
    got = {task: metrics.scrape(address) for task, address in job.targets.items()}
    ps = got["ps:0"]
    global_step = ps.total(metrics.PS_STEP)
    assert global_step == max(t["global_step"] for t in job.trained.values())
    steps = {w: got[w].total(metrics.STEPS) for w in job.trained}
    assert steps == {w: t["steps"] for w, t in job.trained.items()}
    # Every asynchronous step is one update of the global step: within the number of workers.
    assert global_step is not None and abs(sum(steps.values()) - global_step) <= WORKERS
    assert ps.total(metrics.PS_REQUESTS, op="push_pull") == sum(steps.values())
    assert ps.total(metrics.PS_APPLY + "_count") == sum(steps.values())
    assert ps.total(metrics.PS_BYTES) == MODEL_BYTES
    for w, trained in job.trained.items():
        m = got[w]
        assert m.total(metrics.EXAMPLES) == trained["steps"] * BATCH
        assert m.total(metrics.LOSS) == trained["loss"]
        assert m.total(metrics.GLOBAL_STEP) == trained["global_step"]
        assert m.total(metrics.LAST_STEP) == STEPS
        # One gradient of the whole model per step, plus the chief's initial values.
        initial = MODEL_BYTES if w == "worker:0" else 0
        assert m.total(metrics.SENT_BYTES, shard="0") == trained["steps"] * MODEL_BYTES + initial
        # The model back after each step, and the first pull.
        assert m.total(metrics.RECEIVED_BYTES, shard="0") == (trained["steps"] + 1) * MODEL_BYTES
        assert m.total(metrics.STALENESS + "_count") == trained["steps"]
        assert (m.total(metrics.REQUEST_SECONDS + "_count", shard="0") or 0) >= trained["steps"]
        assert (m.total(metrics.MEMORY) or 0) > 10e6
        assert (m.total(metrics.CPU) or 0) > 0
    # The chief checkpoints every 10 steps: the ps paused for each snapshot it took.
    assert (ps.total(metrics.PS_CKPT_PAUSE + "_count") or 0) >= 1
    assert ps.total(metrics.PS_REQUESTS, op="save") == ps.total(metrics.PS_CKPT_PAUSE + "_count")


def test_launch_on_a_terminal_shows_one_progress_line(job: Job) -> None:
    final = max(int(t["global_step"]) for t in job.trained.values())
    line = re.compile(
        rf"step {final}/{STEPS} · [\d.]+ steps/s · loss [\d.e+-]+ · ETA 0:00 · tasks up 3/3"
    )

    def progress() -> str | None:
        screen = job.screen("job:launch")
        return screen if line.search(screen) else None

    screen = _until(
        "the progress line at the final step",
        progress,
        timeout=30,
        shows=lambda: f"({job.size('job:launch')})\n{job.screen('job:launch')}",
    )
    lines = screen.rstrip("\n").splitlines()
    # One line, below the tasks' prefixed output.
    assert len([ln for ln in lines if "tasks up" in ln]) == 1, screen
    assert any(ln.startswith("[worker:0] ") for ln in lines), screen


def test_top_renders_the_live_job(job: Job) -> None:
    top = [sys.executable, "-m", "psflow.cli", "top", "--interval", "0.3"]
    env_flags = [f"-e{k}={v}" for k, v in job.env.items()]
    subprocess.run(
        [*job.tmux, "new-window", "-t", "job", "-n", "top", *env_flags, shlex.join(top)],
        check=True,
    )
    final = max(int(t["global_step"]) for t in job.trained.values())

    def rows() -> dict[str, list[str]] | None:
        screen = job.screen("job:top")
        found = {}
        for ln in screen.splitlines():
            cells = ln.split()
            if cells and cells[0] in job.targets:
                found[cells[0]] = cells
        if len(found) < 3 or "tasks up 3/3" not in screen:
            return None
        # Two scrapes in: rates, and the chief's checkpoint, are there.
        if any(c[1] != "up" or "-" in c[2:4] for t, c in found.items() if t != "ps:0"):
            return None
        return found

    found = _until("psflow top to show every task up", rows, shows=lambda: job.screen("job:top"))
    assert found["ps:0"][2] == str(final)
    for w, trained in job.trained.items():
        cells = found[w]
        assert cells[2] == str(int(trained["global_step"]))
        assert cells[3] == "0.0"  # held still: no steps now
        assert float(cells[4]) == pytest.approx(trained["loss"], rel=1e-3)
    screen = job.screen("job:top")
    assert "watched_train.py" in screen
    assert "MEM" in screen and "STEP/S" in screen
    # Into a pipe (a log), the view at its own width: rich would cut each line to 80 columns.
    env = {k: v for k, v in {**os.environ, **job.env}.items() if k != "COLUMNS"}
    once = subprocess.run([*top, "--once"], env=env, capture_output=True, text=True, timeout=60)
    assert once.returncode == 0, once.stderr
    assert "…" not in once.stdout and "MEM" in once.stdout and "STEP/S" in once.stdout, once.stdout
    assert max(len(ln) for ln in once.stdout.splitlines()) > 80, once.stdout
