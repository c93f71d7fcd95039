#!/usr/bin/env bash
# Creates or reuses .venv and installs psflow with the pinned test requirements.
# Re-installs only when requirements/test.txt or pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
stamp=".venv/.psflow-installed"
want="$(cat requirements/test.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing requirements/test.txt into .venv (first run takes a few minutes)" >&2
    # pip's notes about this machine's optional local indexes are noise; real errors still show.
    .venv/bin/python -m pip install -q -r requirements/test.txt 2>&1 | grep -v "^WARNING: Location" || true
    .venv/bin/python -m pip install -q --no-deps -e . 2>&1 | grep -vE "^WARNING: Location|^ " || true
    .venv/bin/python -c "import psflow, torch, zmq"  # fail here, not later, if the install broke
    echo "$want" > "$stamp"
fi
