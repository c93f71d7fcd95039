#!/usr/bin/env bash
# The whole test suite: lint (ruff), types (mypy), layers (import-linter), then every pytest tier.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup-venv.sh test
export PATH="$root/.venv/bin:$PATH"
echo "== ruff =="
ruff check psflow tests examples benchmarks
ruff format --check psflow tests examples benchmarks
echo "== mypy =="
mypy
echo "== import-linter =="
# The contracts in pyproject.toml ([tool.importlinter]). No cache: the graph builds in
# milliseconds, and the cache would be one more untracked directory in the checkout.
lint-imports --no-cache
echo "== pytest =="
# Two processes, each taking whole files (a module's fixtures are built once): most tests wait on
# other processes (a ps, workers) much of the time. PSFLOW_TEST_PROCESSES=0 runs them in this one;
# arguments after test.sh go to pytest (-n 0 too).
pytest -q -n "${PSFLOW_TEST_PROCESSES:-2}" --dist loadfile "$@"
