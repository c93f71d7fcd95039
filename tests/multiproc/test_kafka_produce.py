"""``psflow data produce``: TFRecord files' records into a topic of a real Kafka-protocol broker
(Tansu, tests/multiproc/kafka_broker.py), at most the rate asked, every record once."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psflow.data.kafka import KafkaConfig, KafkaReader
from psflow.data.kafka_producer import ProducerConfig, produce
from psflow.data.tfrecord import TFRecordWriter

from .kafka_broker import Broker, running_broker

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def broker() -> Iterator[Broker]:
    with running_broker() as b:
        yield b


def test_the_files_records_arrive_once_each_in_turn_over_the_partitions_at_the_rate(
    broker: Broker, tmp_path: Path
) -> None:
    n, rate, partitions = 240, 400.0, 3
    for shard in range(2):  # two files, read in name order
        with TFRecordWriter(str(tmp_path / f"part-{shard}.tfrecord")) as w:
            for i in range(shard * n // 2, (shard + 1) * n // 2):
                w.write(str(i).encode())  # any bytes: a parser given to the reader decides
    cmd = [sys.executable, "-m", "psflow.cli", "data", "produce", str(tmp_path / "part-*")]
    cmd += ["--brokers", broker.address, "--topic", "numbers", "--partitions", str(partitions)]
    start = time.monotonic()
    proc = subprocess.run([*cmd, "--rate", str(rate)], capture_output=True, text=True, timeout=50)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{n} records into numbers" in proc.stdout
    assert took >= (n - 1) / rate  # never faster than asked (a slow machine only adds)
    config = KafkaConfig(brokers=broker.address, topic="numbers", poll_timeout_s=0.5)
    got: dict[int, list[int]] = {}
    with KafkaReader(config, parser=lambda b: b) as reader:
        assert reader.partitions == list(range(partitions))
        deadline = time.monotonic() + 20
        while sum(map(len, got.values())) < n:
            assert time.monotonic() < deadline, got
            for r in reader.read(max_records=n):
                got.setdefault(r.partition, []).append(r.value)
        assert reader.read(max_records=1, timeout_s=0.5) == []  # nothing more
    numbers = {p: [int(v) for v in vs] for p, vs in got.items()}
    assert numbers == {p: list(range(p, n, partitions)) for p in range(partitions)}


def test_a_broker_that_is_not_there_is_named_within_the_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    config = ProducerConfig(brokers=f"127.0.0.1:{port}", topic="t", request_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=f"kafka broker 127.0.0.1:{port} did not answer"):
        produce([b"x"], config)
    assert time.monotonic() - start < 10
