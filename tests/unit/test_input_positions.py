"""Exactly-once input, the parts without processes: the numbering and replay plan of
psflow.train.input_position, a file stream's reads that stop at saved positions, and the
positions a shard keeps, checks and saves (psflow.ps.positions)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from psflow.data import write_records
from psflow.data.stream import FileStreamConfig, FileStreamReader
from psflow.protocol import Key, OptimizerSpec
from psflow.protocol.messages import input_key
from psflow.ps import safefile
from psflow.ps.positions import (
    METADATA_KEY,
    InputPositions,
    input_mark,
    read_positions,
    restored_positions,
)
from psflow.ps.shard_file import decode_shard, encode_shard, shard_file_name, snapshot
from psflow.ps.store import ShardStore
from psflow.train.input_position import InputTracker, plan

pytestmark = pytest.mark.unit


def pos(n: int) -> dict[str, Any]:
    return {"source": "test", "at": n}


def whole(k: int) -> tuple[int, ...]:
    return (k,)


# -- the plan and the numbers ------------------------------------------------------------------


def test_the_plan_goes_back_to_the_earliest_input_and_reads_up_to_each_later_one() -> None:
    assert plan([None, None]) == (None, [])
    assert plan([(whole(4), pos(4)), (whole(4), pos(4))]) == ((whole(4), pos(4)), [])
    marks = [(whole(6), pos(6)), (whole(4), pos(4)), (whole(5), pos(5)), (whole(6), pos(6))]
    assert plan(marks) == ((whole(4), pos(4)), [(whole(5), pos(5)), (whole(6), pos(6))])
    # A shard that holds none of the inputs: from the reader's start, up to each of them.
    assert plan([None, (whole(2), pos(2))]) == (None, [(whole(2), pos(2))])
    with pytest.raises(ValueError, match="input 4 at different positions"):
        plan([(whole(4), pos(4)), (whole(4), pos(5))])


class FakeReader:
    """A position that the test moves as reads would."""

    def __init__(self) -> None:
        self.at = 0
        self.stops: list[int] = []

    def state(self) -> dict[str, Any]:
        return pos(self.at)

    def restore(self, state: Mapping[str, Any]) -> None:
        self.at = int(state["at"])

    def stop_at(self, states: Sequence[Mapping[str, Any]]) -> None:
        self.stops = [int(s["at"]) for s in states]


class FakeOpt:
    def __init__(self, marks: list[tuple[tuple[int, ...], dict[str, Any]] | None]) -> None:
        self.marks = marks
        self.pushed: list[tuple[tuple[int, ...], dict[str, Any]]] = []

    def input_positions(self) -> list[tuple[tuple[int, ...], dict[str, Any]] | None]:
        return self.marks

    def mark_input(self, seq: tuple[int, ...], position: dict[str, Any]) -> None:
        self.pushed.append((seq, position))


def test_inputs_are_numbered_one_after_another_from_where_the_shards_stand() -> None:
    reader, opt = FakeReader(), FakeOpt([(whole(7), pos(70)), (whole(7), pos(70))])
    tracker = InputTracker(reader, "worker:0")
    tracker.resume(opt)  # type: ignore[arg-type]
    assert reader.at == 70 and reader.stops == []
    for at in (80, 90):
        reader.at = at
        tracker.mark(opt)  # type: ignore[arg-type]
    assert opt.pushed == [(whole(8), pos(80)), (whole(9), pos(90))]


def test_a_replay_is_numbered_below_what_the_shards_ahead_hold_and_above_the_others() -> None:
    # Shard 0 holds input 5, shard 1 input 7 (a worker killed between its pushes, or a
    # checkpoint's shards taken at their own moments).
    reader = FakeReader()
    opt = FakeOpt([(whole(5), pos(50)), (whole(7), pos(70))])
    tracker = InputTracker(reader, "worker:1")
    tracker.resume(opt)  # type: ignore[arg-type]
    assert reader.at == 50 and reader.stops == [70]
    for at in (58, 66, 70, 78):  # batches of 8 (the stop at 70 ends the third)
        reader.at = at
        tracker.mark(opt)  # type: ignore[arg-type]
    seqs = [s for s, _ in opt.pushed]
    assert seqs == [(7, 0), (7, 1), (7,), (8,)]
    for seq in seqs[:3]:  # shard 0 applies the replay, shard 1 drops it ...
        assert input_key((5,)) < input_key(seq) <= input_key((7,))
    assert input_key(seqs[3]) > input_key((7,))  # ... and both apply what follows


def test_a_replay_interrupted_goes_on_from_the_batch_a_shard_holds() -> None:
    # Shard 0 applied two batches of the replay up to input 7 before the worker died again.
    reader = FakeReader()
    opt = FakeOpt([((7, 1), pos(66)), ((7,), pos(70))])
    tracker = InputTracker(reader, "worker:1")
    tracker.resume(opt)  # type: ignore[arg-type]
    reader.at = 68  # a smaller batch than the first time: a number is still free
    tracker.mark(opt)  # type: ignore[arg-type]
    reader.at = 70
    tracker.mark(opt)  # type: ignore[arg-type]
    assert [s for s, _ in opt.pushed] == [(7, 2), (7,)]
    opt2 = FakeOpt([((7, 1), pos(66)), ((9,), pos(90))])
    tracker.resume(opt2)  # type: ignore[arg-type]
    reader.at = 70
    tracker.mark(opt2)  # type: ignore[arg-type]
    # Above the batch of input 7 that shard 0 holds, below input 9 that shard 1 holds.
    assert opt2.pushed[0][0] == (9, 0)


def test_a_replay_between_two_batches_of_a_replay_goes_a_level_deeper() -> None:
    # Shards at batches 0 and 1 of a replay up to input 9: however many batches the records
    # between take now (a stream's read may give fewer than asked), each gets a number between.
    reader = FakeReader()
    opt = FakeOpt([((9, 0), pos(50)), ((9, 1), pos(70))])
    tracker = InputTracker(reader, "worker:0")
    tracker.resume(opt)  # type: ignore[arg-type]
    for at in (55, 60, 65, 70):
        reader.at = at
        tracker.mark(opt)  # type: ignore[arg-type]
    seqs = [s for s, _ in opt.pushed]
    assert seqs == [(9, 1, 0), (9, 1, 1), (9, 1, 2), (9, 1)]
    keys = [input_key(s) for s in [(9, 0), *seqs]]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)


def test_a_reader_without_positions_is_refused() -> None:
    with pytest.raises(TypeError, match="has no state"):
        InputTracker(object(), "worker:0")  # type: ignore[arg-type]


# -- a file stream that stops at saved positions ----------------------------------------------


def land(directory: Path, k: int, n: int) -> None:
    hidden = directory / f".part-{k}.tmp"
    write_records(hidden, [f"{k}-{i}".encode() for i in range(n)])
    os.replace(hidden, directory / f"part-{k}.tfrecord")


def files_reader(directory: Path) -> FileStreamReader:
    cfg = FileStreamConfig(pattern=str(directory / "part-*.tfrecord"), poll_interval_s=0.01)
    return FileStreamReader(cfg, parser=bytes.decode)


@pytest.mark.parametrize("replay_batch", [3, 7, 100])
def test_a_file_stream_replays_exactly_up_to_each_saved_position(
    tmp_path: Path, replay_batch: int
) -> None:
    for k, n in enumerate([10, 4, 9]):
        land(tmp_path, k, n)
    first = files_reader(tmp_path)
    batches, states = [], [first.state()]
    # Batches of 5: one ends on file 0's last record (its end not seen yet), one spans files.
    while got := first.read(5, timeout_s=0.05):
        batches.append([r.value for r in got])
        states.append(first.state())
    assert states[2]["partial"] == {str(tmp_path / "part-0.tfrecord"): 10}

    again = files_reader(tmp_path)
    again.restore(states[1])
    again.stop_at([states[3], states[4]])
    read: list[list[str]] = []
    reached = []
    while got := again.read(replay_batch, timeout_s=0.05):
        read.append([r.value for r in got])
        reached.append(again.state())
        if again.state() == states[4]:
            break
    flat = [v for b in read for v in b]
    assert flat == [v for b in batches[1:4] for v in b]  # each record once, none past the stop
    assert states[3] in reached and reached[-1] == states[4]  # each stop exactly, never crossed
    rest = [r.value for r in again.read(100, timeout_s=0.05)]  # no stop left: on as before
    assert rest == [v for b in batches[4:] for v in b]


def test_a_file_stream_stop_behind_its_position_is_refused(tmp_path: Path) -> None:
    land(tmp_path, 0, 10)
    r = files_reader(tmp_path)
    early = r.state()
    r.read(5)
    with pytest.raises(ValueError, match="behind the position before it"):
        r.stop_at([early])


# -- what a shard keeps ------------------------------------------------------------------------


def push_header(**over: Any) -> dict[str, Any]:
    header: dict[str, Any] = {
        Key.INPUT_SEQ: [3],
        Key.INPUT_POSITION: pos(3),
        Key.INPUT_EPOCH: 12,
    }
    header.update(over)
    return {k: v for k, v in header.items() if v is not None}


def test_a_push_input_mark_is_checked() -> None:
    assert input_mark({}) is None
    assert input_mark(push_header()) == ((whole(3), pos(3)), 12)
    assert input_mark(push_header(**{Key.INPUT_SEQ: [3, 0, 7]}))[0][0] == (3, 0, 7)  # type: ignore[index]
    bad = [
        (push_header(**{Key.INPUT_SEQ: None}), "comes without 'input_seq'"),
        (push_header(**{Key.INPUT_SEQ: 3}), "'input_seq' must be a list of 1 to 16 integers"),
        (push_header(**{Key.INPUT_SEQ: [-1]}), "'input_seq' must be a list"),
        (push_header(**{Key.INPUT_SEQ: [True]}), "'input_seq' must be a list"),
        (push_header(**{Key.INPUT_SEQ: []}), "'input_seq' must be a list"),
        (push_header(**{Key.INPUT_SEQ: [1] * 17}), "'input_seq' must be a list"),
        (push_header(**{Key.INPUT_EPOCH: None}), "'input_epoch' must be an integer"),
        (push_header(**{Key.INPUT_POSITION: [1, 2]}), "must be a map"),
        (push_header(**{Key.INPUT_POSITION: {"x": "y" * (1 << 20)}}), "over 1048576"),
    ]
    for header, message in bad:
        with pytest.raises(ValueError, match=message):
            input_mark(header)


def shard_with_inputs(
    marks: dict[str, tuple[tuple[int, ...], dict[str, Any]]], shard: int, n: int
) -> bytes:
    store = ShardStore()
    store.initialize([("w", torch.zeros(2))], OptimizerSpec(name="SGD", kwargs={"lr": 0.1}))
    for task, mark in marks.items():
        store.inputs.record(task, mark)
    return encode_shard(snapshot(store, shard=shard, num_shards=n))


def test_positions_are_saved_with_the_shard_and_read_back(tmp_path: Path) -> None:
    marks = {"worker:0": (whole(5), pos(5)), "worker:1": (whole(9), pos(9))}
    data = shard_with_inputs(marks, 0, 1)
    assert decode_shard(data, "mem").inputs.marks == marks
    path = tmp_path / shard_file_name(0, 1)
    path.write_bytes(data)
    assert read_positions(str(path)).marks == marks
    # A shard no push with a position reached (or a file of psflow before them) holds none.
    plain = shard_with_inputs({}, 0, 1)
    assert METADATA_KEY.encode() not in plain[8 : 8 + int.from_bytes(plain[:8], "little")]
    path.write_bytes(plain)
    assert read_positions(str(path)).marks == {}


def test_restored_positions_are_the_shards_own_or_the_earliest_when_resharded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = []
    for shard, at in enumerate((5, 7)):
        path = tmp_path / shard_file_name(shard, 2)
        marks = {"worker:0": (whole(at), pos(at)), "worker:1": (whole(2), pos(2))}
        path.write_bytes(shard_with_inputs(marks, shard, 2))
        urls.append(str(path))
    assert restored_positions(urls, 1, 2).marks["worker:0"] == (whole(7), pos(7))
    merged = restored_positions(urls, 0, 1)  # two shards into one: the earliest of each task
    assert merged.marks == {"worker:0": (whole(5), pos(5)), "worker:1": (whole(2), pos(2))}
    assert "worker:0's input at different points" in caplog.text
    # The files' metadata as the restore read it with the rows: no header is read again.
    metadata = [safefile.read(u)[1] for u in urls]
    monkeypatch.setattr(safefile, "read_metadata", None)  # a call would fail
    assert restored_positions(urls, 0, 1, metadata=metadata).marks == merged.marks
    assert restored_positions(urls, 1, 2, metadata=metadata).marks["worker:0"][0] == whole(7)
    with pytest.raises(ValueError, match="1 files' metadata for 2 shard files"):
        restored_positions(urls, 0, 1, metadata=metadata[:1])


def test_positions_in_a_file_that_are_not_positions_are_refused() -> None:
    for text, message in [
        ("[1]", "not a map of tasks"),
        (json.dumps({"worker:0": [1]}), "is not \\[seq, position\\]"),
        (json.dumps({"worker:0": [[-1], {}]}), "input number must be a list"),
        (json.dumps({"worker:0": [1, {}]}), "input number must be a list"),
        (json.dumps({"worker:0": [[1], 2]}), "must be a map"),
        ("{", f"{METADATA_KEY} is not JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            InputPositions.from_metadata(text, "shard-0-of-1.safetensors")


# -- a cluster of one ----------------------------------------------------------------------------


def test_a_cluster_of_one_keeps_its_readers_position_in_its_checkpoints(tmp_path: Path) -> None:
    """Alone, the session keeps the position with its own updates: a run stopped after its
    last checkpoint and started again reads on from the checkpoint's position, so every
    record is trained once (rows start at 0, each record adds 1 to its own)."""
    import psflow
    from psflow.cluster.spec import TaskContext
    from psflow.data import FixedLenFeature, serialize_example
    from psflow.train import load_checkpoint

    spec = {"id": FixedLenFeature(dtype="int64")}
    data = tmp_path / "data"
    data.mkdir()
    for k in range(2):
        hidden = data / f".part-{k}.tmp"
        write_records(hidden, [serialize_example({"id": [i]}) for i in range(k * 24, k * 24 + 24)])
        os.replace(hidden, data / f"part-{k}.tfrecord")

    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rows = psflow.nn.Embedding(48, 1, init_std=0.0)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return -self.rows(ids).sum()

    def run(stop_after: int | None) -> list[int]:
        model = Counter()
        cfg = FileStreamConfig(pattern=str(data / "part-*.tfrecord"), poll_interval_s=0.01)
        reader = FileStreamReader(cfg)
        trained: list[int] = []
        sess = psflow.TrainingSession(
            model, TaskContext.alone(), optimizer="SGD", lr=1.0, input=reader,
            checkpoint_dir=str(tmp_path / "ckpt"), save_checkpoint_steps=2,
            log_step_count_steps=None, save_summaries_steps=None,
        )  # fmt: skip
        while (got := reader.read_examples(8, spec, timeout_s=0.05)) is not None:
            model(torch.as_tensor(got["id"])).backward()
            sess.step()
            sess.zero_grad()
            trained += got["id"].tolist()
            if stop_after is not None and sess.global_step == stop_after:
                sess.checkpointer.wait()  # type: ignore[union-attr]
                # "Killed": after the checkpoint of step 2, before its own save (a session
                # ended by an error saves nothing more, and lets go of its thread).
                sess.close(error=RuntimeError("killed"))
                return trained
        sess.close()  # a final checkpoint
        parts = load_checkpoint(str(tmp_path / "ckpt")).tables["rows"]  # type: ignore[union-attr]
        rows = torch.zeros(48)
        for part in parts:
            rows[part["ids"]] = part["values"].reshape(-1)
        assert rows.tolist() == [1.0] * 48, rows
        return trained

    first = run(stop_after=3)  # steps 1-3; the checkpoint at step 2 holds inputs 1 and 2
    second = run(stop_after=None)
    assert first[16:] == second[:8]  # input 3 again: its update was not in the checkpoint
    assert sorted(first[:16] + second) == list(range(48))

    # psflow checkpoint inspect says where the reader stood, from the shard file it checked:
    # the file's header is not read a second time.
    import argparse

    from psflow.ps import positions
    from psflow.train import cli

    again: list[str] = []
    read = positions.read_positions

    def counted(url: str, *args: Any, **kwargs: Any) -> positions.InputPositions:
        again.append(url)
        return read(url, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(io.StringIO()) as out:
        mp.setattr(positions, "read_positions", counted)
        cli.inspect(argparse.Namespace(dir=str(tmp_path / "ckpt"), name=None, json=False))
    shown = out.getvalue().split("input positions")[1].splitlines()[1]
    assert shown.startswith("  chief:0  input 6  {") and "part-1.tfrecord" in shown, shown
    assert again == []


@pytest.mark.parametrize("mode", ["sync", "allreduce"])
def test_modes_that_cannot_say_what_reached_the_optimizer_refuse_a_reader(
    tmp_path: Path, mode: str
) -> None:
    import psflow
    from psflow.cluster.ports import local_cluster
    from psflow.cluster.spec import TaskContext, TaskSpec

    cluster = local_cluster(0 if mode == "allreduce" else 1, 2)  # nothing is started
    ctx = TaskContext(cluster=cluster, task=TaskSpec(job="worker", index=0))
    reader = FileStreamReader(FileStreamConfig(pattern=str(tmp_path / "*.tfrecord")))
    with pytest.raises(ValueError, match=f"input=: {mode} training keeps no input positions"):
        psflow.TrainingSession(torch.nn.Linear(2, 1), ctx, mode=mode, input=reader)


def test_only_the_modes_whose_steps_all_reach_the_optimizer_keep_positions() -> None:
    from psflow.worker import AsyncEngine, StalenessEngine, SyncEngine
    from psflow.worker.allreduce import AllReduceEngine
    from psflow.worker.engine import KeepsInputPositions

    for kept in (AsyncEngine, StalenessEngine):
        assert issubclass(kept, KeepsInputPositions), kept
    for refused in (SyncEngine, AllReduceEngine):
        engine = object.__new__(refused)  # the refusal needs nothing the constructor makes
        with pytest.raises(ValueError, match="training keeps no input positions"):
            engine.input_positions()
        with pytest.raises(ValueError, match="training keeps no input positions"):
            engine.mark_input((1,), {})


# -- the whole protocol, simulated: shards, crashes between pushes, restores -------------------


class Stream:
    """Records 0..n-1 read in order, a position being the next record's index; reads stop at
    the positions given to stop_at, as the real readers' do."""

    def __init__(self, n: int) -> None:
        self.n, self.at, self.stops = n, 0, []  # type: ignore[var-annotated]

    def state(self) -> dict[str, Any]:
        return {"at": self.at}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.at = int(state["at"])

    def stop_at(self, states: Sequence[Mapping[str, Any]]) -> None:
        self.stops = [int(s["at"]) for s in states]

    def read(self, batch: int) -> list[int]:
        while self.stops and self.at >= self.stops[0]:
            self.stops.pop(0)
        end = min(self.n, self.at + batch, *self.stops[:1])
        out = list(range(self.at, end))
        self.at = end
        return out


