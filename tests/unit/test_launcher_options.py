"""``psflow launch``'s restarts, keys and core binding, without starting any task."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import psflow.cli
import psflow.cluster.launch_config as launch_config
import psflow.cluster.ray_backend as ray_backend
from psflow.cluster.cli import launch
from psflow.cluster.cores import bind, core_sets
from psflow.cluster.launcher import LaunchConfig, Launcher
from psflow.cluster.spec import TaskSpec
from psflow.protocol import WORKER_TIMEOUT
from psflow.transport import CurveKeys

pytestmark = pytest.mark.unit


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


def test_each_job_gets_fresh_private_keys_removed_at_its_end(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PSFLOW_KEYS_DIR", raising=False)
    dirs = []
    for _ in range(2):
        launcher = Launcher(LaunchConfig(script=script))
        launcher._make_keys()
        assert launcher.keys_dir is not None
        dirs.append(launcher.keys_dir)
        assert stat.S_IMODE(os.stat(launcher.keys_dir).st_mode) == 0o700
        CurveKeys.load(launcher.keys_dir)  # what every task loads
        secret = Path(launcher.keys_dir) / "server.key_secret"
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert dirs[0] != dirs[1]
    assert (Path(dirs[0]) / "client.key").read_text() != (Path(dirs[1]) / "client.key").read_text()
    for d in dirs:
        launcher.keys_dir = d
        launcher._remove_keys()
        assert not os.path.exists(d)


def test_insecure_or_the_users_own_keys_make_none(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PSFLOW_KEYS_DIR", raising=False)
    launcher = Launcher(LaunchConfig(script=script, insecure=True))
    launcher._make_keys()
    assert launcher.keys_dir is None
    launcher = Launcher(LaunchConfig(script=script, env={"PSFLOW_KEYS_DIR": "/mine"}))
    launcher._make_keys()
    assert launcher.keys_dir is None
    monkeypatch.setenv("PSFLOW_KEYS_DIR", "/mine")
    launcher = Launcher(LaunchConfig(script=script))
    launcher._make_keys()
    assert launcher.keys_dir is None


def test_max_restarts_is_checked(script: str) -> None:
    with pytest.raises(ValueError, match="--max-restarts must be >= 0, got -1"):
        LaunchConfig(script=script, max_restarts=-1)
    with pytest.raises(TypeError, match=r"--max-restarts must be an integer, got 1\.5"):
        LaunchConfig(script=script, max_restarts=1.5)  # type: ignore[arg-type]


def test_the_launch_flags_and_their_defaults(script: str) -> None:
    args = psflow.cli.build_parser().parse_args(
        ["launch", "--max-restarts", "2", "--insecure", script]
    )
    assert args.max_restarts == 2 and args.insecure
    args = psflow.cli.build_parser().parse_args(["launch", script])
    assert args.max_restarts == 0 and not args.insecure


def test_the_ps_exit_deadline_outlasts_the_ps_s_wait_for_a_worker_that_never_spoke(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ps waits one worker timeout for a worker that never spoke to it (one that finished
    before the ps restarted empty) before it exits: the launcher's default deadline is that
    timeout, as the tasks get it, and 30 s more, never the timeout alone."""
    assert launch_config.DEFAULT_WORKER_TIMEOUT == WORKER_TIMEOUT  # the ps's own default
    monkeypatch.delenv("PSFLOW_WORKER_TIMEOUT", raising=False)
    assert LaunchConfig(script=script).ps_exit_seconds == 60.0
    monkeypatch.setenv("PSFLOW_WORKER_TIMEOUT", "45")
    assert LaunchConfig(script=script).ps_exit_seconds == 75.0
    env = {"PSFLOW_WORKER_TIMEOUT": "4"}  # the tasks' own: it wins
    assert LaunchConfig(script=script, env=env).ps_exit_seconds == 34.0
    assert LaunchConfig(script=script, ps_exit_timeout=5.0).ps_exit_seconds == 5.0
    args = psflow.cli.build_parser().parse_args(["launch", script])
    assert args.ps_exit_timeout is None
    with pytest.raises(ValueError, match="PSFLOW_WORKER_TIMEOUT must be a number of seconds"):
        LaunchConfig(script=script, env={"PSFLOW_WORKER_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="ps_exit_timeout"):
        LaunchConfig(script=script, ps_exit_timeout=0.0)


def test_without_ps_the_launcher_plans_one_to_every_three_workers_and_says_so(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[LaunchConfig] = []
    monkeypatch.setattr(Launcher, "run", lambda self: started.append(self.config) or 0)
    parser = psflow.cli.build_parser()
    cases = [
        (["--workers", "7"], 3),
        (["--workers", "2"], 1),
        (["--workers", "7", "--ps", "1"], 1),
        (["--workers", "3", "--mode", "allreduce"], 0),
    ]
    for argv, ps in cases:
        assert launch(parser.parse_args(["launch", *argv, script])) == 0
        assert started[-1].ps == ps, argv
    plans = [x for x in capsys.readouterr().err.splitlines() if "ps for" in x]
    assert len(plans) == 2, plans  # chosen twice; given, or all-reduce's none, not printed
    assert plans[0].startswith("psflow launch: 3 ps for 7 workers (one to every 3), ")
    assert plans[0].endswith("; --ps N chooses another count")


def test_bind_cores_is_off_unless_asked(script: str) -> None:
    assert not psflow.cli.build_parser().parse_args(["launch", script]).bind_cores
    assert psflow.cli.build_parser().parse_args(["launch", "--bind-cores", script]).bind_cores
    assert Launcher(LaunchConfig(script=script, ps=2, workers=1)).cores == {}


def _named(cores: dict[TaskSpec, list[int]]) -> dict[str, list[int]]:
    return {str(t): c for t, c in cores.items()}


def test_core_sets_put_a_ps_beside_a_trainer_before_two_ps_share_a_core() -> None:
    ps = [TaskSpec(job="ps", index=i) for i in range(2)]
    workers = [TaskSpec(job="worker", index=i) for i in range(2)]
    # 3 tasks, 2 cores: the worker alone with ps:1; ps:0 on the other core.
    assert _named(core_sets([*ps, workers[0]], [0, 1])) == {
        "worker:0": [0],
        "ps:0": [1],
        "ps:1": [0],
    }
    # 2 workers and 2 ps on 2 cores: one worker and one ps a core.
    assert _named(core_sets([*ps, *workers], [4, 5])) == {
        "worker:0": [4],
        "worker:1": [5],
        "ps:0": [4],
        "ps:1": [5],
    }
    # A chief and an evaluator are trainers too, the chief first.
    chief, evaluator = TaskSpec(job="chief"), TaskSpec(job="evaluator")
    assert list(core_sets([ps[0], evaluator, workers[0], chief], [0])) == [
        chief,
        workers[0],
        evaluator,
        ps[0],
    ]


def test_core_sets_give_each_task_cores_of_its_own_when_there_are_enough() -> None:
    ps = [TaskSpec(job="ps", index=i) for i in range(2)]
    tasks = [*ps, TaskSpec(job="worker")]
    cores = core_sets(tasks, list(range(8)))
    assert _named(cores) == {"worker:0": [0, 1, 2], "ps:0": [3, 4, 5], "ps:1": [6, 7]}
    assert _named(core_sets(tasks, [2, 3, 5])) == {"worker:0": [2], "ps:0": [3], "ps:1": [5]}
    with pytest.raises(ValueError, match="no cores"):
        core_sets(tasks, [])


def test_a_task_that_cannot_be_bound_says_so_and_runs_unbound(
    capfd: pytest.CaptureFixture[str],
) -> None:
    before = os.sched_getaffinity(0)
    bind([10_000])  # no such core
    assert os.sched_getaffinity(0) == before
    assert "cannot bind this task to cores [10000]" in capfd.readouterr().err


def test_preload_comes_from_the_flag_else_psflow_preload(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[LaunchConfig] = []
    monkeypatch.setattr(Launcher, "run", lambda self: started.append(self.config) or 0)
    parser = psflow.cli.build_parser()
    cases = [
        (None, [], []),
        ("torch, psflow", [], ["torch", "psflow"]),
        ("torch,psflow", ["--preload", "numpy"], ["numpy"]),
        ("torch", ["--preload", ""], []),  # the flag, even empty, overrides the environment
    ]
    for environ, argv, preload in cases:
        if environ is None:
            monkeypatch.delenv("PSFLOW_PRELOAD", raising=False)
        else:
            monkeypatch.setenv("PSFLOW_PRELOAD", environ)
        assert launch(parser.parse_args(["launch", "--ps", "1", *argv, script])) == 0
        assert list(started[-1].preload) == preload, (environ, argv)


def test_preload_is_checked_and_refused_on_ray(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=r"--preload takes module names .*\['to rch'\]"):
        LaunchConfig(script=script, preload=["to rch"])
    with pytest.raises(TypeError, match="preload must be a sequence of module names"):
        LaunchConfig(script=script, preload="torch")
    args = psflow.cli.build_parser().parse_args(
        ["launch", "--backend", "ray", "--preload", "torch", script]
    )
    with pytest.raises(ValueError, match="--preload forks local processes"):
        launch(args)
    # On Ray the environment's PSFLOW_PRELOAD (set for local jobs) is not an error: unused.
    monkeypatch.setenv("PSFLOW_PRELOAD", "torch")
    args = psflow.cli.build_parser().parse_args(["launch", "--backend", "ray", script])
    config: list[LaunchConfig] = []

    class Stub:
        def __init__(self, c: LaunchConfig, _options: object) -> None:
            config.append(c)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(ray_backend, "RayLauncher", Stub)
    assert launch(args) == 0
    assert list(config[0].preload) == []
