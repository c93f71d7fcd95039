"""Faults for the tests, given to real processes as arguments: psflow carries no test branches.

As Horovod's elastic tests pass their fault schedule to the training script, a test runs its
program (a script, or ``-c CODE``) through this one, which injects the faults first::

    python tests/faults.py [--once DIR] [--in-order] [--after-checkpoint DIR]
                           [--kill-at TASK@STEP ...] [--hang-at TASK@STEP:SECONDS ...]
                           [--slow-save SECONDS] [--hold-save FILE] SCRIPT [ARGS...]
    python tests/faults.py [...] -c CODE [ARGS...]

- ``--kill-at worker:0@3500``: task ``worker:0`` SIGKILLs itself once its
  :class:`~psflow.train.TrainingSession` reaches global step 3500 (other tasks ignore it);
  ``--kill-at ps:0@1800``: ps ``ps:0`` SIGKILLs itself once its shard reaches step 1800 (a
  thread of the :class:`~psflow.ps.ParameterServer` watches the step). The flag may be given
  several times (``worker:1@600`` and ``chief:0@1200``).
- ``--hang-at worker:1@700:8``: the same schedule, but the task hangs instead: it SIGSTOPs
  itself for 8 seconds (a detached ``sh`` sends it SIGCONT then), its heartbeat included, as a
  process stopped by a debugger or swapped out would (longer than ``PSFLOW_WORKER_TIMEOUT``: the
  ps declares it dead; then it comes back and rejoins).
- ``--once DIR`` (before the other flags): each task's fault fires once per ``DIR`` (it leaves
  ``DIR/killed-<task>`` or ``DIR/hung-<task>`` first): the same task, restarted by ``psflow
  launch --max-restarts`` with the same arguments, or resumed, trains on past the step.
- ``--in-order`` (after ``--once``, before the faults): the faults strike in the order given,
  whatever the tasks' speeds: each waits, past its step, until the task of the one before it has
  struck and come back (its restart got as far as its session, or its ps server, or a hung
  task resumed, and left ``DIR/back-<task>``). Steps alone order nothing under load: a ps's
  fault at 1000 and the chief's at 1400 both waited for a slow checkpoint and struck at 1559
  and 1556.
- ``--slow-save 1.5``: every checkpoint or export shard this process (a ps) writes waits 1.5 s,
  fully written under its temporary name, before its rename: a window to kill the task in.
- ``--hold-save FILE``: the same, until ``FILE`` exists (at most 60 s): a save held in flight
  until the test lets it go.
- ``--after-checkpoint DIR`` (before the other flags): a fault past its step waits until
  ``DIR`` holds a complete checkpoint (``DIR@1500``: one of global step 1500 or later): a
  schedule that needs one to restore from holds however fast the steps run (500 steps of the
  linear regression take a tenth of a second on a fast host, less than a checkpoint's writing
  and recording).
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psflow.train import Hook, StepContext, TrainingSession

FAULTS = Path(__file__).resolve()
"""This file, to run as a program's wrapper: ``[sys.executable, FAULTS, ...]``."""


ONCE: Path | None = None
"""``--once DIR``: where each task marks the kill it did (it is not done again)."""

ORDER: list[str] = []
"""``--in-order``: the tasks of the faults, in the order they strike (empty: unordered)."""

AFTER_CHECKPOINT: tuple[Path, int] | None = None
"""``--after-checkpoint DIR[@STEP]``: faults wait for a complete checkpoint there, of at least
that global step."""


def _checkpointed() -> bool:
    """Whether a fault past its step may strike: without ``--after-checkpoint``, at once;
    with it, once its directory holds a complete checkpoint of at least its step."""
    if AFTER_CHECKPOINT is None:
        return True
    from psflow.train import CheckpointDir

    where, least = AFTER_CHECKPOINT
    saved = CheckpointDir(str(where))
    latest = saved.latest()
    return latest is not None and saved.manifest(latest).global_step >= least


def _mark(task: str, what: str) -> Path:
    assert ONCE is not None
    return ONCE / f"{what}-{task.replace(':', '-')}"


def _came_back(task: str) -> None:
    """Under ``--once``, marks ``task`` back: its fault struck and this is its restart."""
    if ONCE is not None and (_mark(task, "killed").exists() or _mark(task, "hung").exists()):
        _mark(task, "back").touch()


def _turn(task: str) -> bool:
    """Whether ``task``'s fault may strike under ``--in-order``: the task before it is back."""
    if task not in ORDER or ORDER.index(task) == 0:
        return True
    return _mark(ORDER[ORDER.index(task) - 1], "back").exists()


