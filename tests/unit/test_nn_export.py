"""Tracing and exporting psflow.nn tables: exactly the eager outputs, or a refusal that says why.

A model with fixed and hashed tables (Embedding, and EmbeddingBag in each mode) trained locally,
saved as a state dict, loaded into a fresh model and put in eval mode: ``torch.jit.trace``,
``torch.export`` and both ONNX exporters (run by ONNX Runtime) must give its eager outputs,
on the batch they were recorded with and on another one with ids the tables never held, which
read a row of zeros there as in eager eval mode. What cannot be recorded (an attached table, a
hashed table in training mode, anything under ``torch.jit.script``) is refused with a message
that says what to do instead.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from psflow.nn import Embedding, EmbeddingBag
from psflow.sparse import initial_rows

pytestmark = pytest.mark.unit

DIM = 4
SQRTN = 6
"""The column block of the fixed sqrtn bag in :meth:`Model.parts`."""
HELD = 20
"""Ids 0..HELD-1 are trained (held by the hashed tables); ids from 10**9 up never are."""


class Model(torch.nn.Module):
    """Every kind of lookup: hashed and fixed, Embedding and EmbeddingBag (2-D bags and 1-D
    bags with offsets), sum, mean, max and TensorFlow's sqrtn, with and without a padding id."""

    BAG_PADDING: int | None = 3

    def __init__(self) -> None:
        super().__init__()
        self.h = Embedding(None, DIM, optimizer="Adagrad", padding_idx=5, seed=1)
        self.hsum = EmbeddingBag(None, DIM, mode="sum", optimizer="Adagrad", seed=2)
        self.hmean = EmbeddingBag(
            None, DIM, mode="mean", optimizer="SGD", padding_idx=self.BAG_PADDING
        )
        self.hmax = EmbeddingBag(None, DIM, mode="max", optimizer="Adagrad", seed=4)
        self.hoff = EmbeddingBag(None, DIM, mode="sum", optimizer="Adagrad", seed=5)
        self.f = Embedding(HELD, DIM, padding_idx=0)
        self.fsqrtn = EmbeddingBag(HELD, DIM, mode="sqrtn")
        self.foff = EmbeddingBag(HELD, DIM, mode="mean")
        self.head = torch.nn.Linear(8 * DIM, 1, dtype=torch.float32)

    def parts(
        self, ids: torch.Tensor, bags: torch.Tensor, flat: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        small = bags.remainder(HELD)
        return torch.cat(
            [
                self.h(ids),
                self.hsum(bags),
                self.hmean(bags),
                self.hmax(bags),
                self.hoff(flat, offsets),
                self.f(ids.remainder(HELD)),
                self.fsqrtn(small),
                self.foff(flat.remainder(HELD), offsets),
            ],
            dim=1,
        )

    def forward(
        self, ids: torch.Tensor, bags: torch.Tensor, flat: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        return self.parts(ids, bags, flat, offsets)


class NoBagPadding(Model):
    """No bag with a padding id: what ``torch.onnx.export(dynamo=False)`` can export."""

    BAG_PADDING = None


class Head(Model):
    """The same, with a dense layer on top (its arithmetic is the backend's, not exact)."""

    def forward(
        self, ids: torch.Tensor, bags: torch.Tensor, flat: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        return self.head(self.parts(ids, bags, flat, offsets)).squeeze(1)


def batch(gen: torch.Generator, unseen: bool) -> tuple[torch.Tensor, ...]:
    """8 examples; with ``unseen``, ids no table was trained on among the held ones."""
    ids = torch.randint(0, HELD, (8,), generator=gen)
    bags = torch.randint(0, HELD, (8, 3), generator=gen)
    flat = torch.randint(0, HELD, (12,), generator=gen)
    if unseen:
        ids[::3] = 10**9 + torch.arange(3)
        bags[::2, 1] = 10**9 + 7
        bags[1] = 10**12 + torch.arange(3)  # a bag of ids none of which is held
        flat[::4] = -(10**10)
    ids[1] = 5  # h's padding id
    bags[2, 0] = 3  # hmean's
    offsets = torch.tensor([0, 3, 3, 7, 9, 12, 12, 12])  # with empty bags
    return ids, bags, flat, offsets


def trained(cls: type[Model] = Model) -> Model:
    """A model whose tables were trained on ids 0..HELD-1, through a state dict, eval mode."""
    torch.manual_seed(0)
    src = cls()
    opt = torch.optim.SGD([p for n, p in src.named_parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        src.parts(*batch(gen, unseen=False)).square().sum().backward()
        opt.step()
    state = src.state_dict()
    assert state["hsum.ids"].numel() == HELD
    model = cls()
    model.load_state_dict(state)
    return model.eval()


def inputs() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(2)
    return batch(gen, unseen=False), batch(gen, unseen=True)


def test_eval_mode_reads_zeros_for_ids_a_hashed_table_does_not_hold() -> None:
    model = trained()
    ids = torch.tensor([7, 10**9, 5, -3])
    out = model.h(ids)
    held = dict(zip(model.h.held_ids().tolist(), model.h.held_rows(), strict=True))
    assert torch.equal(out[0], held[7])
    assert torch.equal(out[1:], torch.zeros(3, DIM))  # not held, padding, not held
    # A bag counts an id it does not hold as a zero row (here: in the mean), not the padding id.
    bag = model.hmean(torch.tensor([[7, 10**9, 3]]))
    assert torch.equal(bag[0], held_row(model.hmean, 7) / 2)
    # Read-only: the rows are constants to autograd (nothing trains), and no row is made.
    assert not model.h(torch.tensor([7, 11])).requires_grad
    held_before = model.h.held_ids().numel()
    model.h(torch.tensor([10**9 + 1]))
    assert model.h.held_ids().numel() == held_before


def held_row(table: Any, i: int) -> torch.Tensor:
    return dict(zip(table.held_ids().tolist(), table.held_rows(), strict=True))[i]


def test_training_mode_still_reads_an_unheld_id_as_its_initial_row() -> None:
    model = trained().train()
    with torch.no_grad():
        out = model.h(torch.tensor([10**9]))
    config = model.h.config
    want = initial_rows(1, torch.tensor([10**9]), DIM, std=config.init_std, dtype=config.dtype)
    assert torch.equal(out, want)


def test_eval_mode_follows_rows_loaded_after_it() -> None:
    model = trained()
    model.h.load_rows(torch.tensor([10**9]), torch.ones(1, DIM))
    assert torch.equal(
        model.h(torch.tensor([10**9, 7])), torch.cat([torch.ones(1, DIM), torch.zeros(1, DIM)])
    )


@pytest.mark.parametrize("eager_first", [False, True], ids=["traced-first", "eager-first"])
def test_jit_trace_gives_the_eager_outputs(eager_first: bool) -> None:
    model = trained()
    seen, unseen = inputs()
    if eager_first:
        model(*seen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shapes taken as constants
        traced = torch.jit.trace(model, seen)
    for args in (seen, unseen):
        assert torch.equal(traced(*args), model(*args))
    # The report: a model with a dense head, traced on a batch, returned garbage.
    head = trained(Head)
    assert torch.equal(torch.jit.trace(head, seen)(*unseen), head(*unseen))


def test_torch_export_gives_the_eager_outputs() -> None:
    model = trained()
    seen, unseen = inputs()
    program = torch.export.export(model, seen)
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("sort" in op and "searchsorted" not in op for op in ops), ops
    exported = program.module()
    for args in (seen, unseen):
        assert torch.equal(exported(*args), model(*args))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_onnx_export_gives_the_eager_outputs(dynamo: bool, tmp_path: Path) -> None:
    import onnxruntime as ort  # requirements/test.txt

    model = trained(Model if dynamo else NoBagPadding)
    seen, unseen = inputs()
    path = tmp_path / "model.onnx"
    names = ["ids", "bags", "flat", "offsets"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, seen, str(path), input_names=names, dynamo=dynamo)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for args in (seen, unseen):
        (got,) = session.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})
        want = model(*args).detach().view(-1, 8, DIM)
        got_t = torch.from_numpy(got).view(-1, 8, DIM)
        # Every lookup exactly; sqrtn's division by a bag's norm is ONNX Runtime's arithmetic
        # (seen: 1 float32 ulp apart).
        exact = [i for i in range(8) if i != SQRTN]
        assert torch.equal(got_t[:, exact], want[:, exact])
        torch.testing.assert_close(got_t[:, SQRTN], want[:, SQRTN], rtol=0, atol=1e-6)


def test_the_torchscript_onnx_exporter_refuses_a_bag_with_a_padding_id(tmp_path: Path) -> None:
    seen, _ = inputs()
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match=r"dynamo=True"):
        warnings.simplefilter("ignore")
        torch.onnx.export(trained(), seen, str(tmp_path / "m.onnx"), dynamo=False)


def test_jit_script_is_refused_with_what_to_use_instead() -> None:
    with pytest.raises(RuntimeError, match=r"torch.jit.script.*torch.jit.trace\(model.eval"):
        torch.jit.script(trained())


def test_a_hashed_table_in_training_mode_is_refused() -> None:
    model = trained().train()
    seen, _ = inputs()
    with pytest.raises(RuntimeError, match=r"Embedding\(None, 4\) .*training mode.*model.eval\(\)"):
        torch.jit.trace(model, seen)
    with pytest.raises(RuntimeError, match=r"training mode.*model.eval\(\)"):
        torch.export.export(model, seen)


def test_an_attached_table_is_refused() -> None:
    class Source:
        def rows(self, table: Any, ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(ids.numel(), DIM, requires_grad=True)

    emb = Embedding(10, DIM)
    emb.attach(Source())
    emb.eval()
    ids = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match=r"attached.*parameter servers.*state dict"):
        torch.jit.trace(emb, (ids,))
    with pytest.raises(RuntimeError, match=r"attached.*parameter servers"):
        torch.export.export(emb, (ids,))


def test_a_fixed_table_traces_in_training_mode_too() -> None:
    emb = Embedding(10, DIM)
    ids = torch.tensor([[1, 2], [9, 0]])
    traced = torch.jit.trace(emb, (ids,))
    assert torch.equal(traced(ids), emb(ids))
    with pytest.raises(RuntimeError, match="index out of range"):  # torch's own check
        traced(torch.tensor([10]))


def test_a_hashed_table_on_the_meta_device_still_says_it_holds_no_rows_in_eval_mode() -> None:
    emb = Embedding(None, DIM, device="meta").eval()
    with pytest.raises(RuntimeError, match="meta device and holds no rows"):
        emb(torch.tensor([1]))
