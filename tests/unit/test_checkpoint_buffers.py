"""A model's buffers (BatchNorm's running statistics) in its checkpoints, trained alone: the
chief saves them beside the shard files (``buffers.safetensors``, listed in the manifest), the
evaluator scores with them, a restore gives them back, an export loads strictly; a buffers file
missing, cut short or of another shape is refused naming it; a checkpoint saved before buffers
were still restores and scores."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import psflow.nn as pnn
from psflow.cluster.spec import TaskContext
from psflow.train import Evaluator, TrainingSession
from psflow.train.checkpoint import export_state_dict, load_checkpoint
from psflow.train.checkpoint_buffers import model_buffers
from psflow.train.manifest import BUFFERS_FILE, MANIFEST, Manifest

pytestmark = pytest.mark.unit

STEPS = 20
X = torch.randn(64, 2, generator=torch.Generator().manual_seed(0)) * 3 + 5
Y = X.sum(1, keepdim=True)
BN_BUFFERS = ["1.num_batches_tracked", "1.running_mean", "1.running_var"]


def net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)
    )


def session(model: torch.nn.Module, ckpt: Path, **kwargs: Any) -> TrainingSession:
    options: dict[str, Any] = {
        "optimizer": "SGD",
        "lr": 0.05,
        "checkpoint_dir": str(ckpt),
        "save_checkpoint_steps": 10,
        "log_step_count_steps": None,
        "save_summaries_steps": None,
    }
    return TrainingSession(model, TaskContext.alone(), **(options | kwargs))


def train(model: torch.nn.Module, ckpt: Path, steps: int = STEPS) -> None:
    with session(model, ckpt, last_step=steps) as sess:
        while not sess.should_stop():
            sess.zero_grad()
            loss = F.mse_loss(model(X), Y)
            loss.backward()
            sess.step(loss=loss)


def score(model: torch.nn.Module) -> float:
    model.eval()
    with torch.no_grad():
        return float(F.mse_loss(model(X), Y))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A BatchNorm model trained alone, checkpointed at steps 10 and 20 (the final one)."""
    ckpt = tmp_path_factory.mktemp("bn") / "ckpt"
    model = net()
    train(model, ckpt)
    return ckpt, model


def fresh_copy(trained: tuple[Path, torch.nn.Module], tmp_path: Path) -> Path:
    """The trained checkpoint directory, copied: a test may break it."""
    out = tmp_path / "ckpt"
    shutil.copytree(trained[0], out)
    return out


def test_the_manifest_lists_the_buffers_and_the_file_holds_them(
    trained: tuple[Path, torch.nn.Module],
) -> None:
    ckpt, model = trained
    m = Manifest.from_json((ckpt / "ckpt-20" / MANIFEST).read_text())
    assert m.buffers_file == BUFFERS_FILE
    assert m.buffers == {
        "1.num_batches_tracked": {"shape": [], "dtype": "int64"},
        "1.running_mean": {"shape": [4], "dtype": "float32"},
        "1.running_var": {"shape": [4], "dtype": "float32"},
    }
    saved = load_file(str(ckpt / "ckpt-20" / BUFFERS_FILE))
    assert sorted(saved) == BN_BUFFERS
    for name, value in model_buffers(model).items():
        assert torch.equal(saved[name], value), name
    assert int(saved["1.num_batches_tracked"]) == STEPS


