"""``zero_grad()`` clears gradients, not the graph, as in torch: called between a forward and
its backward (``out = model(x); opt.zero_grad(); loss.backward(); opt.step()``), the tables'
rows still get that backward's gradients at the step, in a cluster of one and against ps
shards (plain, ``overlap``, prefetched rows); a backward before it is discarded, and the
lookups of a forward with no backward are never pushed nor piled up."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import psflow
import psflow.nn as pnn
from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import TaskContext, TaskSpec
from psflow.train import TrainingSession
from psflow.train.alone import LocalEngine
from psflow.transport import TransportConfig
from psflow.worker import DistributedOptimizer
from psflow.worker.engine import ExchangeEngine
from psflow.worker.lookups import Lookups

from .support import worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

VOCAB, DIM, STEPS = 20, 4, 3


class Net(torch.nn.Module):
    """A fixed table, a fixed bag table and a dense head; ``tables``: psflow's, else torch's."""

    def __init__(self, tables: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        nn: Any = pnn if tables else torch.nn
        self.emb = nn.Embedding(VOCAB, DIM)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum")
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.emb(ids[:, 0]), self.bag(ids)], dim=1)
        return self.head(x).pow(2).mean()


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (6, 3), generator=g) for _ in range(n)]  # ids repeat


Opt = Any  # DistributedOptimizer, TrainingSession, or torch.optim.SGD for the reference


def between(model: Net, opt: Opt, a: torch.Tensor, b: torch.Tensor) -> None:
    """The defect's order: zero_grad() after the forward, before its backward."""
    loss = model(a)
    opt.zero_grad()
    loss.backward()


def before(model: Net, opt: Opt, a: torch.Tensor, b: torch.Tensor) -> None:
    """The usual order."""
    opt.zero_grad()
    model(a).backward()


def both(model: Net, opt: Opt, a: torch.Tensor, b: torch.Tensor) -> None:
    """A lookup before zero_grad() and one after it, both reached by the backward."""
    first = model(a)
    opt.zero_grad()
    (first + model(b)).backward()


def discarded(model: Net, opt: Opt, a: torch.Tensor, b: torch.Tensor) -> None:
    """A backward before zero_grad(): its gradients are gone (its loss kept alive)."""
    first = model(a)
    first.backward()
    opt.zero_grad()
    model(b).backward()
    assert first.requires_grad


def again(model: Net, opt: Opt, a: torch.Tensor, b: torch.Tensor) -> None:
    """A backward before zero_grad() and one through the same graph after it: the second's."""
    loss = model(a)
    loss.backward(retain_graph=True)
    opt.zero_grad()
    loss.backward()


def scored(model: Net, opt: Opt, a: torch.Tensor, b: torch.Tensor) -> None:
    """A forward with no backward (scoring in training mode), then zero_grad()."""
    score = model(a)
    opt.zero_grad()
    model(b).backward()
    assert score.requires_grad


ORDERS: dict[str, Callable[[Net, Opt, torch.Tensor, torch.Tensor], None]] = {
    f.__name__: f for f in (between, before, both, discarded, again, scored)
}


@contextlib.contextmanager
def job(where: str, model: Net, **settings: Any) -> Iterator[Opt]:
    """``model``'s optimizer (SGD, lr 0.1): ``alone``, a cluster of one's session, or a
    worker's on 2 in-process ps shards."""
    transport = TransportConfig(timeout=30)
    if where == "alone":
        options: dict[str, Any] = {
            "optimizer": "SGD",
            "lr": 0.1,
            "checkpoint_dir": None,
            "log_step_count_steps": None,
            "save_summaries_steps": None,
        }
        with TrainingSession(model, TaskContext.alone(), **options, **settings) as sess:
            assert isinstance(sess.opt.engine, LocalEngine)
            yield sess
        return
    cluster = local_cluster(2, 1)
    servers = [
        psflow.ParameterServer(
            TaskContext(cluster=cluster, task=TaskSpec(job="ps", index=i)), transport=transport
        ).start()
        for i in range(2)
    ]
    try:
        opt = DistributedOptimizer(
            model, worker_ctx(cluster), optimizer="SGD", lr=0.1, transport=transport, **settings
        )
        try:
            yield opt
        finally:
            opt.close()
    finally:
        for server in servers:
            server.stop()


