"""Learning-rate schedules against real ps processes: the updates every shard applies follow
the global step, a restore goes on from its step, TensorBoard shows what the ps applied, and
all-reduce mode follows the same schedule."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import psflow
from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.train import CheckpointDir, TrainingSession, load_checkpoint
from psflow.transport import TransportConfig

from .support import PRELOAD, ROOT, local_cluster, quiet_session, start_ps, stop, worker_ctx
from .sync_support import assert_close, batch, loss_fn, make_model, run_threads

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

STEP_LR = ("StepLR", {"step_size": 3, "gamma": 0.5})
STEP_LR_4 = ("StepLR", {"step_size": 4, "gamma": 0.5})


def _torch_lrs(lr: float, schedule: tuple[str, dict[str, Any]], steps: int) -> list[float]:
    """torch's own scheduler stepped once a step: the learning rate at steps 0..steps."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = getattr(torch.optim.lr_scheduler, schedule[0])(opt, **schedule[1])
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


class TwoShards(torch.nn.Module):
    """``a`` on ps:0, ``b`` on ps:1; ``b`` takes no part in some steps (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.randn(6, generator=g, dtype=torch.float64))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        out = torch.tanh(x @ self.a)
        return out + torch.tanh(x @ self.b) if use_b else out


def _uses_b(step: int) -> bool:
    return step % 4 != 1


def loss_fn_two(model: TwoShards, x: torch.Tensor, y: torch.Tensor, use_b: bool) -> torch.Tensor:
    return ((model(x, use_b) - y.squeeze(1)) ** 2).mean()


def test_two_shards_apply_the_learning_rate_of_the_global_step() -> None:
    """Asynchronous mode, 2 shards: every update, on either shard, is the one SGD with torch's
    StepLR makes in one process, bit for bit. ps:1 misses the pushes of steps 1, 5 and 9 (``b``
    had no gradient); it follows the global step the next push carries, not its own count."""
    steps = 12
    cluster = local_cluster(2, 1)
    ps = [start_ps(cluster, i) for i in range(2)]
    try:
        model = TwoShards()
        got_lrs = []
        with psflow.DistributedOptimizer(
            model, worker_ctx(cluster), lr=0.5, lr_schedule=STEP_LR, placement="round_robin"
        ) as opt:
            assert {p.param: p.shard for p in opt.pieces} == {"a": 0, "b": 1}
            assert opt.learning_rate == 0.5  # step 0, as ps:0 reported it with the pull
            for step in range(steps):
                x, y = batch(step, 0, 4)
                opt.zero_grad()
                loss_fn_two(model, x, y, _uses_b(step)).backward()
                assert opt.step() == step + 1
                got_lrs.append(opt.learning_rate)
        for p in ps:
            code, err = stop(p)
            assert code == 0, err[-3000:]
    finally:
        for p in ps:
            stop(p, timeout=1)

    ref = TwoShards()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(ref_opt, **STEP_LR[1])
    for step in range(steps):
        x, y = batch(step, 0, 4)
        ref_opt.zero_grad()
        loss_fn_two(ref, x, y, _uses_b(step)).backward()
        ref_opt.step()
        sched.step()
    assert got_lrs == _torch_lrs(0.5, STEP_LR, steps)[1:]
    assert torch.equal(model.a, ref.a) and torch.equal(model.b, ref.b)


def test_synchronous_steps_on_two_shards_follow_the_schedule() -> None:
    """Sync mode, 2 workers, 2 shards, SGD with momentum (torch.optim's own step on the ps):
    the result is one process's SGD on both batches with the same schedule."""
    workers, steps, size, lr = 2, 15, 4, 0.1
    schedule = ("MultiStepLR", {"milestones": [4, 9], "gamma": 0.2})
    cluster = local_cluster(2, workers)
    ps = [start_ps(cluster, i) for i in range(2)]

    def train(index: int) -> Any:
        def body() -> tuple[dict[str, torch.Tensor], list[float | None]]:
            model = make_model("mlp")
            rng = random.Random(index)
            lrs = []
            with psflow.DistributedOptimizer(
                model,
                worker_ctx(cluster, index),
                mode="sync",
                optimizer=OptimizerSpec.of("SGD", lr=lr, momentum=0.9),
                lr_schedule=schedule,
                sync_timeout=30,
            ) as opt:
                while opt.global_step < steps:
                    time.sleep(rng.random() * 0.002)  # arrival order varies from step to step
                    x, y = batch(opt.global_step, index, size)
                    opt.zero_grad()
                    loss_fn(model, x, y).backward()
                    opt.step()
                    lrs.append(opt.learning_rate)
            return {n: p.detach().clone() for n, p in model.state_dict().items()}, lrs

        return body

    try:
        results = run_threads([train(i) for i in range(workers)])
        for p in ps:
            code, err = stop(p)
            assert code == 0, err[-3000:]
    finally:
        for p in ps:
            stop(p, timeout=1)

    model = make_model("mlp")
    ref_opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.MultiStepLR(ref_opt, **schedule[1])  # type: ignore[arg-type]
    for step in range(steps):
        parts = [batch(step, w, size) for w in range(workers)]
        ref_opt.zero_grad()
        loss_fn(
            model, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        ).backward()
        ref_opt.step()
        sched.step()
    want = {n: p.detach().clone() for n, p in model.state_dict().items()}
    expected_lrs = _torch_lrs(lr, schedule, steps)
    for params, lrs in results:
        assert_close(params, want, rtol=1e-6)
        assert lrs[-1] == expected_lrs[steps]


def _session_train(sess: TrainingSession, model: torch.nn.Module, until: int) -> list[float]:
    """Steps until the session stops; the learning rate reported after each step."""
    lrs = []
    while not sess.should_stop():
        x, y = batch(sess.global_step, 0, 4)
        sess.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        sess.step(loss=loss)
        lr = sess.opt.learning_rate
        assert lr is not None
        lrs.append(lr)
    assert sess.global_step == until
    return lrs


def test_a_restored_job_goes_on_with_the_learning_rate_of_its_step(tmp_path: Path) -> None:
    """Save at step 10 (2 shards), start everything again: the ps restore the step and the
    schedule goes on from there (the learning rate of step 10, not of step 0), so the two runs
    together make exactly the updates of one uninterrupted run."""
    url = str(tmp_path / "ckpt")
    cluster = local_cluster(2, 1)
    lr, first, last = 0.2, 10, 16

    def session(model: torch.nn.Module, last_step: int) -> TrainingSession:
        return quiet_session(
            model,
            cluster,
            url,
            lr=lr,
            lr_schedule=ScheduleSpec(name=STEP_LR_4[0], kwargs=STEP_LR_4[1]),
            placement="round_robin",
            last_step=last_step,
        )

    lrs = []
    for run, last_step in enumerate((first, last)):
        ps = [start_ps(cluster, i) for i in range(2)]
        try:
            model = make_model("mlp")
            with session(model, last_step) as sess:
                if run == 1:
                    assert sess.restored_from == f"ckpt-{first}" and sess.global_step == first
                    # Reported by ps:0 with the parameters the session pulled at the start.
                    assert sess.opt.learning_rate == _torch_lrs(lr, STEP_LR_4, first)[first]
                lrs += _session_train(sess, model, last_step)
            for i, p in enumerate(ps):
                code, err = stop(p)
                assert code == 0, err[-3000:]
                at = 0 if run == 0 else first
                assert f"lr_schedule StepLR(step_size=4, gamma=0.5) at step {at}" in err, i
        finally:
            for p in ps:
                stop(p, timeout=1)
        if run == 0:
            ckpt = load_checkpoint(url)
            assert ckpt is not None and ckpt.global_step == first
            assert ckpt.lr_schedule == ScheduleSpec(name=STEP_LR_4[0], kwargs=STEP_LR_4[1])

    assert lrs == _torch_lrs(lr, STEP_LR_4, last)[1:]
    ref = make_model("mlp")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(ref_opt, **STEP_LR_4[1])
    for step in range(last):
        x, y = batch(step, 0, 4)
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        sched.step()
    for name, want in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], want), name
    latest = CheckpointDir(url).latest()
    assert latest == f"ckpt-{last}"


