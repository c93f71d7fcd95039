"""``psflow launch --preload``'s fork server (:mod:`psflow.cluster.forkserver`): each task forked
from it runs its script as ``python script.py`` would (exit code, traceback, threads, atexit,
its own session and streams) and skips the preloaded imports; a launched job's tasks are forked
from it, restarted ones included."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from psflow.cluster import forkserver
from psflow.cluster.forkserver import ForkedTask, ForkServer

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

TASK = """\
import atexit, os, sys, threading, time

print("preloaded", "json" in sys.modules, "name", __name__, "argv", sys.argv[1:])
print("own session", os.getsid(0) == os.getpid(), "stdin", repr(sys.stdin.read()))
print("path0", sys.path[0])
import numpy
print("numpy draw", numpy.random.randint(1 << 62))
atexit.register(lambda: print("atexit after", done))
done = []
threading.Thread(target=lambda: (time.sleep(0.2), done.append("thread"))).start()
sys.stdout.write("last line, no newline")
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "exit":
    sys.exit(int(sys.argv[2]))
if how == "message":
    sys.exit("a message")
if how == "interrupt":
    raise KeyboardInterrupt
"""


@pytest.fixture
def server() -> ForkServer:
    fs = ForkServer(["json", "numpy"], dict(os.environ))
    fs.start(timeout=60)
    yield fs
    fs.stop()


def _run(server: ForkServer, script: Path, *args: str) -> tuple[int, str, str, ForkedTask]:
    task = server.spawn([str(script), *args], dict(os.environ, PYTHONUNBUFFERED="1"))
    code = task.wait(60)
    return code, task.stdout.read().decode(), task.stderr.read().decode(), task


def test_a_forked_task_runs_its_script_as_python_would(server: ForkServer, tmp_path: Path) -> None:
    script = tmp_path / "task.py"
    script.write_text(TASK)
    code, out, err, task = _run(server, script, "ok")
    assert code == 0 and task.poll() == 0, err
    assert "preloaded True name __main__ argv ['ok']" in out
    assert "own session True stdin ''" in out
    assert f"path0 {tmp_path}" in out
    # Output with no newline is flushed; the non-daemon thread ran to its end before atexit.
    assert out.endswith("last line, no newlineatexit after ['thread']\n"), out
    assert err == ""

    # Two tasks draw different numbers (numpy's global state is reseeded in each).
    _, again, _, _ = _run(server, script, "ok")
    draws = [re.search(r"numpy draw (\d+)", o).group(1) for o in (out, again)]  # type: ignore[union-attr]
    assert draws[0] != draws[1]


@pytest.mark.parametrize(
    ("args", "code", "err"),
    [
        (["raise"], 1, r'^Traceback \(most recent call last\):\n  File ".*task.py", line \d+'),
        (["exit", "3"], 3, r"^$"),
        (["exit", "-1"], 255, r"^$"),
        (["message"], 1, r"^a message\n$"),
        (["interrupt"], -signal.SIGINT, r"KeyboardInterrupt\n$"),
    ],
)
def test_a_forked_task_exits_as_python_would(
    server: ForkServer, tmp_path: Path, args: list[str], code: int, err: str
) -> None:
    script = tmp_path / "task.py"
    script.write_text(TASK)
    got, out, stderr, _ = _run(server, script, *args)
    assert got == code, stderr
    assert re.search(err, stderr), stderr
    # An uncaught exception still ran the threads out and atexit (as the interpreter does).
    assert "atexit after ['thread']" in out
    if args == ["raise"]:
        assert "runpy" not in stderr and "forkserver" not in stderr, stderr
        assert stderr.endswith("ValueError: boom\n"), stderr


def test_a_task_killed_and_the_tasks_of_a_stopped_server(
    server: ForkServer, tmp_path: Path
) -> None:
    script = tmp_path / "sleeps.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    killed = server.spawn([str(script)], dict(os.environ))
    assert killed.stdout.readline() == b"up\n"
    os.killpg(killed.pid, signal.SIGKILL)  # a session of its own: its group is its pid
    assert killed.wait(30) == -signal.SIGKILL
    left = server.spawn([str(script)], dict(os.environ))
    assert left.stdout.readline() == b"up\n"
    with pytest.raises(subprocess.TimeoutExpired):
        left.wait(0.1)
    server.stop()
    # The server exited; its task died with it (PR_SET_PDEATHSIG), and says so.
    assert left.poll() == -signal.SIGKILL
    assert left.stdout.read() == b""  # its end of the pipe closed: it is gone
    with pytest.raises(RuntimeError, match="not running"):
        server.spawn([str(script)], dict(os.environ))


def test_torch_threads_follow_each_tasks_omp_num_threads(tmp_path: Path) -> None:
    fs = ForkServer(["torch"], dict(os.environ, OMP_NUM_THREADS="1"))
    fs.start(timeout=120)
    try:
        script = tmp_path / "threads.py"
        script.write_text("import torch\nprint(torch.get_num_threads())\n")
        for threads in ("1", "2"):
            code, out, err, _ = _run_env(fs, script, OMP_NUM_THREADS=threads)
            assert code == 0, err
            assert out == f"{threads}\n"
    finally:
        fs.stop()


def _run_env(server: ForkServer, script: Path, **env: str) -> tuple[int, str, str, ForkedTask]:
    task = server.spawn([str(script)], dict(os.environ, **env))
    code = task.wait(60)
    return code, task.stdout.read().decode(), task.stderr.read().decode(), task


def test_a_module_that_starts_a_thread_cannot_be_preloaded(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "threaded.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    fs = ForkServer(["threaded"], dict(os.environ, PYTHONPATH=str(tmp_path)))
    with pytest.raises(RuntimeError, match=r"could not preload \['threaded'\]: .*started threads"):
        fs.start(timeout=60)
    env = {k: v for k, v in os.environ.items() if k != "PSFLOW_LOG_LEVEL"}
    fs = ForkServer(["no_such_module_here"], env)
    said = r"could not preload \['no_such_module_here'\]: importing no_such_module_here: "
    with pytest.raises(RuntimeError, match=said + "ModuleNotFoundError: No module named"):
        fs.start(timeout=60)
    assert "Traceback" not in capfd.readouterr().err  # the one line says it all


def test_a_launched_job_with_preload_forks_its_tasks_and_restarts(tmp_path: Path) -> None:
    """Every task of ``psflow launch`` with ``PSFLOW_PRELOAD`` is a child of the fork server,
    with its own TF_CONFIG and (``--ps-threads 2``) the ps's own thread count; a task that
    fails is forked again by ``--max-restarts``; the job's exit is the tasks'."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""\
            import json, os, sys, time
            print("torch before import", "torch" in sys.modules)
            import torch
            task = json.loads(os.environ["TF_CONFIG"])["task"]
            name = f"{{task['type']}}:{{task['index']}}"
            parent = open(f"/proc/{{os.getppid()}}/cmdline", "rb").read()
            forked = b"psflow.cluster.forkserver" in parent
            print("forked", forked, "threads", torch.get_num_threads())
            here = {str(tmp_path)!r}
            if name == "ps:0":  # a ps stays until the workers are done (else no restart)
                deadline = time.monotonic() + 60
                while not all(os.path.exists(f"{{here}}/done-worker:{{i}}") for i in (0, 1)):
                    assert time.monotonic() < deadline, "the workers never finished"
                    time.sleep(0.02)
            elif name == "worker:1" and not os.path.exists(f"{{here}}/failed-worker:1"):
                open(f"{{here}}/failed-worker:1", "w").close()
                raise RuntimeError("first run fails")
            else:
                open(f"{{here}}/done-{{name}}", "w").close()
            """
        )
    )
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--ps", "1", "--workers", "2"]
    cmd += ["--ps-threads", "2", "--max-restarts", "1", "--no-metrics", str(script)]
    env = dict(os.environ, PSFLOW_PRELOAD="torch", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out, err = proc.stdout, proc.stderr
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"[{task}] torch before import True" in out, out
    assert out.count("forked True") == 4, out  # worker:1 twice
    assert "[ps:0] forked True threads 2" in out
    assert out.count("[worker:1] forked True threads 1") == 2
    assert re.search(r"\[worker:1\] RuntimeError: first run fails", err), err
    assert "task worker:1 failed with exit code 1; restarting it" in err
    assert "job finished: 3 tasks exited 0" in err


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(90)
def test_a_stopped_fork_server_is_named_and_its_ended_tasks_are_seen(
    server: ForkServer, tmp_path: Path
) -> None:
    """A task's exit is seen without the server (which reaps and reports it): a SIGSTOPped
    server leaves it a zombie. It ends within the server's answer bound, exit code unknown, and
    the server is named as stopped or hung; forking from it fails within that bound too."""
    server.answer_timeout = 2.0
    script = tmp_path / "sleeps.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    tasks = [server.spawn([str(script)], dict(os.environ)) for _ in range(2)]
    for task in tasks:
        assert task.stdout.readline() == b"up\n"
    pid = _parent(tasks[0].pid)
    os.kill(pid, signal.SIGSTOP)
    try:
        os.killpg(tasks[0].pid, signal.SIGKILL)  # a zombie: its parent cannot reap it
        t0 = time.monotonic()
        code = tasks[0].wait()
        assert time.monotonic() - t0 < 10
        assert code == forkserver.UNKNOWN_EXIT
        why = server.problem()
        assert why is not None and f"fork server (pid {pid})" in why, why
        assert f"task {tasks[0].pid}" in why and "stopped or hung" in why, why
        assert tasks[1].poll() is None  # still running
        os.killpg(tasks[1].pid, signal.SIGKILL)
        assert tasks[1].wait(5) == forkserver.UNKNOWN_EXIT  # the server is known not to answer
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"fork server \(pid {pid}\)"):
            server.spawn([str(script)], dict(os.environ))
        assert time.monotonic() - t0 < 10
        t0 = time.monotonic()
        server.stop()  # killed at once: it does not answer
        assert time.monotonic() - t0 < 5
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)


STOPPABLE_JOB = """\
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = f"{task['type']}:{task['index']}"
here = HERE
open(os.path.join(here, "up-" + name), "w").close()
while not (name == "worker:1" and os.path.exists(os.path.join(here, "crash"))):
    time.sleep(0.1)
