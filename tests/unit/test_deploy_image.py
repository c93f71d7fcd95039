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
    # The job's pins, the very file `bash scripts/run.sh` installs (tests/unit/test_setup.py
    # checks that it pins every runtime dependency and no test tool).
    assert re.search(r"^COPY requirements/run\.txt requirements/run\.txt$", dockerfile, re.M)
    assert re.search(r"^RUN pip install .*-r requirements/run\.txt$", dockerfile, re.M)
    assert "requirements/test.txt" not in dockerfile


def test_dockerignore_keeps_environments_history_and_caches_out() -> None:
    lines = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".venv", ".git", "**/__pycache__", ".mypy_cache", ".pytest_cache"} <= lines
    # What `pip install .` needs must stay in the context.
    assert not lines & {"psflow", "pyproject.toml", "README.md", "requirements"}


def test_dockerfile_installs_the_object_storage_extras_at_the_tested_pins() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    tested = dict(
        re.findall(r"^(s3fs|gcsfs)==(\S+)$", (ROOT / "requirements" / "test.txt").read_text(), re.M)
    )
    assert set(tested) == {"s3fs", "gcsfs"}
    for name, version in tested.items():
        assert re.search(rf'^RUN pip install .*"{name}=={re.escape(version)}"', dockerfile, re.M), (
            name
        )
