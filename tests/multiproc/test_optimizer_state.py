"""A dense optimizer's first state given by the script (``optimizer_state=``), on real ps
processes: the job's next step is the one the run that kept the state takes; a checkpoint
restored from the session's directory wins over it."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from psflow.protocol import OptimizerSpec
from psflow.train import TrainingSession, load_checkpoint
from psflow.transport import TransportConfig
from psflow.worker import DistributedOptimizer

from .support import PRELOAD, ROOT, local_cluster, quiet_session, start_ps, stop, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

PROBE = ROOT / "tests" / "multiproc" / "scripts" / "opt_state_probe.py"


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(16, 24, generator=torch.Generator().manual_seed(step))
    return (model(x) - 1.0).square().mean()


def _sessions(
    url: str,
    runs: list[dict[str, Any]],
    check: Callable[[int, TrainingSession, torch.nn.Linear], None],
    finals: list[torch.Tensor] | None = None,
) -> None:
    """Jobs of one ps and one worker, one after the other, saving into ``url``: each a
    ``TrainingSession`` of Adam (with the run's ``adam`` arguments) and its run's keywords; ``check(run, session, model)`` once it
    has started, then two steps (the weight they end with appended to ``finals``)."""
    cluster = local_cluster(1, 1)
    for run, kwargs in enumerate(runs):
        ps = start_ps(cluster)
        try:
            model = torch.nn.Linear(24, 1)
            adam = {"optimizer": OptimizerSpec.of("Adam", lr=0.01, **kwargs.pop("adam", {}))}
            with quiet_session(model, cluster, url, **adam, **kwargs) as sess:
                check(run, sess, model)
                for step in range(2):
                    sess.zero_grad()
                    loss = _loss(model, step)
                    loss.backward()
                    sess.step(loss=loss)
            if finals is not None:
                finals.append(model.weight.detach().clone())
            code, err = stop(ps)
            assert code == 0, err[-3000:]
        finally:
            stop(ps, timeout=1)


@pytest.mark.parametrize(
    "mode",
    [{}, {"mode": "sync", "replicas_to_aggregate": 1, "total_num_replicas": 1}],
    ids=["async", "sync"],
)
def test_a_partitioned_model_goes_on_from_a_torch_runs_adam_state(mode: dict[str, object]) -> None:
    """A single-process torch run trains three steps with Adam; the job starts from its
    values and its optimizer's state, the first layer's weight split over 2 ps by rows (each
    ps its rows of ``exp_avg`` and ``exp_avg_sq``, each its copy of ``step``). One step of the
    job is the run's fourth."""
    torch.manual_seed(3)
    reference = torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1)
    )
    adam = torch.optim.Adam(reference.parameters(), lr=0.05)
    for step in range(3):
        adam.zero_grad()
        _loss(reference, step).backward()
        adam.step()
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 1))
    model.load_state_dict(reference.state_dict())
    names = {id(p): n for n, p in reference.named_parameters()}
    state = {names[id(p)]: dict(s) for p, s in adam.state.items()}

    cluster = local_cluster(2, 1)
    procs = [start_ps(cluster, i) for i in range(2)]
    try:
        opt = DistributedOptimizer(
            model,
            worker_ctx(cluster),
            optimizer="Adam",
            lr=0.05,
            partition_bytes=2048,  # 0.weight (3,840 bytes) in two pieces
            optimizer_state=state,
            transport=TransportConfig(timeout=30),
            sync_timeout=30.0,
            **mode,  # type: ignore[arg-type]
        )
        try:
            split = [p for p in opt.pieces if p.param == "0.weight"]
            assert len(split) == 2 and {p.shard for p in split} == {0, 1}
            opt.zero_grad()
            _loss(model, 3).backward()
            opt.step()
        finally:
            opt.close()
        adam.zero_grad()
        _loss(reference, 3).backward()
        adam.step()
        for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), want.detach(), rtol=0, atol=1e-6, msg=name)
        for p in procs:
            code, err = stop(p)
            assert code == 0, err[-3000:]
    finally:
        for p in procs:
            stop(p, timeout=1)


def test_a_checkpoint_restored_wins_over_the_given_state(tmp_path: Path) -> None:
    """The second session is given state far from the first one's (``exp_avg`` of 1,000) and
    restores the first one's checkpoint: the ps keep the restored state, as they keep the
    restored values."""
    url = str(tmp_path / "ckpt")
    bogus = {
        "weight": {
            "step": 1,
            "exp_avg": torch.full((1, 24), 1000.0),
            "exp_avg_sq": torch.ones(1, 24),
        },
    }

    def check(run: int, sess: TrainingSession, _model: torch.nn.Linear) -> None:
        assert sess.restored_from == ("ckpt-2" if run == 1 else None)

    _sessions(url, [{}, {"optimizer_state": bogus}], check)
    saved = load_checkpoint(url)
    assert saved is not None and saved.name == "ckpt-4"
    exp_avg = saved.opt_tensors["weight"]["exp_avg"]
    assert exp_avg.abs().max() < 10, exp_avg  # (0.9^2 * 1000 = 810 had the given state won)
    assert saved.opt_tensors["weight"]["step"].item() == 4


