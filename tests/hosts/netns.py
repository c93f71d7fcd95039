"""Several hosts on one machine: one network namespace per task, joined by a bridge.

Each host is a namespace with its own loopback and one interface (``eth0``) whose other end
sits on a bridge in a switch namespace of its own, so the machine's own interfaces and routes
are never touched. Cutting a host's cable is ``ip link set <its port> down`` in the switch.
Needs root and iproute2; :func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or ``None`` when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    probe = f"pfprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        stderr = getattr(e, "stderr", "") or str(e)
        return f"cannot create a network namespace: {stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Hosts:
    """``n`` hosts ``10.<a>.<b>.1`` ... on one bridge; ``address(i)`` is host ``i``'s."""

    n: int
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    subnet: str = field(
        default_factory=lambda: f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    )
    made: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"pf{self.tag}sw"

    def ns(self, i: int) -> str:
        return f"pf{self.tag}h{i}"

    def port(self, i: int) -> str:
        """Host ``i``'s port on the bridge (an interface in the switch namespace)."""
        return f"pf{self.tag}p{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def up(self) -> None:
        _ip("netns", "add", self.switch)
        self.made.append(self.switch)
        sw = ("-n", self.switch)
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        _ip(*sw, "link", "set", "lo", "up")
        for i in range(self.n):
            ns = self.ns(i)
            _ip("netns", "add", ns)
            self.made.append(ns)
            # Made inside the switch namespace, one end then moved: the root namespace never
            # holds either end, even for a moment.
            _ip(
                *sw,
                "link",
                "add",
                self.port(i),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip(*sw, "link", "set", self.port(i), "master", "br0")
            _ip(*sw, "link", "set", self.port(i), "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        for ns in reversed(self.made):
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "del", ns)
        self.made.clear()

    def cut(self, i: int) -> None:
        """Takes host ``i``'s link down (its cable pulled at the switch)."""
        _ip("-n", self.switch, "link", "set", self.port(i), "down")

    def mend(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", self.port(i), "up")

    def popen(
        self, i: int, cmd: Sequence[str], *, env: dict[str, str], **kwargs: object
    ) -> subprocess.Popen[str]:
        """Runs ``cmd`` on host ``i`` (``ip netns exec`` execs it: the pid is the command's)."""
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            ["ip", "netns", "exec", self.ns(i), *cmd], env=env, text=True, **kwargs
        )


@contextlib.contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    h = Hosts(n)
    try:
        h.up()
        yield h
    finally:
        h.down()
