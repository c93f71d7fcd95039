"""The evaluator: waiting for checkpoints, scoring each once, the final mark, removed ones.

Checkpoints here are real ones, written by the chief's own code (a
:class:`~psflow.train.checkpoint.Checkpointer` saving a one-shard model, as in all-reduce
mode); no sockets. Every wait is on a file (the evaluator's record) or a thread's end, with a
generous bound.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import psflow
from psflow.cluster.spec import ClusterSpec
from psflow.protocol import OptimizerSpec
from psflow.train import Checkpointer, EvalResult, Evaluator
from psflow.train.evaluator import RECORD
from psflow.train.local_shard import LocalShard
from psflow.train.manifest import CheckpointDir, Manifest

pytestmark = pytest.mark.unit

BOUND = 60.0
"""Upper bound of every wait (the machine may be loaded); none is expected to take long."""


class Chief:
    """A model whose every weight is the global step, saved as the chief saves."""

    def __init__(self, directory: Path, max_to_keep: int | None = None) -> None:
        self.model = torch.nn.Linear(2, 1)
        self.step = 0
        opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        local = LocalShard.of_model(self.model, opt, OptimizerSpec(name="SGD"), lambda: self.step)
        self.checkpointer = Checkpointer(
            str(directory),
            client=local,
            pieces=local.pieces,
            params=dict(self.model.named_parameters()),
            make_client=lambda: local,
            max_to_keep=max_to_keep,
        )

    def save(self, step: int, *, final: bool = False) -> None:
        self.step = step
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float(step))
        self.checkpointer.save(step, final=final)


def weight_sum(model: torch.nn.Module) -> dict[str, float]:
    """Weight and bias summed: 3 x the step of the checkpoint loaded."""
    return {"sum": float(sum(p.sum() for p in model.parameters()))}


def evaluator(tmp_path: Path, eval_fn: Callable[..., dict[str, float]] = weight_sum) -> Evaluator:
    return Evaluator(
        torch.nn.Linear(2, 1), eval_fn, str(tmp_path), timeout=BOUND, poll_interval=0.01
    )


def scalars(tmp_path: Path, tag: str = "eval/sum") -> list[tuple[int, float]]:
    """What TensorBoard reads of ``<logdir>/eval``: (step, value) of ``tag``, every event file."""
    acc = EventAccumulator(str(tmp_path / "eval"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def wait_for_record(tmp_path: Path, name: str) -> None:
    """Until the evaluator's record names checkpoint ``name``."""
    record = tmp_path / "eval" / RECORD
    deadline = time.monotonic() + BOUND
    while not (record.exists() and f'"{name}"' in record.read_text()):
        assert time.monotonic() < deadline, f"{name} never recorded"
        time.sleep(0.01)


def run_in_thread(ev: Evaluator) -> tuple[threading.Thread, list[list[EvalResult]]]:
    out: list[list[EvalResult]] = []
    t = threading.Thread(target=lambda: out.append(ev.run()), daemon=True)
    t.start()
    return t, out


def test_scores_every_checkpoint_once_and_stops_after_the_final_one(tmp_path: Path) -> None:
    chief = Chief(tmp_path)
    for step in (10, 20):
        chief.save(step)
    chief.save(30, final=True)

    results = evaluator(tmp_path).run()

    assert [(r.checkpoint, r.final) for r in results] == [
        ("ckpt-10", False),
        ("ckpt-20", False),
        ("ckpt-30", True),
    ]
    assert scalars(tmp_path) == [(10, 30.0), (20, 60.0), (30, 90.0)]
    # Restarted: everything was scored, the newest is final: nothing to do, nothing written.
    again = evaluator(tmp_path)
    assert set(again.done) == {"ckpt-10", "ckpt-20", "ckpt-30"}
    assert again.run() == []
    assert [s for s, _ in scalars(tmp_path)] == [10, 20, 30]


def test_waits_for_each_new_checkpoint_and_a_restart_goes_on_after_the_last(
    tmp_path: Path,
) -> None:
    chief = Chief(tmp_path)
    ev = evaluator(tmp_path)
    thread, out = run_in_thread(ev)
    chief.save(5)
    wait_for_record(tmp_path, "ckpt-5")
    chief.save(6)
    wait_for_record(tmp_path, "ckpt-6")
    assert thread.is_alive()  # ckpt-6 is not final: it waits on
    # A second evaluator (this one's restart) scores only what comes after ckpt-6.
    restarted = evaluator(tmp_path)
    chief.save(7, final=True)
    thread.join(BOUND)
    assert not thread.is_alive()
    assert [r.global_step for r in out[0]] == [5, 6, 7]
    assert [r.global_step for r in restarted.run()] == []  # ckpt-7 was recorded by the first
    assert scalars(tmp_path) == [(5, 15.0), (6, 18.0), (7, 21.0)]


