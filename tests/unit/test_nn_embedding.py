"""psflow.nn.Embedding and EmbeddingBag compute what torch's compute, local or attached.

Each case builds the psflow module, gives its weight to the torch module, and compares outputs
and weight gradients; attached, the module asks a row source backed by that same weight, and the
gradient each unique id's row receives must be torch's ``weight.grad`` row for that id.
"""

from __future__ import annotations

import doctest
import json
from typing import Any

import pytest
import torch

import psflow
import psflow.nn.embedding
import psflow.nn.table
from psflow.nn import Embedding, EmbeddingBag, RowSource, TableModule
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse import initial_rows
from tests.paths import ROOT

pytestmark = pytest.mark.unit

N, DIM = 13, 5
SEEDS = (0, 1, 2)
TOL = {"rtol": 0, "atol": 1e-6}


class DenseSource:
    """A row source serving rows from a dense tensor, and keeping each leaf it hands out."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach().clone()
        self.asked: list[torch.Tensor] = []
        self.leaves: list[torch.Tensor] = []

    def rows(self, table: TableModule, ids: torch.Tensor) -> torch.Tensor:
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert torch.unique(ids).numel() == ids.numel(), "ids must be unique"
        leaf = self.weight[ids].clone().requires_grad_(True)
        self.asked.append(ids)
        self.leaves.append(leaf)
        return leaf

    def grad_per_id(self) -> dict[int, torch.Tensor]:
        """Each id's row gradient, summed over the leaves handed out."""
        out: dict[int, torch.Tensor] = {}
        for ids, leaf in zip(self.asked, self.leaves, strict=True):
            assert leaf.grad is not None
            for i, g in zip(ids.tolist(), leaf.grad, strict=True):
                out[i] = out[i] + g if i in out else g.clone()
        return out


