"""Synchronous training against real ps processes: exactness, backup workers, shards, timeouts."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

import psflow
from psflow.worker import SyncTimeoutError

from .support import local_cluster, quiet_session, sharded_client, start_ps, stop, worker_ctx
from .sync_support import assert_close, batch, loss_fn, make_model, reference, run_threads

LR = 0.1


def _train(cluster: psflow.ClusterSpec, index: int, kind: str, steps: int, size: int, **kw):  # type: ignore[no-untyped-def]
    def body() -> dict[str, torch.Tensor]:
        model = make_model(kind)
        rng = random.Random(index)
        with psflow.DistributedOptimizer(
            model, worker_ctx(cluster, index), mode="sync", lr=LR, sync_timeout=20, **kw
        ) as opt:
            while opt.global_step < steps:
                time.sleep(rng.random() * 0.002)  # arrival order varies from step to step
                x, y = batch(opt.global_step, index, size)
                opt.zero_grad()
                loss_fn(model, x, y).backward()
                opt.step()
            return {n: p.detach().clone() for n, p in model.state_dict().items()}

    return body


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("shards", [1, 2])
def test_sync_equals_one_process_on_the_full_batch(kind: str, shards: int) -> None:
    workers, size, steps = 2, 4, 50
    cluster = local_cluster(shards, workers)
    ps = [start_ps(cluster, i) for i in range(shards)]
    try:
        results = run_threads([_train(cluster, i, kind, steps, size) for i in range(workers)])
        want = reference(kind, LR, [list(range(workers))] * steps, size)
        for got in results:
            assert_close(got, want, rtol=1e-6)
        for p in ps:
            code, err = stop(p)
            assert code == 0, err
    finally:
        for p in ps:
            stop(p, timeout=1)


def test_a_variable_one_worker_did_not_touch_gets_the_joint_batchs_gradient() -> None:
    """Worker 1's loss does not use ``p``, so it sends no gradient for it: one process on the
    two workers' joint batch would give ``p`` half of worker 0's gradient, not all of it (as
    DDP averages an unused parameter's over every rank)."""
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)

    def body(index: int) -> torch.nn.Module:
        model = torch.nn.Module()
        model.a = torch.nn.Parameter(torch.ones(1))
        model.p = torch.nn.Parameter(torch.ones(1))
        ctx = worker_ctx(cluster, index)
        with psflow.DistributedOptimizer(model, ctx, mode="sync", lr=LR, sync_timeout=20) as opt:
            while opt.global_step < 3:
                opt.zero_grad()
                loss = model.a.sum() + (2 * model.p.sum() if index == 0 else 0)
                loss.backward()
                opt.step()
        return model

    try:
        models = run_threads([lambda i=i: body(i) for i in range(2)])
        for m in models:  # 3 steps of lr 0.1: a's gradient 1 from each, p's (2 + 0) / 2
            assert m.a.item() == pytest.approx(0.7) and m.p.item() == pytest.approx(0.7), (m.a, m.p)
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)


def test_backup_worker_two_shards_apply_the_same_chosen_gradients() -> None:
    """3 workers, 2 aggregated: each step's chosen set is decided by ps:0 and applied by both."""
    workers, size, steps = 3, 3, 30
    cluster = local_cluster(2, workers)
    ps = [start_ps(cluster, i) for i in range(2)]
    opts: list[psflow.DistributedOptimizer] = []
    try:

        def body(index: int) -> dict[str, torch.Tensor]:
            model = make_model("mlp")
            rng = random.Random(index)
            opt = psflow.DistributedOptimizer(
                model,
                worker_ctx(cluster, index),
                mode="sync",
                lr=LR,
                replicas_to_aggregate=2,
                total_num_replicas=3,
                sync_timeout=20,
                partition_bytes=256,
            )
            opts.append(opt)
            seen = [opt.global_step]
            while opt.global_step < steps:
                time.sleep(rng.random() * 0.003)
                x, y = batch(opt.global_step, index, size)
                opt.zero_grad()
                loss_fn(model, x, y).backward()
                seen.append(opt.step())
            assert seen == sorted(seen) and len(set(seen)) == len(seen)  # always forward
            return {n: p.detach().clone() for n, p in model.state_dict().items()}

        results = run_threads([lambda i=i: body(i) for i in range(workers)])
        assert {p.shard for p in opts[0].pieces} == {0, 1}
        assert any(p.rows is not None for p in opts[0].pieces)  # a partitioned tensor too
        status0 = opts[0].sync_status()
        status1 = sharded_client(opts[0]).sync_status(shard=1)
        assert status0["step"] == status1["step"] == steps
        assert status1["decisions"] == status0["decisions"]  # same workers, every step
        chosen = [[int(w.split(":")[1]) for w in ws] for s, ws in status0["decisions"]]
        assert [s for s, _ in status0["decisions"]] == list(range(steps))
        assert all(len(ws) == 2 for ws in chosen)
        total = {w: status0["accepted_by_worker"].get(f"worker:{w}", 0) for w in range(3)}
        assert sum(total.values()) == 2 * steps
        # Every push for a step either made it into the step or was dropped and counted.
        stats = [o.stats() for o in opts]
        assert sum(s["accepted"] for s in stats) == 2 * steps
        assert sum(s["dropped_stale"] for s in stats) == status0["dropped_stale"] > 0
        want = reference("mlp", LR, chosen, size)
        for got in results:
            assert_close(got, want, rtol=1e-6)
    finally:
        for o in opts:
            o.close()
        for p in ps:
            stop(p, timeout=10)


