"""A ps task takes subnormal floats as zero (``ServerConfig.flush_denormals``, on by default, as
TensorFlow's runtime): its serving thread for the dense update, and its row threads for the
rows; off, the IEEE subnormal the same update makes is kept. A worker's training thread does
too while its optimizer is open (``OptimizerConfig.flush_denormals``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import psflow
from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import TaskContext, TaskSpec
from psflow.protocol import RowOptimizerSpec
from psflow.sparse import stripes
from psflow.worker.optimizer import flushing

from .support import quiet_session

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

TINY = 1e-36
"""A normal float32; what an update leaves of it below, 1e-39, is subnormal (under 1.2e-38)."""


@pytest.fixture(autouse=True)
def one_row_thread_after() -> object:
    yield None
    stripes.set_threads(1)


@pytest.mark.parametrize("flush", [True, False])
def test_updates_that_end_subnormal_are_zero_unless_told(tmp_path: Path, flush: bool) -> None:
    cluster = local_cluster(1, 1)
    ctx = TaskContext(cluster=cluster, task=TaskSpec(job="ps", index=0))
    # Two threads: a push's 2,048 rows go in two stripes, one on a row thread.
    ps = psflow.ParameterServer(ctx, threads=2, flush_denormals=flush).start()
    try:
        dense = torch.nn.Linear(4, 1, bias=False)
        table = psflow.nn.Embedding(4096, 8, optimizer=RowOptimizerSpec.of("SGD", lr=1.0),
                                    init_std=TINY)  # fmt: skip
        with torch.no_grad():
            dense.weight.fill_(TINY)
        model = torch.nn.ModuleDict({"dense": dense, "table": table})
        sess = quiet_session(model, cluster, str(tmp_path), optimizer="SGD", lr=1.0)
        ids = torch.arange(2048)
        rows = table(ids)
        # Each gradient is 0.999 of its value: the update leaves a thousandth, subnormal.
        dense.weight.grad = dense.weight.detach() * 0.999
        rows.backward(rows.detach() * 0.999)
        sess.step()
        (weight,) = [v for name, v in ps.store.variables.items() if name.endswith("weight")]
        (held,) = ps.store.tables.values()
        values = held.values[ids.tolist()]
        sess.close()
    finally:
        ps.stop()
    assert stripes.threads() == 2 and len(stripes.bounds(2048)) == 2
    if flush:
        assert bool((weight == 0).all()) and bool((values == 0).all())
    else:
        for t in (weight, values):
            assert bool((t != 0).all()) and bool((t.abs() < torch.finfo(torch.float32).tiny).all())


@pytest.mark.parametrize("flush", [True, False])
def test_a_workers_thread_flushes_while_its_optimizer_is_open(tmp_path: Path, flush: bool) -> None:
    """A cluster of one: the training thread takes subnormals as zero from the optimizer's
    start to its close, which gives back the mode it found; off, the mode is left alone."""
    assert not flushing()
    model = torch.nn.Linear(2, 1)
    sess = psflow.TrainingSession(model, TaskContext.alone(), checkpoint_dir=str(tmp_path),
                                  log_step_count_steps=None, save_summaries_steps=None,
                                  flush_denormals=flush)  # fmt: skip
    try:
        assert flushing() is flush
        tiny = torch.full((4,), TINY)
        assert bool((tiny * 1e-3 == 0).all()) is flush
    finally:
        sess.close()
    assert not flushing()