def test_tensorboard_shows_the_learning_rate_the_ps_applied(tmp_path: Path) -> None:
    """Two asynchronous workers: the chief sees the global steps it sees, and writes at each
    the learning rate ps:0 reported with it, which is torch's ExponentialLR at that step."""
    logdir = str(tmp_path / "events")
    cluster = local_cluster(1, 2)
    schedule = ("ExponentialLR", {"gamma": 0.9})
    lr, last = 0.05, 40
    ps = start_ps(cluster)
    other_started = threading.Event()
    chief_steps = [0]
    chief_done = threading.Event()

    def other() -> None:
        model = make_model("linear")
        with psflow.DistributedOptimizer(
            model, worker_ctx(cluster, 1), lr=lr, lr_schedule=schedule
        ) as opt:
            other_started.set()
            taken = 0
            while opt.global_step < last:
                # At most three steps to each of the chief's: on a loaded machine the chief's
                # first summary took longer than all 40 of this thread's steps, and it saw two.
                deadline = time.monotonic() + 60
                while taken >= 3 * (chief_steps[0] + 1) and not chief_done.is_set():
                    assert time.monotonic() < deadline, "the chief stopped stepping"
                    time.sleep(0.001)
                taken += 1
                x, y = batch(opt.global_step, 1, 4)
                opt.zero_grad()
                loss_fn(model, x, y).backward()
                opt.step()

    try:
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        model = make_model("linear")
        with TrainingSession(
            model,
            worker_ctx(cluster, 0),
            lr=lr,
            lr_schedule=schedule,
            summary_dir=logdir,
            save_summaries_steps=1,
            histogram_steps=None,
            log_step_count_steps=None,
            last_step=last,
            transport=TransportConfig(timeout=20),
        ) as sess:
            assert other_started.wait(60)
            while not sess.should_stop():
                x, y = batch(sess.global_step, 0, 4)
                sess.zero_grad()
                loss = loss_fn(model, x, y)
                loss.backward()
                sess.step(loss=loss)
                chief_steps[0] += 1
            chief_done.set()  # before its end, which may wait for the other
        thread.join(60)
        assert not thread.is_alive()
        code, err = stop(ps)
        assert code == 0, err[-3000:]
    finally:
        chief_done.set()
        stop(ps, timeout=1)

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("learning_rate")
    expected = _torch_lrs(lr, schedule, last + 5)
    assert len(events) >= 5
    for e in events:  # event files hold float32
        assert e.value == float(np.float32(expected[e.step])), (e.step, e.value)
    values = [e.value for e in sorted(events, key=lambda e: e.step)]
    # It decays at every step the chief saw (where its first summary falls depends on how far
    # the other worker ran ahead: each value is checked against its own step above).
    assert all(b < a for a, b in itertools.pairwise(values))


