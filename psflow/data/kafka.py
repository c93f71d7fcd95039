"""Reading a Kafka topic: each worker its share of the partitions, at an exact, saveable position.

:class:`KafkaReader` assigns itself partitions ``worker_index, worker_index + num_workers, ...``
of the topic's partitions in order (no consumer group, no rebalance: a worker's share is fixed
by its index, as its share of files is), and hands out records in each partition's order. Its
:meth:`~KafkaReader.state` is the offset of the next record to hand out in each partition of its
share, plain data (``{"source": "kafka", "topic": ..., "offsets": {"0": 17, ...}}``) that a
checkpoint can hold; :meth:`~KafkaReader.restore` goes back there, and
:meth:`~KafkaReader.stop_at` makes reads stop exactly at positions saved before (a replay). The
states of all workers merge into one (:func:`merge_states`) that any number of workers can
restore from, each taking its own partitions' offsets. Given to a
:class:`~psflow.train.TrainingSession` (``input=``), the reader's position is kept by the ps
with the updates it led to: each record trained once across restarts
(:mod:`psflow.train.input_position`).

Records are ``tf.train.Example`` bytes, parsed a batch at a time by
:func:`psflow.data.parse_examples` (:meth:`~KafkaReader.read_examples`), or anything a parser
given to the reader turns bytes into (:meth:`~KafkaReader.read`). A record that does not parse
is counted and skipped, or stops the reader (:class:`BadRecordError`), as
:attr:`KafkaConfig.on_bad_record` says; either way the topic, partition and offset are named.

A broker that goes away: each read waits at most its timeout and returns what it has; while no
broker answers, the reader logs whom it is waiting for (every ``wait_log_s``), and goes on from
its position when the broker is back; past ``max_wait_s`` (if set) it raises ``TimeoutError``
naming the broker. Every call to the client has a timeout.

The client is confluent-kafka (librdkafka), ``pip install psflow[kafka]``, imported when a
reader is made. The position's plain data (checked, merged) is :mod:`psflow.data.kafka_offsets`'s,
the waits for a broker :mod:`psflow.data.kafka_wait`'s; this module is the one to import from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from psflow.data.batches import ExampleStream, parse_batch
from psflow.data.features import FeatureSpec
from psflow.data.kafka_offsets import SOURCE, checked_state, checked_stops, merge_states, short_of
from psflow.data.kafka_wait import BrokerWait

__all__ = ["SOURCE", "BadRecordError", "KafkaConfig", "KafkaReader", "StreamRecord", "merge_states"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class KafkaConfig:
    """A Kafka reader: the topic, this worker's place among those sharing it, and its waits."""

    brokers: str
    """Bootstrap brokers, ``host:port[,host:port...]``."""
    topic: str
    """The topic to read."""
    worker_index: int = 0
    """This worker's index among ``num_workers``: it reads the topic's partitions
    ``worker_index, worker_index + num_workers, ...`` (in partition order)."""
    num_workers: int = 1
    """Workers sharing the topic; at most its number of partitions."""
    start: Literal["earliest", "latest"] = "earliest"
    """Where a partition of the share starts when no restored state gives its offset: its
    oldest record on the broker, or the next one to arrive."""
    on_bad_record: Literal["skip", "raise"] = "skip"
    """A record that does not parse: counted (``stats["bad_records"]``), logged and skipped,
    or :class:`BadRecordError` (the position stays at the record, for a later read to retry)."""
    poll_timeout_s: float = 1.0
    """The longest one call to the client waits for records."""
    request_timeout_s: float = 10.0
    """The longest a metadata or offset request to the broker waits."""
    wait_log_s: float = 10.0
    """While no broker answers: how often the reader logs whom it waits for."""
    max_wait_s: float | None = None
    """How long the reader waits for a broker that went away (or a topic that is not there)
    before ``TimeoutError``; ``None``: as long as it takes (a job that trains from a stream
    waits for it), logging every ``wait_log_s``."""
    client: Mapping[str, Any] = field(default_factory=dict)
    """More librdkafka settings (``security.protocol``, ``sasl.*``, ``fetch.*`` ...)."""

    def __post_init__(self) -> None:
        if not self.brokers or not isinstance(self.brokers, str):
            raise ValueError(
                f"KafkaConfig: brokers must be 'host:port[,...]', got {self.brokers!r}"
            )
        if not self.topic:
            raise ValueError("KafkaConfig: topic is empty")
        if self.num_workers < 1 or not 0 <= self.worker_index < self.num_workers:
            raise ValueError(
                f"KafkaConfig: worker_index={self.worker_index} must be in "
                f"[0, num_workers={self.num_workers})"
            )
        if self.start not in ("earliest", "latest"):
            raise ValueError(
                f"KafkaConfig: start must be 'earliest' or 'latest', got {self.start!r}"
            )
        if self.on_bad_record not in ("skip", "raise"):
            raise ValueError(
                f"KafkaConfig: on_bad_record must be 'skip' or 'raise', got {self.on_bad_record!r}"
            )
        for name in ("poll_timeout_s", "request_timeout_s", "wait_log_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"KafkaConfig: {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(
                f"KafkaConfig: max_wait_s must be > 0 or None, got {self.max_wait_s!r}"
            )


class StreamRecord(NamedTuple):
    """One record handed out: where it was, and its value (parsed, or the bytes)."""

    partition: int
    offset: int
    value: Any


class BadRecordError(ValueError):
    """A record that does not parse, with ``on_bad_record="raise"``; names where it is."""

    def __init__(self, topic: str, partition: int, offset: int, reason: str) -> None:
        super().__init__(
            f"kafka topic {topic!r} partition {partition} offset {offset}: the record does not "
            f"parse: {reason} (KafkaConfig(on_bad_record='skip') counts and skips such records)"
        )
        self.topic, self.partition, self.offset = topic, partition, offset


class KafkaReader(ExampleStream):
    """Reads this worker's share of a Kafka topic's partitions, at an exact position.

    Args:
        config: the topic, the worker's place, the waits.
        parser: turns a record's bytes into what :meth:`read` hands out (an exception: a bad
            record); ``None``: the bytes themselves.

    Example:
        >>> reader = KafkaReader(KafkaConfig(brokers="127.0.0.1:9092", topic="clicks",
        ...                                  worker_index=ctx.worker_index,
        ...                                  num_workers=ctx.num_workers))  # doctest: +SKIP
        >>> batch = reader.read_examples(512, ctr_spec())    # doctest: +SKIP
        >>> saved = reader.state()   # plain data: the next offset of each partition  # doctest: +SKIP
        >>> reader.restore(saved)    # doctest: +SKIP
    """

    def __init__(
        self, config: KafkaConfig, *, parser: Callable[[bytes], Any] | None = None
    ) -> None:
        try:
            import confluent_kafka
        except ImportError as e:  # an extra
            raise ImportError(
                "psflow.data.kafka needs confluent-kafka: pip install 'psflow[kafka]'"
            ) from e
        self._ck = confluent_kafka
        self.config = config
        self.parser = parser
        self.stats = {"records": 0, "bad_records": 0, "broker_waits": 0}
        self._wait = BrokerWait(
            config.topic,
            poll_timeout_s=config.poll_timeout_s,
            wait_log_s=config.wait_log_s,
            max_wait_s=config.max_wait_s,
            stats=self.stats,
            where=self._where,
        )
        self._probed_at = 0.0
        settings = {
            "bootstrap.servers": config.brokers,
            # librdkafka wants a group even for assigned partitions; nothing is committed.
            "group.id": f"psflow-{config.topic}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "error",  # an offset gone from the broker is an error, named
            "enable.partition.eof": False,
            "socket.timeout.ms": int(config.request_timeout_s * 1000),
            "reconnect.backoff.ms": 100,
            "reconnect.backoff.max.ms": 2000,
            "error_cb": self._wait.on_error,
            "logger": logging.getLogger(f"{__name__}.client"),
            **config.client,
        }
        self._consumer = confluent_kafka.Consumer(settings)
        self._closed = False
        self._stops: list[dict[int, int]] = []
        """:meth:`stop_at`'s positions still ahead, each partition's offset to stop before."""
        self._reseek = False
        """A read fetched records past the next stop: the client seeks back before the next."""
        try:
            self.partitions = self._share()
            self._next: dict[int, int] = {}
            self._resolve_start(self.partitions)
            self._assign()
        except BaseException:
            self.close()
            raise

    # -- the share and the position ----------------------------------------------------------

    def _share(self) -> list[int]:
        """This worker's partitions, once the broker says which the topic has."""
        cfg = self.config
        while True:
            try:
                md = self._consumer.list_topics(cfg.topic, timeout=cfg.request_timeout_s)
                topic = md.topics.get(cfg.topic)
                if topic is not None and topic.error is None and topic.partitions:
                    break
                reason = f"topic {cfg.topic!r}: {topic.error if topic else 'not on the broker'}"
            except self._ck.KafkaException as e:
                reason = f"brokers {cfg.brokers}: {e}"
            self._wait.waiting(reason)
        self._wait.done()
        every = sorted(topic.partitions)
        if cfg.num_workers > len(every):
            raise ValueError(
                f"kafka topic {cfg.topic!r} has {len(every)} partitions, fewer than the "
                f"{cfg.num_workers} workers sharing it: worker {cfg.worker_index} would read none "
                "(add partitions, or read with fewer workers)"
            )
        return every[cfg.worker_index :: cfg.num_workers]

    def _resolve_start(self, partitions: list[int]) -> None:
        """Each partition without a position starts at a concrete offset (the oldest record
        or the next to come), so that a state saved before it hands out any record is exact."""
        cfg = self.config
        for p in partitions:
            tp = self._ck.TopicPartition(cfg.topic, p)
            while True:
                try:
                    low, high = self._consumer.get_watermark_offsets(
                        tp, timeout=cfg.request_timeout_s, cached=False
                    )
                    break
                except self._ck.KafkaException as e:
                    self._wait.waiting(f"topic {cfg.topic!r} partition {p}'s offsets: {e}")
            self._next[p] = low if cfg.start == "earliest" else high
        self._wait.done()

    def _assign(self) -> None:
        """Fetches from each partition's position on; with a stop ahead, only from those
        short of it."""
        topic, stop = self.config.topic, self._stops[0] if self._stops else None
        self._consumer.assign(
            [
                self._ck.TopicPartition(topic, p, self._next[p])
                for p in self.partitions
                if stop is None or self._next[p] < stop[p]
            ]
        )

    def state(self) -> dict[str, Any]:
        """Where the reader is: the offset of the next record it will hand out in each
        partition of its share. Plain data (strings and ints), for a checkpoint to hold."""
        offsets = {str(p): self._next[p] for p in self.partitions}
        return {"source": SOURCE, "topic": self.config.topic, "offsets": offsets}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Goes back to ``state`` (this reader's, or :func:`merge_states` of several): each
        partition of this worker's share at its offset there; one the state does not hold at
        ``config.start``. Partitions of other workers' shares in it are left to them.

        Raises:
            ValueError: for a state that is not a Kafka reader's, or of another topic.
        """
        checked = checked_state(state, self.config.topic)
        missing = [p for p in self.partitions if p not in checked["offsets"]]
        for p in self.partitions:
            if p in checked["offsets"]:
                self._next[p] = checked["offsets"][p]
        if missing:
            self._resolve_start(missing)
        self._assign()

    def stop_at(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Reads hand out no record past ``states[0]`` until the reader is there, then none
        past ``states[1]``, and so on: a replay that ends exactly where a position saved
        before did (:mod:`psflow.train.input_position`). ``[]``: no stop.

        Raises:
            ValueError: for a state that is not this reader's, lacks one of its partitions, or
                is behind the position before it.
        """
        self._stops = checked_stops(states, self.config.topic, self.partitions, self._next)
        self._passed_stops()
        self._assign()

    def _passed_stops(self) -> bool:
        """Drops the stops the reader has reached; whether it did (or must seek back)."""
        changed, self._reseek = self._reseek, False
        while self._stops and all(self._next[p] >= self._stops[0][p] for p in self.partitions):
            self._stops.pop(0)
            changed = True
        return changed

    def _before_read(self) -> None:
        if self._passed_stops():
            self._assign()

    # -- reading -----------------------------------------------------------------------------

    def read(self, max_records: int = 500, timeout_s: float | None = None) -> list[StreamRecord]:
        """Up to ``max_records`` records, each parsed by the reader's parser, waiting at most
        ``timeout_s`` (``config.poll_timeout_s`` by default) for the first; ``[]`` if none came.
        The position moves past every record returned (and every bad record skipped)."""
        self._before_read()
        messages = self._fetch(max_records, timeout_s)
        out, moved = [], {}
        for i, m in enumerate(messages):
            p, off = m.partition(), m.offset()
            moved[p] = off + 1
            try:
                value = m.value() if self.parser is None else self.parser(m.value())
            except Exception as e:  # the user's parser: any failure is this record's
                self._bad(messages, i, f"{type(e).__name__}: {e}")
                continue
            out.append(StreamRecord(p, off, value))
        self._next.update(moved)
        self.stats["records"] += len(out)
        return out

    def read_examples(
        self, batch_size: int, spec: Mapping[str, FeatureSpec], timeout_s: float | None = None
    ) -> dict[str, Any] | None:
        """A batch of ``tf.train.Example`` records parsed by ``spec``
        (:func:`psflow.data.parse_examples`, numpy), up to ``batch_size`` records: as many as
        came within ``timeout_s`` (``config.poll_timeout_s`` by default) of the first, which it
        waits for as long; ``None`` if none came. Bad records are dealt with as
        ``config.on_bad_record`` says."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self._before_read()
        wait = self.config.poll_timeout_s if timeout_s is None else timeout_s
        messages = self._fetch(batch_size, wait)
        deadline = time.monotonic() + wait
        while messages and len(messages) < batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            more = self._fetch(batch_size - len(messages), left)
            if not more:
                break
            messages += more
        if not messages:
            return None
        moved = {m.partition(): m.offset() + 1 for m in messages}  # in each one's order
        values = [m.value() for m in messages]
        parsed, good = parse_batch(values, spec, lambda i, why: self._bad(messages, i, why))
        self._next.update(moved)
        self.stats["records"] += good
        return parsed

    def _bad(self, messages: list[Any], i: int, reason: str) -> None:
        m = messages[i]
        p, off = m.partition(), m.offset()
        if self.config.on_bad_record == "raise":
            # Records before it in this fetch were not handed out: fetched again later.
            self._assign()
            raise BadRecordError(self.config.topic, p, off, reason)
        self.stats["bad_records"] += 1
        log.warning(
            "kafka topic %r partition %d offset %d: skipped a record that does not parse: %s",
            self.config.topic, p, off, reason,
        )  # fmt: skip

    def _fetch(self, max_records: int, timeout_s: float | None) -> list[Any]:
        """The next records of the share, at most ``timeout_s`` waited; errors on them raised
        with the topic, partition and offset named, a missing broker or topic waited for."""
        if self._closed:
            raise RuntimeError(f"kafka reader of {self.config.topic!r} is closed")
        wait = self.config.poll_timeout_s if timeout_s is None else timeout_s
        messages = self._consumer.consume(num_messages=max_records, timeout=wait)
        out = []
        for m in messages:
            err = m.error()
            if err is None:
                out.append(m)
            elif err.code() == self._ck.KafkaError._AUTO_OFFSET_RESET:
                p = m.partition()
                at = None if p is None else self._next.get(p)
                raise RuntimeError(
                    f"kafka topic {self.config.topic!r} partition {p}: offset {at} is "
                    f"no longer on the broker ({err.str()}): the records there were deleted "
                    "(retention) or lost, so reading on would skip them; restore an earlier "
                    "state, or restore one without this partition to start it from "
                    "config.start"
                )
            elif err.code() == self._ck.KafkaError.UNKNOWN_TOPIC_OR_PART:
                self._wait.error = f"topic {self.config.topic!r}: {err.str()}"
            elif err.fatal():
                raise RuntimeError(f"kafka topic {self.config.topic!r}: {err.str()}")
            else:
                self._wait.error = err.str()
        if self._stops:  # none past the stop; its partition is sought back before the next read
            stop = self._stops[0]
            kept = [m for m in out if short_of(m.partition(), m.offset(), stop)]
            self._reseek |= len(kept) < len(out)
            out = kept
        # Records may come from what the client fetched before the broker went: only a broker
        # that answers ends a wait.
        if self._wait.error is not None:
            if not out:
                self._wait.waiting(self._wait.error, sleep=False)
            if self._wait.since is not None and self._broker_answers():
                self._wait.done()
        return out

    def _broker_answers(self) -> bool:
        """Whether the broker gives the topic's metadata now (asked at most once a poll)."""
        now = time.monotonic()
        if now - self._probed_at < self.config.poll_timeout_s:
            return False
        self._probed_at = now
        topic = self.config.topic
        try:
            md = self._consumer.list_topics(topic, timeout=self.config.poll_timeout_s)
        except self._ck.KafkaException:
            return False
        found = md.topics.get(topic)
        return found is not None and found.error is None and bool(found.partitions)

    # -- waiting for a broker ----------------------------------------------------------------

    @property
    def waiting_for(self) -> str | None:
        """Whom the reader is waiting for now (the client's last error), ``None`` if no one."""
        return self._wait.waiting_for

    def _where(self) -> str:
        """The share and its offsets, for a wait's log (not known before the broker names them)."""
        partitions = self.partitions if hasattr(self, "partitions") else "not known yet"
        return f"partitions {partitions} at offsets {getattr(self, '_next', {})}"

    def close(self) -> None:
        """Leaves the broker (commits nothing: the position is :meth:`state`'s)."""
        if not self._closed:
            self._closed = True
            self._consumer.close()

    def __enter__(self) -> KafkaReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
