"""Synchronous training against real ps processes: exactness, backup workers, shards, timeouts."""

from __future__ import annotations

import random
import time

import pytest
import torch

import psflow

from .support import local_cluster, start_ps, stop, worker_ctx
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