class GroupedSource(DenseSource):
    """Gives a batch's rows as the worker's source does over 2 ps with ``mod``
    (``batch_rows``): the unique ids' rows, even ids first, then odd ones. Checks the ids'
    range itself, as such a source must (the table leaves it to the source)."""

    def batch_rows(
        self, table: TableModule, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.checked = getattr(self, "checked", 0) + 1
        table.check_range(*torch.aminmax(ids))
        unique, positions = torch.unique(ids, return_inverse=True)
        order = torch.argsort(unique % 2, stable=True)
        where = torch.empty_like(order)
        where[order] = torch.arange(order.numel())
        return self.rows(table, unique[order]), where[positions]


class PartsSource(GroupedSource):
    """As the worker's source through lanes (``batch_parts``): the grouped rows left in two
    parts (even ids', odd ids'), and a leaf that holds no values (NaN here: a forward that read
    them would show it)."""

    def batch_parts(
        self, table: TableModule, ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        self.given_parts = True
        rows, positions = self.batch_rows(table, ids)
        evens = int((self.asked[-1] % 2 == 0).sum())
        parts = [rows[:evens].detach().clone(), rows[evens:].detach().clone()]
        with torch.no_grad():
            rows.fill_(float("nan"))
        return rows, parts, positions


def random_ids(
    gen: torch.Generator, shape: tuple[int, ...], padding_idx: int | None
) -> torch.Tensor:
    """Ids with duplicates (drawn from half the table), the padding id among them if any."""
    ids = torch.randint(0, N // 2 + 1, shape, generator=gen)
    if padding_idx is not None and ids.numel() > 2:
        ids.view(-1)[1] = padding_idx
    return ids


def check_grads(module: TableModule, source: DenseSource | None, ref: torch.nn.Module) -> None:
    assert ref.weight.grad is not None
    if source is None:
        assert module.weight.grad is not None
        torch.testing.assert_close(module.weight.grad, ref.weight.grad, **TOL)
        return
    grads = source.grad_per_id()
    expected = ref.weight.grad.clone()
    for i, g in grads.items():
        torch.testing.assert_close(g, expected[i], **TOL)
        expected[i] = 0
    # Rows of ids the batch did not use get no gradient from torch either.
    assert torch.count_nonzero(expected) == 0


def attach_or_not(module: TableModule, attached: bool | str) -> DenseSource | None:
    if not attached:
        return None
    kinds = {"grouped": GroupedSource, "parts": PartsSource}
    source = kinds.get(str(attached), DenseSource)(module.weight)
    module.attach(source)
    return source


@pytest.mark.parametrize(
    "attached", [False, True, "grouped", "parts"], ids=["local", "attached", "grouped", "parts"]
)
@pytest.mark.parametrize("padding_idx", [None, 3, -1])
@pytest.mark.parametrize("shape", [(7,), (4, 6), ()], ids=["1d", "2d", "0d"])
@pytest.mark.parametrize("seed", SEEDS)
def test_embedding_matches_torch(
    seed: int, shape: tuple[int, ...], padding_idx: int | None, attached: bool | str
) -> None:
    gen = torch.Generator().manual_seed(seed)
    emb = Embedding(N, DIM, padding_idx=padding_idx, seed=seed)
    ref = torch.nn.Embedding(N, DIM, padding_idx=padding_idx)
    ref.weight.data.copy_(emb.weight.detach())
    source = attach_or_not(emb, attached)
    ids = random_ids(gen, shape, emb.padding_idx)

    out, want = emb(ids), ref(ids)
    torch.testing.assert_close(out, want, **TOL)
    if isinstance(source, PartsSource):  # gathered from the parts, unless padding_idx is set
        assert getattr(source, "given_parts", False) == (padding_idx is None)
    grad_out = torch.randn(want.shape, generator=gen)
    out.backward(grad_out)
    want.backward(grad_out)
    check_grads(emb, source, ref)


@pytest.mark.parametrize("attached", [False, True, "grouped"], ids=["local", "attached", "grouped"])
def test_embedding_scale_grad_by_freq_and_int32_ids_match_torch(attached: bool | str) -> None:
    gen = torch.Generator().manual_seed(5)
    emb = Embedding(N, DIM, scale_grad_by_freq=True, padding_idx=2)
    ref = torch.nn.Embedding(N, DIM, scale_grad_by_freq=True, padding_idx=2)
    ref.weight.data.copy_(emb.weight.detach())
    source = attach_or_not(emb, attached)
    ids = random_ids(gen, (3, 8), 2).to(torch.int32)
    out, want = emb(ids), ref(ids)
    torch.testing.assert_close(out, want, **TOL)
    out.sum().backward()
    want.sum().backward()
    check_grads(emb, source, ref)


@pytest.mark.parametrize("attached", [True, "grouped"], ids=["attached", "grouped"])
def test_a_batch_with_the_padding_id_takes_the_kernels_backward(attached: bool | str) -> None:
    """The padding id among the batch's ids: its row gathered as the others (torch's forward
    gives it as it is) and given no gradient, the rest scatter-added by the kernels."""
    gen = torch.Generator().manual_seed(4)
    emb = Embedding(N, DIM, padding_idx=2, seed=4)
    ref = torch.nn.Embedding(N, DIM, padding_idx=2)
    ref.weight.data.copy_(emb.weight.detach())
    source = attach_or_not(emb, attached)
    assert source is not None
    ids = random_ids(gen, (40, 7), 2)
    out, want = emb(ids), ref(ids)
    assert type(out.grad_fn).__name__ == "ViewBackward0"
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "GatherRowsBackward"
    assert torch.equal(out, want)
    grad_out = torch.randn(want.shape, generator=gen)
    out.backward(grad_out)
    want.backward(grad_out)
    assert torch.count_nonzero(source.grad_per_id()[2]) == 0
    check_grads(emb, source, ref)


def bag_cases() -> list[Any]:
    cases = []
    for mode in ("sum", "mean", "max"):
        for layout in ("offsets", "offsets+last", "2d", "2d-one"):
            for weighted in (False, True) if mode == "sum" else (False,):
                for padding_idx in (None, 4):
                    name = f"{mode}-{layout}{'-weighted' if weighted else ''}-pad{padding_idx}"
                    cases.append(pytest.param(mode, layout, weighted, padding_idx, id=name))
    return cases


def bag_input(
    gen: torch.Generator, layout: str, padding_idx: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if layout == "2d":
        return random_ids(gen, (4, 5), padding_idx), None
    if layout == "2d-one":  # one id a bag, as a CTR model's categorical features
        return random_ids(gen, (9, 1), padding_idx), None
    ids = random_ids(gen, (11,), padding_idx)
    # Bags of sizes 3, 0 (empty), 5, 3; with include_last_offset the last offset closes the
    # last bag.
    offsets = torch.tensor([0, 3, 3, 8])
    if layout == "offsets+last":
        offsets = torch.cat([offsets, torch.tensor([11])])
    return ids, offsets


@pytest.mark.parametrize("attached", [False, True, "grouped"], ids=["local", "attached", "grouped"])
@pytest.mark.parametrize(("mode", "layout", "weighted", "padding_idx"), bag_cases())
@pytest.mark.parametrize("seed", SEEDS)
def test_embedding_bag_matches_torch(
    seed: int,
    mode: str,
    layout: str,
    weighted: bool,
    padding_idx: int | None,
    attached: bool | str,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    last = layout == "offsets+last"
    kwargs: dict[str, Any] = {"mode": mode, "include_last_offset": last, "padding_idx": padding_idx}
    bag = EmbeddingBag(N, DIM, seed=seed, **kwargs)
    ref = torch.nn.EmbeddingBag(N, DIM, **kwargs)
    ref.weight.data.copy_(bag.weight.detach())
    source = attach_or_not(bag, attached)
    ids, offsets = bag_input(gen, layout, padding_idx)
    weights = torch.rand(ids.shape, generator=gen) if weighted else None

    out, want = bag(ids, offsets, weights), ref(ids, offsets, weights)
    torch.testing.assert_close(out, want, **TOL)
    grad_out = torch.randn(want.shape, generator=gen)
    out.backward(grad_out)
    want.backward(grad_out)
    check_grads(bag, source, ref)


@pytest.mark.parametrize(
    "attached", [True, "grouped", "parts"], ids=["attached", "grouped", "parts"]
)
@pytest.mark.parametrize("padding_idx", [None, 5], ids=["", "padded"])
@pytest.mark.parametrize("layout", ["2d", "offsets", "offsets+last"])
@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("dim", [1, 16])
def test_bags_scatter_add_their_gradient(
    dim: int, mode: str, layout: str, padding_idx: int | None, attached: bool | str
) -> None:
    """Bags over an attached table (2-D ids, as a wide term's columns, or ragged ones by
    offsets, empty bags among them; a padding id among the ids, in neither sum nor count):
    torch's values to the bit, the gradient by the kernels' scatter-add (``BagRows``), torch's
    up to the order of its sums, none for the padding row."""
    gen = torch.Generator().manual_seed(3)
    n = 60
    last = layout == "offsets+last"
    kwargs: dict[str, Any] = {"mode": mode, "include_last_offset": last, "padding_idx": padding_idx}
    bag = EmbeddingBag(n, dim, seed=3, **kwargs)
    ref = torch.nn.EmbeddingBag(n, dim, **kwargs)
    ref.weight.data.copy_(bag.weight.detach())
    source = attach_or_not(bag, attached)
    assert source is not None
    offsets = None
    if layout == "2d":
        ids = torch.randint(0, n // 3, (64, 26), generator=gen)  # each id in many bags
    else:
        ids = torch.randint(0, n // 3, (700,), generator=gen)
        cuts = torch.randint(0, 701, (63,), generator=gen).sort().values
        offsets = torch.cat([torch.tensor([0, 0]), cuts])  # the first bag empty, others too
        if last:
            offsets = torch.cat([offsets, torch.tensor([700])])
    out, want = bag(ids, offsets), ref(ids, offsets)
    assert type(out.grad_fn).__name__ == "BagRowsBackward"
    assert torch.equal(out, want)
    grad_out = torch.randn(want.shape, generator=gen)
    out.backward(grad_out)
    want.backward(grad_out)
    assert ref.weight.grad is not None
    grads = source.grad_per_id()
    assert sorted(grads) == sorted(set(ids.view(-1).tolist()))
    for i, g in grads.items():
        torch.testing.assert_close(g, ref.weight.grad[i], rtol=1e-5, atol=1e-5)
    if padding_idx is not None:
        assert torch.count_nonzero(grads[padding_idx]) == 0
    with torch.no_grad():  # no gradient asked: torch's embedding_bag alone
        assert bag(ids, offsets).grad_fn is None and torch.equal(bag(ids, offsets), want)


@pytest.mark.parametrize("padding_idx", [None, 3], ids=["", "padded"])
@pytest.mark.parametrize("layout", ["2d", "offsets"])
def test_weighted_bags_give_rows_and_weights_torch_s_gradients(
    layout: str, padding_idx: int | None
) -> None:
    """Weighted sums (``per_sample_weights``, which TensorFlow's combiners become) take the
    kernels' backward too: the rows' gradient scaled by each id's weight, and the weights'
    gradient each its bag's gradient dotted with its id's row, as torch gives them."""
    gen = torch.Generator().manual_seed(6)
    n, dim = 40, 8
    bag = EmbeddingBag(n, dim, mode="sum", seed=6, padding_idx=padding_idx)
    ref = torch.nn.EmbeddingBag(n, dim, mode="sum", padding_idx=padding_idx)
    ref.weight.data.copy_(bag.weight.detach())
    source = attach_or_not(bag, "grouped")
    assert source is not None
    if layout == "2d":
        ids, offsets = torch.randint(0, n // 2, (30, 9), generator=gen), None
    else:
        ids = torch.randint(0, n // 2, (300,), generator=gen)
        offsets = torch.cat(
            [torch.tensor([0]), torch.randint(0, 301, (29,), generator=gen).sort().values]
        )
    weights = torch.rand(ids.shape, generator=gen).requires_grad_(True)
    ref_weights = weights.detach().clone().requires_grad_(True)
    out, want = bag(ids, offsets, weights), ref(ids, offsets, ref_weights)
    assert type(out.grad_fn).__name__ == "BagRowsBackward"
    assert torch.equal(out, want)
    grad_out = torch.randn(want.shape, generator=gen)
    out.backward(grad_out)
    want.backward(grad_out)
    assert weights.grad is not None and ref_weights.grad is not None and ref.weight.grad is not None
    torch.testing.assert_close(weights.grad, ref_weights.grad, rtol=1e-5, atol=1e-5)
    for i, g in source.grad_per_id().items():
        torch.testing.assert_close(g, ref.weight.grad[i], rtol=1e-5, atol=1e-5)
    if padding_idx is not None:
        assert bool((ids == padding_idx).any())
        assert torch.count_nonzero(weights.grad[ids == padding_idx]) == 0


def test_sqrtn_bags_take_the_kernels_backward() -> None:
    bag = EmbeddingBag(N, DIM, mode="sqrtn", seed=2)
    attach_or_not(bag, True)
    out = bag(torch.tensor([[1, 2, 3], [4, 4, 5]]))
    assert type(out.grad_fn).__name__ == "BagRowsBackward"


@pytest.mark.parametrize("padding_idx", [None, 6], ids=["", "padded"])
@pytest.mark.parametrize("attached", [False, True], ids=["local", "attached"])
def test_a_last_offset_short_of_the_ids_is_refused(attached: bool, padding_idx: int | None) -> None:
    """With ``include_last_offset`` and a last offset short of the ids, torch's forward leaves
    the ids after it out (adds them to the last bag with a padding id) and its CPU backward
    gives them their neighbours' memory: refused, with both numbers (more in test_nn_bags)."""
    bag = EmbeddingBag(N, DIM, mode="sum", include_last_offset=True, padding_idx=padding_idx)
    source = attach_or_not(bag, attached)
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 4 for 6 ids"):
        bag(ids, offsets)
    assert source is None or not source.asked
    out = bag(ids, torch.tensor([0, 2, 6]))
    out.backward(torch.ones_like(out))
    if source is not None:
        assert type(out.grad_fn).__name__ == "BagRowsBackward"
        grads = source.grad_per_id()
        assert all(torch.equal(grads[i], torch.ones(DIM)) for i in range(1, 6))
        assert torch.equal(grads[6], torch.zeros(DIM) if padding_idx else torch.ones(DIM))


@pytest.mark.parametrize(
    "offsets", [[1, 3], [0, 4, 2], [0, 2, 9]], ids=["not-at-0", "decreasing", "past-the-ids"]
)
def test_offsets_torch_refuses_are_refused_as_torch_refuses(offsets: list[int]) -> None:
    bag = EmbeddingBag(N, DIM, mode="sum")
    attach_or_not(bag, True)
    ref = torch.nn.EmbeddingBag(N, DIM, mode="sum")
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    with pytest.raises(RuntimeError) as want:
        ref(ids, torch.tensor(offsets))
    with pytest.raises(RuntimeError) as got:
        bag(ids, torch.tensor(offsets))
    assert str(got.value) == str(want.value)


def test_the_weight_starts_as_the_ps_rows_start() -> None:
    emb = Embedding(N, DIM, padding_idx=2, seed=7, init_std=0.5)
    want = initial_rows(7, torch.arange(N), DIM, std=0.5, dtype=torch.float32, padding_idx=2)
    assert torch.equal(emb.weight.detach(), want)
    assert torch.count_nonzero(emb.weight[2]) == 0
    assert emb.weight.requires_grad


def test_spec_describes_the_table() -> None:
    emb = Embedding(
        N,
        DIM,
        padding_idx=-2,
        dtype=torch.float64,
        partition="div",
        seed=3,
        init_std=0.1,
        optimizer="Adagrad",
    )
    spec = emb.spec("tables.0")
    assert spec == TableSpec(
        name="tables.0",
        embedding_dim=DIM,
        num_embeddings=N,
        partition="div",
        dtype="float64",
        seed=3,
        init_std=0.1,
        padding_idx=N - 2,
        optimizer=RowOptimizerSpec(name="Adagrad"),
    )
    assert emb.float().spec("tables.0").dtype == "float32"  # the weight's dtype now
    with pytest.raises(ValueError, match="float16"):
        emb.half().spec("tables.0")
    hashed = EmbeddingBag(None, 4, mode="sum", min_count=2, max_rows=100)
    assert hashed.spec("bag").hashed
    assert hashed.spec("bag").optimizer is None  # the job's default on the ps
    assert (hashed.spec("bag").min_count, hashed.spec("bag").max_rows) == (2, 100)


def test_attach_drops_the_weight() -> None:
    emb = Embedding(N, DIM)
    assert not emb.attached
    assert [n for n, _ in emb.named_parameters()] == ["weight"]
    emb.attach(DenseSource(emb.weight))
    assert emb.attached
    assert list(emb.parameters()) == []
    assert "weight" not in emb.state_dict()
    with pytest.raises(AttributeError, match="attached"):
        _ = emb.weight
    assert isinstance(DenseSource(torch.zeros(1, 1)), RowSource)


def test_attach_refuses_a_frozen_table_and_a_non_source() -> None:
    frozen = Embedding.from_pretrained(torch.randn(4, 3))
    with pytest.raises(ValueError, match="frozen"):
        frozen.attach(DenseSource(frozen.weight))
    with pytest.raises(TypeError, match="rows"):
        Embedding(4, 3).attach(object())  # type: ignore[arg-type]


def test_from_pretrained_matches_torch() -> None:
    weight = torch.randn(6, 3)
    ids = torch.tensor([[0, 5], [2, 2]])
    emb = Embedding.from_pretrained(weight, freeze=False, padding_idx=1)
    torch.testing.assert_close(emb(ids), torch.nn.Embedding.from_pretrained(weight)(ids))
    assert emb.weight.requires_grad and emb.padding_idx == 1
    bag = EmbeddingBag.from_pretrained(weight, mode="max")
    ref = torch.nn.EmbeddingBag.from_pretrained(weight, mode="max")
    torch.testing.assert_close(bag(ids), ref(ids))
    assert not bag.weight.requires_grad


@pytest.mark.parametrize(
    "attached", [False, True, "grouped", "parts"], ids=["local", "attached", "grouped", "parts"]
)
@pytest.mark.parametrize("bad", [N, N + 100, -1])
def test_an_id_out_of_range_names_the_table_and_the_id(attached: bool | str, bad: int) -> None:
    """Refused before any request: by the table, or by a source that groups the ids itself
    (``batch_rows``, ``batch_parts``), which the table leaves the check to."""
    for module in (Embedding(N, DIM), EmbeddingBag(N, DIM)):
        module.spec("users")
        source = attach_or_not(module, attached)
        ids = torch.tensor([[1, bad, 2]])
        with pytest.raises(IndexError, match=rf"table 'users'.*id {bad}\b"):
            module(ids)
        if source is not None:
            assert source.asked == []
            # A grouping source was given the ids unchecked, and refused them itself.
            assert getattr(source, "checked", 0) == (attached in ("grouped", "parts"))


def test_ids_of_a_float_dtype_are_refused() -> None:
    emb = Embedding(N, DIM)
    emb.attach(DenseSource(emb.weight))
    with pytest.raises(TypeError, match="int64"):
        emb(torch.tensor([1.0, 2.0]))


def test_max_norm_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"max_norm=1\.0.*in place.*max_norm=None"):
        Embedding(N, DIM, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        EmbeddingBag(N, DIM, max_norm=2.0)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="padding_idx=20"):
        Embedding(N, DIM, padding_idx=20)
    with pytest.raises(ValueError, match=r"hashed.*no end"):
        Embedding(None, DIM, padding_idx=-1)
    with pytest.raises(ValueError, match="dtype"):
        Embedding(N, DIM, dtype=torch.float16)
    with pytest.raises(ValueError, match="mode"):
        EmbeddingBag(N, DIM, mode="median")
    with pytest.raises(ValueError, match="shape"):
        Embedding(N, DIM, _weight=torch.zeros(N, DIM + 1))
    with pytest.raises(ValueError, match="unknown row optimizer"):
        Embedding(None, DIM, optimizer="Adadelta")
    with pytest.raises(ValueError, match="partition"):
        Embedding(N, DIM, partition="range")


def test_attached_bags_check_their_layout_before_asking() -> None:
    bag = EmbeddingBag(N, DIM, mode="mean")
    source = attach_or_not(bag, True)
    assert source is not None
    with pytest.raises(ValueError, match="2-D"):
        bag(torch.zeros(2, 3, dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="per_sample_weights has shape"):
        bag(torch.zeros(2, 3, dtype=torch.int64), None, torch.ones(2, 2))
    assert source.asked == []


def test_an_empty_batch_asks_for_nothing() -> None:
    bag = EmbeddingBag(N, DIM, mode="sum")
    ref = torch.nn.EmbeddingBag(N, DIM, mode="sum", _weight=bag.weight.detach().clone())
    source = attach_or_not(bag, True)
    assert source is not None
    ids, offsets = torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0])
    torch.testing.assert_close(bag(ids, offsets), ref(ids, offsets))
    assert source.asked == []


def test_meta_device_allocates_nothing() -> None:
    # 10^12 x 64 float32 would be 256 TB: built at all, it could only be on meta.
    emb = Embedding(10**12, 64, device="meta")
    assert emb.weight.is_meta
    bag = EmbeddingBag(10**12, 64, mode="sum", device="meta")
    assert bag.weight.is_meta
    assert emb.spec("big").num_embeddings == 10**12
    source = DenseSource(torch.randn(4, 64))
    emb.attach(source)
    assert emb(torch.tensor([3, 1, 3])).shape == (3, 64)
    hashed = Embedding(None, 4, optimizer="SGD", device="meta")
    with pytest.raises(RuntimeError, match=r"meta.*attach"):
        hashed(torch.tensor([1]))


def test_a_local_hashed_table_needs_an_optimizer_to_train() -> None:
    emb = Embedding(None, DIM, seed=4)  # fine to build: a worker may attach it
    with pytest.raises(ValueError, match=r"optimizer='Adagrad'.*torch\.no_grad"):
        emb(torch.tensor([1, 2]))
    with torch.no_grad():  # looking rows up (a model loaded to serve) needs none
        got = emb(torch.tensor([1, 2]))
    want = initial_rows(4, torch.tensor([1, 2]), DIM, std=1.0, dtype=torch.float32)
    torch.testing.assert_close(got, want, **TOL)


def test_a_local_hashed_table_takes_any_id_and_starts_as_the_ps_rows_start() -> None:
    emb = Embedding(None, DIM, optimizer="Adagrad", seed=4, padding_idx=0)
    ids = torch.tensor([[2**40, -5], [0, 2**40]])
    out = emb(ids)
    rows = initial_rows(4, torch.tensor([2**40, -5]), DIM, std=1.0, dtype=torch.float32)
    torch.testing.assert_close(out[0], rows, **TOL)
    torch.testing.assert_close(out[1, 1], rows[0], **TOL)
    assert torch.count_nonzero(out[1, 0]) == 0
    assert list(emb.parameters()) == []


@pytest.mark.parametrize("cls", [Embedding, EmbeddingBag])
def test_a_local_hashed_table_trains_with_its_fused_optimizer(cls: type[TableModule]) -> None:
    # Each id (arbitrary int64s) has a target vector; Adagrad on the rows, applied in backward,
    # must bring the lookups close to the targets with no optimizer step in the loop.
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([3, 10**9, -7, 2**50, 42])
    targets = torch.randn(len(ids), DIM, generator=gen)
    emb = cls(None, DIM, optimizer=RowOptimizerSpec.of("Adagrad", lr=0.3))
    losses = []
    for _ in range(40):
        batch = ids.view(-1, 1) if cls is EmbeddingBag else ids  # bags of one id
        loss = torch.nn.functional.mse_loss(emb(batch), targets)
        loss.backward()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], losses


def test_a_local_hashed_table_updates_only_in_backward_and_only_the_ids_used() -> None:
    emb = Embedding(None, 2, optimizer=RowOptimizerSpec.of("SGD", lr=0.5))
    ids = torch.tensor([5, 6])
    before = emb(ids).detach()
    assert torch.equal(emb(ids).detach(), before)  # a lookup alone changes nothing
    emb(torch.tensor([5, 5])).sum().backward()  # gradient 2 on each column of row 5
    after = emb(ids).detach()
    torch.testing.assert_close(after[0], before[0] - 0.5 * 2, **TOL)
    torch.testing.assert_close(after[1], before[1], **TOL)


def test_a_hashed_table_given_rows_by_id_starts_from_them() -> None:
    """``load_rows``: a hashed table's rows for given ids (a TensorFlow hash table's keys and
    values), with their Adagrad accumulators: a lookup gives them, other ids their seeded
    rows, and the next update starts from the given accumulator."""
    emb = Embedding(None, DIM, optimizer=RowOptimizerSpec.of("Adagrad", lr=0.5), seed=3)
    ids = torch.tensor([2**40, -5, 7])
    rows = torch.randn(3, DIM, generator=torch.Generator().manual_seed(1))
    emb.load_rows(ids, rows, {"sum": torch.full((3, DIM), 4.0)})
    assert torch.equal(emb.held_ids(), ids) and torch.equal(emb.held_rows(), rows)
    assert torch.equal(emb(ids).detach(), rows)
    other = initial_rows(3, torch.tensor([8]), DIM, std=1.0, dtype=torch.float32)
    torch.testing.assert_close(emb(torch.tensor([8])).detach(), other, **TOL)
    emb(torch.tensor([7])).sum().backward()  # gradient 1: Adagrad's sum 4 + 1, step 0.5/sqrt(5)
    want = rows[2] - 0.5 / (5.0**0.5 + 1e-10)
    torch.testing.assert_close(emb(torch.tensor([7])).detach()[0], want, **TOL)


def test_a_hashed_table_holds_what_local_training_made_of_its_rows() -> None:
    """What a hashed table holds (what a job given the model starts from) is its rows as local
    training left them: the given rows once trained, the rows training made, and the row-wise
    optimizer's state for each; a lookup alone makes no row."""
    adagrad = RowOptimizerSpec.of("Adagrad", lr=0.5)
    emb = Embedding(None, DIM, optimizer=adagrad, seed=3)
    assert emb.held_rows() is None and emb.held_ids() is None and emb.held_state() == {}
    emb(torch.tensor([4]))  # a lookup: no row is made
    assert emb.held_rows() is None
    ids = torch.tensor([2**40, 7])
    rows = torch.randn(2, DIM, generator=torch.Generator().manual_seed(1))
    emb.load_rows(ids, rows, {"sum": torch.full((2, DIM), 4.0)})
    emb(torch.tensor([7, 9])).sum().backward()  # trains 7 (given) and makes 9
    held = dict(zip(emb.held_ids().tolist(), emb.held_rows(), strict=True))
    assert sorted(held) == sorted([2**40, 7, 9])
    assert torch.equal(held[2**40], rows[0])
    torch.testing.assert_close(held[7], rows[1] - 0.5 / 5.0**0.5, **TOL)
    assert torch.equal(held[9], emb(torch.tensor([9])).detach()[0])
    sums = dict(zip(emb.held_ids().tolist(), emb.held_state()["sum"], strict=True))
    # a made row's accumulator: initial_accumulator_value (0.1, TensorFlow's) + 1
    assert sums[2**40][0] == 4.0 and sums[7][0] == 5.0 and sums[9][0] == pytest.approx(1.1)


def test_a_hashed_table_goes_through_a_state_dict(tmp_path: Any) -> None:
    """A hashed table held here is in its model's state dict (``ids``, ``rows``, and its
    optimizer's state as ``opt.<state>``), saved as safetensors and loaded into a fresh model:
    the same rows, and the same next step (its Adam state came too)."""
    from safetensors.torch import load_file, save_file

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.users = EmbeddingBag(None, DIM, mode="sum", optimizer=RowOptimizerSpec.of("Adam", lr=0.1))
        m.head = torch.nn.Linear(DIM, 1)
        return m

    def step(m: torch.nn.Module, batch: torch.Tensor) -> None:
        m.head(m.users(batch)).sum().backward()  # the table updates in backward

    trained, fresh = model(), model()
    assert set(fresh.state_dict()) == {"users.ids", "users.rows", "head.weight", "head.bias"}
    for s in range(3):
        step(trained, torch.randint(0, 50, (4, 3), generator=torch.Generator().manual_seed(s)))
    sd = trained.state_dict()
    assert set(sd) == {
        "users.ids",
        "users.rows",
        "users.opt.exp_avg",
        "users.opt.exp_avg_sq",
        "users.opt.step",
        "head.weight",
        "head.bias",
    }
    save_file(sd, str(tmp_path / "model.safetensors"))
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    seen = trained.users.held_ids()
    assert seen is not None and seen.numel() > 3
    with torch.no_grad():
        assert torch.equal(fresh.users(seen.view(-1, 1)), trained.users(seen.view(-1, 1)))
    nxt = torch.randint(0, 50, (4, 3), generator=torch.Generator().manual_seed(9))
    step(trained, nxt)
    step(fresh, nxt)
    with torch.no_grad():
        torch.testing.assert_close(
            fresh.users(seen.view(-1, 1)), trained.users(seen.view(-1, 1)), rtol=0, atol=0
        )
    without_state = model()  # rows alone (what `psflow checkpoint export` writes): fresh state
    without_state.load_state_dict({k: v for k, v in sd.items() if ".opt." not in k})
    assert torch.equal(without_state.users.held_rows(), sd["users.rows"])
    assert without_state.users.held_state() == {}  # none given: each row's starts fresh


def test_a_state_dict_that_does_not_fit_a_hashed_table_is_refused() -> None:
    emb = Embedding(None, DIM, optimizer="Adagrad")
    ids = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match=r"expected \[len\(ids\), embedding_dim\]"):
        emb.load_state_dict({"ids": ids, "rows": torch.zeros(2, DIM + 1)})
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*\"rows\""):
        emb.load_state_dict({"ids": ids})
    with pytest.raises(RuntimeError, match="ids are not tensors"):
        emb.load_state_dict({"ids": [1, 2], "rows": torch.zeros(2, DIM)})
    with pytest.raises(RuntimeError, match="Adagrad keeps state"):
        emb.load_state_dict({"ids": ids, "rows": torch.zeros(2, DIM), "opt.accum": ids})
    emb.attach(DenseSource(torch.zeros(1, DIM)))
    assert emb.state_dict() == {}  # its rows are on the ps
    emb.load_state_dict({})
    with pytest.raises(RuntimeError, match="attached: its rows are on the ps"):
        emb.load_state_dict({"ids": ids, "rows": torch.zeros(2, DIM)})


def test_load_rows_names_what_is_wrong() -> None:
    emb = EmbeddingBag(None, DIM, optimizer="Adagrad", padding_idx=0)
    ids, rows = torch.tensor([1, 2]), torch.zeros(2, DIM)
    cases = [
        (Embedding(N, DIM), (ids, rows), "for a hashed table"),
        (emb, (torch.tensor([1, 1]), rows), "ids repeat"),
        (emb, (torch.tensor([1.0, 2.0]), rows), "1-D int64"),
        (emb, (torch.tensor([0, 2]), rows), "padding id 0"),
        (emb, (ids, torch.zeros(2, DIM + 1)), r"expected \[len\(ids\), embedding_dim\]"),
        (emb, (ids, rows, {"accum": rows}), r"Adagrad keeps state \['sum'\]"),
        (emb, (ids, rows, {"sum": torch.zeros(3, DIM)}), "optimizer state 'sum' is"),
        (EmbeddingBag(None, DIM), (ids, rows, {"sum": rows}), "optimizer named"),
    ]
    for module, args, match in cases:
        with pytest.raises(ValueError, match=match):
            module.load_rows(*args)
    emb.attach(DenseSource(torch.zeros(1, DIM)))
    with pytest.raises(ValueError, match="attached"):
        emb.load_rows(ids, rows)


TF_COMBINERS = json.loads((ROOT / "tests" / "fixtures" / "tf_combiners.json").read_text())


def _tf_bags(
    include_last_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bags, weights = TF_COMBINERS["bags"], TF_COMBINERS["weights"]
    ids = torch.tensor([i for b in bags for i in b])
    starts = [sum(map(len, bags[:k])) for k in range(len(bags) + include_last_offset)]
    w = torch.tensor([x for ws in weights for x in ws], dtype=torch.float32)
    return ids, torch.tensor(starts), w


@pytest.mark.parametrize(
    "key", ["sum", "sum_weighted", "mean", "mean_weighted", "sqrtn", "sqrtn_weighted"]
)
@pytest.mark.parametrize("source", [None, DenseSource, PartsSource])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_bags_combine_as_tensorflow_s_combiners(
    key: str, source: type[DenseSource] | None, include_last_offset: bool
) -> None:
    """``mode`` "sum", "mean" and "sqrtn" (TensorFlow's own, which torch lacks, as it lacks a
    weighted mean), with and without weights, on ragged bags with an empty one and a repeated id: the output and the
    table's gradient ``tf.nn.safe_embedding_lookup_sparse`` gave (TensorFlow 2.21), locally
    and with the rows from a row source."""
    mode, weighted = key.removesuffix("_weighted"), key.endswith("_weighted")
    table = torch.tensor(TF_COMBINERS["table"])
    bag = EmbeddingBag.from_pretrained(
        table, freeze=False, mode=mode, include_last_offset=include_last_offset
    )
    if source is not None:
        bag.attach(rows := source(table))
    ids, offsets, w = _tf_bags(include_last_offset)
    out = bag(ids, offsets, per_sample_weights=w if weighted else None)
    want = TF_COMBINERS[key]
    torch.testing.assert_close(out, torch.tensor(want["output"]), rtol=0, atol=1e-6)
    (out * torch.tensor(TF_COMBINERS["upstream"])).sum().backward()
    if source is None:
        grad = bag.weight.grad
    else:
        grad = torch.zeros_like(table)
        for i, g in rows.grad_per_id().items():
            grad[i] += g
    torch.testing.assert_close(grad, torch.tensor(want["grad"]), rtol=0, atol=1e-6)


def test_sqrtn_takes_2d_bags_and_the_padding_id_counts_in_neither_sum() -> None:
    """2-D bags give what the same bags as offsets give; the padding id adds nothing and is
    not counted (a bag of ids 1, 2 and the padding id is the bag 1, 2)."""
    bag = EmbeddingBag(N, DIM, mode="sqrtn", padding_idx=0)
    ids = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]])
    flat = bag(torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 2, 3]))
    torch.testing.assert_close(bag(ids), flat, rtol=0, atol=1e-6)
    torch.testing.assert_close(flat[0], bag.weight[1:3].sum(0) / 2**0.5, rtol=0, atol=1e-6)
    one = EmbeddingBag(N, DIM, mode="sqrtn")
    torch.testing.assert_close(one(torch.tensor([[4], [7]])), one.weight[[4, 7]])
    most = EmbeddingBag(N, DIM, mode="max")
    most.attach(DenseSource(most.weight))
    with pytest.raises(NotImplementedError, match="'sqrtn', not 'max'"):
        most(ids, per_sample_weights=torch.ones(3, 3))