@pytest.mark.parametrize(
    "mode", [["--mode", "allreduce"], ["--ps", "1", "--mode", "sync"]], ids=["allreduce", "sync"]
)
def test_a_launched_job_goes_on_from_the_given_state(mode: list[str]) -> None:
    """``psflow launch --workers 2``: each worker's ``TrainingSession`` starts from a torch
    run's Adam state (in all-reduce mode every rank loads it into its own optimizer; in sync
    mode the chief sends it to the ps) and its first step is the run's fourth, on both."""
    cmd = [sys.executable, "-m", "psflow.cli", "launch", *mode, "--workers", "2"]
    cmd += ["--preload", PRELOAD, str(PROBE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = dict(re.findall(r"\[(worker:\d)\] max diff (\S+)", proc.stdout))
    assert sorted(diffs) == ["worker:0", "worker:1"], proc.stdout[-2000:]
    assert all(float(d) < 1e-6 for d in diffs.values()), diffs


def test_an_init_with_optimizer_state_the_ps_cannot_take_is_refused() -> None:
    """The ps checks the optimizer state an init carries: state of the wrong shape, for a
    variable the init does not give, or without a key the optimizer keeps gets an error reply
    naming it; the ps stays uninitialised (nothing half made), and the chief's good init then
    succeeds."""
    from psflow.protocol import Key
    from psflow.transport import PeerError
    from psflow.worker.client import ShardedClient

    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    client = ShardedClient(worker_ctx(cluster), TransportConfig(timeout=30))
    spec = OptimizerSpec.of("SGD", lr=0.5, momentum=0.9)
    w = ("w", torch.ones(2, 2))
    try:
        client.wait_ready(60, initialized=False)
        ones = torch.ones(2, 2)
        bad = [
            (
                spec,
                [w, ("w/opt/momentum_buffer", torch.ones(3))],
                r"'w'/'momentum_buffer' has shape \[3\]",
            ),
            (spec, [w, ("x/opt/momentum_buffer", ones)], "unknown variable 'x'"),
            (  # Adam's state without its step: every push would fail for want of it
                OptimizerSpec.of("Adam", lr=0.5),
                [w, ("w/opt/exp_avg", ones), ("w/opt/exp_avg_sq", ones)],
                r"state of 'w' lacks \['step'\], which torch.optim.Adam",
            ),
        ]
        for optimizer, tensors, match in bad:
            var = tensors[1][0].split("/")[0]
            with pytest.raises(PeerError, match=match):
                client.initialize({0: tensors}, optimizer, opt_state={0: {var: {}}})
            assert not client.status()[0][Key.INITIALIZED]
        good = [w, ("w/opt/momentum_buffer", torch.full((2, 2), 2.0))]
        assert client.initialize({0: good}, spec, opt_state={0: {"w": {}}})
        ((_, got),) = client.push({0: [("w", torch.ones(2, 2))]}, pull=True)[0][1]
        # momentum: buf = 0.9 * 2 + 1 = 2.8; w = 1 - 0.5 * 2.8
        torch.testing.assert_close(got, torch.full((2, 2), 1 - 0.5 * 2.8))
        client.done()
        code, err = stop(ps)
        assert code == 0, err[-3000:]  # it served on through both refusals
    finally:
        client.close()
        stop(ps, timeout=1)


def test_a_checkpoint_whose_optimizer_state_the_job_cannot_take_restores_its_values(
    tmp_path: Path,
) -> None:
    """Saved under ``Adam``, restored under ``Adam(amsgrad=True)``: the saved state lacks
    ``max_exp_avg_sq``, and every step would fail on the ps for want of it (it did). The chief
    restores the values and step, says why it leaves the optimizer state, and training goes
    on."""
    url = str(tmp_path / "ckpt")
    finals: list[torch.Tensor] = []

    def check(run: int, sess: TrainingSession, model: torch.nn.Linear) -> None:
        if run == 1:
            assert sess.restored_from == "ckpt-2" and sess.global_step == 2
            assert torch.equal(model.weight.detach(), finals[0])  # the saved values

    _sessions(url, [{}, {"adam": {"amsgrad": True}}], check, finals)
    saved = load_checkpoint(url)
    assert saved is not None and saved.name == "ckpt-4"
    assert "max_exp_avg_sq" in saved.opt_tensors["weight"]


@pytest.mark.parametrize("name", ["Adagrad", "Adam"])
def test_a_ps_with_no_dense_variable_saves_and_restores_with_any_optimizer(
    tmp_path: Path, name: str
) -> None:
    """Two ps for one dense tensor: ps:1 holds none, only the optimizer's placeholder, which
    Adagrad gives state when it is built (the save failed: ``IndexError`` on ps:1). Saved,
    restored into a second job, and stepped on: the value and state go on as one process's."""
    cluster = local_cluster(2, 1)
    url = str(tmp_path / "run")
    spec = OptimizerSpec.of(name, lr=0.1)
    reference = torch.nn.Parameter(torch.ones(3))
    ref_opt = spec.build([reference])
    for run in range(2):
        ps = [start_ps(cluster, i) for i in range(2)]
        try:
            model = torch.nn.Module()
            model.w = torch.nn.Parameter(torch.ones(3))
            with quiet_session(model, cluster, url, optimizer=spec) as sess:
                assert sess.global_step == run
                sess.zero_grad()
                loss = (model.w * torch.arange(3.0)).sum()
                loss.backward()
                sess.step(loss=loss)
                sess.save()
            ref_opt.zero_grad()
            (reference * torch.arange(3.0)).sum().backward()
            ref_opt.step()
            assert torch.equal(model.w.detach(), reference.detach()), (run, model.w, reference)
            for p in ps:
                code, err = stop(p)
                assert code == 0, err[-3000:]
        finally:
            for p in ps:
                stop(p, timeout=1)
