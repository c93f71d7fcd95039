"""Exactly-once input across restarts: numbered records, each adding 1 to its own row, so that
what reached the optimizer can be counted after tasks are killed (issue 37, items 1 and 2).

- A job of 2 ps and 2 workers reads a Kafka topic (Tansu, a real broker), or TFRecord files
  shared by the hash of their paths, with its reader's position given to the session; a ps, the chief and the other worker are SIGKILLed at
  scheduled steps and restarted by ``psflow launch --max-restarts``. At the end every row is 1:
  no record trained twice, none skipped.
- The replay: shards that hold a worker's input at different points (its push reached one
  shard and not the other when it died) make the restarted worker read the records between
  once more, which the shard ahead drops and the other applies.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from psflow.cluster.ports import local_cluster
from psflow.data import serialize_example, write_records
from psflow.data.stream import FileStreamConfig, FileStreamReader, owner
from psflow.train import CheckpointDir, TrainingSession
from psflow.worker.calls import ShardCalls
from tests.faults import FAULTS

from .kafka_broker import running_broker
from .scripts.counted_stream import SPEC, Counter
from .support import CLI_MAIN, ROOT, launch_cmd, quiet_session, run_forked, start_ps, stop

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

SCRIPT = ROOT / "tests" / "multiproc" / "scripts" / "counted_stream.py"
PARTITIONS = 4


def example(i: int) -> bytes:
    return serialize_example({"id": [i]})


def land(directory: Path, k: int, ids: Sequence[int]) -> None:
    hidden = directory / f".part-{k}.tmp"
    write_records(hidden, [example(i) for i in ids])
    hidden.rename(directory / f"part-{k}.tfrecord")


def counted_rows(logdir: Path) -> torch.Tensor:
    """Every row of the job's last checkpoint, by id (-1 where a shard holds none)."""
    d = CheckpointDir(str(logdir))
    name = d.latest()
    assert name is not None, f"no checkpoint in {logdir}"
    ids, values = [], []
    for url in d.shard_urls(name, d.manifest(name).num_shards):
        tensors = load_file(url)
        for key, t in tensors.items():
            if key.endswith("/ids"):
                ids.append(t)
                values.append(tensors[key[: -len("ids")] + "values"])
    rows = torch.full((int(torch.cat(ids).max()) + 1,), -1.0)
    rows[torch.cat(ids)] = torch.cat(values).reshape(-1)
    return rows


def assert_each_once(rows: torch.Tensor, records: int) -> None:
    assert rows.numel() == records, f"{rows.numel()} rows for {records} records"
    twice = (rows > 1).nonzero().reshape(-1).tolist()
    skipped = (rows < 1).nonzero().reshape(-1).tolist()
    assert not twice and not skipped, (
        f"trained twice: {len(twice)} {twice[:10]}, skipped: {len(skipped)} {skipped[:10]}"
    )


@pytest.mark.parametrize("source", ["kafka", "files"])
def test_each_record_is_trained_once_across_killed_tasks(tmp_path: Path, source: str) -> None:
    with contextlib.ExitStack() as stack:
        job_with_kills(tmp_path, source, stack)


