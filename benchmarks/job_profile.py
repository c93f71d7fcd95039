"""job_profile: where a running CTR job's processes spend the cores they have.

    .venv/bin/python benchmarks/job_profile.py --ps 4 --workers 12 [--data DIR] \\
        [--preset full|smoke] [--window 10] [--warmup 15] [--pyspy ps:0,worker:0] \\
        [--out DIR] [--rate 50] [--socket] [--extra="--device cuda"]

Starts ``psflow launch`` of ``examples/ctr.py`` with ``scaling.py``'s model (``--preset``),
waits ``--warmup`` seconds once every task runs, then for ``--window`` seconds reads each task's
CPU time from ``/proc``: the whole process (cores it kept busy) and its busiest thread (a share
near 1.0 is a thread that saturates a core: a ps's serving thread, a worker's training loop).
With ``--pyspy``, ``py-spy record --native --idle -f raw`` of the named tasks for another
window after that one (py-spy stops a process at each sample), written to ``--out``
(collapsed stacks: one line per stack, its sample count last). ``--extra``: more arguments
for the example (``--device cuda``: GPU workers). The job is stopped after the window. Without ``--data``, a ``psflow data synth-ctr`` set of the preset's size is made in a
temporary directory. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import emit, machine  # noqa: E402
from scaling import PRESETS, Job, job_command, synthesize  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Every descendant of ``pid``."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except FileNotFoundError:
            continue
        for child in text.split():
            out.append(int(child))
            out += children(int(child))
    return out


def task_name(pid: int) -> str | None:
    """``ps:0``/``worker:3``/... from the process's ``TF_CONFIG``; ``None`` for others."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (FileNotFoundError, PermissionError):
        return None
    for item in environ:
        if item.startswith(b"TF_CONFIG="):
            task = json.loads(item[len(b"TF_CONFIG=") :])["task"]
            return f"{task['type']}:{task['index']}"
    return None


def cpu_ticks(pid: int) -> dict[str, int]:
    """utime + stime of each thread of ``pid`` (``tid/comm`` keys) and of the whole process."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[f"{tid}/{comm}"] = int(fields[11]) + int(fields[12])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ps", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--data", help="a `psflow data synth-ctr` directory (default: new)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before the window")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--pyspy", default="", help="tasks to record with py-spy, e.g. ps:0")
    parser.add_argument("--out", default=".", help="where py-spy's files go")
    parser.add_argument("--rate", type=int, default=50, help="py-spy's samples a second")
    parser.add_argument("--socket", action="store_true", help="PSFLOW_SHM=0")
    parser.add_argument("--extra", default="", help="the example's arguments, space-separated")
    args = parser.parse_args()
    p = PRESETS[args.preset]
    with tempfile.TemporaryDirectory(prefix="psflow-job-profile-") as tmp:
        data = args.data or os.path.join(tmp, "ctr")
        if not args.data:
            synthesize(data, p)
        rows = profile(args, p, data)
    emit(
        {
            "benchmark": "job_profile",
            "ps": args.ps,
            "workers": args.workers,
            "path": "socket" if args.socket else "shm",
            "extra": args.extra,
            "window_s": args.window,
            "tasks": rows,
            "machine": machine(),
        }
    )


def profile(args: argparse.Namespace, p: dict[str, Any], data: str) -> dict[str, Any]:
    """Runs the job and measures its tasks; returns each one's figures by name."""
    tasks = args.ps + args.workers
    steps = 10**6  # stopped after the window
    env = dict(os.environ, PSFLOW_SHM="0" if args.socket else "1")
    launcher = subprocess.Popen(
        job_command(p, data, Job(args.ps, args.workers), steps, args.extra.split()),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            found = {task_name(pid): pid for pid in children(launcher.pid)}
            named = {name: pid for name, pid in found.items() if name is not None}
            if len(named) == tasks:
                break
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the job did not start its {tasks} tasks: {named}")
            time.sleep(0.2)
        time.sleep(args.warmup)
        if launcher.poll() is not None:
            _, err = launcher.communicate()
            raise SystemExit(f"the job ended during the warm-up: {err[-2000:]}")
        before = {name: cpu_ticks(pid) for name, pid in named.items()}
        start = time.monotonic()
        time.sleep(args.window)
        after = {name: cpu_ticks(pid) for name, pid in named.items()}
        seconds = time.monotonic() - start
        # py-spy stops each process at every sample (native stacks need it), so its window
        # comes after the one measured.
        spies = []
        pyspy = shutil.which("py-spy") or shutil.which(
            "py-spy", path=str(Path(sys.executable).parent)
        )
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for name in filter(None, args.pyspy.split(",")):
            if pyspy is None:
                print("py-spy is not installed: no stacks recorded", flush=True)
                break
            path = Path(args.out) / f"pyspy-{name.replace(':', '')}.txt"
            cmd = [pyspy, "record", "--pid", str(named[name]), "-d", str(int(args.window))]
            cmd += [
                "--native",
                "--idle",
                "--threads",
                "-r",
                str(args.rate),
                "-f",
                "raw",
                "-o",
                str(path),
            ]
            spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for spy in spies:
            _, spy_err = spy.communicate(timeout=args.window + 60)
            if spy.returncode != 0:
                print(f"py-spy exited with {spy.returncode}: {spy_err.decode()[-1000:]}")
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=30)
        except ProcessLookupError:
            pass  # it ended by itself (a failed start is said above)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
    rows: dict[str, Any] = {}
    for name in sorted(named, key=lambda n: (n.split(":")[0], int(n.split(":")[1]))):
        used = {t: after[name][t] - before[name].get(t, 0) for t in after[name]}
        busiest = max(used, key=lambda t: used[t])
        rows[name] = {
            "cores": round(sum(used.values()) / TICK / seconds, 2),
            "busiest_thread": busiest.split("/", 1)[1],
            "busiest_share": round(used[busiest] / TICK / seconds, 2),
        }
        print(f"{name:>10}: {rows[name]}", flush=True)
    return rows


if __name__ == "__main__":
    main()
