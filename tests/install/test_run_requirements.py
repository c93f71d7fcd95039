"""What pip would install for ``bash scripts/run.sh``, transitive dependencies included.

pip resolves ``requirements/run.txt`` for a fresh virtual environment (no system site packages)
with ``--dry-run --report``: nothing is installed, and only metadata is fetched for packages
that are not on the machine's local wheel indexes. Needs the package registries (about 10 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_setup import TEST_TOOLS, canonical, runtime_dependencies

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_job_resolves_to_its_runtime_and_no_test_tool(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # A bare environment, resolved for by this Python's pip (``pip --python``): the same empty
    # target as a venv with its own pip, without the seconds ensurepip takes to install one.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--quiet",
            "--dry-run",
            "--report",
            str(report),
            "-r",
            str(ROOT / "requirements" / "run.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = {
        canonical(item["metadata"]["name"]): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert runtime_dependencies() <= set(resolved)
    assert not TEST_TOOLS & set(resolved), sorted(TEST_TOOLS & set(resolved))
    # The CPU build where the machine has it (2.13.0+cpu), never another version.
    assert resolved["torch"].split("+")[0] == "2.13.0"
    assert not any(name.startswith("nvidia-") for name in resolved), sorted(resolved)