sys.exit(3)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["a task fails", "SIGTERM"])
def test_a_launched_job_whose_fork_server_is_stopped_ends_naming_it(
    tmp_path: Path, how: str
) -> None:
    """``psflow launch --preload`` whose fork server is SIGSTOPped: a task that fails (a zombie
    the server does not reap), or SIGTERM to the launcher, ends the job within a bound, with a
    line naming the fork server, not a false "not gone after SIGTERM"; the server is killed."""
    script = tmp_path / "job.py"
    script.write_text(STOPPABLE_JOB.replace("HERE", repr(str(tmp_path))))
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--ps", "1", "--workers", "2"]
    cmd += ["--no-metrics", str(script)]
    env = dict(os.environ, PSFLOW_PRELOAD="json", OMP_NUM_THREADS="1")
    out, err = (open(tmp_path / n, "w+") for n in ("out", "err"))  # noqa: SIM115
    launcher = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
    server = 0
    try:
        deadline = time.monotonic() + 60
        up = [tmp_path / f"up-{t}" for t in ("ps:0", "worker:0", "worker:1")]
        while not all(p.exists() for p in up):
            assert time.monotonic() < deadline and launcher.poll() is None, err.read()
            time.sleep(0.05)
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text()
        (server,) = (int(c) for c in children.split())  # its one child: the tasks are the server's
        assert b"psflow.cluster.forkserver" in Path(f"/proc/{server}/cmdline").read_bytes()
        os.kill(server, signal.SIGSTOP)
        t0 = time.monotonic()
        if how == "SIGTERM":
            launcher.send_signal(signal.SIGTERM)
        else:
            (tmp_path / "crash").touch()
        code = launcher.wait(timeout=60)
        took = time.monotonic() - t0
        err.seek(0)
        said = err.read()
        assert code == (128 + signal.SIGTERM if how == "SIGTERM" else 1), said
        assert took < 40, said
        assert f"the fork server (pid {server}) " in said and "stopped or hung" in said, said
        assert "not gone" not in said, said
        with pytest.raises(ProcessLookupError):
            os.kill(server, 0)  # killed (and reaped) by the launcher
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        if server:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGKILL)
                os.kill(server, signal.SIGCONT)
        out.close()
        err.close()
