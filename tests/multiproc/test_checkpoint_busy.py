"""A chief restarted while the ps still write the checkpoint its first self asked for: it
leaves that directory alone, skips its own saves until the ps are done (or, asked to wait, waits
for them), then saves; the job never fails on it."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from psflow.protocol import Code, Key, Op
from psflow.serve.delta import list_exports
from psflow.train import CheckpointDir
from psflow.transport import PeerError, TransportConfig
from psflow.worker import DistributedOptimizer, ShardedClient

from .support import local_cluster, quiet_session, start_ps, stop, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def _step(opt: Any, model: torch.nn.Module) -> None:
    opt.zero_grad()
    model(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()


@contextlib.contextmanager
def _ps_holding_saves(cluster: Any, gate: Path) -> Iterator[None]:
    """The cluster's ps, each holding every checkpoint or export file unrenamed until ``gate``
    exists; at the end of the block each must exit 0 by itself, no write of theirs failed."""
    procs = [
        start_ps(cluster, i, faults=["--hold-save", str(gate)])
        for i in range(cluster.num_tasks("ps"))
    ]
    try:
        yield
        for p in procs:
            code, err = stop(p)
            assert code == 0, err[-3000:]
            assert "failed" not in err, err[-3000:]
    finally:
        gate.touch()
        for p in procs:
            stop(p, timeout=1)


@contextlib.contextmanager
def _first_chief(cluster: Any) -> Iterator[ShardedClient]:
    """The first chief: it initialises the ps and trains a step; what the caller asks through
    the client it yields is the last it does: it is gone then, before the ps have written
    (what it would have done next, no one does)."""
    transport = TransportConfig(timeout=20)
    first = torch.nn.Linear(4, 1)
    opt = DistributedOptimizer(first, worker_ctx(cluster), lr=0.1, transport=transport)
    client = ShardedClient(worker_ctx(cluster), transport)
    try:
        _step(opt, first)
        yield client
    finally:
        client.close()
        opt.close(finished=False)


def _listed(url: str, name: str) -> None:
    """Waits until a ps writing ``name`` under ``url`` has made its directory (its thread's
    first step)."""
    deadline = time.monotonic() + 20
    while name not in [c.name for c in CheckpointDir(url).checkpoints()]:
        assert time.monotonic() < deadline, f"{name} never appeared under {url}"
        time.sleep(0.01)


@pytest.mark.parametrize("asked", ["both", "ps:1"])
def test_a_restarted_chief_waits_for_the_save_its_first_self_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, asked: str
) -> None:
    """``asked``: the shards the first chief asked to save before it was gone (``ps:1``: it
    died between its two requests, or ps:0 had written its file already)."""
    cluster = local_cluster(2, 1)
    gate = tmp_path / "gate"
    url = str(tmp_path / "ckpt")
    abandoned = "ckpt-1"
    with _ps_holding_saves(cluster, gate):
        with _first_chief(cluster) as client:
            if asked == "both":
                replies = client.save({0: f"{url}/ckpt-0"}, by_step=True)
                assert replies[0][Key.SNAPSHOT_STEP] == 1
            client.save({1: f"{url}/{abandoned}"})
        _listed(url, abandoned)

        model = torch.nn.Linear(4, 1)
        with caplog.at_level(logging.INFO), quiet_session(model, cluster, url, lr=0.1) as sess:
            # Removed, the ps's writes would fail: it is left until a save completes.
            assert f"left incomplete checkpoints {abandoned}: a ps still writes them" in caplog.text
            _step(sess, model)
            assert sess.checkpointer is not None
            assert sess.checkpointer.save(sess.global_step, wait=False) is None
            if asked == "both":
                assert "ps:0: a checkpoint of this shard is still being written" in caplog.text
            else:  # ps:0 took its snapshot; the checkpoint is given up at ps:1's refusal
                assert "checkpoint ckpt-2 abandoned, shard 0's file unnamed: ps:1: a " in (
                    caplog.text
                )

            # A save that waits asks again until the ps are done, then saves.
            refusals = threading.Event()
            asked = sess.checkpointer.client.save

            def save(*args: Any, **kwargs: Any) -> Any:
                try:
                    return asked(*args, **kwargs)
                except PeerError as e:
                    if e.code == Code.BUSY:
                        refusals.set()
                    raise

            sess.checkpointer.client.save = save  # type: ignore[method-assign]
            saved: list[str | None] = []
            waiting = threading.Thread(target=lambda: saved.append(sess.save()))
            waiting.start()
            assert refusals.wait(20), "the save was never refused while the ps still wrote"
            gate.touch()
            waiting.join(30)
            assert saved and saved[0] is not None, saved
            name = saved[0].rsplit("/", 1)[1]
            d = CheckpointDir(url)
            # The abandoned directory (no manifest, never to get one) went with the complete save.
            assert [(c.name, c.complete) for c in d.checkpoints()] == [(name, True)]
            assert d.manifest(name).global_step == sess.global_step


def test_a_restarted_chief_skips_exports_while_the_ps_write_its_first_selfs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = local_cluster(1, 1)
    gate = tmp_path / "gate"
    exports = tmp_path / "exports"
    with _ps_holding_saves(cluster, gate):
        with _first_chief(cluster) as client:
            header = {Key.OP: Op.EXPORT, Key.EXPORT_SEQ: 0, Key.BASE: 0, Key.RESERVE_BYTES: 0}
            client.call({0: {**header, Key.DIR: str(exports / "export-0")}})

        model = torch.nn.Linear(4, 1)
        with caplog.at_level(logging.DEBUG, "psflow.train.exports"), quiet_session(
            model, cluster, str(tmp_path / "ckpt"), lr=0.1, export_dir=str(exports),
            export_every=1e-6,  # due at every step
        ) as sess:  # fmt: skip
            for _ in range(3):  # each step's export is refused; none fails the session
                _step(sess, model)
                assert sess.exporter is not None
                sess.exporter.wait()
            assert "export skipped: ps:0: an export of this shard is still being written" in (
                caplog.text
            )
            done: list[str] = []
            waiting = threading.Thread(target=lambda: done.append(sess.export() or ""))
            waiting.start()
            deadline = time.monotonic() + 20
            while "export refused, asking again" not in caplog.text:
                assert time.monotonic() < deadline, "the export was never refused"
                time.sleep(0.01)
            gate.touch()
            waiting.join(30)
            assert done and done[0], done
            # The export asked of the dead chief stays unpublished; the new one is complete.
            assert [e.seq for e in list_exports(str(exports))] == [int(done[0].rsplit("-", 1)[1])]