def test_repr_says_where_the_rows_are() -> None:
    emb = Embedding(N, DIM, padding_idx=1)
    assert repr(emb) == repr(torch.nn.Embedding(N, DIM, padding_idx=1))
    emb.attach(DenseSource(emb.weight))
    assert "attached" in repr(emb)
    assert "Adagrad" in repr(EmbeddingBag(None, 3, optimizer="Adagrad"))


def test_psflow_nn_is_a_subpackage_of_psflow() -> None:
    assert psflow.nn.Embedding is Embedding


@pytest.mark.parametrize("module", [psflow.nn.embedding, psflow.nn.table], ids=lambda m: m.__name__)
def test_the_docstring_examples_run(module: Any) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_optimizer_state_given_with_pretrained_rows_is_the_optimizers() -> None:
    rows = torch.randn(6, 3)
    sums = torch.rand(6, 3)
    emb = Embedding.from_pretrained(
        rows, freeze=False, optimizer="Adagrad", optimizer_state={"sum": sums}
    )
    assert torch.equal(emb.held_state()["sum"], sums)
    bag = EmbeddingBag.from_pretrained(
        rows,
        freeze=False,
        optimizer="Ftrl",
        optimizer_state={"accum": sums, "linear": -sums},
    )
    assert sorted(bag.held_state()) == ["accum", "linear"]
    bad = [
        ({"optimizer_state": {"sum": sums}}, "needs the table's optimizer named"),
        ({"optimizer": "Adagrad", "optimizer_state": {"accum": sums}}, r"keeps state \['sum'\]"),
        (
            {"optimizer": "Adagrad", "optimizer_state": {"sum": sums[:5]}},
            r"'sum' is \[5, 3\] torch.float32, expected \[6, 3\]",
        ),
        (
            {"optimizer": "Adagrad", "optimizer_state": {"sum": sums.double()}},
            "torch.float64, expected",
        ),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            Embedding.from_pretrained(rows, freeze=False, **kwargs)  # type: ignore[arg-type]
    # Attached (the job has the rows), the module holds no state either.
    emb.attach(DenseSource(rows))
    assert emb.held_state() == {}