def _strike(task: str, hang: float | None, step: int) -> None:
    """SIGKILLs this process, or with ``hang`` SIGSTOPs it for that many seconds (once per task
    under :data:`ONCE`, when given)."""
    if ONCE is not None:
        mark = _mark(task, "killed" if hang is None else "hung")
        if mark.exists():
            return
        mark.touch()
    # The moment of the fault, for whoever measures what follows (tests/fault_matrix.py).
    what = "SIGKILL" if hang is None else f"SIGSTOP for {hang:g} s"
    print(f"fault: {task} {what} at step {step}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if hang is None:
        os.kill(os.getpid(), signal.SIGKILL)
    # Detached, so that it outlives nothing and needs nothing of this (stopped) process.
    subprocess.Popen(
        ["/bin/sh", "-c", f"sleep {hang}; kill -CONT {os.getpid()}"], start_new_session=True
    )
    os.kill(os.getpid(), signal.SIGSTOP)
    if ONCE is not None:  # resumed: back, for a fault --in-order after this one
        _mark(task, "back").touch()


def _parse(spec: str, *, hang: bool = False) -> tuple[str, int, float | None]:
    who, sep, at = spec.partition("@")
    step, _, seconds = at.partition(":")
    try:
        if not sep or not step.isdigit() or bool(seconds) != hang:
            raise ValueError
        return who, int(step), float(seconds) if hang else None
    except ValueError:
        example = "worker:1@700:8 (seconds)" if hang else "worker:0@3000"
        form = "<task>@<step>:<seconds>" if hang else "<task>@<step>"
        raise ValueError(f"fault schedule {spec!r} must be {form}, e.g. {example}") from None


class FaultHook(Hook):
    """SIGKILLs this task once the global step reaches ``step`` (with ``hang``, SIGSTOPs it
    for that many seconds)."""

    def __init__(self, step: int, task: str = "", hang: float | None = None) -> None:
        self.step = step
        self.task = task
        self.hang = hang

    @classmethod
    def from_spec(cls, spec: str, task: str, *, hang: bool = False) -> FaultHook | None:
        """The hook for ``task`` from a schedule ``<task>@<step>`` (``<task>@<step>:<seconds>``
        with ``hang``); ``None`` for other tasks."""
        who, at, seconds = _parse(spec, hang=hang)
        if who != task:
            return None
        _came_back(task)
        return cls(at, task, seconds)

    def after_step(self, ctx: StepContext) -> None:
        if ctx.global_step >= self.step and _checkpointed() and _turn(self.task):
            _strike(self.task, self.hang, ctx.global_step)


def kill_at(spec: str, *, hang: bool = False) -> None:
    """Every :class:`TrainingSession` of this process gets the :class:`FaultHook` of ``spec``;
    for a ps task (``ps:1@1800``), its :class:`~psflow.ps.ParameterServer` a watching thread."""
    who, _, _ = _parse(spec, hang=hang)  # validates it now
    if who.startswith("ps:"):
        _strike_ps_at(spec, hang=hang)
        return
    original = TrainingSession.__init__

    def init(self: TrainingSession, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        hook = FaultHook.from_spec(spec, str(self.ctx.task), hang=hang)
        if hook is not None:
            self.hooks.append(hook)

    TrainingSession.__init__ = init  # type: ignore[method-assign]


def _strike_ps_at(spec: str, *, hang: bool) -> None:
    from psflow.ps import ParameterServer

    original = ParameterServer.start

    def start(self: ParameterServer) -> ParameterServer:
        out = original(self)
        who, at, seconds = _parse(spec, hang=hang)
        if who == self.name:
            _came_back(self.name)

            def watch() -> None:
                # Polled: the serving thread must not be slowed by a test's hook.
                while self.store.step < at or not _checkpointed() or not _turn(self.name):
                    time.sleep(0.005)
                _strike(self.name, seconds, self.store.step)

            threading.Thread(target=watch, name="psflow-test-fault", daemon=True).start()
        return out

    ParameterServer.start = start  # type: ignore[method-assign]


def slow_save(seconds: float) -> None:
    """Checkpoint and export shards written by this process wait ``seconds`` before their
    rename."""
    _before_rename(lambda: time.sleep(seconds))


def hold_save(gate: Path, timeout: float = 60.0) -> None:
    """Checkpoint and export shards written by this process wait before their rename until
    ``gate`` exists (at most ``timeout`` seconds): a save held in flight as long as a test needs."""

    def hold() -> None:
        deadline = time.monotonic() + timeout
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    _before_rename(hold)


def _before_rename(pause: Callable[[], None]) -> None:
    """Checkpoint and export files written by this process call ``pause`` before their rename."""
    import psflow.ps.checkpoint as shard_files
    import psflow.ps.exports as export_files

    write = shard_files.atomic_write

    def delayed(*args: Any, before_commit: Callable[[], None] | None = None, **kwargs: Any) -> None:
        def commit() -> None:
            if before_commit is not None:
                before_commit()
            pause()

        write(*args, before_commit=commit, **kwargs)

    shard_files.atomic_write = delayed  # type: ignore[assignment]
    export_files.atomic_write = delayed  # type: ignore[assignment]


def main(argv: list[str]) -> None:
    global ONCE, AFTER_CHECKPOINT
    flags = (
        *("--kill-at", "--hang-at", "--slow-save", "--hold-save", "--once", "--after-checkpoint"),
        "--in-order",
    )
    in_order = False
    while argv and argv[0] in flags:
        if argv[0] == "--in-order":
            if ONCE is None:
                raise SystemExit("--in-order needs --once DIR before it (its marks order faults)")
            in_order, argv = True, argv[1:]
            continue
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--once":
            ONCE = Path(value)
            ONCE.mkdir(parents=True, exist_ok=True)
        elif flag == "--after-checkpoint":
            where, _, least = value.rpartition("@") if "@" in value else (value, "", "0")
            AFTER_CHECKPOINT = (Path(where), int(least))
        elif flag in ("--kill-at", "--hang-at"):
            kill_at(value, hang=flag == "--hang-at")
            if in_order:
                who = _parse(value, hang=flag == "--hang-at")[0]
                if who in ORDER:
                    raise SystemExit(f"--in-order: {who} is given two faults; --once strikes one")
                ORDER.append(who)
        elif flag == "--hold-save":
            hold_save(Path(value))
        else:
            slow_save(float(value))
    if not argv:
        raise SystemExit(__doc__)
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = argv
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
