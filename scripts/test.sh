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
# Three processes (pytest-xdist) on a 2-core machine: most multi-process tests spend part of
# their time waiting (a timeout running out, a task hung on purpose, a ps starting), and a third
# process uses those seconds (quiet machine: 9 min 48 s with three, 11 min 7 s with two).
# `--dist worksteal`: each starts with a share of the tests, and one that runs out takes half of
# what another has left, so none idles while another runs a long file. (`--dist loadfile` hands
# out whole files, the ones with the fewest tests last: the slowest multi-process files came
# last, and one process ran alone for the last minute or two.) A module's fixtures may be built
# in more than one process: the few module-scoped ones are cheap, Spark's session aside.
# PSFLOW_TEST_PROCESSES=0 runs them in this one; arguments after test.sh go to pytest.
pytest -q -n "${PSFLOW_TEST_PROCESSES:-3}" --dist worksteal "$@"
