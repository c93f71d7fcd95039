"""psflow's own log lines in a task: shown without the script configuring logging, once each
when it does, at PSFLOW_LOG_LEVEL; and the task defaults that set it (issue 16, item 11)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from psflow import env as envvars
from psflow.cluster import logs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TF_CONFIG = json.dumps(
    {
        "cluster": {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
        "task": {"type": "ps", "index": 0},
    }
)


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (its logging untouched by pytest's), as a task."""
    environ = {k: v for k, v in os.environ.items() if k != envvars.PSFLOW_LOG_LEVEL}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**environ, "TF_CONFIG": TF_CONFIG, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


LOG = "logging.getLogger('psflow.train.session').info('saved checkpoint %s', 'ckpt-7')"


def test_psflow_info_lines_show_without_any_logging_setup() -> None:
    proc = run(f"import logging, psflow; psflow.resolve([]); {LOG}; print('ok')")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(
        r"\S+ \S+ INFO psflow.train.session: saved checkpoint ckpt-7\n", proc.stderr
    ), proc.stderr
    # Before resolve(), psflow leaves logging as Python has it (a library imported elsewhere).
    proc = run(f"import logging, psflow; {LOG}")
    assert proc.stderr == ""


@contextlib.contextmanager
def bare_logging() -> Iterator[None]:
    """Logging as a fresh interpreter has it (pytest's capture handlers set aside), restored
    afterwards. Entered in the test's body: pytest adds its handlers after the fixtures."""
    root, psflow_logger = logging.getLogger(), logging.getLogger("psflow")
    saved = (list(root.handlers), root.level, list(psflow_logger.handlers), psflow_logger.level)
    root.handlers.clear()
    psflow_logger.handlers.clear()
    psflow_logger.setLevel(logging.NOTSET)
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        psflow_logger.handlers[:] = saved[2]
        psflow_logger.setLevel(saved[3])


def _saved(level: str = "info") -> None:
    getattr(logging.getLogger("psflow.train.session"), level)("saved checkpoint %s", "ckpt-7")


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_script_that_configures_logging_sees_each_line_once(
    capsys: pytest.CaptureFixture[str], when: str
) -> None:
    def basic_config() -> None:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    with bare_logging():
        if when == "before":
            basic_config()
        logs.configure({})
        if when == "after":
            basic_config()
        _saved()
    assert capsys.readouterr().err == "INFO psflow.train.session: saved checkpoint ckpt-7\n"


def test_the_script_s_own_handler_on_the_psflow_logger_is_enough(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with bare_logging():
        logging.getLogger("psflow").addHandler(logging.StreamHandler(sys.stdout))
        logs.configure({})
        _saved()
    assert capsys.readouterr() == ("saved checkpoint ckpt-7\n", "")


def test_the_level_comes_from_psflow_log_level(capsys: pytest.CaptureFixture[str]) -> None:
    with bare_logging():
        logs.configure({envvars.PSFLOW_LOG_LEVEL: "warning"})
        _saved()
        _saved("warning")
    err = capsys.readouterr().err
    assert err.count("saved checkpoint") == 1 and "WARNING psflow.train.session" in err
    with pytest.raises(ValueError, match="PSFLOW_LOG_LEVEL='LOUD' is not a level: use one of"):
        logs.configure({envvars.PSFLOW_LOG_LEVEL: "LOUD"})


def test_configure_adds_one_handler_and_never_touches_the_root_logger() -> None:
    with bare_logging():
        _configure_twice()


def _configure_twice() -> None:
    logs.configure({})
    assert logging.getLogger("psflow").level == logging.INFO
    logs.configure({envvars.PSFLOW_LOG_LEVEL: "DEBUG"})
    handlers = logging.getLogger("psflow").handlers
    assert [type(h) for h in handlers] == [logs.FallbackHandler]
    assert logging.getLogger("psflow").level == logging.DEBUG
    assert logging.getLogger().handlers == []
    # A level the script set itself stands when PSFLOW_LOG_LEVEL says nothing.
    logging.getLogger("psflow").setLevel(logging.ERROR)
    logs.configure({})
    assert logging.getLogger("psflow").level == logging.ERROR


def test_every_task_psflow_starts_gets_the_task_defaults() -> None:
    assert envvars.TASK_DEFAULTS[envvars.PSFLOW_LOG_LEVEL] == "INFO"
    # The image sets them as the launcher and the rendered manifests do.
    dockerfile = (ROOT / "Dockerfile").read_text()
    env_block = re.search(r"^ENV ((?:.*\\\n)*.*)$", dockerfile, re.M)
    assert env_block is not None
    for key, value in envvars.TASK_DEFAULTS.items():
        assert f"{key}={value}" in env_block.group(1), key
    # So do the rendered manifests, for every target.
    from psflow.deploy import JobConfig, render

    job = JobConfig(name="demo", image="psflow:0.1.0", workers=2, script="train.py")
    for target in ("kubernetes", "tfjob", "compose", "marathon"):
        text = render(job, target).text
        assert re.search(r"PSFLOW_LOG_LEVEL\W+(value: )?\W*INFO", text), target
