"""Exactly-once input: a reader's position kept by the ps with the updates it led to.

Given the reader its loop reads from (``TrainingSession(model, ctx, input=reader)``: a
:class:`~psflow.data.KafkaReader`, a :class:`~psflow.data.FileStreamReader`, or anything with
their :class:`PositionedReader` methods), the session numbers each step's input and sends the
reader's position past the batch with the step's push. Every shard keeps the pair with the
update, in the same request, and in its checkpoint (:mod:`psflow.ps.positions`). So whatever
stops (a worker killed, the chief, a ps restored from its last checkpoint), the rows and the
positions the shards hold belong together, and a worker that starts again (or recovers from a
lost ps) asks every shard where its input stands and reads on from there: no record trained
twice, none skipped.

Shards can stand at different inputs of one worker: it may die between its pushes to two of
them, and a checkpoint's shards are taken at their own moments. The reader then goes back to
the earliest and reads up to each later position in turn (the reader's ``stop_at``): the
records up to the next position make one input again (in batches of the loop's size), which
the shards that hold it drop and the others apply. Numbers (:attr:`~psflow.protocol.Key.
INPUT_SEQ`, ordered by :func:`~psflow.protocol.messages.input_key`): input ``k`` of a worker is
``[k]``; the batches that replay the records up to a position numbered ``T`` are ``T + [0]``,
``T + [1]``, ..., the last one ``T`` itself: above the number of any shard behind, not above
what the shards at ``T`` hold. A replay cut short and replayed again goes one level deeper, so
however the batches fall (a stream's read may give fewer records than asked) there is always a
number between.

Asynchronous training and bounded staleness keep positions; synchronous training does not (a
step's gradients may be dropped as stale), nor all-reduce mode.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from psflow.protocol.messages import MAX_INPUT_DEPTH, InputMark, input_key, input_name
from psflow.worker import DistributedOptimizer

log = logging.getLogger("psflow.train.session")

Mark = InputMark
"""An input's number and the reader's position past it."""


class PositionedReader(Protocol):
    """What a session needs of its reader: a position as plain data, a way back to one, and
    reads that stop at given positions."""

    def state(self) -> dict[str, Any]:
        """The position past every record handed out."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        """Goes back to ``state``."""
        ...

    def stop_at(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Reads hand out no record past ``states[0]`` until the reader is there, then none
        past ``states[1]``, and so on (each a later position than the one before)."""
        ...


def same_position(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two positions are one (one may have crossed the wire: lists, string keys)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def plan(marks: Sequence[Mark | None]) -> tuple[Mark | None, list[Mark]]:
    """From each shard's last input of a worker: where its reader goes back to (``None``:
    where it starts, as some shard has none) and the later positions it reads up to in turn.

    Raises:
        ValueError: when two shards hold one number at different positions (not one reader's
            inputs).
    """
    by_seq: dict[tuple[int, ...], dict[str, Any]] = {}
    for mark in marks:
        if mark is None:
            continue
        seq, position = mark
        if seq in by_seq and not same_position(by_seq[seq], position):
            raise ValueError(
                f"two shards hold input {input_name(seq)} at different positions "
                f"({by_seq[seq]!r:.200} and {position!r:.200}): not the inputs of one reader"
            )
        by_seq[seq] = position
    ordered = [(seq, by_seq[seq]) for seq in sorted(by_seq, key=input_key)]
    if not ordered:
        return None, []
    if any(m is None for m in marks):
        return None, ordered
    return ordered[0], ordered[1:]


def number_toward(last: tuple[int, ...] | None, target: tuple[int, ...]) -> tuple[int, ...]:
    """The number of a batch that replays records short of ``target``'s position, the one
    after ``last`` (``None``: the first input): above ``last``, below ``target``."""
    depth = len(target)
    if last is not None and len(last) > depth and last[:depth] == target:
        return (*target, last[depth] + 1)  # a replay toward target, cut short before: on
    if depth >= MAX_INPUT_DEPTH:
        raise RuntimeError(
            f"input {input_name(target)}: replays nested {depth} deep, past {MAX_INPUT_DEPTH}"
        )
    return (*target, 0)


class InputTracker:
    """Numbers a session's inputs and keeps its reader where the shards stand.

    Args:
        reader: the loop's reader.
        task: the session's task, for the log.
    """

    def __init__(self, reader: PositionedReader, task: str) -> None:
        for method in ("state", "restore", "stop_at"):
            if not callable(getattr(reader, method, None)):
                raise TypeError(
                    f"input=: {type(reader).__name__} has no {method}(): a reader with "
                    "state(), restore() and stop_at() (KafkaReader, FileStreamReader) keeps "
                    "its position with the ps"
                )
        self.reader = reader
        self.task = task
        self.first = reader.state()
        """Where the reader started: where it goes back to when some shard holds none of its
        inputs."""
        self.last: tuple[int, ...] | None = None
        """The number of the last input marked (``None``: none yet)."""
        self.ahead: list[Mark] = []
        """Positions some shards hold past where the reader is, in order: read up to each."""

    def resume(self, opt: DistributedOptimizer) -> None:
        """Puts the reader where the shards stand (asked through ``opt``): at the earliest of
        this task's inputs they hold, reading up to each later one in turn."""
        start, ahead = plan(opt.input_positions())
        self.reader.restore(self.first if start is None else start[1])
        self.reader.stop_at([position for _, position in ahead])
        self.ahead = ahead
        self.last = None if start is None else start[0]
        if start is None and not ahead:
            return
        where = "its start" if start is None else f"input {input_name(start[0])}"
        replay = (
            f"; replaying up to input {input_name(ahead[-1][0])}, which some shards hold already"
            if ahead
            else ""
        )
        log.info("%s: reading on from %s%s", self.task, where, replay)

    def mark(self, opt: DistributedOptimizer) -> None:
        """Numbers the input of the step about to be pushed, and gives ``opt`` its number and
        the reader's position past it."""
        position = self.reader.state()
        if self.ahead:
            seq, target = self.ahead[0]
            if same_position(position, target):
                self.ahead.pop(0)
            else:  # a batch short of the next position the shards hold
                seq = number_toward(self.last, seq)
        else:
            seq = (1,) if self.last is None else (self.last[0] + 1,)
        self.last = seq
        opt.mark_input(seq, position)