def lookups(opt: Opt) -> Lookups[Any]:
    engine = (opt.opt if isinstance(opt, TrainingSession) else opt).engine
    if isinstance(engine, LocalEngine):
        return engine.tables._looked_up
    assert isinstance(engine, ExchangeEngine)
    return engine.exchange.tables._looked_up


def trained(
    where: str, order: str, *, prefetch: bool = False, **settings: Any
) -> dict[str, torch.Tensor]:
    """The tables' rows and the head after :data:`STEPS` steps taken in ``order``."""
    data = batches(2 * STEPS + 2)
    model = Net(tables=True)
    with job(where, model, **settings) as opt:
        for step in range(STEPS):
            ORDERS[order](model, opt, data[2 * step], data[2 * step + 1])
            if prefetch:  # the next step's first batch rides this push
                model.emb.prefetch(data[2 * step + 2][:, 0])
                model.bag.prefetch(data[2 * step + 2])
            opt.step()
            assert len(lookups(opt)) == 0, "a step forgets every lookup"
        opt.pull()  # with overlap, takes the last push's reply
        model.eval()
        with torch.no_grad():
            return {
                "emb": model.emb(torch.arange(VOCAB)).clone(),
                "bag": model.bag(torch.arange(VOCAB)[:, None]).clone(),
                "head": model.head.weight.detach().clone(),
            }


def reference(order: str) -> dict[str, torch.Tensor]:
    """What torch's own modules and SGD make of the same steps."""
    tables = Net(tables=True)
    model = Net(tables=False)
    model.load_state_dict({k: v.detach().clone() for k, v in tables.state_dict().items()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(2 * STEPS + 2)
    for step in range(STEPS):
        ORDERS[order](model, opt, data[2 * step], data[2 * step + 1])
        opt.step()
    return {
        "emb": model.emb.weight.detach(),
        "bag": model.bag.weight.detach(),
        "head": model.head.weight.detach(),
    }


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("where", ["alone", "ps"])
def test_rows_take_the_gradients_torch_would_apply_around_zero_grad(where: str, order: str) -> None:
    """``zero_grad()`` between a forward and its backward: the step applies that backward's
    row gradients (they were dropped, the dense ones applied); a lookup before it and one
    after, both reached: both; a backward before it, or a forward with no backward: none
    (through a graph that a backward after it reaches again: that backward's only).
    In a cluster of one and on 2 ps, as torch.optim.SGD over torch's modules."""
    got = trained(where, order)
    want = reference(order)
    for name in ("emb", "bag", "head"):
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "settings",
    [{"overlap": True}, {"prefetch": True}, {"overlap": True, "prefetch": True}],
    ids=["overlap", "prefetch", "overlap+prefetch"],
)
def test_zero_grad_between_forward_and_backward_trains_as_before_it(
    settings: dict[str, Any],
) -> None:
    """With ``overlap`` (a push in flight as the next forward looks up) and prefetched rows
    (the forward takes the rows that came with the last push), ``zero_grad()`` between the
    forward and its backward trains as ``zero_grad()`` before the forward does."""
    usual = trained("ps", "before", **settings)
    got = trained("ps", "between", **settings)
    for name in ("emb", "bag", "head"):
        torch.testing.assert_close(got[name], usual[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("where", ["alone", "ps"])
def test_lookups_of_forwards_with_no_backward_do_not_pile_up(where: str) -> None:
    """Forwards in training mode with no backward and no step (scoring), each followed by
    ``zero_grad()``: the lookups they leave go with their graphs, and none is pushed."""
    data = batches(40)
    model = Net(tables=True)
    with job(where, model) as opt:
        before = model.emb(torch.arange(VOCAB)).detach().clone()
        opt.zero_grad()
        for ids in data:
            model(ids)  # its graph dropped at once
            opt.zero_grad()
            assert len(lookups(opt)) == 0
        kept = model(data[0])  # a graph still held: its lookups stay, weakly
        opt.zero_grad()
        assert len(lookups(opt)) == 2  # the fixed table's and the bag's
        model(data[1]).backward()
        opt.step()
        assert len(lookups(opt)) == 0
        del kept
        touched = torch.zeros(VOCAB, dtype=torch.bool)  # by the one backward, the only push
        touched[data[1][:, 0]] = True
        model.eval()
        with torch.no_grad():
            after = model.emb(torch.arange(VOCAB))
        assert not torch.equal(after[touched], before[touched])
        torch.testing.assert_close(after[~touched], before[~touched], rtol=0, atol=0)
