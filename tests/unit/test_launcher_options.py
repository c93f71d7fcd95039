"""``psflow launch``'s restarts and keys, without starting any task."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import psflow.cli
from psflow.cluster.launcher import LaunchConfig, Launcher
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
