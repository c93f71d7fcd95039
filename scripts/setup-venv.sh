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
    log=.venv/pip-install.log
    if ! { .venv/bin/python -m pip install -q -r requirements/test.txt &&
           .venv/bin/python -m pip install -q --no-deps -e .; } >"$log" 2>&1; then
        grep -v "^WARNING: Location" "$log" >&2
        echo "setup: pip install failed (full log: $log)" >&2
        exit 1
    fi
    .venv/bin/python -c "import psflow, torch, zmq"  # fail here, not later, if the install broke
    echo "$want" > "$stamp"
fi