def test_the_evaluator_scores_as_the_trained_model_by_hand(
    trained: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    ckpt, model = trained
    by_hand = score(copy.deepcopy(model))
    results = Evaluator(
        net(), lambda m: {"loss": F.mse_loss(m(X), Y)}, str(ckpt), logdir=str(tmp_path),
        timeout=5, poll_interval=0.01,
    ).run()  # fmt: skip
    assert [r.checkpoint for r in results] == ["ckpt-10", "ckpt-20"]
    assert results[-1].metrics is not None
    assert results[-1].metrics["loss"] == pytest.approx(by_hand, rel=1e-6)


def test_a_restore_gives_the_chief_the_saved_statistics(
    trained: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    ckpt = fresh_copy(trained, tmp_path)
    model = net()
    with session(model, ckpt, last_step=STEPS) as sess:
        assert sess.restored_from == "ckpt-20"
    for name, value in model_buffers(trained[1]).items():
        assert torch.equal(model_buffers(model)[name], value), name
    assert score(model) == pytest.approx(score(copy.deepcopy(trained[1])), rel=1e-6)


def test_the_export_loads_strictly(trained: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    export_state_dict(str(trained[0]), str(out))
    model = net()
    model.load_state_dict(load_file(str(out)))  # strict
    assert score(model) == pytest.approx(score(copy.deepcopy(trained[1])), rel=1e-6)


def _missing(path: Path) -> None:
    path.unlink()


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])


def _reshaped(path: Path) -> None:
    saved = load_file(str(path))
    saved["1.running_mean"] = torch.zeros(5)
    save_file(saved, str(path))


def _one_more(path: Path) -> None:
    saved = load_file(str(path))
    saved["extra"] = torch.zeros(1)
    save_file(saved, str(path))


def _retyped(path: Path) -> None:
    saved = load_file(str(path))
    saved["1.running_var"] = saved["1.running_var"].double()
    save_file(saved, str(path))


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (_missing, "named in ckpt-20's manifest, does not exist"),
        (_truncated, "runs past the end of the file"),
        (_reshaped, "buffer '1.running_mean' is float32[5], the manifest says float32[4]"),
        (_one_more, "holds buffers ['extra']"),
        (_retyped, "buffer '1.running_var' is float64[4]"),
    ],
)
def test_a_damaged_buffers_file_is_refused_naming_it(
    trained: tuple[Path, torch.nn.Module], tmp_path: Path, damage: Any, words: str
) -> None:
    ckpt = fresh_copy(trained, tmp_path)
    damage(ckpt / "ckpt-20" / BUFFERS_FILE)
    where = f"{ckpt}/ckpt-20/{BUFFERS_FILE}"
    for read in (
        lambda: load_checkpoint(str(ckpt)),
        lambda: export_state_dict(str(ckpt), str(tmp_path / "out.safetensors")),
        lambda: session(net(), ckpt, last_step=STEPS),
        lambda: Evaluator(net(), lambda m: {"x": 0.0}, str(ckpt), logdir=str(tmp_path)).load(
            "ckpt-20"
        ),
    ):
        with pytest.raises(ValueError) as refused:
            read()
        assert where in str(refused.value) and words in str(refused.value), refused.value


def _edit_manifest(ckpt: Path, edit: Any) -> None:
    path = ckpt / "ckpt-20" / MANIFEST
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.update(buffers_file="../../x.safetensors"), "is not 'buffers.safetensors'"),
        (lambda d: d.update(buffers_file=None), "buffers_file is None for 3 buffers"),
        (lambda d: d.update(buffers=[1]), "buffers must map names to objects"),
        (
            lambda d: d["buffers"]["1.running_mean"].update(shape=[-1]),
            "buffers.1.running_mean.shape = [-1] is not a list of sizes",
        ),
        (
            lambda d: d["buffers"]["1.running_mean"].update(dtype="complex64"),
            "buffers.1.running_mean.dtype = 'complex64' is not a dtype",
        ),
        (
            lambda d: d["buffers"].pop("1.running_mean"),
            "holds buffers ['1.running_mean'], which",
        ),
    ],
)
def test_a_manifest_whose_buffers_do_not_hold_is_refused(
    trained: tuple[Path, torch.nn.Module], tmp_path: Path, edit: Any, words: str
) -> None:
    ckpt = fresh_copy(trained, tmp_path)
    _edit_manifest(ckpt, edit)
    with pytest.raises(ValueError, match="ckpt-20") as refused:
        load_checkpoint(str(ckpt), "ckpt-20")
    assert words in str(refused.value), refused.value


