"""ModeStatsHook writes the training mode's counters as TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.train import ModeStatsHook, StepContext


def test_mode_stats_become_scalars(tmp_path: Path) -> None:
    stats = {"mode": "async", "staleness_mean": 1.5, "staleness_max": 3, "waited_steps": 2}
    session = SimpleNamespace(opt=SimpleNamespace(stats=lambda: stats))
    hook = ModeStatsHook(str(tmp_path), every_n_steps=10)
    for step in (5, 10, 20):
        hook.after_step(StepContext(session=session, global_step=step))  # type: ignore[arg-type]
    hook.end(session)
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == [
        "mode/staleness_max",
        "mode/staleness_mean",
        "mode/waited_steps",
    ]
    assert [e.step for e in acc.Scalars("mode/staleness_mean")] == [10, 20]
    assert acc.Scalars("mode/staleness_max")[0].value == 3.0
