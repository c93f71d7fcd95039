"""The transport's environment variables, read through psflow.env's typed readers: a value the
variable cannot mean is refused, naming the variable and the value, instead of a bare float()
error or a switch silently left on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from psflow.transport import TransportConfig, generate_keys

pytestmark = pytest.mark.unit

VARIABLES = (
    "PSFLOW_TIMEOUT",
    "PSFLOW_LINK_TIMEOUT",
    "PSFLOW_SHM",
    "PSFLOW_WAIT_LOG_SECONDS",
    "PSFLOW_KEYS_DIR",
    "PSFLOW_IO_THREADS",
)


@pytest.fixture(autouse=True)
def _unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _refused(name: str, raw: str) -> str:
    """The message, naming ``name`` and ``raw``, with which TransportConfig refuses it."""
    with pytest.raises(ValueError) as info:
        TransportConfig()
    message = str(info.value)
    assert name in message, message
    assert repr(raw) in message, message
    return message


@pytest.mark.parametrize("raw", ["abc", "-1", "0", "nan", "inf"])
def test_a_bad_timeout_names_its_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PSFLOW_TIMEOUT", raw)
    assert re.match(
        r"PSFLOW_TIMEOUT must be a number of seconds > 0", _refused("PSFLOW_TIMEOUT", raw)
    )


@pytest.mark.parametrize("raw", ["abc", "-1", "0", "nan"])
def test_a_bad_link_timeout_names_its_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PSFLOW_LINK_TIMEOUT", raw)
    _refused("PSFLOW_LINK_TIMEOUT", raw)


def test_a_link_timeout_given_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"link_timeout \(PSFLOW_LINK_TIMEOUT\) must be > 0"):
        TransportConfig(link_timeout=0)


@pytest.mark.parametrize("raw", ["abc", "-1", "0"])
def test_a_bad_wait_log_names_its_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PSFLOW_WAIT_LOG_SECONDS", raw)
    _refused("PSFLOW_WAIT_LOG_SECONDS", raw)


@pytest.mark.parametrize("raw", ["maybe", "2", "enabled"])
def test_a_bad_shm_switch_names_its_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """Before: anything but 0/off/false/no turned shared memory on."""
    monkeypatch.setenv("PSFLOW_SHM", raw)
    assert "1, on, true, yes, 0, off, false, no" in _refused("PSFLOW_SHM", raw)


def test_good_values_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSFLOW_TIMEOUT", "2.5")
    monkeypatch.setenv("PSFLOW_WAIT_LOG_SECONDS", "3")
    monkeypatch.setenv("PSFLOW_SHM", "Off")
    monkeypatch.setenv("PSFLOW_LINK_TIMEOUT", "7")
    config = TransportConfig()
    assert (config.timeout, config.wait_log_seconds, config.shared_memory) == (2.5, 3.0, False)
    assert config.link_timeout == 7.0
    monkeypatch.setenv("PSFLOW_SHM", "yes")
    assert TransportConfig().shared_memory


def test_unset_or_empty_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = TransportConfig()
    assert (defaults.timeout, defaults.wait_log_seconds, defaults.shared_memory) == (60, 10, True)
    assert defaults.link_timeout == 20
    for name in ("PSFLOW_TIMEOUT", "PSFLOW_WAIT_LOG_SECONDS", "PSFLOW_SHM"):
        monkeypatch.setenv(name, "")
    config = TransportConfig()
    assert (config.timeout, config.wait_log_seconds, config.shared_memory) == (60, 10, True)


def test_a_field_given_is_not_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSFLOW_TIMEOUT", "abc")
    monkeypatch.setenv("PSFLOW_SHM", "maybe")
    config = TransportConfig(timeout=5, shared_memory=False)
    assert (config.timeout, config.shared_memory) == (5, False)


def test_keys_come_from_the_keys_dir_when_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert TransportConfig.from_env(shared_memory=False).keys is None
    monkeypatch.setenv("PSFLOW_KEYS_DIR", "")  # empty: as unset
    assert TransportConfig.from_env(shared_memory=False).keys is None
    monkeypatch.setenv("PSFLOW_KEYS_DIR", str(generate_keys(tmp_path / "keys")))
    assert TransportConfig.from_env(shared_memory=False).keys is not None


@pytest.mark.parametrize("raw", ["abc", "0", "-2", "1.5"])
def test_bad_io_threads_name_their_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PSFLOW_IO_THREADS", raw)
    _refused("PSFLOW_IO_THREADS", raw)


IO_THREADS_SCRIPT = """
import os, threading, time
from psflow.cluster.ports import free_ports
from psflow.transport import Server, TransportConfig

def comm(tid):
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()

(port,) = free_ports(1)
before = set(os.listdir("/proc/self/task"))
server = Server(f"127.0.0.1:{port}", TransportConfig(shared_memory=False))
# libzmq starts its threads before the first socket exists, but each names itself once it runs:
# wait (on the names, with a deadline) until every new thread that Python did not start has one.
python = {str(t.native_id) for t in threading.enumerate()}
native = set(os.listdir("/proc/self/task")) - before - python
deadline = time.monotonic() + 30
while not all(comm(t).startswith("ZMQbg/") for t in native) and time.monotonic() < deadline:
    time.sleep(0.01)
print(sorted(n for n in map(comm, native) if n.startswith("ZMQbg/IO")))
server.close()
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="threads listed by /proc only")
def test_io_threads_start_with_the_first_socket() -> None:
    """``PSFLOW_IO_THREADS=2``: a task whose first socket is a psflow server runs two ZeroMQ
    I/O threads (a fresh process: the test process's context has started its own)."""
    env = {"PSFLOW_IO_THREADS": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", IO_THREADS_SCRIPT], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == "['ZMQbg/IO/0', 'ZMQbg/IO/1']"
    del env["PSFLOW_IO_THREADS"]
    out = subprocess.run(
        [sys.executable, "-c", IO_THREADS_SCRIPT], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == "['ZMQbg/IO/0']"
