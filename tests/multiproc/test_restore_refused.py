"""A ps that refuses a restore: the chief's user reads the ps's own one-line reason, not a
``PeerError`` from the client's depths (issue 36)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import psflow.nn as pnn
from tests import psflow_checkpoint

from .support import local_cluster, quiet_session, start_ps, stop

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]


class _Model(torch.nn.Module):
    """The checkpoint's dense parameters and tables, but ``items`` 5 wide where it saved 3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Module()
        self.fc.weight = torch.nn.Parameter(torch.zeros(10, 4))
        self.fc.bias = torch.nn.Parameter(torch.zeros(4))
        self.items = pnn.Embedding(40, 5, optimizer="Adagrad")
        self.users = pnn.Embedding(None, 3, optimizer="Adagrad")


def test_a_restore_the_ps_refuses_reaches_the_user_as_its_reason(tmp_path: Path) -> None:
    run, _ = psflow_checkpoint.copy(tmp_path)
    cluster = local_cluster(2, 1)
    procs = [start_ps(cluster, i) for i in range(2)]
    try:
        with pytest.raises(ValueError) as refused:
            quiet_session(_Model(), cluster, str(run), optimizer="Adam", lr=0.01)
        message = str(refused.value)
        assert refused.value.__cause__ is None and refused.value.__suppress_context__
        assert "\n" not in message
        assert message.startswith(f"{run}/ckpt-3: ps:") and "refused the restore" in message
        assert "items" in message, message
    finally:
        for p in procs:
            stop(p, timeout=1)
