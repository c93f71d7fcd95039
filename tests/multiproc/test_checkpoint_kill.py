"""A task SIGKILLed in the middle of a save leaves the previous checkpoint restorable.

The ps tasks run with the fault ``--slow-save`` (:mod:`tests.faults`): each shard file waits,
fully written under its temporary name, before its rename; the kills land in that window.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from psflow.cluster.spec import TaskSpec
from psflow.train import CheckpointDir, TrainingSession, load_checkpoint
from psflow.transport import TransportConfig
from psflow.worker.client import ShardedClient

from .forked import Forked
from .support import local_cluster, start_ps, stop, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

SLOW = ["--slow-save", "1.5"]


def _train(sess: TrainingSession, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        sess.zero_grad()
        loss = model(torch.ones(1, 64)).pow(2).sum()
        loss.backward()
        sess.step(loss=loss)


def _session(
    model: torch.nn.Module, cluster: object, url: str, timeout: float = 15
) -> TrainingSession:
    return TrainingSession(
        model,
        worker_ctx(cluster),  # type: ignore[arg-type]
        optimizer="Adam",
        lr=0.01,
        checkpoint_dir=url,
        save_checkpoint_secs=3600,
        log_step_count_steps=None,
        transport=TransportConfig(timeout=timeout),
        end_timeout=1,
    )


def test_ps_killed_mid_save_then_restore_into_two_ps(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, faults=SLOW)
    try:
        probe = ShardedClient(worker_ctx(cluster), TransportConfig(timeout=30))
        probe.status()  # the ps is up: the short timeout below is for its death only
        probe.close()
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        sess = _session(model, cluster, url, timeout=10)
        _train(sess, model, 3)
        assert sess.save() == f"{url}/ckpt-3"
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        _train(sess, model, 3)
        assert sess.checkpointer is not None
        sess.checkpointer.save(sess.global_step, wait=False)  # the ps now writes ckpt-6 slowly
        time.sleep(0.5)
        ps.kill()
        stop(ps)
        with pytest.raises(RuntimeError, match="saving a checkpoint failed: ps:0"):
            sess.checkpointer.wait()
        sess.close(RuntimeError("ps died"))
    finally:
        stop(ps, timeout=1)

    d = CheckpointDir(url)
    assert d.latest() == "ckpt-3"
    assert [(c.name, c.complete) for c in d.checkpoints()] == [("ckpt-3", True), ("ckpt-6", False)]

    # A job with two ps tasks restores it, with no restore call in the script.
    cluster2 = local_cluster(2, 1)
    ps2 = [start_ps(cluster2, i) for i in range(2)]
    try:
        torch.manual_seed(123)
        model2 = torch.nn.Linear(64, 64)
        with _session(model2, cluster2, url) as sess2:
            assert sess2.restored_from == "ckpt-3" and sess2.global_step == 3
            for n, p in model2.named_parameters():
                assert torch.equal(p.detach(), saved[n]), n
            assert [c.name for c in d.checkpoints()] == ["ckpt-3"]  # incomplete one removed
            _train(sess2, model2, 2)
        for p in ps2:
            code, err = stop(p)
            assert code == 0, err
        ckpt = load_checkpoint(url)
        assert ckpt is not None and ckpt.global_step == 5 and ckpt.manifest.num_shards == 2
        assert "exp_avg" in ckpt.opt_tensors["weight"]  # Adam's state travelled along
    finally:
        for p in ps2:
            stop(p, timeout=1)


CHIEF = """
import sys, torch, psflow
from psflow.train import TrainingSession
ctx, _ = psflow.resolve([])
model = torch.nn.Linear(64, 64)
sess = TrainingSession(model, ctx, lr=0.1, checkpoint_dir=sys.argv[1], save_checkpoint_secs=3600,
                       log_step_count_steps=None)
def train(n):
    for _ in range(n):
        sess.zero_grad()
        model(torch.ones(1, 64)).pow(2).sum().backward()
        sess.step()
train(3)
sess.save()
train(3)
sess.checkpointer.save(sess.global_step, wait=False)
print("SAVING", flush=True)
import time
time.sleep(60)
"""


def test_chief_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, faults=SLOW)
    chief = Forked(  # forked from the server that imported torch, as the ps is
        ["-c", CHIEF, url],
        env=dict(os.environ, TF_CONFIG=cluster.to_tf_config(TaskSpec(job="worker", index=0))),
    )
    try:
        assert chief.stdout is not None
        line = chief.stdout.readline()
        assert line.strip() == "SAVING", stop(chief)[1][-2000:]
        chief.kill()
        stop(chief)
        # The ps finishes its shard file (renamed into place 1.5 s into the save); no manifest
        # will ever follow.
        shard = tmp_path / "ckpt" / "ckpt-6" / "shard-0-of-1.safetensors"
        deadline = time.monotonic() + 30
        while not shard.exists():
            assert ps.poll() is None, stop(ps)[1][-2000:]
            assert time.monotonic() < deadline, "the ps never finished its shard of ckpt-6"
            time.sleep(0.05)
        d = CheckpointDir(url)
        assert d.latest() == "ckpt-3"
        assert not (tmp_path / "ckpt" / "ckpt-6" / "manifest.json").exists()
        ckpt = load_checkpoint(url)
        assert ckpt is not None and ckpt.global_step == 3
    finally:
        stop(chief, timeout=1)
        ps.kill()
        stop(ps)