def test_no_hang_without_backup_the_error_names_who_sent_and_who_did_not() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    try:
        m0, m1 = make_model("linear"), make_model("linear")
        with (
            psflow.DistributedOptimizer(
                m0, worker_ctx(cluster, 0), mode="sync", sync_timeout=1.5
            ) as o0,
            psflow.DistributedOptimizer(m1, worker_ctx(cluster, 1), mode="sync") as _o1,
        ):
            x, y = batch(0, 0, 4)
            loss_fn(m0, x, y).backward()
            start = time.monotonic()
            with pytest.raises(SyncTimeoutError) as info:
                o0.step()  # worker:1 never pushes
            assert time.monotonic() - start < 10
            message = str(info.value)
            assert "step 0 did not complete within 1.5 s" in message
            assert "1 of 2 gradients arrived (from worker:0)" in message
            assert "none from worker:1" in message
            assert info.value.arrived == ["worker:0"] and info.value.missing == ["worker:1"]
    finally:
        stop(ps, timeout=10)


def test_pending_push_gets_an_error_when_the_last_other_worker_finishes() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    try:
        m0, m1 = make_model("linear"), make_model("linear")
        o0 = psflow.DistributedOptimizer(m0, worker_ctx(cluster, 0), mode="sync", sync_timeout=30)
        o1 = psflow.DistributedOptimizer(m1, worker_ctx(cluster, 1), mode="sync")
        x, y = batch(0, 0, 4)
        loss_fn(m0, x, y).backward()

        def finish_soon() -> None:
            time.sleep(0.5)
            o1.close()

        start = time.monotonic()
        with pytest.raises(psflow.PeerError, match="step 0 cannot complete: it needs 2 gradients"):
            run_threads([o0.step, finish_soon])
        assert time.monotonic() - start < 10
        o0.close()
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)


def test_bounded_staleness_holds_the_fast_worker_back() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    done = [0, 0]
    violations: list[tuple[int, int]] = []
    s = 1
    try:

        def body(index: int, steps: int, delay: float) -> dict[str, object]:
            model = make_model("linear")
            with psflow.DistributedOptimizer(
                model, worker_ctx(cluster, index), lr=LR, max_staleness=s, sync_timeout=20
            ) as opt:
                for _ in range(steps):
                    time.sleep(delay)
                    x, y = batch(done[index], index, 4)
                    opt.zero_grad()
                    loss_fn(model, x, y).backward()
                    opt.step()
                    done[index] += 1
                    other = done[1 - index]
                    # Until the slow worker finishes (6 steps), fast stays within s of it.
                    if index == 0 and other < 6 and done[0] - 1 - other > s:
                        violations.append((done[0], other))
                return opt.stats()

        fast, slow = run_threads([lambda: body(0, 12, 0.0), lambda: body(1, 6, 0.05)])
        assert not violations
        assert fast["waited_steps"] > 0 and slow["mode"] == "async"
        assert fast["local_steps"] == 12 and sum(fast["staleness_histogram"].values()) == 12
        assert fast["staleness_max"] <= 6 and fast["staleness_mean"] >= 0
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)


def test_bounded_staleness_names_a_worker_that_stopped_stepping() -> None:
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    try:
        m0, m1 = make_model("linear"), make_model("linear")
        fast = psflow.DistributedOptimizer(
            m0, worker_ctx(cluster, 0), lr=LR, max_staleness=1, sync_timeout=1.5
        )
        # worker:1 joins and then never steps (hung, or stuck in its input pipeline).
        hung = psflow.DistributedOptimizer(
            m1, worker_ctx(cluster, 1), lr=LR, max_staleness=1, sync_timeout=1.5
        )
        steps = 0
        start = time.monotonic()
        with pytest.raises(SyncTimeoutError) as info:
            for _ in range(10):
                x, y = batch(steps, 0, 4)
                fast.zero_grad()
                loss_fn(m0, x, y).backward()
                fast.step()
                steps += 1
        assert steps == 2  # clock 0 and 1 pass; clock 2 would be 2 ahead of worker:1
        message = str(info.value)
        assert "worker:1" in message and "max_staleness=1" in message, message
        assert time.monotonic() - start < 10
        hung.close()
        fast.close()
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)


def test_a_step_awaiting_a_worker_hung_in_its_own_code_ends_past_the_recovery_timeout(
    tmp_path: Path,
) -> None:
    """worker:1 holds its optimizer open (its heartbeat beats) and never steps: the chief's
    step fails again and again while every ps answers (each recovery succeeded, for ever);
    once the one step has failed for longer than the recovery timeout, it ends naming worker:1."""
    cluster = local_cluster(1, 2)
    ps = start_ps(cluster)
    hung = threading.Event()

    def idle() -> None:
        ctx = worker_ctx(cluster, 1)
        model = torch.nn.Linear(2, 1)
        with psflow.DistributedOptimizer(model, ctx, mode="sync", lr=LR, sync_timeout=1):
            hung.wait(120)

    worker = threading.Thread(target=idle)
    worker.start()
    model = torch.nn.Linear(2, 1)
    settings = {"mode": "sync", "sync_timeout": 1, "recovery_timeout": 3}
    try:
        failed = pytest.raises(RuntimeError, match=r"global step 0 has failed for \d+ s")
        with (
            failed as caught,
            quiet_session(model, cluster, str(tmp_path), timeout=2, **settings) as sess,
        ):
            for _ in range(100):
                sess.zero_grad()
                loss = model(torch.ones(1, 2)).sum()
                loss.backward()
                sess.step(loss=loss)
        assert "none from worker:1" in str(caught.value), caught.value
    finally:
        hung.set()
        worker.join(60)
        stop(ps, timeout=10)
