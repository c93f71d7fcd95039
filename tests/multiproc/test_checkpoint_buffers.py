"""A BatchNorm model trained with 2 real ps: the ps hold its parameters, the chief saves its
running statistics beside their shard files; the evaluator scores the checkpoint as the chief's
model scores by hand, a restore into fresh ps gives a new chief the saved statistics, and the
export loads strictly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from psflow.train import Evaluator, TrainingSession
from psflow.train.checkpoint import export_state_dict, load_checkpoint
from psflow.train.checkpoint_buffers import model_buffers
from psflow.train.manifest import BUFFERS_FILE

from .support import local_cluster, quiet_session, start_ps, stop

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

X = torch.randn(64, 2, generator=torch.Generator().manual_seed(0)) * 3 + 5
Y = X.sum(1, keepdim=True)


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )


def score(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        return float(F.mse_loss(model(X), Y))


def train(sess: TrainingSession, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        sess.zero_grad()
        loss = F.mse_loss(model(X), Y)
        loss.backward()
        sess.step(loss=loss)


def test_a_batchnorm_model_with_ps_is_scored_restored_and_exported_with_its_statistics(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    cluster = local_cluster(2, 1)
    procs = [start_ps(cluster, i) for i in range(2)]
    try:
        model = net()
        with quiet_session(model, cluster, str(ckpt), optimizer="SGD", lr=0.05) as sess:
            train(sess, model, 12)
            url = sess.save()
            saved = {n: b.clone() for n, b in model_buffers(model).items()}
        assert url is not None
        name = Path(url).name
        assert int(saved["1.num_batches_tracked"]) == 12
        # By hand: the ps's parameters (the checkpoint's), the chief's own statistics.
        ckpt_read = load_checkpoint(str(ckpt), name)
        assert ckpt_read is not None
        by_hand = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in by_hand.named_parameters():
                p.copy_(ckpt_read.params[n])
        results = Evaluator(
            net(), lambda m: {"loss": F.mse_loss(m(X), Y)}, str(ckpt), logdir=str(tmp_path),
            timeout=5, poll_interval=0.01,
        ).run()  # fmt: skip
        scored = {r.checkpoint: r.metrics for r in results}
        assert scored[name] is not None
        assert scored[name]["loss"] == pytest.approx(score(by_hand), rel=1e-6)

        on_disk = load_file(str(ckpt / name / BUFFERS_FILE))
        assert sorted(on_disk) == sorted(saved)
        for n, b in saved.items():
            assert torch.equal(on_disk[n], b), n

        out = tmp_path / "model.safetensors"
        export_state_dict(str(ckpt), str(out), name)
        exported = net()
        exported.load_state_dict(load_file(str(out)))  # strict
        assert score(exported) == pytest.approx(score(by_hand), rel=1e-6)

        # Fresh ps (the job's ended with it): the restore gives a new chief the saved statistics.
        for p in procs:
            stop(p, timeout=5)
        procs = [start_ps(cluster, i) for i in range(2)]
        again = net()
        with quiet_session(again, cluster, str(ckpt), optimizer="SGD", lr=0.05) as sess:
            assert sess.restored_from is not None
            for n, b in saved.items():
                assert torch.equal(model_buffers(again)[n], b), n
    finally:
        for p in procs:
            stop(p, timeout=5)
