"""A cluster of one: a session with no cluster trains in its own process as the ps would, with
the same optimizers, schedule, checkpoints, summaries and hooks; its checkpoints restore into a
job of 2 ps, and the job's restore alone."""

from __future__ import annotations

import math
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.cluster.spec import ClusterSpec, TaskContext
from psflow.train import CheckpointDir, NanLossError, TrainingSession
from psflow.train.alone import LocalEngine

from .support import local_cluster, quiet_session, run_forked, start_ps, stop, worker_ctx
from .test_tables import Recommender, batch, loss_of, table_rows

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

SETTINGS: dict[str, Any] = {
    "optimizer": "Adam",
    "lr": 0.01,
    "lr_schedule": ("StepLR", {"step_size": 2, "gamma": 0.5}),
}
"""Adam on the dense layers with a schedule, row-wise Adagrad on the hashed table and the
job's optimizer's row-wise form (Adam, scheduled) on the fixed one."""

PROBE_USERS = torch.cat([batch(s, 0, 8)[1].flatten() for s in range(8)]).unique()
ITEMS = torch.arange(50)


def alone_session(
    model: torch.nn.Module, checkpoint_dir: str | None, **kwargs: Any
) -> TrainingSession:
    options: dict[str, Any] = {
        "checkpoint_dir": checkpoint_dir,
        "save_checkpoint_secs": 3600,
        "log_step_count_steps": None,
        "save_summaries_steps": None,
        **SETTINGS,
    }
    return TrainingSession(model, TaskContext.alone(), **(options | kwargs))


def train(sess: TrainingSession, model: Recommender, steps: range) -> None:
    for step in steps:
        items, users, y = batch(step, 0, 8)
        sess.zero_grad()
        loss = loss_of(model, items, users, y)
        loss.backward()
        sess.step(loss=loss)


def alone_rows(sess: TrainingSession) -> dict[str, torch.Tensor]:
    engine = sess.opt.engine
    assert isinstance(engine, LocalEngine)
    rows = engine.tables.tables
    return {"items": rows["items"].lookup(ITEMS), "users": rows["users"].lookup(PROBE_USERS)}


def job_rows(sess: TrainingSession) -> dict[str, torch.Tensor]:
    return {
        "items": table_rows(sess.opt, "items", ITEMS),
        "users": table_rows(sess.opt, "users", PROBE_USERS),
    }


def dense(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.head.named_parameters()}


def test_alone_trains_as_one_worker_on_two_ps(two_ps: ClusterSpec, tmp_path: Path) -> None:
    """Every step alone equals the same step of one worker against 2 ps: the dense layers (Adam
    with its schedule), the fixed table (scheduled row-wise Adam) and the hashed table (row-wise
    Adagrad)."""
    alone_model, job_model = Recommender(), Recommender()
    with alone_session(alone_model, None) as alone:
        assert alone.alone and alone.global_step == 0
        train(alone, alone_model, range(5))
        assert alone.global_step == 5
        assert alone.opt.learning_rate == pytest.approx(0.01 * 0.5**2)
        mine = alone_rows(alone)
    with quiet_session(job_model, two_ps, str(tmp_path), **SETTINGS) as job:
        train(job, job_model, range(5))
        theirs = job_rows(job)
        job.opt.pull()
    for name in ("items", "users"):
        torch.testing.assert_close(mine[name], theirs[name])
    for name, value in dense(job_model).items():
        torch.testing.assert_close(dense(alone_model)[name], value)


def test_a_checkpoint_goes_from_alone_to_two_ps_and_back(tmp_path: Path) -> None:
    """Saved alone (one shard), restored by a job of 2 ps: the same rows and dense values; the
    job's checkpoint restored alone: the same again, and each goes on from the saved step."""
    url = str(tmp_path / "ckpt")
    model = Recommender()
    with alone_session(model, url) as alone:
        train(alone, model, range(3))
        saved, saved_dense = alone_rows(alone), dense(model)
    cluster = local_cluster(2, 1)
    procs = [start_ps(cluster, i) for i in range(2)]
    try:
        model = Recommender()
        with quiet_session(model, cluster, url, **SETTINGS) as job:
            assert job.restored_from == "ckpt-3" and job.global_step == 3
            restored = job_rows(job)
            for name in ("items", "users"):
                torch.testing.assert_close(restored[name], saved[name])
            for name, value in saved_dense.items():
                torch.testing.assert_close(dense(model)[name], value)
            train(job, model, range(3, 5))
            job_saved = job_rows(job)
            job.opt.pull()
            job_dense = dense(model)
        for p in procs:
            code, err = stop(p)
            assert code == 0, err[-3000:]
    finally:
        for p in procs:
            stop(p, timeout=1)
    model = Recommender()
    with alone_session(model, url) as alone:
        assert alone.restored_from == "ckpt-5" and alone.global_step == 5
        for name, rows in alone_rows(alone).items():
            torch.testing.assert_close(rows, job_saved[name])
        for name, value in job_dense.items():
            torch.testing.assert_close(dense(model)[name], value)
        train(alone, model, range(5, 6))
        assert alone.global_step == 6