def job_with_kills(tmp_path: Path, source: str, stack: contextlib.ExitStack) -> None:
    records, logdir = 4000, tmp_path / "run"  # 250 steps of 16
    if source == "kafka":
        broker = stack.enter_context(running_broker())
        broker.topic("counted", PARTITIONS)
        broker.produce("counted", [(i % PARTITIONS, example(i)) for i in range(records)])
        given = ["--brokers", broker.address, "--topic", "counted"]
        given += ["--partitions", str(PARTITIONS)]
    else:
        data = tmp_path / "data"
        data.mkdir()
        # Shared by the hash of their paths, which hold the test's temporary directory: names
        # chosen so that each worker reads five, whose 125 steps take the global step past its
        # kill below (with the split left to chance, a worker of three files finished first).
        shares: dict[int, list[int]] = {0: [], 1: []}  # worker -> its files' numbers
        for k in itertools.count():
            share = shares[owner(str(data / f"part-{k}.tfrecord"), 2)]
            if len(share) < 5:
                share.append(k)
            if all(len(got) == 5 for got in shares.values()):
                break
        names = sorted(shares[0] + shares[1])
        for j, k in enumerate(names):
            land(data, k, range(j * 400, (j + 1) * 400))
        given = ["--files", str(data / "part-*.tfrecord")]
    faults = [
        *("--once", str(tmp_path / "faults")),
        # A ps (the chief restores every shard from the last checkpoint: the positions go back
        # with the rows; or with none saved yet, the chief fails, and started again it
        # initialises the lost shard afresh: its positions are none, the other's kept), the
        # other worker and the chief (the ps keep theirs: each reads on from them). The order
        # of the last two depends on the machine's speed; a worker's own 125 steps take the
        # global step past each.
        *("--kill-at", "ps:1@50"),
        *("--kill-at", "worker:1@90"),
        *("--kill-at", "worker:0@120"),
    ]
    cmd = launch_cmd(
        FAULTS,
        *faults,
        str(SCRIPT),
        *("--records", str(records), "--logdir", str(logdir)),
        *given,
        ps=2,
        workers=2,
        preload=True,
    )
    cmd.insert(cmd.index("launch") + 1, "--max-restarts")
    # More than the 3 kills: a worker whose lookup (in the model's forward, outside the
    # session's step) finds the killed ps gone fails, and is restarted too.
    cmd.insert(cmd.index("--max-restarts") + 1, "8")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220)
    err = proc.stderr
    story = "\n".join(
        line
        for line in (err + proc.stdout).splitlines()
        if re.search(r"fault:|failed with|finished|reading on|came back|trained \d+|Error", line)
    )
    assert proc.returncode == 0, err[-5000:]
    restarted = re.findall(r"task (\S+) failed with signal 9; restarting it", err)
    assert sorted(restarted) == ["ps:1", "worker:0", "worker:1"], story
    assert len(re.findall(r"\[ps:1\] .* initialised by worker:0", err)) == 2, story
    # Each worker read on from where the shards stood after its restarts.
    assert len(re.findall(r"worker:\d: reading on from ", err)) >= 3, story
    assert_each_once(counted_rows(logdir), records)


def three_files(tmp_path: Path) -> str:
    """Records 0-95 in three files of 32 (part-0 to part-2); their glob."""
    data = tmp_path / "data"
    data.mkdir()
    for k in range(3):
        land(data, k, range(k * 32, (k + 1) * 32))
    return str(data / "part-*.tfrecord")


def train_files(
    sess: TrainingSession,
    model: Counter,
    reader: FileStreamReader,
    batch: int,
    then: Callable[[int, list[list[int]]], None] | None = None,
) -> list[list[int]]:
    """Steps on the files' batches until the last file is read whole; ``then(step, seen)``
    after each step. Returns the batches' ids."""
    seen: list[list[int]] = []
    while "part-2.tfrecord" not in " ".join(reader.state()["done"]):
        got = reader.read_examples(batch, SPEC, timeout_s=0.5)
        if got is None:
            continue
        seen.append(got["id"].tolist())
        sess.zero_grad()
        model(torch.as_tensor(got["id"])).backward()
        step = sess.step()
        if then is not None:
            then(step, seen)
    return seen


class OnlyShardZero:
    """Sends a call's requests to shard 0 alone, as if the worker died before the others."""

    def __init__(self, calls: ShardCalls) -> None:
        self.calls = calls
        self.real = calls.call

    def __call__(self, headers: dict[int, dict[str, Any]], tensors: Any = None, **kw: Any) -> Any:
        tensors = None if tensors is None else {0: tensors.get(0, [])}
        return self.real({0: headers[0]}, tensors, **kw)


