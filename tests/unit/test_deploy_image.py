"""The Dockerfile and .dockerignore (no Docker engine here: their content is checked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_installs_every_runtime_dependency_at_its_pin() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert 'ENTRYPOINT ["tini", "--"]' in dockerfile
    (selected,) = re.findall(r"grep -E '\^\(([^)]*)\)=='", dockerfile)
    in_image = set(selected.split("|"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.M | re.S)
    assert deps is not None
    runtime = set(re.findall(r'^\s*"([A-Za-z0-9_.-]+)', deps.group(1), re.M))
    assert runtime and runtime == in_image, "the Dockerfile and pyproject disagree on what runs"
    pinned = set(
        re.findall(r"^([A-Za-z0-9_.-]+)==", (ROOT / "requirements/test.txt").read_text(), re.M)
    )
    assert in_image <= pinned, f"not pinned in requirements/test.txt: {in_image - pinned}"


def test_dockerignore_keeps_environments_history_and_caches_out() -> None:
    lines = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git", "**/__pycache__", ".mypy_cache", ".pytest_cache"} <= lines
    # What `pip install .` needs must stay in the context.
    assert not lines & {"psflow", "pyproject.toml", "README.md", "requirements"}
