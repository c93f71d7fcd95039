"""Hooks, session configuration and summaries (no sockets)."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.train import (
    LoggingHook,
    NanGuardHook,
    NanLossError,
    SessionConfig,
    StepContext,
    StopAtStepHook,
    SummaryHook,
)
from tests.faults import FaultHook

pytestmark = pytest.mark.unit


class FakeSession:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 1)
        self.ctx = SimpleNamespace(task="worker:1")
        self.global_step = 0
        self.latest_checkpoint = "ckpt-10"
        self.stopped = False

    def request_stop(self) -> None:
        self.stopped = True


def _ctx(sess: Any, step: int, loss: float | None = 1.0) -> StepContext:
    return StepContext(session=sess, global_step=step, loss=loss)


def test_stop_at_step() -> None:
    sess = FakeSession()
    hook = StopAtStepHook(5)
    hook.begin(sess)  # type: ignore[arg-type]
    assert not sess.stopped
    hook.after_step(_ctx(sess, 4))
    assert not sess.stopped
    hook.after_step(_ctx(sess, 5))
    assert sess.stopped
    resumed = FakeSession()
    resumed.global_step = 7
    hook.begin(resumed)  # type: ignore[arg-type]
    assert resumed.stopped
    with pytest.raises(ValueError, match="last_step"):
        StopAtStepHook(-1)


class _ReadsCounted(FakeSession):
    reads = 0

    @property  # type: ignore[override]
    def latest_checkpoint(self) -> str:
        self.reads += 1
        return "ckpt-10"

    @latest_checkpoint.setter
    def latest_checkpoint(self, _: str) -> None:
        pass


def test_nan_guard_names_the_step_task_and_last_checkpoint() -> None:
    sess = _ReadsCounted()
    guard = NanGuardHook()
    for _ in range(3):
        guard.before_step(_ctx(sess, 3, 0.5))
    assert sess.reads == 0  # the checkpoint directory (perhaps remote) is read for a bad step only
    with pytest.raises(NanLossError, match=r"loss is nan at global step 3 on worker:1.*ckpt-10"):
        guard.before_step(_ctx(sess, 3, float("nan")))
    sess.model.weight.grad = torch.tensor([[1.0, float("inf")]])
    with pytest.raises(NanLossError, match="gradient of 'weight'"):
        guard.before_step(_ctx(sess, 3, 0.5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_guard_finds_a_bad_value_in_any_gradient_of_any_dtype(bad: float, path: str) -> None:
    sess = FakeSession()
    sess.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(
        torch.bfloat16
    )
    sess.model[0].float()  # two dtypes on one device, checked together
    table = torch.nn.Embedding(10, 2, sparse=True)
    sess.model.add_module("table", table)
    for p in sess.model.parameters():
        p.grad = torch.zeros_like(p)
    table.weight.grad = torch.sparse_coo_tensor([[1, 7]], torch.ones(2, 2), (10, 2))
    guard = NanGuardHook()
    guard.before_step(_ctx(sess, 1))  # all finite
    sess.model[1].bias.grad[1] = bad
    with pytest.raises(NanLossError, match=r"gradient of '1\.bias'"):
        guard.before_step(_ctx(sess, 2))
    sess.model[1].bias.grad.zero_()
    table.weight.grad = torch.sparse_coo_tensor(
        [[1, 7]], torch.tensor([[0.0, bad], [1, 1]]), (10, 2)
    )
    with pytest.raises(NanLossError, match=r"gradient of 'table\.weight'"):
        guard.before_step(_ctx(sess, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_nan_guard_lets_the_largest_finite_gradients_through(dtype: torch.dtype, path: str) -> None:
    """Finite values whose squares overflow (the 2-norm infinite) are still finite: the
    largest magnitude decides."""
    sess = FakeSession()
    sess.model = torch.nn.Linear(64, 4).to(dtype)
    top = torch.finfo(dtype).max
    sess.model.weight.grad = torch.full_like(sess.model.weight, top)
    sess.model.weight.grad[0, :32] = -top
    sess.model.bias.grad = torch.zeros_like(sess.model.bias)
    assert not torch._foreach_norm([sess.model.weight.grad], 2)[0].isfinite()  # overflows
    NanGuardHook().before_step(_ctx(sess, 1))
    sess.model.bias.grad[3] = float("nan")
    with pytest.raises(NanLossError, match="gradient of 'bias'"):
        NanGuardHook().before_step(_ctx(sess, 2))


def test_logging_hook_prints_rate_loss_and_eta_lines_when_not_a_tty() -> None:
    out = io.StringIO()
    hook = LoggingHook(every_n_steps=10, last_step=100, stream=out)
    sess = FakeSession()
    hook.begin(sess)  # type: ignore[arg-type]
    for step in range(1, 21):
        hook.after_step(_ctx(sess, step, loss=0.5))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 10/100 [##") and "10%" in lines[0]
    assert "steps/s" in lines[0] and "loss 0.5" in lines[0] and "ETA 0:00:" in lines[0]


def test_fault_schedule_parsing() -> None:
    assert FaultHook.from_spec("worker:0@30", "worker:1") is None
    hook = FaultHook.from_spec("worker:0@30", "worker:0")
    assert hook is not None and hook.step == 30
    with pytest.raises(ValueError, match="<task>@<step>"):
        FaultHook.from_spec("worker:0", "worker:0")
    hang = FaultHook.from_spec("worker:1@700:8.5", "worker:1", hang=True)
    assert hang is not None and (hang.step, hang.hang) == (700, 8.5)
    with pytest.raises(ValueError, match="<task>@<step>:<seconds>"):
        FaultHook.from_spec("worker:1@700", "worker:1", hang=True)
    with pytest.raises(ValueError, match=r"<task>@<step>, e\.g\."):
        FaultHook.from_spec("worker:1@700:8", "worker:1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"save_checkpoint_steps": 0}, "save_checkpoint_steps"),
        ({"max_to_keep": 0}, "max_to_keep"),
        ({"save_checkpoint_secs": -1.0}, "save_checkpoint_secs"),
        ({"last_step": -2}, "last_step"),
        ({"checkpoint_dir": ""}, "checkpoint_dir"),
        ({"recovery_timeout": 0.0}, "recovery_timeout"),
    ],
)
def test_session_config_rejects_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SessionConfig.of(**kwargs)


def test_session_config_defaults_follow_tensorflow() -> None:
    cfg = SessionConfig.of(checkpoint_dir="/tmp/x")
    assert cfg.checkpoint.save_checkpoint_secs == 600.0 and cfg.summaries.summary_dir == "/tmp/x"
    assert (
        SessionConfig.of(
            checkpoint_dir="/tmp/x", save_checkpoint_steps=5
        ).checkpoint.save_checkpoint_secs
        is None
    )


def test_an_optimizer_named_without_lr_takes_the_torch_class_default() -> None:
    # As docs/api.md says: "the optimizer's". Adam's 1e-3, never a psflow-wide 0.01.
    for name in ("SGD", "Adam", "Adagrad"):
        spec = SessionConfig.of(optimizer=name).training.optimizer
        built = spec.build([torch.zeros(2, requires_grad=True)])
        assert (
            spec.lr
            == built.defaults["lr"]
            == getattr(torch.optim, name)([torch.zeros(1)]).defaults["lr"]
        )
    assert SessionConfig.of(optimizer="Adam", lr=0.05).training.optimizer.lr == 0.05


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        (
            {"optimizer": "Adam", "betaz": (0.9, 0.99)},
            "OptimizerSpec.of('Adam', lr=..., betas=...)",
        ),
        ({"optimizer": "SGD", "momentum": 0.9}, "OptimizerSpec.of('SGD', lr=..., momentum=...)"),
        ({"momentum": 0.9}, "OptimizerSpec.of('SGD', lr=..., momentum=...)"),
        ({"optimizer": "Adam", "momentum": 0.9}, "nor is it an argument of torch.optim.Adam"),
        ({"lrr": 0.1}, "did you mean 'lr'?"),
    ],
)
def test_an_optimizer_argument_beside_the_name_is_sent_to_that_optimizer_spec(
    kwargs: dict[str, Any], hint: str
) -> None:
    with pytest.raises(ValueError, match="no setting of the session") as e:
        SessionConfig.of(**kwargs)
    assert hint in str(e.value)


def test_summaries_are_readable_by_tensorboard(tmp_path: Path) -> None:
    sess = FakeSession()
    hook = SummaryHook(str(tmp_path), every_n_steps=10, histogram_steps=20, learning_rate=0.1)
    hook.begin(sess)  # type: ignore[arg-type]
    for step in range(1, 41):
        hook.after_step(_ctx(sess, step, loss=1.0 / step))
    hook.scalar("user/accuracy", 0.75, 40)
    hook.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"loss", "global_step/sec", "learning_rate", "user/accuracy"} <= set(tags["scalars"])
    assert {"weight", "bias"} <= set(tags["histograms"])
    assert [e.step for e in acc.Scalars("loss")] == [10, 20, 30, 40]
    assert acc.Scalars("learning_rate")[0].value == pytest.approx(0.1)
    assert acc.Scalars("loss")[0].value == pytest.approx(sum(1 / s for s in range(1, 11)) / 10)
    assert [e.step for e in acc.Histograms("weight")] == [20, 40]
