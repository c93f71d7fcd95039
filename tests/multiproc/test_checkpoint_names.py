"""A checkpoint directory is named by the global step it holds, also when other workers' updates
land between the chief's last step and its save (asynchronous training)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from psflow.train import CheckpointDir
from psflow.transport import TransportConfig
from psflow.worker import DistributedOptimizer

from .support import local_cluster, quiet_session, start_ps, stop, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def test_a_checkpoint_is_named_by_the_step_it_holds(tmp_path: Path) -> None:
    cluster = local_cluster(2, 2)
    procs = [start_ps(cluster, i) for i in range(2)]
    url = str(tmp_path / "ckpt")
    try:
        chief_model, other_model = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
        with quiet_session(chief_model, cluster, url, lr=0.1) as sess:
            other = DistributedOptimizer(
                other_model, worker_ctx(cluster, 1), lr=0.1, transport=TransportConfig(timeout=20)
            )
            for opt, model in ((sess, chief_model), (other, other_model), (other, other_model)):
                opt.zero_grad()
                model(torch.ones(2, 4)).pow(2).sum().backward()
                opt.step()
            assert sess.global_step == 1  # the chief has not seen the other worker's 2 steps
            saved = sess.save()
            assert saved is not None and saved.endswith("ckpt-3"), saved
            d = CheckpointDir(url)
            assert [c.name for c in d.checkpoints()] == ["ckpt-3"]
            assert d.manifest("ckpt-3").global_step == 3
            other.close()
        for p in procs:
            code, err = stop(p)
            assert code == 0, err[-3000:]
    finally:
        for p in procs:
            stop(p, timeout=1)