def test_a_fifo_at_the_buffers_file_is_refused_not_opened(
    trained: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    ckpt = fresh_copy(trained, tmp_path)
    path = ckpt / "ckpt-20" / BUFFERS_FILE
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(ValueError, match="where a file belongs"):
        load_checkpoint(str(ckpt))


class _Scaled(torch.nn.Module):
    """The trained model's layers, with one buffer more (``scale``, ``width`` wide)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = net()
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_model_whose_buffers_differ_is_refused_naming_the_buffer(tmp_path: Path) -> None:
    train(_Scaled(3), tmp_path / "ckpt", steps=10)
    with pytest.raises(ValueError, match=r"buffer 'scale' is float32\[3\], the model has"):
        session(_Scaled(5), tmp_path / "ckpt", last_step=10)
    fewer = _Scaled(3)
    del fewer.scale
    with pytest.raises(ValueError, match=r"missing \[\], not in the model \['scale'\]"):
        Evaluator(fewer, lambda m: {"x": 0.0}, str(tmp_path / "ckpt")).load("ckpt-10")
    more = _Scaled(3)
    more.register_buffer("offset", torch.zeros(1))
    with pytest.raises(ValueError, match=r"missing \['offset'\], not in the model \[\]"):
        Evaluator(more, lambda m: {"x": 0.0}, str(tmp_path / "ckpt")).load("ckpt-10")
    Evaluator(_Scaled(3), lambda m: {"x": 0.0}, str(tmp_path / "ckpt")).load("ckpt-10")


def test_a_checkpoint_saved_before_buffers_were_still_restores_and_scores(
    trained: tuple[Path, torch.nn.Module], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = fresh_copy(trained, tmp_path)
    for name in ("ckpt-10", "ckpt-20"):
        path = ckpt / name / MANIFEST
        data = json.loads(path.read_text())
        del data["buffers"], data["buffers_file"]  # as psflow wrote manifests before
        path.write_text(json.dumps(data))
        (ckpt / name / BUFFERS_FILE).unlink()
    assert load_checkpoint(str(ckpt)).buffers is None  # type: ignore[union-attr]
    model = net()
    initial = {n: b.clone() for n, b in model_buffers(model).items()}
    with (
        caplog.at_level(logging.INFO, logger="psflow.train.session"),
        session(model, ckpt, last_step=STEPS) as sess,
    ):
        assert sess.restored_from == "ckpt-20"
    assert "holds no buffers (saved before psflow saved them)" in caplog.text
    for name, value in initial.items():
        assert torch.equal(model_buffers(model)[name], value), name  # as they were
    trained_params = dict(trained[1].named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, trained_params[name]), name
    results = Evaluator(
        net(), lambda m: {"loss": F.mse_loss(m(X), Y)}, str(ckpt), logdir=str(tmp_path),
        timeout=5, poll_interval=0.01,
    ).run()  # fmt: skip
    assert results[-1].metrics is not None and results[-1].checkpoint == "ckpt-20"
    out = tmp_path / "model.safetensors"
    export_state_dict(str(ckpt), str(out))
    assert sorted(load_file(str(out))) == sorted(trained_params)


def test_buffers_leave_out_parameters_tables_and_non_persistent_ones() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = pnn.Embedding(10, 3)
            self.users = pnn.Embedding(None, 3)
            self.items.register_buffer("inside_a_table", torch.zeros(2))
            self.bn = torch.nn.BatchNorm1d(3)
            self.register_buffer("constant", torch.ones(2), persistent=False)
            self.shared = self.bn  # the same buffers under a second name, as in state_dict

    model = Model()
    names = sorted(model_buffers(model))
    assert names == [
        f"{m}.{b}"
        for m in ("bn", "shared")
        for b in ("num_batches_tracked", "running_mean", "running_var")
    ]
    state = model.state_dict()
    assert set(names) <= set(state)


def test_a_checkpoint_of_a_model_without_buffers_records_none(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    train(model, tmp_path / "ckpt", steps=10)
    m = Manifest.from_json((tmp_path / "ckpt" / "ckpt-10" / MANIFEST).read_text())
    assert m.buffers == {} and m.buffers_file is None
    assert not (tmp_path / "ckpt" / "ckpt-10" / BUFFERS_FILE).exists()
    ckpt = load_checkpoint(str(tmp_path / "ckpt"))
    assert ckpt is not None and ckpt.buffers == {}


class _WithExtra(torch.nn.Module):
    """The trained model's layers, and one buffer more (``extra``), given."""

    def __init__(self, extra: torch.Tensor) -> None:
        super().__init__()
        self.body = net()
        self.register_buffer("extra", extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_buffer_a_checkpoint_cannot_hold_is_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="psflow.train.checkpoint_buffers"):
        train(_WithExtra(torch.zeros(2, dtype=torch.complex64)), tmp_path / "ckpt", steps=20)
    assert caplog.text.count("buffer 'extra' is torch.complex64: not checkpointed") == 1
    m = Manifest.from_json((tmp_path / "ckpt" / "ckpt-20" / MANIFEST).read_text())
    assert sorted(m.buffers or {}) == [f"body.{b}" for b in BN_BUFFERS]
    model = _WithExtra(torch.ones(2, dtype=torch.complex64))
    with session(model, tmp_path / "ckpt", last_step=20) as sess:  # restores the rest
        assert sess.restored_from == "ckpt-20"
    assert int(model.body[1].num_batches_tracked) == 20
    assert torch.equal(model.extra, torch.ones(2, dtype=torch.complex64))


def test_a_buffer_that_is_not_finite_is_not_checkpointed(tmp_path: Path) -> None:
    model = _WithExtra(torch.tensor([1.0, float("nan")]))
    with pytest.raises(RuntimeError, match="buffer 'extra' is not finite: refusing"):
        train(model, tmp_path / "ckpt", steps=10)
    assert not (tmp_path / "ckpt" / "ckpt-10" / MANIFEST).exists()
