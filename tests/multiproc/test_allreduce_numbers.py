"""All-reduce mode's numbers against one process: a parameter no rank's backward reached is
left alone, and a restored job goes on at its schedule's rate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .support import PRELOAD

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

UNUSED = """
import copy, torch, psflow
ctx, argv = psflow.resolve()
torch.manual_seed(0)
class M(torch.nn.Module):
    def __init__(s):
        super().__init__(); s.a = torch.nn.Linear(2, 1); s.b = torch.nn.Linear(2, 1)
    def forward(s, x, use_b):
        return s.a(x) + (s.b(x) if use_b else 0)
m = M(); ref = copy.deepcopy(m); ropt = torch.optim.Adam(ref.parameters(), lr=0.1)
opt = psflow.DistributedOptimizer(m, ctx, mode="allreduce", optimizer="Adam", lr=0.1)
g = torch.Generator().manual_seed(1)
for step in range(6):  # b in the loss for two steps only (every rank the same batch)
    x = torch.randn(4, 2, generator=g); y = torch.randn(4, 1, generator=g)
    opt.zero_grad(); ((m(x, step < 2) - y) ** 2).mean().backward(); opt.step()
    ropt.zero_grad(); ((ref(x, step < 2) - y) ** 2).mean().backward(); ropt.step()
for name, p in ref.named_parameters():
    assert torch.equal(dict(m.named_parameters())[name], p), (name, p)
print("same as torch")
opt.close()
"""

SCHEDULED = """
import os, torch, psflow
ctx, argv = psflow.resolve()
torch.manual_seed(0); m = torch.nn.Linear(2, 1)
with psflow.TrainingSession(m, ctx, optimizer="SGD", lr=1.0,
        lr_schedule=("ExponentialLR", {"gamma": 0.5}), checkpoint_dir=argv[0],
        save_checkpoint_steps=1, last_step=int(argv[1]), log_step_count_steps=None) as sess:
    while not sess.should_stop():
        g = torch.Generator().manual_seed(sess.global_step)
        x = torch.randn(4, 2, generator=g); y = torch.randn(4, 1, generator=g)
        sess.zero_grad(); loss = ((m(x) - y) ** 2).mean(); loss.backward()
        print(f"step {sess.global_step} lr {sess.opt.learning_rate}", flush=True)
        sess.step(loss=loss)
    print("final", m.weight.tolist(), m.bias.tolist(), flush=True)
"""


def _launch(script: Path, *args: str, workers: int = 1) -> str:
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--mode", "allreduce", "--no-metrics"]
    cmd += ["--workers", str(workers), "--preload", PRELOAD, str(script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("workers", [1, 2])
def test_a_parameter_no_backward_reached_is_left_alone(tmp_path: Path, workers: int) -> None:
    """It was given a zeroed gradient, on which Adam went on stepping (0.12 away from torch's
    after 4 such steps), where torch and a sync ps leave it alone."""
    script = tmp_path / "unused.py"
    script.write_text(UNUSED)
    assert _launch(script, workers=workers).count("same as torch") == workers


def test_a_restored_job_goes_on_at_its_schedules_rate(tmp_path: Path) -> None:
    """Its first step took the schedule's step-0 rate (1.0, not 0.0625 at step 4)."""
    script = tmp_path / "scheduled.py"
    script.write_text(SCHEDULED)
    _launch(script, str(tmp_path / "a"), "4")
    resumed = _launch(script, str(tmp_path / "a"), "6")
    whole = _launch(script, str(tmp_path / "b"), "6")
    assert "[worker:0] step 4 lr 0.0625" in resumed, resumed
    final = [ln for ln in resumed.splitlines() if "final" in ln]
    assert final and final == [ln for ln in whole.splitlines() if "final" in ln], (resumed, whole)
