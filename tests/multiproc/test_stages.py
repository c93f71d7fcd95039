"""A model split into stages trains through a real ps as one model: the same updates as the
unsplit model trained in one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import psflow

from .support import local_cluster, start_ps, stop, worker_ctx


class Front(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 6)
        self.lstm = nn.LSTM(6, 8, batch_first=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(ids))
        return out[:, -1]


def _model() -> tuple[Front, nn.Linear]:
    torch.manual_seed(0)
    return Front(), nn.Linear(8, 4)


def test_stages_train_through_the_ps_like_the_unsplit_model() -> None:
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 30, (12, 5), generator=g), torch.randint(0, 4, (12,), generator=g))
        for _ in range(4)
    ]
    front, head = _model()
    ref = nn.Sequential(*_model())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    try:
        net = psflow.Stages([front, head], ["cpu", "cpu"], micro_batches=3)
        with psflow.DistributedOptimizer(net, worker_ctx(cluster), optimizer="SGD", lr=0.5) as opt:
            assert {p.param for p in opt.pieces} == {n for n, _ in net.named_parameters()}
            for step, (ids, y) in enumerate(batches, 1):
                opt.zero_grad()
                F.cross_entropy(net(ids), y).backward()
                assert opt.step() == step
                ref_opt.zero_grad()
                F.cross_entropy(ref(ids), y).backward()
                ref_opt.step()
                # The ps applied the split model's gradients; the pull put them in its stages.
                for (name, got), want in zip(net.named_parameters(), ref.parameters(), strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        code, err = stop(ps)
        assert code == 0, err[-2000:]
    finally:
        if ps.poll() is None:
            ps.kill()
            ps.wait()
