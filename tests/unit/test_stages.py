"""Stages (model parallel, micro-batches) and towers (data parallel) give the gradients of the
unsplit model on one device, for the text classifier's shape: embedding -> LSTM -> linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from psflow.worker import Stages, Towers

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Front(nn.Module):
    """Embedding and LSTM: the last step's output of each sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(30, 6)
        self.lstm = nn.LSTM(6, 8, batch_first=True)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(ids))
        return out[torch.arange(len(ids), device=out.device), lengths.to(out.device) - 1]


def _model() -> tuple[Front, nn.Linear]:
    torch.manual_seed(0)
    return Front().double(), nn.Linear(8, 4).double()


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 7, (n,), generator=g)
    ids = torch.randint(1, 30, (n, 7), generator=g) * (torch.arange(7) < lengths[:, None])
    return ids, lengths, torch.randint(0, 4, (n,), generator=g)


def _grads(*modules: nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": p.grad.cpu()  # type: ignore[union-attr]
        for i, m in enumerate(modules)
        for name, p in m.named_parameters()
    }


def _reference(n: int) -> tuple[dict[str, torch.Tensor], float]:
    front, head = _model()
    ids, lengths, y = _data(n)
    loss = F.cross_entropy(head(front(ids, lengths)), y)
    loss.backward()
    return _grads(front, head), loss.item()


@pytest.mark.parametrize(("micro_batches", "n"), [(1, 8), (4, 8), (3, 10), (4, 3)])
def test_stages_give_the_unsplit_gradients(micro_batches: int, n: int) -> None:
    want, want_loss = _reference(n)
    front, head = _model()
    net = Stages([front, head], ["cpu", "cpu"], micro_batches=micro_batches)
    ids, lengths, y = _data(n)
    for _ in range(2):  # a second step: gradients cleared and made again, not carried over
        net.zero_grad()
        logits = net(ids, lengths)
        loss = F.cross_entropy(logits, y)
        loss.backward()
    assert logits.shape == (n, 4)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    got = _grads(front, head)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)
    # The parameters are the stage modules' own: an optimizer given `net` trains them.
    assert {id(p) for p in net.parameters()} == {
        id(p) for p in [*front.parameters(), *head.parameters()]
    }


def test_towers_give_an_embedding_looked_up_once_the_batch_gradient() -> None:
    """The example's towers: the embedding runs once, outside; LSTM and classifier per tower."""

    class Rest(nn.Module):
        def __init__(self, front: Front, head: nn.Linear) -> None:
            super().__init__()
            self.lstm, self.head = front.lstm, head

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(x)
            return self.head(out[torch.arange(len(x)), lengths - 1])

    want, want_loss = _reference(10)
    front, head = _model()
    towers = Towers(Rest(front, head), ["cpu", "cpu", "cpu"])
    ids, lengths, y = _data(10)
    front.embedding.zero_grad()
    x = front.embedding(ids)
    loss = towers.backward(lambda m, x, n, y: F.cross_entropy(m(x, n), y), x, lengths, y)
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    got = _grads(front, head)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_bad_stages_are_refused() -> None:
    front, head = _model()
    with pytest.raises(ValueError, match="2 stages but 1 devices"):
        Stages([front, head], ["cpu"])
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        Stages([front, head], ["cpu", "cpu"], micro_batches=0)
    with pytest.raises(ValueError, match="stages run on cpu or cuda"):
        Stages([front, head], ["cpu", "mps"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda:0 is not available"):
            Stages([front, head], ["cpu", "cuda:0"])
    net = Stages([front, head], ["cpu", "cpu"])
    with pytest.raises(ValueError, match="differ in batch size"):
        net(torch.zeros(4, 7, dtype=torch.long), torch.ones(3, dtype=torch.long))


@CUDA
def test_stages_on_cuda_and_cpu_give_the_unsplit_gradients() -> None:
    want, _ = _reference(8)
    front, head = _model()
    net = Stages([front, head], ["cuda:0", "cpu"], micro_batches=4)
    ids, lengths, y = _data(8)
    F.cross_entropy(net(ids, lengths), y).backward()
    assert next(front.parameters()).device.type == "cuda"
    got = _grads(front, head)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-7, atol=1e-9, msg=name)
