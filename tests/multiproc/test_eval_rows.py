"""In eval mode an id no table holds reads zeros, wherever the table's rows live: on the ps
(a lookup with ``absent_zeros``), in a cluster of one, as an export and a model server give it;
in training it reads its seeded initial row, as before."""

from __future__ import annotations

import pytest
import torch

import psflow.nn as pnn
from psflow.cluster.spec import ClusterSpec
from psflow.protocol import RowOptimizerSpec
from psflow.train import TrainingSession
from psflow.transport import TransportConfig
from psflow.worker import DistributedOptimizer

from .support import worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

HELD, NEVER = torch.tensor([3, 8]), torch.tensor([3, 999])


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    table = pnn.Embedding(None, 4, seed=5, optimizer=RowOptimizerSpec.of("SGD", lr=0.5))
    return torch.nn.ModuleDict({"emb": table, "head": torch.nn.Linear(4, 1)})


def _train_once(model: torch.nn.ModuleDict, step: object) -> None:
    model["head"](model["emb"](HELD)).sum().backward()
    step()  # type: ignore[operator]


def _modes(model: torch.nn.ModuleDict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        model.train()
        training = model["emb"](NEVER).clone()
        model.eval()
        evaluating = model["emb"](NEVER).clone()
    return training, evaluating


def _check(training: torch.Tensor, evaluating: torch.Tensor) -> None:
    assert torch.equal(training[0], evaluating[0])  # a held row reads the same in both
    assert training[1].abs().sum() > 0  # training: the seeded initial row
    assert torch.equal(evaluating[1], torch.zeros(4))  # eval: zeros


def test_through_the_ps(two_ps: ClusterSpec) -> None:
    model = _model()
    opt = DistributedOptimizer(
        model, worker_ctx(two_ps), optimizer="SGD", lr=0.1, transport=TransportConfig(timeout=30)
    )
    try:
        opt.zero_grad()
        _train_once(model, opt.step)
        _check(*_modes(model))
    finally:
        opt.close()


def test_alone(tmp_path: object) -> None:
    model = _model()
    with TrainingSession(model, None, optimizer="SGD", lr=0.1) as sess:
        sess.zero_grad()
        _train_once(model, sess.step)
        _check(*_modes(model))
