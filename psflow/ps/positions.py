"""Where each worker's input stands on one shard: the part of a push that makes it exactly once.

A worker that trains from a stream (:mod:`psflow.train.input_position`) numbers its pushes
(:attr:`~psflow.protocol.Key.INPUT_SEQ`, higher for each) and sends with each its reader's
position past the batch (:attr:`~psflow.protocol.Key.INPUT_POSITION`). The shard applies a push
and records ``(seq, position)`` for its sender in one request, and drops a push whose number it
has recorded already (a restarted worker replaying what the shard holds). The record goes into
the shard's checkpoint with the rows it belongs to (metadata ``psflow.inputs``), so that after a
restore the positions match the rows; a restarted worker asks every shard where it stands
(``status``) and reads on from there. A shard whose state was set again since a worker asked
(a restore from a checkpoint, a restart) refuses that worker's next push
(:class:`~psflow.ps.errors.InputOvertakenError`, :meth:`InputPositions.applied`), so that it
asks again rather than read on past what the shard lost.

Positions are plain data (maps, lists, strings, numbers), checked like anything received: a
position the shard cannot keep is refused before anything changes.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from psflow.protocol import Key
from psflow.protocol.messages import MAX_INPUT_DEPTH, InputMark, input_key, input_name
from psflow.ps import safefile
from psflow.ps.errors import InputOvertakenError

log = logging.getLogger(__name__)


MAX_POSITION_BYTES = 1 << 20
"""The largest position a shard keeps, as JSON (a reader's state is a few offsets or paths)."""

METADATA_KEY = "psflow.inputs"
"""The shard file metadata that holds the positions: ``{task: [seq, position]}`` as JSON."""


def input_mark(header: Mapping[str, Any]) -> tuple[InputMark, int] | None:
    """A push header's input number and position, and the shard epoch its sender learnt them
    against, checked; ``None`` if it carries none.

    Raises:
        ValueError: saying what is wrong with them.
    """
    seq = header.get(Key.INPUT_SEQ)
    if seq is None:
        for key in (Key.INPUT_POSITION, Key.INPUT_EPOCH):
            if key in header:
                raise ValueError(f"'{key}' comes without '{Key.INPUT_SEQ}'")
        return None
    position = checked_position(header.get(Key.INPUT_POSITION), f"'{Key.INPUT_POSITION}'")
    seq = checked_seq(header.get(Key.INPUT_SEQ), f"'{Key.INPUT_SEQ}'")
    return (seq, position), _number(header, Key.INPUT_EPOCH)


def pushed_input(
    inputs: InputPositions, header: Mapping[str, Any], sender: str, shard: int
) -> tuple[InputMark | None, bool]:
    """A push's input number and position (``None`` when it carries no
    :attr:`Key.INPUT_SEQ`), and whether the shard holds that input already: a restarted
    worker's replay, dropped (what the shard applied then stays, and the reply is as for any
    push). The caller records the mark (:meth:`InputPositions.record`) with the update.

    Raises:
        ValueError: for a malformed position (:func:`input_mark`).
        InputOvertakenError: as :meth:`InputPositions.applied`.
    """
    given = input_mark(header) if Key.INPUT_SEQ in header else None
    if given is None:
        return None, False
    mark, epoch = given
    if inputs.applied(sender, mark[0], epoch):
        log.info(
            "shard %d: %s's input %s is applied already: push dropped",
            shard, sender, input_name(mark[0]),
        )  # fmt: skip
        return mark, True
    return mark, False


def _number(header: Mapping[str, Any], key: Key) -> int:
    value = header.get(key)
    if not _count(value):
        raise ValueError(f"'{key}' must be an integer in [0, 2**63), got {value!r:.80}")
    assert isinstance(value, int)
    return value


def _count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < 1 << 63


def checked_seq(seq: Any, what: str) -> tuple[int, ...]:
    """``seq`` as an input number: 1 to :data:`MAX_INPUT_DEPTH` integers in [0, 2**63)."""
    if (
        not isinstance(seq, list | tuple)
        or not 1 <= len(seq) <= MAX_INPUT_DEPTH
        or not all(_count(n) for n in seq)
    ):
        raise ValueError(
            f"{what} must be a list of 1 to {MAX_INPUT_DEPTH} integers in [0, 2**63), "
            f"got {seq!r:.80}"
        )
    return tuple(seq)


def checked_position(position: Any, what: str) -> dict[str, Any]:
    """``position`` if it is a map of plain data no larger than :data:`MAX_POSITION_BYTES`."""
    if not isinstance(position, dict):
        raise ValueError(f"{what} must be a map (a reader's state), got {position!r:.80}")
    try:
        size = len(json.dumps(position, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{what} is not plain data: {e}") from None
    if size > MAX_POSITION_BYTES:
        raise ValueError(f"{what} is {size} bytes as JSON, over {MAX_POSITION_BYTES}")
    return position


class InputPositions:
    """Per sending task, the last input this shard applied: ``(seq, position)``."""

    def __init__(self, marks: Mapping[str, InputMark] | None = None) -> None:
        self.marks: dict[str, InputMark] = dict(marks or {})
        self.epoch = secrets.randbits(62)
        """Drawn anew with every state of the shard (these positions are made with it)."""

    def applied(self, task: str, seq: tuple[int, ...], epoch: int) -> bool:
        """Whether a push of ``task`` numbered ``seq``, learnt against shard state ``epoch``,
        is one this shard holds already (a replay: dropped, answered as any push).

        Raises:
            InputOvertakenError: ``epoch`` is not this state's (a restore or a restart since
                the worker asked where it stands): it must ask again.
        """
        if epoch != self.epoch:
            raise InputOvertakenError(
                f"{task}'s input position is of an earlier state of this shard (restored from "
                "a checkpoint, or restarted, since): ask where the input stands again"
            )
        mark = self.marks.get(task)
        return mark is not None and input_key(seq) <= input_key(mark[0])

    def record(self, task: str, mark: InputMark) -> None:
        self.marks[task] = mark

    def of(self, task: str) -> list[Any] | None:
        """``[seq, position]`` of ``task``'s last applied push, as a status reply says it."""
        mark = self.marks.get(task)
        return None if mark is None else [list(mark[0]), mark[1]]

    def to_metadata(self) -> str:
        return json.dumps({t: [list(s), p] for t, (s, p) in sorted(self.marks.items())})

    @classmethod
    def from_metadata(cls, text: str, source: str) -> InputPositions:
        """Positions as a shard file's metadata holds them.

        Raises:
            ValueError: naming ``source`` when they are not ``{task: [seq, position]}``.
        """
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{source}: {METADATA_KEY} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{source}: {METADATA_KEY} is not a map of tasks")
        marks: dict[str, InputMark] = {}
        for task, entry in data.items():
            if not isinstance(entry, list) or len(entry) != 2:
                raise ValueError(
                    f"{source}: {METADATA_KEY} of {task!r} is not [seq, position]: {entry!r:.80}"
                )
            seq = checked_seq(entry[0], f"{source}: {task}'s input number")
            marks[task] = (seq, checked_position(entry[1], f"{source}: {task}'s position"))
        return cls(marks)


def read_positions(
    url: str, root: str | None = None, metadata: Mapping[str, str] | None = None
) -> InputPositions:
    """The positions a shard file holds (none for a file saved without them): its
    ``metadata`` where read already, else its header alone is read."""
    meta = safefile.read_metadata(url, root) if metadata is None else metadata
    text = meta.get(METADATA_KEY)
    return InputPositions() if text is None else InputPositions.from_metadata(text, url)


def restored_positions(
    urls: Sequence[str],
    shard: int,
    num_shards: int,
    root: str | None = None,
    metadata: Sequence[Mapping[str, str]] | None = None,
) -> InputPositions:
    """Shard ``shard``'s positions after a restore from the checkpoint files ``urls``: its own
    file's, when the checkpoint has as many shards; else (the rows re-sharded) each task's
    lowest over all files, where a worker reads on from: rows of the shards that were ahead
    get the inputs between again (logged). ``metadata``: each file's, where the restore read
    it with the rows (:func:`~psflow.ps.tables.restore_tables`); else each header is read."""
    if not urls:
        return InputPositions()
    metas: Sequence[Mapping[str, str] | None] = [None] * len(urls) if metadata is None else metadata
    if len(metas) != len(urls):
        raise ValueError(f"{len(metas)} files' metadata for {len(urls)} shard files")
    if len(urls) == num_shards:
        return read_positions(urls[shard], root, metas[shard])
    every = [read_positions(u, root, m) for u, m in zip(urls, metas, strict=True)]
    tasks = set().union(*(p.marks for p in every))
    marks: dict[str, InputMark] = {}
    for task in sorted(tasks):
        seen = [p.marks.get(task) for p in every]
        held = [m for m in seen if m is not None]
        if len(held) < len(seen):
            log.warning(
                "shard %d: %s's input position is missing from some of the checkpoint's %d "
                "shard files (re-sharded to %d): it reads its input from the start again",
                shard, task, len(urls), num_shards,
            )  # fmt: skip
            continue
        lowest = min(held, key=lambda m: input_key(m[0]))
        if any(m[0] != lowest[0] for m in held):
            log.warning(
                "shard %d: the checkpoint's %d shards hold %s's input at different points and "
                "are re-sharded to %d: it reads on from the earliest, and rows of the shards "
                "that were ahead get those inputs again",
                shard, len(urls), task, num_shards,
            )  # fmt: skip
        marks[task] = lowest
    return InputPositions(marks)
