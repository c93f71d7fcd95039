"""``psflow launch --backend ray``: every task of a job as a Ray actor, the script unchanged.

Ray Train has no parameter-server mode; this runs psflow's own tasks on a Ray cluster instead
(a local one, or KubeRay's): one placement group per job, one bundle per task with the resources
it asks for (``SPREAD`` over the nodes by default, or ``PACK``), and in each bundle an actor
(:class:`~psflow.cluster.ray_actor.TaskRunner`) that runs ``python SCRIPT ARGS`` with the task's
``TF_CONFIG``, built from the bundle's node address and a port free there. What the job does
follows ``psflow launch`` (:mod:`psflow.cluster.launcher`):

- each task's output lines come back prefixed with the task (``[worker:1] ...``);
- a failed task is restarted by Ray (the actor's ``max_restarts``) in the same bundle, so with
  the same address and ``TF_CONFIG``, up to ``--max-restarts`` times for the job; a restarted ps
  comes back empty and the chief restores it, a worker rejoins, the chief resumes;
- the job succeeds when every trainer exits 0 and the ps then exit by themselves; a task failing
  with no restart left stops the others (SIGTERM, then SIGKILL after ``--grace``) and the job
  exits 1; Ctrl-C or SIGTERM stops it with 128 + the signal; an evaluator's failure does not stop
  training, but the job then exits 1.

A Ray address that does not answer within ``PSFLOW_READY_TIMEOUT`` (default 300 s) fails naming
it; so does a placement group the cluster cannot place in that time.

Example:
    >>> # from psflow.cluster import LaunchConfig
    >>> # code = RayLauncher(LaunchConfig(script="train.py"), RayOptions(address="head:6379")).run()
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psflow import env as envvars
from psflow.cluster.forkserver import exit_status
from psflow.cluster.launch_config import LaunchConfig
from psflow.cluster.spec import ClusterSpec, TaskSpec

STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK")
"""Ray's placement-group strategies."""

_POLL = 0.5
"""Seconds one poll of a task's output waits at most (the driver notices a stop this fast)."""


@dataclass(kw_only=True)
class RayOptions:
    """Where and how a job runs on Ray."""

    address: str | None = None
    """The Ray cluster (``host:port`` of its head's GCS); ``None``: ``RAY_ADDRESS`` if set, else
    a Ray started on this machine for the job."""
    strategy: str = "SPREAD"
    """How the tasks' bundles are placed on the nodes: ``SPREAD`` (over as many nodes as it can)
    or ``PACK`` (as few); ``STRICT_*`` fails when it cannot."""
    task_cpus: float = 1.0
    """CPUs each task's bundle and actor ask for (its ``OMP_NUM_THREADS`` too)."""
    trainer_gpus: float = 0.0
    """GPUs each worker (and the chief) asks for."""
    ready_timeout: float | None = None
    """Seconds the address may take to answer and the placement group to be placed; ``None``:
    ``PSFLOW_READY_TIMEOUT`` (default 300)."""
    node_ip: str | None = None
    """This machine's address in the Ray cluster, when Ray cannot tell (a head on a loopback
    alias such as ``127.0.0.2``)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"--placement {self.strategy!r} must be one of {', '.join(STRATEGIES)}"
            )
        if self.task_cpus <= 0 or self.trainer_gpus < 0:
            raise ValueError("task_cpus must be > 0 and trainer_gpus >= 0")
        if self.ready_timeout is None:
            self.ready_timeout = envvars.seconds(envvars.PSFLOW_READY_TIMEOUT, 300.0)
        if self.ready_timeout <= 0:
            raise ValueError(f"ready_timeout must be > 0 seconds, got {self.ready_timeout}")
        if self.address is not None:
            host, sep, port = self.address.removeprefix("ray://").rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--address {self.address!r} must be HOST:PORT of the Ray head")


class _Task:
    """The driver's view of one task: its actor, its run and its exit code."""

    def __init__(self, spec: TaskSpec, actor: Any) -> None:
        self.spec = spec
        self.actor = actor
        self.run: int | None = None
        """The actor's process id in the run last seen (another after a restart)."""
        self.code: int | None = None
        """The script's exit code in the current run (``None``: running or restarting)."""
        self.restarting = False
        self.lost: str | None = None
        """Why the actor is gone for good (it could not be reached within the ready timeout)."""


