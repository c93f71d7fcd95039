"""Writing records into a Kafka topic at a set rate: what feeds a job that trains from a stream.

:func:`produce` sends each record (``tf.train.Example`` bytes, or any bytes) to the topic's
partitions in turn, at most :attr:`ProducerConfig.rate` a second, and returns once the broker
has acknowledged every one; ``psflow data produce FILES`` sends TFRecord files' records this
way (the CTR layout's from ``psflow data synth-ctr`` for ``examples/online_ctr.py``). The topic
is created with :attr:`ProducerConfig.partitions` partitions when the broker does not have it.

Every wait is bounded: a broker that does not answer, or does not acknowledge, is named in a
``TimeoutError``; a record it refuses, in a ``RuntimeError`` with the broker's reason.

The client is confluent-kafka (librdkafka), ``pip install psflow[kafka]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ProducerConfig:
    """Where records go and how fast."""

    brokers: str
    """Bootstrap brokers, ``host:port[,host:port...]``."""
    topic: str
    """The topic to write."""
    partitions: int = 4
    """The topic's partitions when it is created here (an existing topic keeps its own); at
    least as many as the workers that will read it."""
    rate: float | None = None
    """Records a second at most; ``None``: as fast as the broker takes them."""
    request_timeout_s: float = 10.0
    """The longest a metadata or topic request to the broker waits."""
    flush_timeout_s: float = 30.0
    """The longest the end waits for the broker to acknowledge what is in flight."""

    def __post_init__(self) -> None:
        if not self.brokers or not isinstance(self.brokers, str):
            raise ValueError(
                f"ProducerConfig: brokers must be 'host:port[,...]', got {self.brokers!r}"
            )
        if not self.topic:
            raise ValueError("ProducerConfig: topic is empty")
        if type(self.partitions) is not int or self.partitions < 1:
            raise ValueError(f"ProducerConfig: partitions must be >= 1, got {self.partitions!r}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"ProducerConfig: rate must be > 0 or None, got {self.rate!r}")
        for name in ("request_timeout_s", "flush_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ProducerConfig: {name} must be > 0, got {getattr(self, name)!r}")


def _client() -> tuple[Any, Any]:
    try:
        import confluent_kafka
        from confluent_kafka import admin
    except ImportError as e:  # an extra
        raise ImportError(
            "psflow.data.kafka_producer needs confluent-kafka: pip install 'psflow[kafka]'"
        ) from e
    return confluent_kafka, admin


def ensure_topic(config: ProducerConfig) -> int:
    """Creates the topic with ``config.partitions`` partitions unless the broker has it;
    returns its number of partitions.

    Raises:
        TimeoutError: naming the broker, when it does not answer within the request timeout.
    """
    ck, admin = _client()
    client = admin.AdminClient(
        {
            "bootstrap.servers": config.brokers,
            "socket.timeout.ms": int(config.request_timeout_s * 1000),
        }
    )
    timeout = config.request_timeout_s
    try:
        # Every topic's metadata: asking for this one alone makes some brokers (Tansu) create
        # it with their default partitions.
        topics = client.list_topics(timeout=timeout).topics
    except ck.KafkaException as e:
        raise TimeoutError(
            f"kafka broker {config.brokers} did not answer within {timeout} s: {e}"
        ) from None
    meta = topics.get(config.topic)
    if meta is not None and meta.error is None and meta.partitions:
        return len(meta.partitions)
    new = admin.NewTopic(config.topic, num_partitions=config.partitions, replication_factor=1)
    futures = client.create_topics([new], operation_timeout=timeout, request_timeout=timeout)
    try:
        futures[config.topic].result(timeout=timeout + 5)
    except ck.KafkaException as e:
        if e.args[0].code() != ck.KafkaError.TOPIC_ALREADY_EXISTS:  # made meanwhile: fine
            raise RuntimeError(
                f"kafka broker {config.brokers}: cannot create topic {config.topic!r}: {e}"
            ) from None
    log.info(
        "created topic %r with %d partitions on %s", config.topic, config.partitions, config.brokers
    )
    return config.partitions


def produce(
    records: Iterable[bytes],
    config: ProducerConfig,
    *,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Sends ``records`` to the topic, partition ``i % partitions`` for the ``i``-th, at most
    ``config.rate`` a second; returns how many the broker acknowledged (all of them).

    ``progress`` is called with the count sent so far about once a second.

    Raises:
        TimeoutError: naming the broker, when it does not answer or acknowledge in time.
        RuntimeError: when it refuses a record (its reason and the record's number).
    """
    ck, _ = _client()
    partitions = ensure_topic(config)
    failed: list[str] = []
    acked = 0

    def delivered(err: Any, msg: Any) -> None:
        nonlocal acked
        if err is not None:
            failed.append(f"partition {msg.partition()}: {err}")
        else:
            acked += 1

    producer = ck.Producer(
        {
            "bootstrap.servers": config.brokers,
            "linger.ms": 5,
            "message.timeout.ms": int(config.flush_timeout_s * 1000),
            "socket.timeout.ms": int(config.request_timeout_s * 1000),
        }
    )
    start = last_report = time.monotonic()
    sent = 0
    for value in records:
        if config.rate is not None:
            ahead = start + sent / config.rate - time.monotonic()
            if ahead > 0:
                producer.poll(ahead)  # serves delivery reports while it waits
        while True:
            try:
                producer.produce(
                    config.topic, value, partition=sent % partitions, on_delivery=delivered
                )
                break
            except BufferError:  # the client's queue is full: let the broker catch up
                if producer.poll(config.request_timeout_s) == 0 and not acked:
                    raise TimeoutError(
                        f"kafka broker {config.brokers} took none of the records within "
                        f"{config.request_timeout_s} s"
                    ) from None
        sent += 1
        producer.poll(0)
        if failed:
            raise RuntimeError(
                f"kafka broker {config.brokers} refused a record of topic {config.topic!r}: {failed[0]}"
            )
        now = time.monotonic()
        if progress is not None and now - last_report >= 1.0:
            progress(sent)
            last_report = now
    left = producer.flush(config.flush_timeout_s)
    if failed:
        raise RuntimeError(
            f"kafka broker {config.brokers} refused a record of topic {config.topic!r}: {failed[0]}"
        )
    if left:
        raise TimeoutError(
            f"kafka broker {config.brokers}: {left} of {sent} records not acknowledged within "
            f"{config.flush_timeout_s} s"
        )
    return acked
