"""Ports for a local job's tasks: free ones, chosen where no outgoing connection takes them.

:func:`local_cluster` gives ``psflow launch`` (and the tests and benchmarks) a cluster of tasks
on this host, each on a port :func:`free_ports` chose.
"""

from __future__ import annotations

import random
import socket

from psflow.cluster.spec import ClusterSpec

_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _listening_ports() -> range:
    """Where :func:`free_ports` looks: the 12,000 ports just below the kernel's ephemeral range
    (Linux's ``ip_local_port_range``, 32768-60999 by default), which the kernel never hands to
    an outgoing connection; an empty range where there is none to read."""
    try:
        with open(_PORT_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(max(1024, low - 12000), low)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (held open together while chosen).

    Chosen at random below the ephemeral range: a port the kernel picks for ``bind(0)`` comes
    from the range it also gives outgoing connections (ZeroMQ's, other jobs'), so one of those
    could take it before the task binds it. Outside Linux, the kernel's own choice.
    """
    socks: list[socket.socket] = []
    candidates = _listening_ports()
    try:
        for _ in range(20 * n if len(candidates) else 0):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, random.choice(candidates)))
            except OSError:  # taken (or lingering): another
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_cluster(
    ps: int, workers: int, *, chief: bool = False, host: str = "127.0.0.1", evaluators: int = 0
) -> ClusterSpec:
    """A cluster of local tasks on free ports (evaluators outside it: nobody calls them)."""
    ports = iter(free_ports(ps + workers + int(chief), host))
    jobs: dict[str, list[str]] = {}
    if chief:
        jobs["chief"] = [f"{host}:{next(ports)}"]
    if ps:
        jobs["ps"] = [f"{host}:{next(ports)}" for _ in range(ps)]
    if workers:
        jobs["worker"] = [f"{host}:{next(ports)}" for _ in range(workers)]
    return ClusterSpec(jobs=jobs, evaluators=evaluators)
