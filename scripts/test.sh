#!/usr/bin/env bash
# The whole test suite: lint (ruff), types (mypy), then every pytest tier.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup-venv.sh
export PATH="$root/.venv/bin:$PATH"
echo "== ruff =="
ruff check psflow tests examples benchmarks
ruff format --check psflow tests examples benchmarks
echo "== mypy =="
mypy
echo "== pytest =="
pytest -q "$@"