def test_allreduce_follows_the_schedule_on_every_rank() -> None:
    """No ps: each rank applies the schedule by its own step, so they stay identical and
    equal one process's SGD on both batches with the same schedule."""
    steps, lr = 12, 0.1
    kwargs = {"mode": "allreduce", "lr": lr, "lr_schedule": list(STEP_LR)}
    script = ROOT / "tests" / "multiproc" / "scripts" / "lr_worker.py"
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--workers", "2", "--mode", "allreduce"]
    cmd += ["--preload", PRELOAD]
    proc = subprocess.run(
        [*cmd, str(script), str(steps), json.dumps(kwargs)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        task, _, rest = line.partition("] ")
        if rest.startswith("RESULT "):
            results[task.lstrip("[")] = json.loads(rest[len("RESULT ") :])
    assert sorted(results) == ["worker:0", "worker:1"], proc.stdout[-2000:]
    expected_lrs = _torch_lrs(lr, STEP_LR, steps)[1:]
    for r in results.values():
        assert r["step"] == steps and r["lrs"] == expected_lrs
    assert results["worker:0"]["params"] == results["worker:1"]["params"]

    model = make_model("mlp")
    ref_opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(ref_opt, **STEP_LR[1])
    for step in range(steps):
        parts = [batch(step, w, 4) for w in range(2)]
        ref_opt.zero_grad()
        loss_fn(
            model, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        ).backward()
        ref_opt.step()
        sched.step()
    for name, want in model.state_dict().items():
        got = torch.tensor(results["worker:0"]["params"][name], dtype=torch.float64)
        assert torch.allclose(got, want.reshape(-1), rtol=1e-9, atol=1e-12), name