def test_a_push_that_reached_one_shard_is_replayed_to_the_other_alone(tmp_path: Path) -> None:
    records, batch = 96, 16
    pattern = three_files(tmp_path)
    cluster = local_cluster(2, 1)
    ps = [start_ps(cluster, i) for i in range(2)]
    logdir = str(tmp_path / "ckpt")
    try:
        # First run: two whole steps, then the third reaches shard 0 only, and the worker dies.
        model = Counter(records)
        reader = FileStreamReader(FileStreamConfig(pattern=pattern, poll_interval_s=0.05))
        sess = quiet_session(model, cluster, logdir, input=reader, optimizer="SGD", lr=1.0)
        first: list[list[int]] = []
        for step in range(3):
            got = reader.read_examples(batch, SPEC, timeout_s=0.5)
            assert got is not None
            first.append(got["id"].tolist())
            sess.zero_grad()
            model(torch.as_tensor(got["id"])).backward()
            if step == 2:  # the push alone
                client = sess.opt.engine.client  # type: ignore[attr-defined]
                client.call = OnlyShardZero(client)
            sess.step()
        sess.close(RuntimeError("killed"))  # not finished: the ps wait for it

        # Second run, as the restarted worker: shard 1 holds input 2, shard 0 input 3.
        model = Counter(records)
        reader = FileStreamReader(FileStreamConfig(pattern=pattern, poll_interval_s=0.05))
        with quiet_session(model, cluster, logdir, input=reader, optimizer="SGD", lr=1.0) as sess:
            again = train_files(sess, model, reader, batch)
        assert again[0] == first[2]  # the third batch once more, exactly: then on
        assert sorted(i for b in first[:2] + again for i in b) == list(range(records))
        for p in ps:
            assert stop(p, timeout=30)[0] == 0
        assert_each_once(counted_rows(tmp_path / "ckpt"), records)
        # The checkpoint says where the reader stood: past the last file, on both shards.
        shown = run_forked(["-c", CLI_MAIN, "checkpoint", "inspect", logdir], timeout=60)
        assert shown.returncode == 0, shown.stderr
        line = shown.stdout.split("input positions")[1].splitlines()[1]
        assert line.startswith("  worker:0  input 6  {") and "part-2.tfrecord" in line, line
    finally:
        for p in ps:
            p.kill()


@pytest.mark.parametrize("staleness", [None, 2], ids=["async", "bounded_staleness"])
def test_a_shard_restored_under_a_worker_refuses_its_next_push_and_it_reads_again(
    tmp_path: Path, staleness: int | None
) -> None:
    """The chief restores the shards while a worker trains (a ps of the job came back empty):
    that worker's next push, numbered from where it stood, is refused (it would read on past
    what the shards lost); it asks again, and its reader goes back with them."""
    records, batch = 96, 16
    pattern = three_files(tmp_path)
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, 0)
    logdir = tmp_path / "ckpt"
    try:
        model = Counter(records)
        config = FileStreamConfig(pattern=pattern, poll_interval_s=0.05)
        reader = FileStreamReader(config)
        mode = {} if staleness is None else {"max_staleness": staleness}
        with quiet_session(
            model, cluster, str(logdir), input=reader, optimizer="SGD", lr=1.0, **mode
        ) as sess:
            assert type(sess.opt.engine).__name__ == (
                "AsyncEngine" if staleness is None else "StalenessEngine"
            )

            def then(step: int, seen: list[list[int]]) -> None:
                if step == 2 and len(seen) == 2:
                    sess.save()  # inputs 1 and 2 in the checkpoint
                if step == 4 and len(seen) == 4:
                    sess._restore(replace=True, timeout=20)  # back to step 2, under the loop

            seen = train_files(sess, model, reader, batch, then)
        # Batch 5's push was refused; then batches 3 and 4 were read again, and every record
        # was trained once in the end.
        assert seen[5:7] == seen[2:4], seen
        assert sorted(i for b in seen[:2] + seen[5:] for i in b) == list(range(records))
        assert stop(ps, timeout=30)[0] == 0
        assert_each_once(counted_rows(logdir), records)
    finally:
        ps.kill()
