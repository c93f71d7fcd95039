"""``benchmarks/scaling.py``'s job shapes: each suffix becomes its launcher flag."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _scaling() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scaling", ROOT / "benchmarks" / "scaling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_job_suffixes_become_launcher_flags() -> None:
    scaling = _scaling()
    jobs = scaling.parse_jobs("1x3,4x12t2bi,1x3i")
    assert [j.name for j in jobs] == ["1x3", "4x12t2bi", "1x3i"]
    preset = scaling.PRESETS["smoke"]
    plain, every, insecure = (scaling.job_command(preset, "/d", j, 10) for j in jobs)

    def launcher(cmd: list[str]) -> list[str]:  # the launcher's part, before the script
        return cmd[: cmd.index(str(ROOT / "examples" / "ctr.py"))]

    assert "--insecure" not in launcher(plain) and "--bind-cores" not in launcher(plain)
    assert launcher(insecure)[-1] == "--insecure"
    flags = launcher(every)
    assert flags[flags.index("--ps-threads") + 1] == "2"
    assert "--bind-cores" in flags and "--insecure" in flags


@pytest.mark.parametrize("bad", ["1x3ib", "x3", "1x0", "1x3t", "1x3 i"])
def test_a_job_out_of_shape_is_refused(bad: str) -> None:
    with pytest.raises(SystemExit, match="is not PSxWORKERS"):
        _scaling().parse_jobs(bad)
