"""A Kafka reader's position as plain data: each partition's next offset, checked and merged.

A :class:`~psflow.data.kafka.KafkaReader`'s :meth:`~psflow.data.kafka.KafkaReader.state` is
``{"source": "kafka", "topic": ..., "offsets": {"0": 17, ...}}``, the offset of the next record to
hand out in each partition of its share. Here is what reads such states back, untrusted (a
checkpoint's): each checked, the states of all workers merged into one (:func:`merge_states`),
and the stops of a replay (:meth:`~psflow.data.kafka.KafkaReader.stop_at`) checked against the
reader's share. Nothing here talks to a broker.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SOURCE = "kafka"
"""The ``source`` of a Kafka reader's state."""


def merge_states(states: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The states of the readers sharing one topic as one (each partition's offset from the
    reader that holds it), which any number of readers can
    :meth:`~psflow.data.kafka.KafkaReader.restore` from."""
    topic: str | None = None
    offsets: dict[str, int] = {}
    for state in states:
        checked = checked_state(state, topic)
        topic = checked["topic"]
        for p, off in checked["offsets"].items():
            if str(p) in offsets:
                raise ValueError(f"kafka states: partition {p} of {topic!r} is in two of them")
            offsets[str(p)] = off
    if topic is None:
        raise ValueError("kafka states: none given")
    return {"source": SOURCE, "topic": topic, "offsets": offsets}


def checked_state(state: Mapping[str, Any], topic: str | None) -> dict[str, Any]:
    if not isinstance(state, Mapping) or state.get("source") != SOURCE:
        raise ValueError(f"not a kafka reader's state: {state!r:.200}")
    name = state.get("topic")
    if not isinstance(name, str) or (topic is not None and name != topic):
        raise ValueError(f"kafka state: topic {name!r}, expected {topic!r}")
    offsets = state.get("offsets")
    if not isinstance(offsets, Mapping):
        raise ValueError(
            f"kafka state of {name!r}: offsets must be a mapping, got {offsets!r:.200}"
        )
    out: dict[int, int] = {}
    for p, off in offsets.items():
        # An int, or one written as JSON writes a key: its canonical digits only ('01' and
        # '1_0', which int() takes, would name partition 1 twice, or partition 10).
        if isinstance(p, int) and not isinstance(p, bool):
            part = p
        elif isinstance(p, str) and p.isascii() and p.isdigit() and str(int(p)) == p:
            part = int(p)
        else:
            raise ValueError(f"kafka state of {name!r}: partition {p!r} is not a number")
        if isinstance(off, bool) or not isinstance(off, int) or off < 0 or part < 0:
            raise ValueError(f"kafka state of {name!r}: partition {p!r} offset {off!r} is invalid")
        if part in out:
            raise ValueError(f"kafka state of {name!r}: partition {part} given twice")
        out[part] = off
    return {"topic": name, "offsets": out}


def checked_stops(
    states: Sequence[Mapping[str, Any]],
    topic: str,
    partitions: list[int],
    at: Mapping[int, int],
) -> list[dict[int, int]]:
    """``states`` as a reader's stops, each partition of its share's offset to stop before:
    each must hold every partition of ``partitions`` and be behind none of the position
    before it (the first: ``at``, where the reader is)."""
    stops: list[dict[int, int]] = []
    for state in states:
        offsets = checked_state(state, topic)["offsets"]
        missing = [p for p in partitions if p not in offsets]
        if missing:
            raise ValueError(
                f"kafka stop of {topic!r}: no offset for partition(s) {missing} "
                "of this reader's share"
            )
        behind = [p for p in partitions if offsets[p] < at[p]]
        if behind:
            raise ValueError(
                f"kafka stop of {topic!r}: partition {behind[0]} at offset "
                f"{offsets[behind[0]]}, behind {at[behind[0]]} where the reader will be"
            )
        at = {p: offsets[p] for p in partitions}
        stops.append(at)
    return stops


def short_of(partition: int | None, offset: int | None, stop: Mapping[int, int]) -> bool:
    """Whether a record is short of ``stop`` (each partition's offset to stop before)."""
    return partition is not None and offset is not None and offset < stop.get(partition, 0)
