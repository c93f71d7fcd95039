"""Two contracts of psflow.nn's tables that torch's modules leave to their callers.

- ``include_last_offset``: the last offset must be the number of ids (torch's contract). torch
  does not check it, and gives numbers that disagree with each other when it is short: its
  forward leaves the ids after the last offset out, or with a ``padding_idx`` adds them to the
  last bag, and its CPU backward without one gives them uninitialised memory. psflow refuses
  such offsets, in every path (local, attached, hashed, eval mode, a cluster of one).
- A hashed table held in this process applies its row-wise optimizer once per backward pass:
  the table looked up several times in one loss updates each id once, with the gradients of
  all the lookups summed, as the same table on a ps does.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import psflow
import psflow.nn as pnn
from psflow.cluster.spec import TaskContext
from psflow.nn import EmbeddingBag, RowOptimizerSpec, TableModule
from psflow.sparse.optim import RowOptimizer

pytestmark = pytest.mark.unit

N, DIM = 9, 3


class DenseSource:
    """A row source serving rows from a dense tensor (as test_nn_embedding's)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().clone()
        self.asked = 0

    def rows(self, table: TableModule, ids: torch.Tensor) -> torch.Tensor:
        self.asked += 1
        return self.weight[ids].clone().requires_grad_(True)


def _session(model: torch.nn.Module) -> psflow.TrainingSession:
    """A cluster of one: the model's tables attached to a ps in this process."""
    return psflow.TrainingSession(
        model, TaskContext.alone(), optimizer="SGD", lr=0.1, checkpoint_dir=None,
        log_step_count_steps=None, save_summaries_steps=None,
    )  # fmt: skip


# -- include_last_offset: the last offset is the number of ids ------------------------------

IDS = torch.tensor([0, 0, 8, 4, 0, 8, 8, 2, 4])


def _bag(kind: str, mode: str, padding_idx: int | None) -> tuple[EmbeddingBag, DenseSource | None]:
    opt = RowOptimizerSpec.of("SGD", lr=1.0)
    if kind.startswith("hashed"):
        bag = EmbeddingBag(None, DIM, mode=mode, include_last_offset=True, padding_idx=padding_idx,
                           optimizer=opt)  # fmt: skip
        bag.load_rows(torch.tensor([0, 2, 4]), torch.randn(3, DIM))
        if kind == "hashed-eval":
            bag.eval()
        return bag, None
    bag = EmbeddingBag(N, DIM, mode=mode, include_last_offset=True, padding_idx=padding_idx)
    source = None
    if kind == "attached":
        source = DenseSource(bag.weight)
        bag.attach(source)
    return bag, source


@pytest.mark.parametrize("offsets", [[0, 0, 3, 3, 5], [0, 0, 3, 3, 12]], ids=["short", "past"])
@pytest.mark.parametrize("padding_idx", [None, 8], ids=["", "padded"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max", "sqrtn"])
@pytest.mark.parametrize("kind", ["local", "attached", "hashed", "hashed-eval"])
def test_a_last_offset_that_is_not_the_number_of_ids_is_refused(
    kind: str, mode: str, padding_idx: int | None, offsets: list[int]
) -> None:
    """With ``include_last_offset``, a last offset short of the ids (which torch's forward
    and backward disagree about) or past them is refused, naming both numbers, before any row
    is asked for; with or without gradients, with or without weights."""
    bag, source = _bag(kind, mode, padding_idx)
    weights = torch.rand(IDS.shape) if mode in ("sum", "sqrtn") else None
    last = offsets[-1]
    for w in (None, weights):
        with pytest.raises(ValueError, match=rf"offsets\[-1\] = {last}.* {len(IDS)} ids"):
            bag(IDS, torch.tensor(offsets), w)
        with torch.no_grad(), pytest.raises(ValueError, match=rf"offsets\[-1\] = {last}"):
            bag(IDS, torch.tensor(offsets), w)
    assert source is None or source.asked == 0
    # The same bags closed by the number of ids are taken.
    fixed = torch.tensor([*offsets[:-1], len(IDS)])
    assert bag(IDS, fixed).shape == (len(offsets) - 1, DIM)


def test_a_cluster_of_one_refuses_a_short_last_offset_and_trains_a_right_one_as_torch() -> None:
    """In a cluster of one (the table on a ps in this process): a short last offset is refused;
    bags whose last offset is the number of ids give torch's output, and the ps applies
    torch's gradient (SGD, lr 1: the rows move by it), the padding row untouched."""
    logging.disable(logging.WARNING)
    try:
        torch.manual_seed(0)
        model = torch.nn.Module()
        model.l = torch.nn.Linear(1, 1)
        model.e = EmbeddingBag(N, DIM, mode="sum", include_last_offset=True, padding_idx=8,
                               optimizer=RowOptimizerSpec.of("SGD", lr=1.0))  # fmt: skip
        ref = torch.nn.EmbeddingBag(N, DIM, mode="sum", include_last_offset=True, padding_idx=8)
        ref.weight.data.copy_(model.e.weight.detach())
        start = model.e.weight.detach().clone()
        offsets = torch.tensor([0, 0, 3, 3, len(IDS)])
        upstream = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
        sess = _session(model)
        with sess:
            sess.zero_grad()
            with pytest.raises(ValueError, match=r"offsets\[-1\] = 5.* 9 ids"):
                model.e(IDS, torch.tensor([0, 0, 3, 3, 5]))
            out, want = model.e(IDS, offsets), ref(IDS, offsets)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
            loss = (out * upstream).sum()
            loss.backward()
            sess.step(loss=loss)
            model.eval()
            with torch.no_grad():
                rows = model.e(torch.arange(N).view(-1, 1))
    finally:
        logging.disable(logging.NOTSET)
    (want * upstream).sum().backward()
    assert ref.weight.grad is not None
    torch.testing.assert_close(start - rows, ref.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(ref.weight.grad[8]) == 0 and torch.equal(rows[8], start[8])


@pytest.mark.parametrize("kind", ["local", "attached", "hashed"])
@pytest.mark.parametrize("padding_idx", [None, 8], ids=["", "padded"])
def test_bags_closed_by_the_number_of_ids_train_as_torch_s(
    kind: str, padding_idx: int | None
) -> None:
    """A right ``include_last_offset`` input: torch's output and torch's gradient, locally
    (torch's optimizer on the weight), attached (the rows' gradient) and hashed (its fused
    SGD, lr 1: the rows move by the gradient)."""
    torch.manual_seed(2)
    bag, source = _bag(kind, "sum", padding_idx)
    ref = torch.nn.EmbeddingBag(N, DIM, mode="sum", include_last_offset=True,
                                padding_idx=padding_idx)  # fmt: skip
    ids = torch.tensor([0, 2, 8, 4, 0, 8, 2, 2, 4])
    if kind == "hashed":  # its rows as its lookups give them (the padding row zeros)
        with torch.no_grad():
            start = bag(torch.arange(N).view(-1, 1)).clone()
    else:
        start = (bag.weight if source is None else source.weight).detach().clone()
    ref.weight.data.copy_(start)
    offsets = torch.tensor([0, 0, 3, 3, len(ids)])
    out, want = bag(ids, offsets), ref(ids, offsets)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert ref.weight.grad is not None
    if kind == "local":
        assert bag.weight.grad is not None
        torch.testing.assert_close(bag.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    elif kind == "attached":
        assert type(out.grad_fn).__name__ == "BagRowsBackward"
    else:
        with torch.no_grad():
            rows = bag(torch.arange(N).view(-1, 1))
        torch.testing.assert_close(start - rows, ref.weight.grad, rtol=1e-5, atol=1e-5)


# -- a hashed table held here: one update per backward pass ---------------------------------

SPECS = [
    RowOptimizerSpec.of("Adagrad", lr=0.5),
    RowOptimizerSpec.of("RowWiseAdagrad", lr=0.5),
    RowOptimizerSpec.of("Adam", lr=0.1),
    RowOptimizerSpec.of("Ftrl", lr=0.05, l1=0.01),
    RowOptimizerSpec.of("SGD", lr=0.5),
]


def _reference(
    spec: RowOptimizerSpec, start: torch.Tensor, grads: list[torch.Tensor]
) -> torch.Tensor:
    """``start`` after one row-wise update a gradient of ``grads`` (each of every row, one
    after the other), applied to the rows each touches: what a ps does with each step."""
    ro = RowOptimizer(spec)
    rows, state = start.clone(), ro.new_state(start.shape[0], start.shape[1], start.dtype)
    for grad in grads:
        touched = grad.abs().sum(1).nonzero().view(-1)
        ro.apply(rows, state, touched, grad[touched])
    return rows


def _dense_grad(start: torch.Tensor, lookups: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The gradient of ``sum((start[x] * c).sum() for x, c in lookups)`` (torch's, summed over
    the lookups in one backward)."""
    w = start.clone().requires_grad_(True)
    sum((w[x] * c).sum() for x, c in lookups).backward()  # type: ignore[union-attr]
    return w.grad


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
@pytest.mark.parametrize("cls", [pnn.Embedding, pnn.EmbeddingBag])
def test_a_table_looked_up_several_times_in_one_loss_updates_once(
    cls: type[pnn.Embedding | pnn.EmbeddingBag], spec: RowOptimizerSpec
) -> None:
    """A hashed table held here looked up twice (then three times) in one loss: one update
    per id, of the sum of its gradients, to the bit what the row-wise optimizer gives for the
    summed gradient (as the same table on a ps is updated)."""
    torch.manual_seed(0)
    h = cls(None, DIM, optimizer=spec)
    ids = torch.arange(10)

    def look(x: torch.Tensor) -> torch.Tensor:
        return h(x.view(-1, 1)) if cls is pnn.EmbeddingBag else h(x)

    with torch.no_grad():
        start = look(ids).clone()
    x1, x2, x3 = torch.tensor([1, 2, 2, 5]), torch.tensor([5, 1, 7]), torch.tensor([7, 9, 1])
    c1, c2, c3 = torch.ones(4, DIM), -2 * torch.ones(3, DIM), torch.rand(3, DIM)
    ((look(x1) * c1).sum() + (look(x2) * c2).sum()).backward()
    with torch.no_grad():
        got = look(ids)
    want = _reference(spec, start, [_dense_grad(start, [(x1, c1), (x2, c2)])])
    assert torch.equal(got, want), (got - want).abs().max()

    # Three lookups in the next backward: one more update each, on their sum.
    ((look(x1) * c1).sum() + (look(x2) * c2).sum() + (look(x3) * c3).sum()).backward()
    with torch.no_grad():
        got = look(ids)
    first = _dense_grad(start, [(x1, c1), (x2, c2)])
    want = _reference(spec, start, [first, _dense_grad(start, [(x1, c1), (x2, c2), (x3, c3)])])
    assert torch.equal(got, want), (got - want).abs().max()


def test_each_backward_pass_is_one_update() -> None:
    """The documented contract ("applies its row-wise optimizer in backward"): two losses, two
    backward passes, two updates, each of its own pass's lookups (torch would add the
    gradients into ``.grad`` for one step; this table has no step)."""
    spec = RowOptimizerSpec.of("Adagrad", lr=0.5)
    torch.manual_seed(1)
    h = pnn.Embedding(None, DIM, optimizer=spec)
    ids = torch.arange(6)
    with torch.no_grad():
        start = h(ids).clone()
    x1, x2 = torch.tensor([1, 2, 2]), torch.tensor([2, 4])
    a, b = h(x1), h(x2)  # both looked up before either backward: both read the start rows
    a.sum().backward()
    (3 * b).sum().backward()
    with torch.no_grad():
        got = h(ids)
    g1 = _dense_grad(start, [(x1, torch.ones(3, DIM))])
    g2 = _dense_grad(start, [(x2, 3 * torch.ones(2, DIM))])
    assert torch.equal(got, _reference(spec, start, [g1, g2]))


def test_a_backward_that_fails_updates_nothing() -> None:
    """The update is applied once the whole backward pass is done: one that fails part way
    applies none of it, and the next one applies only its own gradients."""
    spec = RowOptimizerSpec.of("SGD", lr=1.0)
    h = pnn.Embedding(None, DIM, optimizer=spec)
    ids = torch.arange(4)
    with torch.no_grad():
        start = h(ids).clone()

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("a failing backward")

    failing = Fail.apply(h(torch.tensor([2]))).sum()
    loss = failing + h(torch.tensor([1])).sum()  # row 1's gradient comes first, then the error
    with pytest.raises(RuntimeError, match="a failing backward"):
        loss.backward()
    with torch.no_grad():
        assert torch.equal(h(ids), start)
    h(torch.tensor([3])).sum().backward()
    with torch.no_grad():
        got = h(ids)
    assert torch.equal(got[:3], start[:3])
    assert torch.equal(got[3], start[3] - 1)


def test_one_backward_pass_is_one_push_to_admission() -> None:
    """``min_count`` counts pushes, one a step on the ps: here one a backward pass, however
    many lookups of the id it had (two lookups in one loss are not two pushes)."""
    h = pnn.Embedding(None, DIM, optimizer=RowOptimizerSpec.of("SGD", lr=1.0), min_count=2)
    x = torch.tensor([4])
    (h(x).sum() + h(x).sum()).backward()  # one pass: one push, not admitted
    assert h.held_ids() is None
    torch.autograd.backward([h(x).sum(), h(x).sum()])  # one pass over two losses: the second
    held = h.held_ids()
    assert held is not None and held.tolist() == [4]
