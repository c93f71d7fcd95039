"""psflow.env's typed readers: a good value, unset, and a bad one refused with the variable and
its value named; and the components that read through them refuse a bad value alike."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from psflow import env as envvars

pytestmark = pytest.mark.unit


def _refused(name: str, value: str) -> str:
    """What a refusal of ``name=value`` must say: the variable, then the value."""
    return rf"{name}\b.*{re.escape(repr(value))}"


def test_text(monkeypatch: pytest.MonkeyPatch) -> None:
    name = envvars.PSFLOW_LOGDIR
    monkeypatch.setenv(name, "/tmp/run")
    assert envvars.text(name) == "/tmp/run"
    monkeypatch.setenv(name, "")
    assert envvars.text(name, "default") == "default"
    monkeypatch.delenv(name)
    assert envvars.text(name) is None
    assert envvars.text(name, "default") == "default"


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("ON", True), ("yes", True), ("0", False), ("False", False)]
)
def test_flag(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv(envvars.PSFLOW_SHM, raw)
    assert envvars.flag(envvars.PSFLOW_SHM, not value) is value


def test_flag_unset_and_bad(monkeypatch: pytest.MonkeyPatch) -> None:
    name = envvars.PSFLOW_SHM
    monkeypatch.delenv(name, raising=False)
    assert envvars.flag(name, True) is True
    assert envvars.flag(name, False) is False
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=_refused(name, "maybe")):
        envvars.flag(name, True)


def test_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    name, choices = envvars.PSFLOW_MODE, ("async", "sync", "allreduce")
    monkeypatch.setenv(name, "sync")
    assert envvars.choice(name, choices, "async") == "sync"
    monkeypatch.delenv(name)
    assert envvars.choice(name, choices, "async") == "async"
    monkeypatch.setenv(name, "fast")
    with pytest.raises(ValueError, match=_refused(name, "fast")):
        envvars.choice(name, choices, "async")


def test_port(monkeypatch: pytest.MonkeyPatch) -> None:
    name = envvars.PSFLOW_METRICS_PORT
    monkeypatch.setenv(name, "9090")
    assert envvars.port(name) == 9090
    assert envvars.port(name, {name: "0"}) == 0  # a mapping given is read instead
    monkeypatch.delenv(name)
    assert envvars.port(name) is None
    for bad in ("http", "-1", "65536"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=_refused(name, bad)):
            envvars.port(name)


@pytest.mark.parametrize(
    ("read", "raw", "value", "bad"),
    [
        (lambda n: envvars.seconds(n, 60.0), "2.5", 2.5, "0"),
        (envvars.seconds_or_none, "30", 30.0, "-1"),
        (lambda n: envvars.micros(n, 0.002), "500", 0.0005, "-5"),
    ],
    ids=["seconds", "seconds_or_none", "micros"],
)
def test_numbers(
    monkeypatch: pytest.MonkeyPatch,
    read: Callable[[str], Any],
    raw: str,
    value: float,
    bad: str,
) -> None:
    name = envvars.PSFLOW_TIMEOUT
    monkeypatch.setenv(name, raw)
    assert read(name) == pytest.approx(value)
    for refused in (bad, "soon", "inf", "nan"):
        monkeypatch.setenv(name, refused)
        with pytest.raises(ValueError, match=_refused(name, refused)):
            read(name)


def test_numbers_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    name = envvars.PSFLOW_TIMEOUT
    monkeypatch.delenv(name, raising=False)
    assert envvars.seconds(name, 60.0) == 60.0
    assert envvars.seconds_or_none(name) is None
    assert envvars.micros(name, 0.002) == 0.002


# -- the components that read them ------------------------------------------------------------


def test_gc_freeze_refuses_maybe(monkeypatch: pytest.MonkeyPatch) -> None:
    from psflow import allocator

    monkeypatch.setenv(envvars.PSFLOW_GC_FREEZE, "maybe")
    with pytest.raises(ValueError, match=_refused("PSFLOW_GC_FREEZE", "maybe")):
        allocator.freeze_gc()


def test_malloc_refuses_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from psflow import allocator

    monkeypatch.setenv(envvars.PSFLOW_MALLOC, "fast")
    with pytest.raises(ValueError, match=_refused("PSFLOW_MALLOC", "fast")):
        allocator.tune()
    with pytest.raises(ValueError, match=_refused("PSFLOW_MALLOC", "fast")):
        allocator.table_empty((4, 4), torch.float32)


def test_cli_refuses_a_loud_log_level(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import psflow.cli

    monkeypatch.setenv(envvars.PSFLOW_LOG_LEVEL, "LOUD")
    assert psflow.cli.main([]) == 2
    err = capsys.readouterr().err
    assert "PSFLOW_LOG_LEVEL='LOUD' is not DEBUG, INFO, WARNING or ERROR" in err


def test_a_task_refuses_a_loud_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    from psflow.cluster import logs

    monkeypatch.setenv(envvars.PSFLOW_LOG_LEVEL, "LOUD")
    with pytest.raises(ValueError, match=_refused("PSFLOW_LOG_LEVEL", "LOUD")):
        logs.configure()


def test_metrics_port_refuses_a_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from psflow import metrics

    monkeypatch.setenv(envvars.PSFLOW_METRICS_PORT, "http")
    with pytest.raises(ValueError, match=_refused("PSFLOW_METRICS_PORT", "http")):
        metrics.metrics_port()