def test_alone_writes_summaries_and_runs_the_hooks(tmp_path: Path) -> None:
    """The chief's summaries (loss, learning rate, a user scalar) go to TensorBoard alone, the
    last step stops the loop, and the NaN guard stops a non-finite loss before any update."""
    logdir = str(tmp_path / "run")
    model = Recommender()
    with alone_session(model, logdir, save_summaries_steps=1, last_step=4) as sess:
        steps = 0
        while not sess.should_stop():
            train(sess, model, range(steps, steps + 1))
            steps += 1
        sess.add_scalar("eval/auc", 0.75)
    assert steps == 4
    events = EventAccumulator(logdir)
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "loss" in tags and "eval/auc" in tags, tags
    assert [e.step for e in events.Scalars("eval/auc")] == [4]
    model = Recommender()
    before = dense(model)
    with pytest.raises(NanLossError), alone_session(model, None) as sess:
        items, users, y = batch(0, 0, 8)
        sess.zero_grad()
        loss = loss_of(model, items, users, y) * math.nan
        loss.backward()
        sess.step(loss=loss)
    for name, value in before.items():
        torch.testing.assert_close(dense(model)[name], value)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_saves_the_final_checkpoint_before_the_loop_ends(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """SIGTERM, or a first Ctrl-C, ends the loop with the final checkpoint already saved, before
    anything the script does after its loop; a second Ctrl-C raises at once."""
    url = str(tmp_path / "ckpt")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        model = Recommender()
        with alone_session(model, url) as sess:
            steps = 0
            while not sess.should_stop():
                train(sess, model, range(steps, steps + 1))
                steps += 1
                if steps == 3:
                    os.kill(os.getpid(), signum)
            assert steps == 3
            assert CheckpointDir(url).latest() == "ckpt-3"  # in the loop's last should_stop()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        model = Recommender()
        with pytest.raises(KeyboardInterrupt), alone_session(model, url) as sess:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_launched_job_of_one_worker_and_no_ps_is_a_cluster_of_one(tmp_path: Path) -> None:
    """A real cluster spec with one worker and no ps trains in that process; with two workers
    and no ps (not all-reduce) the session refuses, naming what is missing."""
    one = local_cluster(0, 1)
    model = Recommender()
    with TrainingSession(model, worker_ctx(one), **SETTINGS, log_step_count_steps=None) as sess:
        assert sess.alone
        train(sess, model, range(2))
        assert sess.global_step == 2
    two = local_cluster(0, 2)
    with pytest.raises(ValueError, match="no ps task"):
        TrainingSession(Recommender(), worker_ctx(two), **SETTINGS, log_step_count_steps=None)


def test_the_readme_example_runs_alone_and_resumes(tmp_path: Path) -> None:
    """`python examples/linear_regression.py` with no cluster: the same script trains in its one
    process, checkpoints, and a second run goes on from the first's last checkpoint."""
    script = Path(__file__).resolve().parents[2] / "examples" / "linear_regression.py"
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PSFLOW_CLUSTER_FILE")}
    args = ["--logdir", str(tmp_path / "run"), "--log_step_count_steps", "100"]
    for steps, restored in ((300, None), (500, "ckpt-300")):
        # Forked from the server that imported torch, with this environment: python SCRIPT.
        proc = run_forked([str(script), "--train_steps", str(steps), *args], env=env, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(r"^W=[-\d.]+ b=[-\d.]+$", proc.stdout, re.M), proc.stdout
        assert CheckpointDir(str(tmp_path / "run")).latest() == f"ckpt-{steps}"
        if restored is not None:
            assert f"restored Linear from {tmp_path / 'run' / restored}" in proc.stderr
