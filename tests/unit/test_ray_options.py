"""``psflow launch --backend ray``: options checked before anything connects (no Ray cluster)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from psflow.cluster.ray_backend import RayOptions

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"strategy": "EVEN"}, "--placement 'EVEN' must be one of SPREAD, PACK"),
        ({"address": "head"}, "--address 'head' must be HOST:PORT of the Ray head"),
        ({"address": "head:99999"}, "--address 'head:99999'"),
        ({"task_cpus": 0}, "task_cpus must be > 0"),
        ({"ready_timeout": -1}, "ready_timeout must be > 0 seconds"),
    ],
)
def test_bad_options_name_themselves(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RayOptions(**kw)  # type: ignore[arg-type]


def test_ready_timeout_defaults_to_psflow_ready_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSFLOW_READY_TIMEOUT", "7.5")
    assert RayOptions().ready_timeout == 7.5
    assert RayOptions(ready_timeout=2).ready_timeout == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--bind-cores"], "--bind-cores binds local processes"),
        (["--host", "0.0.0.0"], "--host is the local launcher's"),
        (["--placement", "EVEN"], "--placement 'EVEN' must be one of"),
    ],
)
def test_local_only_flags_are_refused_on_ray(flags: list[str], message: str) -> None:
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--backend", "ray", *flags]
    proc = subprocess.run(
        [*cmd, str(ROOT / "examples" / "linear_regression.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("psflow launch: error: ") and message in line
