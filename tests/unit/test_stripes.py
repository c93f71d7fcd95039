"""psflow.sparse.stripes: one request's rows updated and gathered on several threads, each a
stripe of them, with the same bits as on one; a bad index changes nothing in any stripe."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from psflow import env as envvars
from psflow.protocol import RowOptimizerSpec
from psflow.ps.config import ServerConfig
from psflow.sparse import RowOptimizer, kernels, stripes

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(kernels.KERNELS is None, reason="the row kernels were not built"),
]

ROWS, DIM, N = 20_000, 64, 4096


@pytest.fixture(autouse=True)
def one_thread_after() -> Iterator[None]:
    yield
    stripes.set_threads(1)


SPECS = [
    RowOptimizerSpec.of("SGD", lr=0.1),
    RowOptimizerSpec.of("Adagrad", lr=0.1, initial_accumulator_value=0.1),
    RowOptimizerSpec.of("RowWiseAdagrad", lr=0.1),
    RowOptimizerSpec.of("Adam", lr=0.01),
    RowOptimizerSpec.of("Ftrl", lr=0.1, l1=0.01, l2=0.01),
]


def table(opt: RowOptimizer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(ROWS, DIM, generator=g)
    state = opt.new_state(ROWS, DIM, values.dtype)
    for t in state.values():
        if t.is_floating_point():
            t.add_(torch.rand(t.shape, generator=g))
    return values, state


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_striped_updates_give_the_bits_of_one_thread(spec: RowOptimizerSpec) -> None:
    opt = RowOptimizer(spec)
    g = torch.Generator().manual_seed(1)
    index = torch.randperm(ROWS, generator=g)[:N]
    grads = [torch.randn(N, DIM, generator=g) for _ in range(3)]
    results = []
    for threads in (1, 3):
        stripes.set_threads(threads)
        assert len(stripes.bounds(N)) == threads
        values, state = table(opt)
        for grad in grads:
            opt.apply(values, state, index, grad)
        results.append((values, state))
    (v1, s1), (v3, s3) = results
    assert torch.equal(v1, v3)
    assert all(torch.equal(s1[k], s3[k]) for k in s1)


def test_a_bad_index_in_any_stripe_changes_nothing() -> None:
    opt = RowOptimizer(SPECS[1])
    stripes.set_threads(3)
    values, state = table(opt)
    before = values.clone(), {k: t.clone() for k, t in state.items()}
    index = torch.randperm(ROWS)[:N]
    index[-1] = ROWS  # in the last stripe: the first two would have run
    with pytest.raises(IndexError, match=f"row index {ROWS} is out of range"):
        opt.apply(values, state, index, torch.ones(N, DIM))
    assert torch.equal(values, before[0])
    assert all(torch.equal(state[k], before[1][k]) for k in state)


def test_striped_gathers_are_index_select() -> None:
    src = torch.randn(ROWS, DIM)
    index = torch.randint(0, ROWS, (N,))
    stripes.set_threads(4)
    assert torch.equal(kernels.gather(src, index), src.index_select(0, index))
    index[2000] = -1
    with pytest.raises(IndexError, match="row index -1 is out of range"):
        kernels.gather(src, index)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_gather_of_held_rows_leaves_the_rows_at_minus_one(threads: int) -> None:
    """A lookup's gather with ids a hashed table does not hold (-1: their initial rows are
    written after it): the held rows gathered, those at -1 left as they were, on one thread
    or in stripes; any other negative row refused before anything is written."""
    src = torch.randn(ROWS, DIM)
    index = torch.randint(0, ROWS, (N,))
    index[::7] = -1
    out = torch.full((N, DIM), 5.0)
    stripes.set_threads(threads)
    args = (src.data_ptr(), index.data_ptr(), N, DIM * 4, ROWS)
    assert kernels.gather_at(out.data_ptr(), *args, held=True) == -1
    held = index >= 0
    assert torch.equal(out[held], src[index[held]])
    assert bool((out[~held] == 5.0).all())
    index[N - 1] = -2
    before = out.clone()
    assert kernels.gather_at(out.data_ptr(), *args, held=True) == N - 1
    if threads == 1:  # in stripes, the others may have run: a gather's refusal writes no table
        assert torch.equal(out, before)
    assert kernels.gather_at(out.data_ptr(), *args) == 0  # without held, -1 is a bad row


def test_a_stripe_that_fails_is_raised_once_every_stripe_has_ended() -> None:
    stripes.set_threads(3)
    last = stripes.bounds(N)[-1][0]
    ended: list[int] = []

    def work(b: int, e: int) -> int:
        ended.append(b)
        if b == last:  # a stripe on a pool thread
            raise RuntimeError(f"stripe at {b}")
        return -1

    with pytest.raises(stripes.StripeError, match=f"RuntimeError: stripe at {last}"):
        stripes.run(N, work)
    assert sorted(ended) == [b for b, _ in stripes.bounds(N)]  # every stripe had ended
    # Work that only reads rows (a gather) half-does nothing: its own error, the shard serves on.
    ended.clear()
    with pytest.raises(RuntimeError, match=f"^stripe at {last}$"):
        stripes.run(N, work, writes=False)
    assert sorted(ended) == [b for b, _ in stripes.bounds(N)]


def test_small_requests_stay_on_one_thread_and_counts_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stripes.set_threads(8)
    assert stripes.bounds(100) == [(0, 100)]
    assert stripes.bounds(stripes.MIN_STRIPE * 2) == [(0, 512), (512, 1024)]
    with pytest.raises(ValueError, match="row threads must be an integer >= 1"):
        stripes.set_threads(0)
    monkeypatch.setenv(envvars.PSFLOW_PS_THREADS, "two")
    with pytest.raises(ValueError, match="PSFLOW_PS_THREADS must be an integer >= 1, got 'two'"):
        ServerConfig()
    monkeypatch.setenv(envvars.PSFLOW_PS_THREADS, "3")
    assert ServerConfig().threads == 3
    # Without it, the cores the task was given (as psflow launch sets OMP_NUM_THREADS), else 1.
    monkeypatch.delenv(envvars.PSFLOW_PS_THREADS)
    monkeypatch.setenv(envvars.OMP_NUM_THREADS, "2")
    assert ServerConfig().threads == 2
    monkeypatch.delenv(envvars.OMP_NUM_THREADS)
    assert ServerConfig().threads == 1
