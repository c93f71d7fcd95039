"""Embedding tables on real ps processes: rows pulled by id, row gradients pushed with the
step, row-wise optimizers applied on the ps, every mode, checkpoints restored into another
number of ps, and bad ids refused while the ps keeps serving."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import psflow.nn as pnn
from psflow.cluster.spec import ClusterSpec
from psflow.protocol import Key, Op, OptimizerSpec, RowOptimizerSpec
from psflow.train import CheckpointDir, Evaluator, TrainingSession, load_checkpoint
from psflow.transport import PeerError, TransportConfig
from psflow.worker import DistributedOptimizer
from psflow.worker.engine import ExchangeEngine
from psflow.worker.tables import TableClient

from .support import (
    CLI_MAIN,
    local_cluster,
    quiet_session,
    run_forked,
    start_ps,
    stop,
    worker_ctx,
)
from .sync_support import run_threads

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

VOCAB, DIM, HASHED_DIM = 50, 4, 3


class Recommender(torch.nn.Module):
    """A fixed table, a hashed bag table and a dense head: every path of the tables."""

    def __init__(self, partition: str = "mod") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = pnn.Embedding(VOCAB, DIM, padding_idx=0, partition=partition, seed=1)
        self.users = pnn.EmbeddingBag(
            None, HASHED_DIM, mode="sum", seed=2, init_std=0.1, optimizer="Adagrad"
        )
        self.head = torch.nn.Linear(DIM + HASHED_DIM, 1)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.items(items).mean(1), self.users(users)], dim=1)
        return self.head(x).squeeze(1)


def batch(step: int, worker: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + worker)
    items = torch.randint(0, VOCAB, (size, 3), generator=g)
    users = torch.randint(-(2**40), 2**40, (size, 2), generator=g)  # any int64 id
    users[:, 1] = users[:, 0] % 7  # some repeated ids across the batch
    y = torch.randn(size, generator=g)
    return items, users, y


def loss_of(model: Recommender, items: torch.Tensor, users: torch.Tensor, y: torch.Tensor):
    return F.mse_loss(model(items, users), y)


def tables(opt: DistributedOptimizer | TrainingSession) -> TableClient:
    engine = (opt.opt if isinstance(opt, TrainingSession) else opt).engine
    assert isinstance(engine, ExchangeEngine)
    return engine.exchange.tables


def table_rows(opt: DistributedOptimizer, name: str, ids: torch.Tensor) -> torch.Tensor:
    client = tables(opt)
    rows = client.rows(client.modules[name], ids).detach().clone()
    client.clear()
    return rows


def _ps(cluster: ClusterSpec) -> list[subprocess.Popen[str]]:
    return [start_ps(cluster, i) for i in range(cluster.num_tasks("ps"))]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
"""The worker's devices: on CUDA its model and batches are there, its rows come there, and
the ps stay on the CPU."""


@pytest.mark.usefixtures("path")  # the worker's grouping: psflow's kernel, or torch's ops
@pytest.mark.parametrize("device", DEVICES)
def test_one_worker_matches_one_process_adagrad(two_ps: ClusterSpec, device: str) -> None:
    """One asynchronous worker against 2 ps takes exactly the steps one process takes with
    torch.optim.Adagrad over a local copy of the same model (rows untouched by a step get a
    zero gradient there, which Adagrad leaves as they are): its model on the CPU, or on CUDA
    (the rows it pulls land there), against the one process on the CPU."""
    local = Recommender()
    users_rows = {}
    # The hashed table's rows start from (seed, id): the same on the ps as in a local module.
    remote = Recommender().to(device)
    torch.manual_seed(0)
    ref_items = torch.nn.Embedding(VOCAB, DIM, padding_idx=0)
    ref_items.weight.data.copy_(local.items.weight.data)
    opt = DistributedOptimizer(
        remote,
        worker_ctx(two_ps),
        optimizer="Adagrad",
        lr=0.1,
        transport=TransportConfig(timeout=30),
    )
    try:
        assert not any("items" in n for n, _ in opt.engine.exchange.params.items())
        assert remote.items.attached and remote.users.attached
        ref_opt = torch.optim.Adagrad([*ref_items.parameters(), *local.head.parameters()], lr=0.1)
        for step in range(6):
            items, users, y = batch(step, 0, 8)
            opt.zero_grad()
            assert remote.items(items.to(device)).device.type == device
            loss_of(remote, items.to(device), users.to(device), y.to(device)).backward()
            opt.step()
            ref_opt.zero_grad()
            x = torch.cat([ref_items(items).mean(1), local.users(users)], 1)
            F.mse_loss(local.head(x).squeeze(1), y).backward()
            ref_opt.step()
            users_rows[step] = users
        got = table_rows(opt, "items", torch.arange(VOCAB))
        torch.testing.assert_close(got, ref_items.weight.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(got[0], torch.zeros(DIM)), "the padding row never moves"
        for name in ("weight", "bias"):
            torch.testing.assert_close(
                getattr(remote.head, name).detach().cpu(), getattr(local.head, name).detach()
            )
        status = tables(opt).status()
        assert set(status) == {0, 1}
        held = sum(int(s["users"]["rows"]) for s in status.values())
        distinct = len(torch.unique(torch.cat([u.flatten() for u in users_rows.values()])))
        assert held == distinct, (held, distinct, status)
    finally:
        opt.close()


def test_a_table_on_the_jobs_optimizer_follows_its_schedule(two_ps: ClusterSpec) -> None:
    """A table that names no optimizer takes the job's, schedule included: one worker with
    SGD and StepLR takes the steps of one process with torch.optim.SGD and the same scheduler
    over the whole model (the dense head and the table's rows alike)."""
    torch.manual_seed(0)
    remote = torch.nn.ModuleDict(
        {"emb": pnn.Embedding(VOCAB, DIM, seed=1), "head": torch.nn.Linear(DIM, 1)}
    )
    ref_items = torch.nn.Embedding(VOCAB, DIM)
    ref_items.weight.data.copy_(remote["emb"].weight.data)
    ref_head = torch.nn.Linear(DIM, 1)
    ref_head.load_state_dict(remote["head"].state_dict())
    schedule = ("StepLR", {"step_size": 2, "gamma": 0.25})
    opt = DistributedOptimizer(
        remote,
        worker_ctx(two_ps),
        optimizer="SGD",
        lr=0.5,
        lr_schedule=schedule,
        transport=TransportConfig(timeout=30),
    )
    try:
        ref_opt = torch.optim.SGD([*ref_items.parameters(), *ref_head.parameters()], lr=0.5)
        ref_schedule = torch.optim.lr_scheduler.StepLR(ref_opt, **schedule[1])
        for step in range(7):
            items, _, y = batch(step, 0, 8)
            opt.zero_grad()
            F.mse_loss(remote["head"](remote["emb"](items).mean(1)).squeeze(1), y).backward()
            opt.step()
            ref_opt.zero_grad()
            F.mse_loss(ref_head(ref_items(items).mean(1)).squeeze(1), y).backward()
            ref_opt.step()
            ref_schedule.step()
        assert ref_schedule.get_last_lr()[0] < 0.5 / 10  # the rate did move
        got = table_rows(opt, "emb", torch.arange(VOCAB))
        torch.testing.assert_close(got, ref_items.weight.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(remote["head"].weight.detach(), ref_head.weight.detach())
    finally:
        opt.close()


@pytest.mark.parametrize("bad", [VOCAB, -1, 2**62])
def test_an_id_out_of_range_is_named_by_the_worker_before_any_request(
    two_ps: ClusterSpec, bad: int
) -> None:
    """Checked as the worker groups the batch's ids (one pass with their grouping), and as a
    coming batch's are asked for with the next step (``prefetch``)."""
    table = pnn.Embedding(VOCAB, DIM, seed=1)
    opt = DistributedOptimizer(table, worker_ctx(two_ps), lr=0.1)
    try:
        client = tables(opt).client
        sent = client.send
        asked: list[object] = []
        client.send = lambda *a, **k: (asked.append(a), sent(*a, **k))[1]  # type: ignore[method-assign]
        with pytest.raises(IndexError, match=rf"table .*id {bad} is out of range.*\[0, {VOCAB}\)"):
            table(torch.tensor([[1, 2], [bad, 3]]))
        with pytest.raises(IndexError, match=rf"table .*id {bad} is out of range"):
            table.prefetch(torch.tensor([[1, 2], [bad, 3]]))
        assert asked == [] and not tables(opt).prefetched.asked
        assert table(torch.tensor([1, VOCAB - 1])).shape == (2, DIM)  # and it goes on
    finally:
        opt.close()


def test_bad_ids_are_refused_and_the_ps_keeps_serving(two_ps: ClusterSpec) -> None:
    model = Recommender()
    opt = DistributedOptimizer(
        model, worker_ctx(two_ps), lr=0.1, transport=TransportConfig(timeout=30)
    )
    try:
        client = tables(opt).client
        with pytest.raises(PeerError, match=r"items.*(1000|out of range)"):
            client.lookup({0: [("items", torch.tensor([1000 * 2], dtype=torch.int64))]})
        with pytest.raises(PeerError, match="items"):
            client.lookup({0: [("items", torch.tensor([1.0]))]})  # not int64
        with pytest.raises(PeerError, match="nothing"):
            client.lookup({1: [("nothing", torch.tensor([1], dtype=torch.int64))]})
        # A push of rows of the wrong width: refused, and nothing changes.
        before = table_rows(opt, "items", torch.tensor([2]))
        bad = {0: {Key.OP: Op.PUSH, Key.ROWS: ["items"]}}
        tensors = {0: [("items#ids", torch.tensor([2])), ("items#grad", torch.ones(1, DIM + 1))]}
        with pytest.raises(PeerError, match="items"):
            client.call(bad, tensors)
        torch.testing.assert_close(table_rows(opt, "items", torch.tensor([2])), before)
        with pytest.raises((IndexError, ValueError), match="items"):
            model.items(torch.tensor([[VOCAB]]))  # named on the worker, before any request
        items, users, y = batch(0, 0, 4)
        opt.zero_grad()
        loss_of(model, items, users, y).backward()
        assert opt.step() == 1
    finally:
        opt.close()


def test_sync_workers_equal_one_process_with_their_joint_batch() -> None:
    """K synchronous workers with batch B give the same table as one process with batch K*B
    (row gradients summed per id over the replicas and divided by their number)."""
    cluster = local_cluster(2, 2)
    procs = _ps(cluster)
    try:
        models = [Recommender(partition="div") for _ in range(2)]
        local = Recommender(partition="div")
        ref_items = torch.nn.Embedding(VOCAB, DIM, padding_idx=0)
        ref_items.weight.data.copy_(local.items.weight.data)
        opts: list[DistributedOptimizer] = []

        def make(i: int) -> None:
            opts.append(
                DistributedOptimizer(
                    models[i],
                    worker_ctx(cluster, i),
                    optimizer="SGD",
                    lr=0.5,
                    mode="sync",
                    transport=TransportConfig(timeout=30),
                )
            )

        run_threads([lambda: make(0), lambda: make(1)])
        steps = 4

        def train(i: int) -> None:
            model = models[i]
            opt = next(o for o in opts if o.model is model)
            for step in range(steps):
                items, _, y = batch(step, i, 4)
                opt.zero_grad()
                x = model.items(items).mean(1)
                F.mse_loss(x.sum(1), y).backward()
                opt.step()

        run_threads([lambda: train(0), lambda: train(1)])
        ref_opt = torch.optim.SGD(ref_items.parameters(), lr=0.5)
        for step in range(steps):
            parts = [batch(step, i, 4) for i in range(2)]
            items = torch.cat([p[0] for p in parts])
            y = torch.cat([p[2] for p in parts])
            ref_opt.zero_grad()
            F.mse_loss(ref_items(items).mean(1).sum(1), y).backward()
            ref_opt.step()
        got = table_rows(opts[0], "items", torch.arange(VOCAB))
        torch.testing.assert_close(got, ref_items.weight.detach(), rtol=1e-5, atol=1e-6)
        assert opts[0].global_step == steps
    finally:
        for opt in opts:
            opt.close()
        for p in procs:
            stop(p, timeout=5)


def test_staleness_mode_trains_tables() -> None:
    cluster = local_cluster(1, 1)
    procs = _ps(cluster)
    try:
        model = Recommender()
        opt = DistributedOptimizer(
            model,
            worker_ctx(cluster),
            lr=0.05,
            max_staleness=1,
            transport=TransportConfig(timeout=30),
        )
        items, users, y = batch(0, 0, 16)
        first = None
        for _ in range(20):
            opt.zero_grad()
            loss = loss_of(model, items, users, y)
            loss.backward()
            opt.step()
            first = first if first is not None else loss.item()
        assert loss.item() < first
        opt.close()
    finally:
        for p in procs:
            stop(p, timeout=5)


def _session(model: torch.nn.Module, cluster: ClusterSpec, url: str) -> TrainingSession:
    return quiet_session(model, cluster, url, timeout=30, optimizer="Adam", lr=0.01)


def test_a_checkpoint_restores_tables_into_another_number_of_ps(tmp_path: Path) -> None:
    """Tables and their row-wise state are saved with the dense variables and restored into
    3 ps from a checkpoint of 2: the same rows, and training goes on."""
    url = str(tmp_path / "ckpt")
    ids = torch.arange(VOCAB)
    probe_users = torch.cat([batch(s, 0, 8)[1].flatten() for s in range(3)]).unique()
    saved: dict[str, torch.Tensor] = {}
    for run, num_ps in enumerate((2, 3)):
        cluster = local_cluster(num_ps, 1)
        procs = _ps(cluster)
        try:
            model = Recommender()
            with _session(model, cluster, url) as sess:
                if run == 0:
                    for step in range(3):
                        items, users, y = batch(step, 0, 8)
                        sess.zero_grad()
                        loss = loss_of(model, items, users, y)
                        loss.backward()
                        sess.step(loss=loss)
                    saved["items"] = table_rows(sess.opt, "items", ids)
                    saved["users"] = table_rows(sess.opt, "users", probe_users)
                else:
                    assert sess.restored_from == "ckpt-3"
                    torch.testing.assert_close(table_rows(sess.opt, "items", ids), saved["items"])
                    torch.testing.assert_close(
                        table_rows(sess.opt, "users", probe_users), saved["users"]
                    )
                    items, users, y = batch(9, 0, 8)
                    sess.zero_grad()
                    loss = loss_of(model, items, users, y)
                    loss.backward()
                    sess.step(loss=loss)
            for p in procs:
                code, err = stop(p)
                assert code == 0, err[-3000:]
        finally:
            for p in procs:
                stop(p, timeout=1)
    manifest = CheckpointDir(url).manifest("ckpt-3")
    assert set(manifest.tables) == {"items", "users"}
    assert manifest.tables["items"]["rows"] == VOCAB
    assert manifest.tables["users"]["rows"] == len(probe_users)
    cli = ["-c", CLI_MAIN, "checkpoint"]  # `psflow checkpoint`, forked (:mod:`.forked`)
    inspected = run_forked([*cli, "inspect", url, "--name", "ckpt-3"], timeout=60)
    assert inspected.returncode == 0, inspected.stderr[-3000:]
    shown = inspected.stdout
    assert re.search(rf"items\s+{VOCAB} x {DIM}\s+rows {VOCAB}", shown), shown
    assert re.search(rf"users\s+hashed x {HASHED_DIM}\s+rows {len(probe_users)}", shown), shown
    out = tmp_path / "plain.safetensors"
    exported = run_forked([*cli, "export", url, str(out), "--name", "ckpt-3"], timeout=60)
    assert exported.returncode == 0, exported.stderr[-3000:]
    said = exported.stdout
    assert "2 embedding tables (1 hashed: <table>.ids and <table>.rows) of ckpt-3" in said, said
    plain = torch.nn.Embedding(VOCAB, DIM)
    exported = load_file(out)
    plain.load_state_dict({"weight": exported["items.weight"]})
    torch.testing.assert_close(plain.weight.detach(), saved["items"])
    # The whole model loads it with no ps, strictly: the hashed table's ids and rows too.
    served = Recommender()
    served.load_state_dict(exported)
    assert torch.equal(served.users.held_ids(), probe_users.sort().values)
    with torch.no_grad():
        torch.testing.assert_close(served.users(probe_users.view(-1, 1)), saved["users"])
    # The evaluator loads it with no ps: the fixed table into its weight, the hashed one's rows
    # kept on the evaluator (an id never trained reads as its initial row, as from the ps).
    fresh = Recommender()
    initial = fresh.users(torch.tensor([[12345]])).detach()  # local hashed rows, before
    Evaluator(fresh, lambda m: {"x": 0.0}, url, logdir=str(tmp_path)).load("ckpt-3")
    torch.testing.assert_close(fresh.items.weight.detach(), saved["items"])
    torch.testing.assert_close(fresh.users(probe_users.view(-1, 1)).detach(), saved["users"])
    torch.testing.assert_close(fresh.users(torch.tensor([[12345]])).detach(), initial)
    dense = load_checkpoint(url, "ckpt-3")
    assert dense is not None
    torch.testing.assert_close(fresh.head.weight.detach(), dense.params["head.weight"])
    wrong = Recommender()
    wrong.items = pnn.Embedding(VOCAB + 1, DIM)
    with pytest.raises(ValueError, match=rf"ckpt-3: table 'items' is {VOCAB} x {DIM}"):
        Evaluator(wrong, lambda m: {"x": 0.0}, url, logdir=str(tmp_path)).load("ckpt-3")


@pytest.mark.parametrize("optimizer", ["SGD", "Adagrad"])
def test_a_plain_torch_sparse_embedding_pushes_rows(two_ps: ClusterSpec, optimizer: str) -> None:
    """``torch.nn.Embedding(sparse=True)`` (a dense parameter on the ps, partitioned over 2
    shards here) pushes only the rows its batch touched, and trains as in one process."""
    torch.manual_seed(3)
    remote = torch.nn.EmbeddingBag(40, 4, mode="sum", sparse=True)
    local = torch.nn.EmbeddingBag(40, 4, mode="sum", sparse=True)
    local.weight.data.copy_(remote.weight.data)
    opt = DistributedOptimizer(
        remote,
        worker_ctx(two_ps),
        optimizer=optimizer,
        lr=0.1,
        partition_bytes=64,  # 40 x 4 floats: split by rows over both shards
        transport=TransportConfig(timeout=30),
    )
    try:
        assert {p.shard for p in opt.pieces} == {0, 1}
        ref = getattr(torch.optim, optimizer)(local.parameters(), lr=0.1)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 40, (6, 3), generator=g)
            opt.zero_grad()
            remote(ids).pow(2).sum().backward()
            assert remote.weight.grad is not None and remote.weight.grad.is_sparse
            opt.step()
            ref.zero_grad()
            local(ids).pow(2).sum().backward()
            ref.step()
        torch.testing.assert_close(remote.weight.detach(), local.weight.detach())
    finally:
        opt.close()


@pytest.mark.parametrize("partition", ["mod", "div"])
def test_a_table_given_rows_trains_on_the_ps_from_them(two_ps: ClusterSpec, partition: str) -> None:
    """A table whose rows the model holds when it is given to the job (``from_pretrained``, a
    loaded state dict) starts there on the ps, not from its seed: the chief's init sends each
    shard its part. The job then takes the steps torch takes from the same rows."""
    g = torch.Generator().manual_seed(5)
    pretrained = torch.randn(VOCAB, DIM, generator=g)
    loaded = torch.randn(VOCAB, DIM, generator=g)
    sgd = RowOptimizerSpec.of("SGD", lr=0.5)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = pnn.EmbeddingBag.from_pretrained(
                pretrained.clone(), freeze=False, mode="sum", partition=partition, optimizer=sgd
            )
            self.items = pnn.Embedding(VOCAB, DIM, partition=partition, optimizer=sgd)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return (self.bag(ids) * self.items(ids[:, 0])).sum()

    remote = Model()
    remote.load_state_dict({"bag.weight": pretrained, "items.weight": loaded})
    ref_bag = torch.nn.EmbeddingBag.from_pretrained(pretrained.clone(), freeze=False, mode="sum")
    ref_items = torch.nn.Embedding.from_pretrained(loaded.clone(), freeze=False)
    opt = DistributedOptimizer(
        remote, worker_ctx(two_ps), optimizer="SGD", lr=0.5, transport=TransportConfig(timeout=30)
    )
    try:
        assert remote.bag.attached and remote.items.attached
        assert tables(opt).initial == {}  # the worker holds no table once the job has started
        every = torch.arange(VOCAB)
        assert torch.equal(table_rows(opt, "bag", every), pretrained)
        assert torch.equal(table_rows(opt, "items", every), loaded)
        ref = torch.optim.SGD([*ref_bag.parameters(), *ref_items.parameters()], lr=0.5)
        for step in range(4):
            ids = torch.randint(0, VOCAB, (6, 3), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            remote(ids).backward()
            opt.step()
            ref.zero_grad()
            (ref_bag(ids) * ref_items(ids[:, 0])).sum().backward()
            ref.step()
        torch.testing.assert_close(table_rows(opt, "bag", every), ref_bag.weight.detach())
        torch.testing.assert_close(table_rows(opt, "items", every), ref_items.weight.detach())
        assert not torch.equal(ref_bag.weight.detach(), pretrained)  # it did train
    finally:
        opt.close()


def test_a_hashed_table_given_rows_by_id_trains_on_the_ps_from_them(two_ps: ClusterSpec) -> None:
    """A hashed table given rows by id (``load_rows``: a TensorFlow hash table's keys and
    values) with their Adagrad accumulators, then trained a step in this process: the chief's
    init sends each ps the rows of its ids as local training left them (and the row it made),
    the ps hold exactly those, and one worker's steps are the steps of one process whose
    table was given and trained the same (ids it was not given start from the seed in both)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.tensor([3, -(2**40), 2**50 + 1, 12, 7])
    rows = torch.randn(5, HASHED_DIM, generator=gen)
    sums = torch.rand(5, HASHED_DIM, generator=gen) + 0.5
    adagrad = RowOptimizerSpec.of("Adagrad", lr=0.1)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.users = pnn.EmbeddingBag(None, HASHED_DIM, mode="sum", seed=2, optimizer=adagrad)
        m.head = torch.nn.Linear(HASHED_DIM, 1)
        m.users.load_rows(ids, rows, {"sum": sums})
        m.users(torch.tensor([[3, 12, 999]])).sum().backward()  # trains here: 3, 12, and 999
        m.zero_grad()
        return m

    def loss(m: torch.nn.Module, batch: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m.head(m.users(batch)).squeeze(1), y)

    remote, local = model(), model()
    first = torch.cat([ids, torch.tensor([999])])
    trained = local.users(first.view(-1, 1)).detach()
    assert torch.equal(trained[[1, 2, 4]], rows[[1, 2, 4]])  # untouched here
    assert not torch.allclose(trained[[0, 3]], rows[[0, 3]])  # 3 and 12 trained
    opt = DistributedOptimizer(
        remote,
        worker_ctx(two_ps),
        optimizer="Adagrad",
        lr=0.1,
        transport=TransportConfig(timeout=30),
    )
    try:
        assert torch.equal(table_rows(opt, "users", first), trained)  # before any step
        held = {s: int(v["users"]["rows"]) for s, v in tables(opt).status().items()}
        assert held == {0: 2, 1: 4}, held  # split mod 2: -(2**40) and 12 on ps 0
        ref_opt = torch.optim.Adagrad(local.head.parameters(), lr=0.1)
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            batch = ids[torch.randint(0, 5, (6, 2), generator=g)]
            batch[:, 1] = 1000 + step  # and an id it was not given
            y = torch.randn(6, generator=g)
            opt.zero_grad()
            loss(remote, batch, y).backward()
            opt.step()
            ref_opt.zero_grad()
            loss(local, batch, y).backward()
            ref_opt.step()
        every = torch.cat([ids, torch.arange(1000, 1004)])
        want = local.users(every.view(-1, 1)).detach()
        torch.testing.assert_close(table_rows(opt, "users", every), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(want[:5], rows)  # it did train
        for name in ("weight", "bias"):
            torch.testing.assert_close(
                getattr(remote.head, name).detach(), getattr(local.head, name).detach()
            )
    finally:
        opt.close()


@pytest.mark.parametrize("with_state", [True, False])
def test_a_tensorflow_trained_model_takes_its_next_step_in_psflow(
    two_ps: ClusterSpec, with_state: bool
) -> None:
    """A model trained in TensorFlow goes on in psflow from its checkpoint
    (``tests/fixtures/tf_checkpoint``): its partitioned tables' rows in id order, and their
    Adagrad accumulators, sent by the chief's init; its dense kernel loaded, and its
    accumulator given as ``optimizer_state``. One psflow step on the batch TensorFlow's next
    step used gives the tables and the kernel TensorFlow gave. Without the accumulators (a
    fresh optimizer) the step is another one."""
    from psflow.train.tf_checkpoint import TFCheckpoint

    fixture = Path(__file__).parent.parent / "fixtures" / "tf_checkpoint"
    expected = json.loads((fixture / "expected.json").read_text())
    ckpt = TFCheckpoint(str(fixture / expected["prefix"]))
    adagrad = RowOptimizerSpec.of("Adagrad", lr=0.1, initial_accumulator_value=0.1)

    def table(name: str, strategy: str) -> pnn.Embedding:
        state = ckpt.table_state(name, "Adagrad", strategy) if with_state else None
        return pnn.Embedding.from_pretrained(
            ckpt.embedding(name, strategy),
            freeze=False,
            partition=strategy,
            optimizer=adagrad,
            optimizer_state=state,
        )

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = table("items", "mod")
            self.users = table("users", "div")
            self.kernel = torch.nn.Parameter(ckpt.tensor("dense/kernel"))

        def forward(self, item_ids: torch.Tensor, user_ids: torch.Tensor) -> torch.Tensor:
            x = torch.cat([self.items(item_ids), self.users(user_ids)], dim=1)
            return ((x @ self.kernel) ** 2).sum()

    model = Model()
    opt = DistributedOptimizer(
        model,
        worker_ctx(two_ps),
        optimizer=OptimizerSpec.of("Adagrad", lr=0.1, initial_accumulator_value=0.1),
        optimizer_state=(
            {"kernel": ckpt.optimizer_state("dense/kernel", "Adagrad")} if with_state else None
        ),
        transport=TransportConfig(timeout=30),
    )
    try:
        step = expected["step"]
        opt.zero_grad()
        model(torch.tensor(step["item_ids"]), torch.tensor(step["user_ids"])).backward()
        opt.step()
        kernel = torch.tensor(expected["dense_after_next_step"]["dense/kernel"])
        got_kernel = model.kernel.detach()  # the step's pull brought the ps's value back
        if with_state:
            torch.testing.assert_close(got_kernel, kernel, rtol=1e-5, atol=1e-6)
        else:
            assert not torch.allclose(got_kernel, kernel, rtol=1e-3, atol=1e-4)
        for name in ("items", "users"):
            want = torch.tensor(expected["rows_in_id_order"][name]["after_next_step"])
            got = table_rows(opt, name, torch.arange(want.shape[0]))
            if with_state:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            else:
                assert not torch.allclose(got, want, rtol=1e-3, atol=1e-4), name
    finally:
        opt.close()


def test_a_tensorflow_model_trained_with_adam_goes_on_in_psflow(two_ps: ClusterSpec) -> None:
    """``tests/fixtures/tf_dense_state``: TensorFlow's ``AdamOptimizer`` trained a dense kernel
    and a table partitioned ``mod`` for three steps. The job starts the table from its rows
    and moments in id order with every row at the optimizer's step (``table_state``), and the
    kernel from its moments and step (``optimizer_state``, the job's torch ``Adam``). One step
    on 2 ps gives the table TensorFlow's next step gave (every row) and the kernel within
    Adam's epsilon placement (TensorFlow adds it before the bias correction, torch after)."""
    from psflow.train.tf_checkpoint import TFCheckpoint

    fixture = Path(__file__).parent.parent / "fixtures" / "tf_dense_state"
    expected = json.loads((fixture / "expected.json").read_text())
    ckpt = TFCheckpoint(str(fixture / expected["prefix"]))
    settings = expected["optimizers"]["emb"][1]
    betas = (settings["beta1"], settings["beta2"])

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = pnn.Embedding.from_pretrained(
                ckpt.embedding("emb", "mod"),
                freeze=False,
                partition="mod",
                optimizer=RowOptimizerSpec.of(
                    "Adam", lr=settings["lr"], betas=betas, eps=settings["epsilon"]
                ),
                optimizer_state=ckpt.table_state("emb", "Adam", "mod"),
            )
            self.kernel = torch.nn.Parameter(ckpt.tensor("hidden/kernel"))
            self.bias = torch.nn.Parameter(ckpt.tensor("hidden/bias"), requires_grad=False)
            self.out = torch.nn.Parameter(ckpt.tensor("out/kernel"), requires_grad=False)

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ self.kernel + self.bias + self.emb(ids)) @ self.out

    model = Model()
    opt = DistributedOptimizer(
        model,
        worker_ctx(two_ps),
        optimizer=OptimizerSpec.of("Adam", lr=settings["lr"], betas=betas, eps=settings["epsilon"]),
        optimizer_state={"kernel": ckpt.optimizer_state("hidden/kernel", "Adam")},
        transport=TransportConfig(timeout=30),
    )
    try:
        x, y = torch.tensor(expected["x"]), torch.tensor(expected["y"])
        opt.zero_grad()
        ((model(x, torch.tensor(expected["ids"])) - y) ** 2).mean().backward()
        opt.step()
        after = expected["after_next_step"]
        torch.testing.assert_close(
            model.kernel.detach(), torch.tensor(after["hidden/kernel"]), rtol=0, atol=5e-6
        )
        got = table_rows(opt, "emb", torch.arange(6))
        torch.testing.assert_close(got, torch.tensor(after["emb"]), rtol=0, atol=1e-6)
    finally:
        opt.close()


def test_a_keras_model_goes_on_in_psflow(two_ps: ClusterSpec) -> None:
    """``tests/fixtures/tf_keras/keras3_adagrad``: Keras 3 trained an ``Embedding`` and a
    ``Dense`` under ``Adagrad`` for three steps and saved them with ``tf.train.Checkpoint``.
    The job takes the table's rows and accumulators, and the layer's kernel (transposed),
    bias and accumulators, by their Keras names. One step on 2 ps with Keras's next batch
    gives every variable Keras's next step gave."""
    from psflow.train.tf_checkpoint import TFCheckpoint

    fixture = Path(__file__).parent.parent / "fixtures" / "tf_keras"
    case = json.loads((fixture / "expected.json").read_text())["cases"]["keras3_adagrad"]
    ckpt = TFCheckpoint(str(fixture / case["prefix"]))
    lr, start = case["settings"]["learning_rate"], case["settings"]["initial_accumulator_value"]
    # Keras adds epsilon (1e-7) inside Adagrad's square root, torch outside: none here.
    adagrad = {"lr": lr, "initial_accumulator_value": start, "eps": 0.0}

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = pnn.Embedding.from_pretrained(
                ckpt.tensor("model/items/embeddings"),
                freeze=False,
                optimizer=RowOptimizerSpec.of("Adagrad", **adagrad),
                optimizer_state=ckpt.table_state("model/items/embeddings", "Adagrad"),
            )
            self.head = torch.nn.Linear(6, 2)
            with torch.no_grad():
                self.head.weight.copy_(ckpt.tensor("model/head/kernel").T)
                self.head.bias.copy_(ckpt.tensor("model/head/bias"))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.items(ids).flatten(1))  # Embedding, Flatten, Dense

    model = Model()
    state = {
        "head.weight": ckpt.optimizer_state("model/head/kernel", "Adagrad", transpose=True),
        "head.bias": ckpt.optimizer_state("model/head/bias", "Adagrad"),
    }
    opt = DistributedOptimizer(
        model,
        worker_ctx(two_ps),
        optimizer=OptimizerSpec.of("Adagrad", **adagrad),
        optimizer_state=state,
        transport=TransportConfig(timeout=30),
    )
    try:
        opt.zero_grad()
        y = torch.tensor(case["y"])
        ((model(torch.tensor(case["ids"])) - y) ** 2).mean().backward()
        opt.step()
        after = {name: torch.tensor(v["after"]) for name, v in case["variables"].items()}
        got = model.head.weight.detach().T
        torch.testing.assert_close(got, after["model/head/kernel"], rtol=0, atol=1e-6)
        got = model.head.bias.detach()
        torch.testing.assert_close(got, after["model/head/bias"], rtol=0, atol=1e-6)
        rows = table_rows(opt, "items", torch.arange(len(after["model/items/embeddings"])))
        torch.testing.assert_close(rows, after["model/items/embeddings"], rtol=0, atol=1e-6)
    finally:
        opt.close()


def test_a_frozen_table_stays_on_the_worker(two_ps: ClusterSpec) -> None:
    """A frozen table (``from_pretrained``'s default, as in torch) does not train: the job
    leaves it on the worker as a plain weight, and trains the rest of the model around it."""
    pretrained = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(6))
    model = torch.nn.Sequential()
    model.add_module("frozen", pnn.Embedding.from_pretrained(pretrained.clone()))
    model.add_module("head", torch.nn.Linear(DIM, 1))
    opt = DistributedOptimizer(
        model, worker_ctx(two_ps), optimizer="SGD", lr=0.5, transport=TransportConfig(timeout=30)
    )
    try:
        assert not model.frozen.attached and not tables(opt)
        assert sorted(opt.engine.exchange.params) == ["head.bias", "head.weight"]
        before = model.head.weight.detach().clone()
        for step in range(2):
            opt.zero_grad()
            model(torch.tensor([step, 3])).sum().backward()
            opt.step()
        assert torch.equal(model.frozen.weight, pretrained)
        assert not torch.equal(model.head.weight.detach(), before)
    finally:
        opt.close()


