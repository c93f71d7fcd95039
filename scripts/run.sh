#!/usr/bin/env bash
# The main job: a local cluster (1 ps + 2 workers) training the classic linear-regression example.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup-venv.sh run
exec .venv/bin/psflow launch --ps 1 --workers 2 examples/linear_regression.py "$@"