def test_a_checkpoint_marked_final_after_it_was_scored_ends_the_run(tmp_path: Path) -> None:
    chief = Chief(tmp_path)
    thread, out = run_in_thread(evaluator(tmp_path))
    chief.save(4)
    wait_for_record(tmp_path, "ckpt-4")
    # Training ends at the step of the last scheduled save: the chief marks that checkpoint.
    chief.checkpointer.save(4, final=True)
    assert CheckpointDir(str(tmp_path)).manifest("ckpt-4").final
    thread.join(BOUND)
    assert not thread.is_alive()
    assert [(r.global_step, r.final) for r in out[0]] == [(4, False)]
    assert scalars(tmp_path) == [(4, 12.0)]  # not scored twice
    records = [json.loads(x) for x in (tmp_path / "eval" / RECORD).read_text().splitlines()]
    assert [(r["checkpoint"], r["final"]) for r in records] == [
        ("ckpt-4", False),
        ("ckpt-4", True),
    ]


def test_a_checkpoint_removed_before_it_was_read_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chief = Chief(tmp_path, max_to_keep=1)
    chief.checkpointer.max_to_keep = None
    chief.save(1)
    chief.save(2)
    chief.checkpointer.max_to_keep = 1

    def slow_eval(model: torch.nn.Module) -> dict[str, float]:
        if not (tmp_path / "ckpt-3").exists():
            chief.save(3, final=True)  # while ckpt-1 is scored: prunes ckpt-2 (and ckpt-1)
        return weight_sum(model)

    with caplog.at_level(logging.WARNING, logger="psflow.train.evaluator"):
        results = evaluator(tmp_path, slow_eval).run()

    assert [(r.checkpoint, r.metrics) for r in results] == [
        ("ckpt-1", {"sum": 3.0}),
        ("ckpt-2", None),
        ("ckpt-3", {"sum": 9.0}),
    ]
    assert "ckpt-2 was removed (max_to_keep) before it could be read: skipped" in caplog.text
    assert scalars(tmp_path) == [(1, 3.0), (3, 9.0)]


def test_no_final_checkpoint_times_out_naming_the_last_one(tmp_path: Path) -> None:
    Chief(tmp_path).save(3)
    ev = Evaluator(
        torch.nn.Linear(2, 1), weight_sum, str(tmp_path), timeout=0.2, poll_interval=0.01
    )
    with pytest.raises(TimeoutError, match=r"none marked final \(the newest scored: ckpt-3\)"):
        ev.run()
    assert scalars(tmp_path) == [(3, 9.0)]


def test_bad_arguments_and_results_are_named(tmp_path: Path) -> None:
    Chief(tmp_path).save(1, final=True)
    with pytest.raises(TypeError, match=r"eval_fn .* must return a non-empty \{name: number\}"):
        evaluator(tmp_path, lambda m: 0.5).run()  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match=r"returned acc='high', which is not a number"):
        evaluator(tmp_path, lambda m: {"acc": "high"}).run()  # type: ignore[dict-item]
    with pytest.raises(
        ValueError, match=r"ckpt-1: .weight. is float32\[1, 2\], the model has float32\[1, 3\]"
    ):
        Evaluator(torch.nn.Linear(3, 1), weight_sum, str(tmp_path), timeout=BOUND).run()
    with pytest.raises(ValueError, match="give logdir"):
        Evaluator(torch.nn.Linear(2, 1), weight_sum, "memory://somewhere")
    with pytest.raises(ValueError, match="checkpoint_dir"):
        Evaluator(torch.nn.Linear(2, 1), weight_sum)


def test_manifests_without_the_final_field_still_read() -> None:
    m = Manifest(global_step=3, num_shards=1, optimizer={}, variables=[])
    data = json.loads(m.to_json())
    assert data.pop("final") is False
    assert Manifest.from_json(json.dumps(data)).final is False
    data["final"] = "yes"
    with pytest.raises(ValueError, match="final is not true or false"):
        Manifest.from_json(json.dumps(data))


def test_a_script_knows_it_is_the_evaluator_from_tf_config() -> None:
    cluster = ClusterSpec(jobs={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, evaluators=1)
    tf_config = json.loads(cluster.to_tf_config(psflow.TaskSpec(job="evaluator", index=0)))
    assert "evaluator" not in tf_config["cluster"]  # TensorFlow keeps it outside
    ctx, _ = psflow.resolve([], environ={"TF_CONFIG": json.dumps(tf_config)})
    assert ctx.is_evaluator and not ctx.is_chief
    worker, _ = psflow.resolve([], environ={"TF_CONFIG": cluster.to_tf_config(cluster.chief)})
    assert not worker.is_evaluator


def test_a_checkpoint_that_is_there_but_unreadable_is_an_error_not_a_skip(tmp_path: Path) -> None:
    Chief(tmp_path).save(2, final=True)
    (tmp_path / "ckpt-2" / "shard-0-of-1.safetensors").unlink()  # its manifest stays
    with pytest.raises(ValueError, match=r"shard-0-of-1.safetensors, named in ckpt-2's manifest"):
        evaluator(tmp_path).run()
    assert not (tmp_path / "eval" / RECORD).exists()