def test_an_init_with_first_rows_of_the_wrong_shape_is_refused(two_ps: ClusterSpec) -> None:
    """The ps checks the rows an init gives a table before it creates anything: an error reply
    names the table, the ps stays uninitialised, and the chief's good init then succeeds."""
    from psflow.protocol import OptimizerSpec, RowOptimizerSpec, TableSpec
    from psflow.worker.client import ShardedClient

    spec = TableSpec(
        name="emb", embedding_dim=DIM, num_embeddings=VOCAB, optimizer=RowOptimizerSpec.of("SGD")
    )
    client = ShardedClient(worker_ctx(two_ps), TransportConfig(timeout=30))
    try:
        client.wait_ready(60, initialized=False)
        wrong = {s: [("emb#rows", torch.zeros(VOCAB // 2, DIM + 1))] for s in range(2)}
        with pytest.raises(PeerError, match=r"first rows of table 'emb' are \[25, 5\]"):
            client.initialize(
                wrong, OptimizerSpec.of("SGD"), tables=[spec.to_wire()], initial_rows=["emb"]
            )
        assert not any(h[Key.INITIALIZED] for h in client.status().values())
        right = {s: [("emb#rows", torch.full((VOCAB // 2, DIM), float(s)))] for s in range(2)}
        assert client.initialize(
            right, OptimizerSpec.of("SGD"), tables=[spec.to_wire()], initial_rows=["emb"]
        )
        ((_, got),) = client.lookup({1: [("emb", torch.tensor([3, 7]))]})[1][1]
        assert torch.equal(got, torch.ones(2, DIM))
    finally:
        client.close()


def test_adam_names_what_to_use_for_a_sparse_gradient(two_ps: ClusterSpec) -> None:
    emb = torch.nn.Embedding(10, 2, sparse=True)
    opt = DistributedOptimizer(emb, worker_ctx(two_ps), optimizer="Adam", lr=0.1)
    try:
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(PeerError, match=r"Adam.*sparse"):
            opt.step()
        opt.zero_grad()
        assert opt.pull() == 0  # the ps goes on serving
    finally:
        opt.close()


def test_prefetched_rows_ride_the_step_and_train_the_same() -> None:
    """With prefetch, the next batch's rows come back with the push (no lookup request of
    their own); one worker trains exactly as without."""
    results = []
    for use_prefetch in (False, True):
        cluster = local_cluster(2, 1)
        procs = _ps(cluster)
        model = Recommender()
        opt = DistributedOptimizer(
            model,
            worker_ctx(cluster),
            optimizer="Adagrad",
            lr=0.1,
            transport=TransportConfig(timeout=30),
        )
        client = tables(opt).client
        lookups: list[dict[int, list[tuple[str, torch.Tensor]]]] = []
        real_lookup = client.lookup

        def counting(ids, into=None, *, real=real_lookup, seen=lookups, **how):  # type: ignore[no-untyped-def]
            seen.append(ids)
            return real(ids, into, **how)

        client.lookup = counting  # type: ignore[method-assign]
        try:
            data = [batch(step, 0, 8) for step in range(6)]
            for step, (items, users, y) in enumerate(data):
                opt.zero_grad()
                loss_of(model, items, users, y).backward()
                if use_prefetch and step + 1 < len(data):
                    model.items.prefetch(data[step + 1][0])
                    model.users.prefetch(data[step + 1][1])
                opt.step()
            asked = len(lookups)
            rows = table_rows(opt, "items", torch.arange(VOCAB))
            results.append((rows, model.head.weight.detach().clone(), asked))
        finally:
            opt.close()
            for p in procs:
                stop(p, timeout=5)
    (items_a, head_a, asked_a), (items_b, head_b, asked_b) = results
    torch.testing.assert_close(items_b, items_a)
    torch.testing.assert_close(head_b, head_a)
    # Without prefetch each forward asks for both tables; with it only the first forward does.
    assert (asked_a, asked_b) == (2 * 6, 2), (asked_a, asked_b)


def test_prefetched_rows_stay_in_the_lanes_until_a_request_would_overwrite_them() -> None:
    """Prefetched rows large enough for the lanes come back in each shard's request area and
    are used there by the next forward; a request to a shard in between (another table's
    lookup, made first in the forward) first moves them out. The dense values that came with
    them are copied into the model at once (the next request overwrites that area: adopted
    there, the model's weights would become the next request's bytes). Either way one worker
    trains exactly as without prefetch."""
    rows, dim, n = 4000, 64, 600
    g = torch.Generator().manual_seed(5)
    data = [torch.randint(0, rows, (2, n), generator=g) for _ in range(5)]
    results = []
    for mode in ("plain", "prefetch", "prefetch, other table first"):
        cluster = local_cluster(2, 1)
        procs = _ps(cluster)
        model = torch.nn.ModuleDict(
            {
                "a": pnn.Embedding(rows, dim, seed=3, init_std=0.1, optimizer="Adagrad"),
                "b": pnn.Embedding(rows, dim, seed=4, init_std=0.1, optimizer="Adagrad"),
                # Dense values come back with the rows, in the request area too: 128 KB.
                "head": torch.nn.Linear(dim, 512),
            }
        )
        torch.nn.init.constant_(model["head"].weight, 0.5)
        torch.nn.init.constant_(model["head"].bias, 0.1)
        opt = DistributedOptimizer(model, worker_ctx(cluster), optimizer="SGD", lr=0.01)
        moved: list[int] = []  # the shards whose lanes held rows that were moved out
        prefetched = tables(opt).prefetched
        real_move = prefetched._move_out

        def move_out(shard: int, real=real_move, prefetched=prefetched, moved=moved) -> None:  # type: ignore[no-untyped-def]
            if any(shard in hit.parts for hit in prefetched.kept.values()):
                moved.append(shard)
            real(shard)

        prefetched._move_out = move_out  # type: ignore[method-assign]
        try:
            for step, ids in enumerate(data):
                opt.zero_grad()
                head = model["head"]
                if mode == "prefetch, other table first":
                    b = model["b"](ids[1])  # its lookup goes to the lanes that hold a's rows
                    loss = head(model["a"](ids[0])).pow(2).sum() + (b**2).sum()
                else:
                    loss = head(model["a"](ids[0])).pow(2).sum() + (model["b"](ids[1]) ** 2).sum()
                loss.backward()
                if mode != "plain" and step + 1 < len(data):
                    model["a"].prefetch(data[step + 1][0])
                opt.step()
            opt.pull()
            got = [
                table_rows(opt, name, torch.arange(rows)) for name in sorted(tables(opt).modules)
            ]
            results.append(([*got, model["head"].weight.detach().clone()], moved))
        finally:
            opt.close()
            for p in procs:
                stop(p, timeout=5)
    (plain, _), (fetched, moved_none), (other_first, moved_some) = results
    assert moved_none == [] and sorted(set(moved_some)) == [0, 1], (moved_none, moved_some)
    for got in (fetched, other_first):
        for x, y in zip(got, plain, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("shm", ["1", "0"], ids=["lane", "socket"])
def test_large_lookups_come_back_through_the_lane(
    shm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows too large for a header come back in the lane's request area (the reply area may
    hold the model's parameters, still in use), where the forward gathers them (views, not
    copies); through the socket when the ps takes no lanes. Either way they are the table's
    rows, and training goes on over them."""
    from psflow.protocol.messages import IN_REQUEST_AREA
    from psflow.transport import wire

    seen: list[object] = []
    decode = wire.decode_tensors

    def spy(header, frames, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(header.get(Key.IN_LANE))
        if header.get(Key.IN_LANE) == IN_REQUEST_AREA:
            viewed.append(kwargs["transient"])
        return decode(header, frames, **kwargs)

    viewed: list[bool] = []

    monkeypatch.setattr(wire, "decode_tensors", spy)
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, env={"PSFLOW_SHM": shm})
    try:
        local = pnn.Embedding(5000, 64, seed=4, init_std=0.1)
        remote = torch.nn.Sequential(
            pnn.Embedding(5000, 64, seed=4, init_std=0.1, optimizer="SGD"), torch.nn.Linear(64, 1)
        )
        ids = torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:512]
        with DistributedOptimizer(remote, worker_ctx(cluster), lr=0.1) as opt:
            for step in range(3):
                now = table_rows(opt, "0", ids)  # rows copied out of the lane
                seen.clear()
                viewed.clear()
                opt.zero_grad()
                out = remote[0](ids)  # 512 x 64 float32: 128 KB of rows, gathered in the lane
                torch.testing.assert_close(out, now, rtol=0, atol=0)
                if step == 0:
                    torch.testing.assert_close(out, local(ids), rtol=0, atol=0)
                else:
                    assert viewed == ([True] if shm == "1" else []), viewed
                remote[1](out).square().mean().backward()
                opt.step()
                # From the second step: the first push made the lane's request area as large.
                if step:
                    assert (IN_REQUEST_AREA in seen) == (shm == "1"), seen
            after = table_rows(opt, "0", ids)
        assert not torch.equal(after, local(ids).detach())  # the pushes were applied
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)
