"""The fault matrix: every role (ps, worker, chief) in every mode (asynchronous; synchronous with
one backup worker), killed with SIGKILL at a scheduled step or stopped with SIGSTOP for longer
than the timeouts, in a real ``psflow launch --max-restarts 1`` job of the linear-regression
example. Each fault is data given to the processes (``tests/faults.py``); this script reads the
job's output as it comes and times what follows::

    python tests/fault_matrix.py                 # all twelve, a Markdown table, a JSON line last
    python tests/fault_matrix.py --only sync-ps-kill async-worker-hang
    python tests/fault_matrix.py --preload      # each task forked from a server (psflow launch
                                                # --preload): restarts skip importing torch

- detected: from the fault to the first line that names the task as failed, dead or silent
  (the launcher, the ps or a worker);
- recovered: from the fault to training seen going on (the ps's global step, read from its
  metrics, rising; about 0 when it never stopped);
- steps lost: global steps the job went back (a restore from a checkpoint), else 0;
- the result: the launcher's exit code and the model (W near 2.0 and b near 0.3).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "tests" / "faults.py"
EXAMPLE = ROOT / "examples" / "linear_regression.py"

TRAIN_STEPS = 3000
FAULT_STEP = 1200
HANG_SECONDS = 10.0
ENV = {
    "PSFLOW_WORKER_TIMEOUT": "4",  # the ps declares a silent worker dead after 4 s
    "PSFLOW_TIMEOUT": "6",  # a request to a silent ps gives up after 6 s (then: recovery)
}
"""Timeouts shorter than the hang, so that every hang outlasts them."""

PRELOAD = "torch,torch._dynamo,psflow.train,psflow.ps,psflow.worker"
"""What a job preloads with ``--preload`` (``psflow launch --preload``): the test runs every
scenario so, each task (and each restart) forked from a server that imported these once,
sparing 2-3 s of CPU a task. ``torch._dynamo``: torch imports it at a process's first
``torch.optim`` optimizer (every ps builds one), 1.5 s of CPU more a task else."""

WORKERS = 3
"""Three workers: in synchronous mode, two aggregated per step and one backup."""

LINE = re.compile(r"^\[(\S+)\] (.*)$")
PROGRESS = re.compile(r"^step (\d+)/")
SAVED = re.compile(r"saved checkpoint \S+ \(global step (\d+)\)")
METRICS_AT = re.compile(r"metrics at \S+: ps:0 (\S+?),")
PS_STEP = re.compile(r"^psflow_ps_global_step\{[^}]*\} (\S+)$", re.M)
RESTORED = re.compile(r"restored from ckpt-(\d+)")


@dataclasses.dataclass(frozen=True)
class Scenario:
    mode: str  # async | sync
    role: str  # ps | worker | chief
    fault: str  # kill | hang

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.role}-{self.fault}"

    @property
    def task(self) -> str:
        return {"ps": "ps:0", "worker": "worker:1", "chief": "worker:0"}[self.role]


SCENARIOS = [
    Scenario(mode, role, fault)
    for mode in ("async", "sync")
    for role in ("ps", "worker", "chief")
    for fault in ("kill", "hang")
]


@dataclasses.dataclass
class Result:
    scenario: str
    exit_code: int | None
    fault_step: int | None
    detected_s: float | None
    recovered_s: float | None
    steps_lost: int | None
    final_step: int | None
    w: float | None
    b: float | None
    detected_by: str | None
    seconds: float

    @property
    def right_model(self) -> bool:
        return (
            self.w is not None
            and self.b is not None
            and abs(self.w - 2.0) < 0.05
            and abs(self.b - 0.3) < 0.05
        )


def command(s: Scenario, workdir: Path, preload: str = "") -> list[str]:
    flag = "--kill-at" if s.fault == "kill" else "--hang-at"
    spec = f"{s.task}@{FAULT_STEP}" + ("" if s.fault == "kill" else f":{HANG_SECONDS:g}")
    launch = ["launch", "--ps", "1", "--workers", str(WORKERS), "--max-restarts", "1"]
    # --ps-exit-timeout 5: a task hung across the end of the job is stopped 5 s after the ps
    # exit (30 by default).
    launch += ["--mode", s.mode, "--grace", "10", "--ps-exit-timeout", "5"]
    launch += ["--preload", preload]  # empty: each task a fresh python
    script = [str(EXAMPLE), "--train_steps", str(TRAIN_STEPS), "--lr", "0.01"]
    script += ["--save_checkpoint_steps", "500", "--log_step_count_steps", "100"]
    script += ["--logdir", str(workdir / "run")]
    if s.mode == "sync":
        script += ["--replicas_to_aggregate", str(WORKERS - 1)]
    faults = [str(FAULTS), "--once", str(workdir / "faults")]
    if s.role == "ps" and s.fault == "kill":  # restored from a checkpoint: one there first
        faults += ["--after-checkpoint", str(workdir / "run")]
    faults += [flag, spec]
    return [sys.executable, "-m", "psflow.cli", *launch, *faults, *script]


def run(
    s: Scenario, workdir: Path, timeout: float = 240, preload: str = ""
) -> tuple[Result, list[str]]:
    """Runs one scenario (``preload``: its job's ``--preload``); its result and the job's output
    (stdout and stderr, as read)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command(s, workdir, preload),
        env={**os.environ, **ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()

    def read(stream: object) -> None:
        for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
            with lock:
                lines.append((time.monotonic(), line.rstrip("\n")))

    steps: list[tuple[float, int]] = []  # the ps's global step, from its metrics
    done = threading.Event()

    def poll() -> None:
        url = None
        while not done.is_set():
            if url is None:
                with lock:
                    for _, text in lines:
                        m = METRICS_AT.search(text)
                        if m:
                            url = f"http://{m.group(1)}/metrics"
                if url is None:
                    time.sleep(0.05)
                    continue
            try:
                with urllib.request.urlopen(url, timeout=0.5) as r:
                    found = PS_STEP.search(r.read().decode())
                if found:
                    steps.append((time.monotonic(), int(float(found.group(1)))))
            except OSError:
                pass  # down (killed, restarting) or stopped (SIGSTOP): no figure now
            time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    readers = [
        threading.Thread(target=read, args=(st,), daemon=True) for st in (proc.stdout, proc.stderr)
    ]
    for t in readers:
        t.start()
    try:
        code: int | None = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    for t in readers:
        t.join(10)
    done.set()
    poller.join(5)
    result = _measure(s, lines, steps, code, time.monotonic() - start)
    return result, [text for _, text in lines]


def _measure(
    s: Scenario,
    lines: list[tuple[float, str]],
    steps: list[tuple[float, int]],
    code: int | None,
    took: float,
) -> Result:
    # A line naming the task as failed (the launcher), dead (the ps) or silent (a worker).
    task = re.escape(s.task)
    detected = re.compile(
        rf"task {task} failed with signal|{task} is dead"
        rf"|{task} at \S+: (no answer within|step \d+ did not complete"
        r"|its connection closed with a request in flight)"
    )
    fault_at = fault_step = None
    detected_at = recovered_at = None
    detected_by = None
    restored: int | None = None
    final_step = w = b = None
    early: str | None = None
    for t, text in lines:
        m = LINE.match(text)
        who, msg = (m.group(1), m.group(2)) if m else ("", text)
        if fault_at is None:
            f = re.search(rf"fault: {re.escape(s.task)} \S+.* at step (\d+)", msg)
            if f:
                fault_at, fault_step = t, int(f.group(1))
                if early is not None:  # noticed at once: the task's own last line came later
                    detected_at, detected_by = t, early
            elif early is None and detected.search(msg):
                # The launcher's line can overtake the killed task's last one (each pipe is
                # relayed by its own thread).
                early = text[:160]
            continue
        if detected_at is None and detected.search(msg):
            detected_at, detected_by = t, text[:160]
        r = RESTORED.search(msg)
        if r:
            restored = int(r.group(1))
        p = PROGRESS.match(msg) or SAVED.search(msg)
        if p and who == "worker:0":
            final_step = max(final_step or 0, int(p.group(1)))
        wb = re.fullmatch(r"W=(\S+) b=(\S+)", msg)
        if wb and who == "worker:0":
            w, b = float(wb.group(1)), float(wb.group(2))
    if fault_at is not None:
        # Training going on: the ps's global step rising between two readings both after the
        # fault (0 when it never stopped).
        after = [(t, n) for t, n in steps if t > fault_at]
        for (_, n0), (t1, n1) in itertools.pairwise(after):
            if n1 > n0:
                recovered_at = t1
                break
    if fault_at is None:
        return Result(s.name, code, None, None, None, None, final_step, w, b, None, took)
    return Result(
        scenario=s.name,
        exit_code=code,
        fault_step=fault_step,
        detected_s=None if detected_at is None else round(detected_at - fault_at, 2),
        recovered_s=None if recovered_at is None else round(max(0.0, recovered_at - fault_at), 2),
        steps_lost=0 if restored is None or fault_step is None else max(0, fault_step - restored),
        final_step=final_step,
        w=w,
        b=b,
        detected_by=detected_by,
        seconds=round(took, 1),
    )


def table(results: list[Result]) -> str:
    rows = [
        "| fault | time to detect (s) | time to recover (s) | steps lost | exit | W, b |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        model = "-" if r.w is None else f"{r.w:.3f}, {r.b:.3f}"
        rows.append(
            f"| {r.scenario} | {r.detected_s} | {r.recovered_s} | {r.steps_lost} | "
            f"{r.exit_code} | {model} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="scenario names (default: all)")
    parser.add_argument("--log", action="store_true", help="print each job's output too")
    parser.add_argument("--logs", type=Path, help="write each job's output to DIR/<scenario>.log")
    parser.add_argument(
        "--preload",
        action="store_true",
        help=f"fork each task from a server that imported {PRELOAD} (as the test does)",
    )
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    results = []
    for s in chosen:
        with tempfile.TemporaryDirectory(prefix=f"psflow-{s.name}-") as d:
            result, out = run(s, Path(d), preload=PRELOAD if args.preload else "")
        results.append(result)
        print(f"{s.name}: {json.dumps(dataclasses.asdict(result))}", file=sys.stderr, flush=True)
        if args.log:
            print("\n".join(out), file=sys.stderr)
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            (args.logs / f"{s.name}.log").write_text("\n".join(out) + "\n")
    print(table(results))
    print(json.dumps([dataclasses.asdict(r) for r in results]))


if __name__ == "__main__":
    main()