class RayLauncher:
    """Starts and supervises one job on Ray (``psflow launch --backend ray``)."""

    def __init__(self, config: LaunchConfig, options: RayOptions | None = None) -> None:
        self.config = config
        self.options = options or RayOptions()
        self.cluster: ClusterSpec | None = None
        self.tasks: dict[TaskSpec, _Task] = {}
        self.restarts = 0
        """Tasks restarted by Ray (at most ``max_restarts`` for the job)."""
        self._count_lock = threading.Lock()
        self._pg: Any = None
        self._out_lock = threading.RLock()
        self._changed = threading.Event()
        self._stopping = threading.Event()
        self._kill_now = threading.Event()
        self._done = threading.Event()
        self._signal: signal.Signals | None = None
        self._threads: list[threading.Thread] = []

    # -- start ------------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        with self._out_lock:
            sys.stderr.write(f"psflow launch: {message}\n")
            sys.stderr.flush()

    def _connect(self) -> None:
        import ray

        from psflow.cluster.ray_actor import answers

        address = self.options.address
        timeout = float(self.options.ready_timeout or 0)
        if address is not None:
            host, _, port = address.removeprefix("ray://").rpartition(":")
            deadline = time.monotonic() + timeout
            # ray.init would retry an address that does not answer for minutes, in C++ threads
            # that no timeout of ours reaches: ask the socket first.
            while not answers(host, int(port), min(2.0, timeout)):
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"the Ray cluster at {address} did not answer within {timeout:g} s "
                        f"({envvars.PSFLOW_READY_TIMEOUT}): is its head running?"
                    )
                time.sleep(0.2)
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING"}
        if self.options.node_ip is not None:
            kwargs["_node_ip_address"] = self.options.node_ip
        ray.init(address=address, **kwargs)

    def _tasks(self) -> list[TaskSpec]:
        c = self.config
        out = [TaskSpec(job="chief", index=0)] if c.chief else []
        out += [TaskSpec(job="ps", index=i) for i in range(c.ps)]
        out += [TaskSpec(job="worker", index=i) for i in range(c.workers)]
        out += [TaskSpec(job="evaluator", index=i) for i in range(c.evaluators)]
        return out

    def _bundle(self, task: TaskSpec) -> dict[str, float]:
        bundle = {"CPU": self.options.task_cpus}
        if self.options.trainer_gpus and task.job in ("chief", "worker"):
            bundle["GPU"] = self.options.trainer_gpus
        return bundle

    def _place(self, tasks: list[TaskSpec]) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self._pg = placement_group([self._bundle(t) for t in tasks], strategy=self.options.strategy)
        timeout = float(self.options.ready_timeout or 0)
        try:
            ray.get(self._pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            need = ", ".join(f"{k} {v:g}" for k, v in self._bundle(tasks[-1]).items())
            raise ValueError(
                f"Ray could not place the job's {len(tasks)} tasks ({need} each, "
                f"{self.options.strategy}) within {timeout:g} s: the cluster has "
                f"{ray.available_resources()} free"
            ) from None

    def _addresses(self, tasks: list[TaskSpec]) -> dict[TaskSpec, str]:
        """Each listening task's address: its bundle's node and a port free there."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from psflow.cluster.ray_actor import node_address

        probe = ray.remote(num_cpus=0)(node_address)
        for _ in range(5):
            refs = {
                t: probe.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._pg, placement_group_bundle_index=i
                    )
                ).remote()
                for i, t in enumerate(tasks)
                if t.job != "evaluator"
            }
            got = {t: ray.get(r, timeout=self.options.ready_timeout) for t, r in refs.items()}
            if len(set(got.values())) == len(got):  # two tasks of one node drew the same port
                return {t: f"{host}:{port}" for t, (host, port) in got.items()}
        raise RuntimeError("could not find distinct free ports for the tasks")

    def _keys(self) -> dict[str, bytes] | None:
        """The job's fresh CurveZMQ keys, sent to each actor (as ``psflow launch`` makes them)."""
        if self.config.insecure or self.config.env.get(envvars.PSFLOW_KEYS_DIR):
            return None
        if envvars.text(envvars.PSFLOW_KEYS_DIR):
            return None
        from psflow.cluster.keys import generate_keys

        with tempfile.TemporaryDirectory(prefix="psflow-keys-") as d:
            generate_keys(d, force=True)
            return {p.name: p.read_bytes() for p in Path(d).iterdir()}

    def start(self) -> None:
        """Connects, places the job, and starts an actor per task (ps first)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from psflow.cluster.ray_actor import TaskRunner

        self._connect()
        if threading.current_thread() is threading.main_thread():
            # After ray.init, which puts in handlers of its own that end the driver at once.
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, self._on_signal)
        tasks = self._tasks()
        self._place(tasks)
        addresses = self._addresses(tasks)
        jobs: dict[str, list[str]] = {}
        for t in tasks:
            if t in addresses:
                jobs.setdefault(t.job, []).append(addresses[t])
        self.cluster = ClusterSpec(jobs=jobs, evaluators=self.config.evaluators)
        keys = self._keys()
        runner = ray.remote(TaskRunner)
        argv = ["python", self.config.script, *self.config.args]
        threads = max(1, int(self.options.task_cpus))
        order = sorted(range(len(tasks)), key=lambda i: tasks[i].job != "ps")
        for i in order:
            t = tasks[i]
            env = {**envvars.TASK_DEFAULTS, **self.config.env}
            env.setdefault(envvars.OMP_NUM_THREADS, str(threads))
            env[envvars.TF_CONFIG] = self.cluster.to_tf_config(t)
            env["PYTHONUNBUFFERED"] = "1"
            if self.config.mode is not None:
                env[envvars.PSFLOW_MODE] = self.config.mode
            bundle = self._bundle(t)
            actor = runner.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                max_restarts=self.config.max_restarts,
                max_concurrency=4,  # poll and stop while a poll waits
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i
                ),
            ).remote(
                str(t),
                [sys.executable if argv[0] == "python" else argv[0], *argv[1:]],
                env,
                os.getcwd(),
                keys,
            )
            self.tasks[t] = _Task(t, actor)
        where = ", ".join(f"{t} {a}" for t, a in addresses.items())
        self._say(f"{len(tasks)} tasks as Ray actors ({self.options.strategy}): {where}")
        for task in self.tasks.values():
            th = threading.Thread(target=self._follow, args=(task,), daemon=True)
            th.start()
            self._threads.append(th)

    # -- supervise --------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._stopping.is_set():
            if not self._kill_now.is_set():
                self._kill_now.set()
                self._say(f"received {signal.Signals(signum).name} again; killing every task now")
            return
        self._signal = signal.Signals(signum)
        self._stopping.set()
        self._changed.set()
        self._say(
            f"received {self._signal.name}; stopping every task (SIGTERM, then SIGKILL after "
            f"{self.config.grace:g} s; {self._signal.name} again kills at once)"
        )

    def _follow(self, task: _Task) -> None:
        """Relays one task's output and notes its exit codes and restarts, until the job ends."""
        import ray

        prefix = f"[{task.spec}] "
        failing_since: float | None = None
        while not self._done.is_set():
            try:
                run, lines, code = ray.get(task.actor.poll.remote(_POLL), timeout=_POLL + 30)
            except (
                ray.exceptions.RayActorError,
                ray.exceptions.ActorUnavailableError,
                ray.exceptions.GetTimeoutError,
            ) as e:
                # Restarting (Ray queues the next poll) or gone: gone only if it stays away.
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > float(self.options.ready_timeout or 0) or (
                    not self.config.max_restarts and isinstance(e, ray.exceptions.RayActorError)
                ):
                    task.lost = f"its actor is gone ({type(e).__name__})"
                    self._changed.set()
                    return
                time.sleep(0.2)
                continue
            failing_since = None
            with self._out_lock:
                for stream, line in lines:
                    sink = sys.stdout if stream == 1 else sys.stderr
                    sink.write(prefix + line + "\n")
                    sink.flush()
            if run != task.run:
                if task.run is not None and not task.restarting:
                    # Ray restarted it without our asking: its process or node died.
                    with self._count_lock:
                        self.restarts += 1
                        n = self.restarts
                    limit = self.config.max_restarts
                    if n > limit:
                        task.lost = f"Ray restarted its actor past --max-restarts {limit}"
                        self._changed.set()
                        return
                    self._say(
                        f"task {task.spec}'s actor died; Ray restarted it with the same address "
                        f"and TF_CONFIG (restart {n} of {limit} for the job)"
                    )
                task.run, task.restarting = run, False
            if code is not None and task.code is None and not task.restarting:
                task.code = code
                self._changed.set()
                if code == 0:
                    return  # done: nothing more will come from it

    def _restart(self, task: _Task, how: str) -> bool:
        limit = self.config.max_restarts
        if self.restarts >= limit:
            if limit:
                self._say(f"no restart left (--max-restarts {limit}, all used)")
            return False
        if any(t.spec.job == "ps" and t.code == 0 for t in self.tasks.values()):
            return False
        with self._count_lock:
            self.restarts += 1
        self._say(
            f"task {task.spec} failed with {how}; Ray restarts its actor with the same address "
            f"and TF_CONFIG (restart {self.restarts} of {limit} for the job)"
        )
        task.code, task.restarting = None, True
        task.actor.die.remote()
        return True

    def wait(self) -> int:
        """Supervises the job until it ends; returns the exit code ``psflow launch`` gives."""
        trainers = [t for t in self.tasks.values() if t.spec.job in ("chief", "worker")]
        failed_evaluators: list[TaskSpec] = []
        trainers_done_at: float | None = None
        while True:
            self._changed.wait(0.1)
            self._changed.clear()
            if self._stopping.is_set():
                return 128 + (self._signal or signal.SIGINT)
            for task in self.tasks.values():
                if task.lost is not None:
                    self._say(f"task {task.spec} failed: {task.lost}; stopping the other tasks")
                    return 1
                code = task.code
                if code is None or code == 0 or task.spec in failed_evaluators:
                    continue
                how = exit_status(code)
                if task.spec.job == "evaluator":
                    failed_evaluators.append(task.spec)
                    self._say(f"task {task.spec} failed with {how}; training goes on without it")
                    continue
                if not self._restart(task, how):
                    self._say(f"task {task.spec} failed with {how}; stopping the other tasks")
                    return 1
            if trainers_done_at is None and all(t.code == 0 for t in trainers):
                trainers_done_at = time.monotonic()
            codes = [(t.spec, t.code) for t in self.tasks.values()]
            if all(c == 0 or (c is not None and s in failed_evaluators) for s, c in codes):
                if failed_evaluators:
                    self._say(f"job finished, but {', '.join(map(str, failed_evaluators))} failed")
                    return 1
                self._say(f"job finished: {len(codes)} tasks exited 0")
                return 0
            if trainers_done_at is not None:
                waited = time.monotonic() - trainers_done_at
                for job, limit in (
                    ("ps", self.config.ps_exit_seconds),
                    ("evaluator", self.config.eval_exit_timeout),
                ):
                    left = [str(s) for s, c in codes if s.job == job and c is None]
                    if left and waited > limit:
                        self._say(
                            f"{', '.join(left)} did not exit within {limit:g} s of the workers "
                            "finishing; stopping them"
                        )
                        return 1

    def stop(self) -> None:
        """Stops every task still running (the trainers first, then the ps), then the actors and
        the placement group."""
        import ray

        self._done.set()
        for first in (True, False):
            group = [t for t in self.tasks.values() if (t.spec.job != "ps") == first]
            refs = [t.actor.stop.remote(self.config.grace) for t in group if t.code is None]
            deadline = time.monotonic() + self.config.grace + 15
            while refs and not self._kill_now.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    _, refs = ray.wait(refs, num_returns=len(refs), timeout=0.2)
        # Each actor removes its copy of the job's keys first: ray.kill ends its process with
        # nothing run there, and a second Ctrl-C (or a stop past its time) kills it mid-stop.
        # An actor already gone answers at once (with an error).
        refs = [t.actor.remove_keys.remote() for t in self.tasks.values()]
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=10)
        # Killing an actor's process kills its script too (the parent-death signal).
        for t in self.tasks.values():
            with contextlib.suppress(Exception):
                ray.kill(t.actor, no_restart=True)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None

    def run(self) -> int:
        """Starts the job, supervises it, stops it (on its end, a failure or SIGINT/SIGTERM)."""
        import ray

        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            self.start()
            return self.wait()
        finally:
            try:
                if ray.is_initialized():
                    self.stop()
                    for th in self._threads:
                        th.join(timeout=5)
                    ray.shutdown()
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)