class Shard:
    """What a ps does with a push: the drop rule and the record."""

    def __init__(self) -> None:
        self.mark: tuple[tuple[int, ...], dict[str, Any]] | None = None
        self.counts: dict[int, int] = {}

    def push(self, seq: tuple[int, ...], position: dict[str, Any], records: list[int]) -> None:
        if self.mark is not None and input_key(seq) <= input_key(self.mark[0]):
            return  # held already
        for r in records:
            self.counts[r] = self.counts.get(r, 0) + 1
        self.mark = (seq, dict(position))


class Job:
    """The job's shards as a worker's optimizer sees them (record r lives on shard r % n), and
    its checkpoints: each shard's snapshot taken at its own step (a save's skew), complete once
    all are in; a lost ps restores every shard from the latest complete one."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.shards = [Shard() for _ in range(n)]
        self.rng = rng
        self.pending: tuple[tuple[int, ...], dict[str, Any]] | None = None
        self.crash_after: int | None = None  # shards the next push reaches before a crash
        self.saving: list[Any] | None = None
        self.latest: list[Any] | None = None

    def input_positions(self) -> list[tuple[tuple[int, ...], dict[str, Any]] | None]:
        return [s.mark for s in self.shards]

    def mark_input(self, seq: tuple[int, ...], position: dict[str, Any]) -> None:
        self.pending = (seq, position)

    def step(self, records: list[int]) -> bool:
        """The push of ``records`` (whether it reached every shard), then a save's next
        snapshot if one is under way."""
        assert self.pending is not None
        seq, position = self.pending
        order = list(range(len(self.shards)))
        self.rng.shuffle(order)  # the requests go out at once; any may land first
        reached = len(order) if self.crash_after is None else self.crash_after
        for i in order[:reached]:
            mine = [r for r in records if r % len(self.shards) == i]
            self.shards[i].push(seq, position, mine)
        if self.saving is not None:
            i = len(self.saving)
            self.saving.append((self.shards[i].mark, dict(self.shards[i].counts)))
            if len(self.saving) == len(self.shards):
                self.latest, self.saving = self.saving, None
        return reached == len(order)

    def restore(self) -> None:
        self.saving = None  # a save cut short by the loss is no checkpoint
        for shard, saved in zip(self.shards, self.latest or [(None, {})] * 3, strict=True):
            shard.mark, shard.counts = saved[0], dict(saved[1])


@pytest.mark.parametrize("seed", range(40))
def test_every_record_reaches_its_shard_once_whatever_dies_when(seed: int) -> None:
    """A worker reads batches (their size changing between runs, and a stream's reads giving
    fewer records than asked) and pushes each to 3 shards; at random it dies between its pushes
    to two shards, a checkpoint starts (each shard's snapshot a step apart), or a ps is lost and
    every shard goes back to the latest complete checkpoint; each start resumes where the
    shards stand. In the end every record is counted once, on its own shard."""
    rng = random.Random(seed)
    n = 600
    job = Job(3, rng)
    while True:
        stream = Stream(n)
        tracker = InputTracker(stream, "worker:0")
        tracker.resume(job)  # type: ignore[arg-type]
        batch = rng.choice([5, 8, 13, 32])
        again = False
        while stream.at < n or stream.stops:
            records = stream.read(rng.randint(1, batch))
            if not records and not stream.stops:
                break
            fate = rng.random()
            job.crash_after = rng.randrange(3) if fate < 0.04 else None
            tracker.mark(job)  # type: ignore[arg-type]
            if not job.step(records):
                again = True  # the worker died mid-push
                break
            if fate > 0.98:
                job.restore()  # a ps lost: every shard from the latest checkpoint
                again = True
                break
            if fate > 0.9 and job.saving is None:
                job.saving = []
        if not again and stream.at >= n and not stream.stops:
            break
    counts = {r: c for s in job.shards for r, c in s.counts.items()}
    assert sorted(counts) == list(range(n)), f"skipped: {sorted(set(range(n)) - set(counts))[:10]}"
    assert set(counts.values()) == {1}, {r: c for r, c in counts.items() if c != 1}
