"""A worker whose model is on a GPU: rows, values and gradients cross between the host and
the device through its staging (:mod:`psflow.worker.staging`), against 2 real ps.

On the CPU, a staging whose copies behave as a GPU's do (begun, then waited for) checks where
the worker begins them and where it waits; on a machine with CUDA, the worker trains there as
it does on the CPU, pinned or not."""

from __future__ import annotations

import pytest
import torch

from psflow.cluster.spec import ClusterSpec
from psflow.transport import TransportConfig
from psflow.worker import DistributedOptimizer
from psflow.worker.staging import Staging
from psflow.worker.tables import TableClient

from .support import local_cluster, stop, worker_ctx
from .test_tables import VOCAB, Recommender, _ps, batch, loss_of, table_rows, tables

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS = 6


class Deferred(Staging):
    """Copies as a GPU's are, on the CPU: every device crosses; a copy to the host holds NaN
    (integers: the most negative) until :meth:`wait` (it was only begun), then what the tensor
    held when it was asked. Logs
    what it is given: ``rows`` (2-D floats to the device), ``other`` (to the device),
    ``value`` (into a device's tensor), ``to_host``, ``wait`` (when something was under way)."""

    def __init__(self) -> None:
        super().__init__(pinned=False)
        self.log: list[str] = []
        self._late: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._made: list[torch.Tensor] = []

    def crosses(self, device: torch.device) -> bool:
        return True

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if any(t is out for out in self._made):
            return t  # "on the device" already
        self.log.append("rows" if t.dim() == 2 and t.is_floating_point() else "other")
        out = t.clone()
        self._made.append(out)
        return out

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append("value")
        dst.copy_(src)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        unset = float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min
        out = torch.full_like(t, unset)
        self._late.append((out, t.clone()))
        self.log.append("to_host")
        return out

    def wait(self) -> None:
        if self._late:
            self.log.append("wait")
        for out, held in self._late:
            out.copy_(held)
        self._late = []


def _worker(model: Recommender, cluster: ClusterSpec, **how: bool) -> DistributedOptimizer:
    """The worker of a job of 2 ps and 1 worker, training ``model`` with Adagrad."""
    return DistributedOptimizer(
        model,
        worker_ctx(cluster),
        optimizer="Adagrad",
        lr=0.1,
        transport=TransportConfig(timeout=30),
        **how,
    )


def _train(
    device: str, log: list[str], *, pinned: bool = True, overlap: bool = False
) -> tuple[list[torch.Tensor], int]:
    """One worker against 2 ps, prefetching each next batch's rows (with ``overlap``, each
    push's reply taken at the next step, and no prefetch): the items table's rows, the dense
    head's values at the end, and the lookups the worker asked for."""
    cluster = local_cluster(2, 1)
    procs = _ps(cluster)
    model = Recommender().to(device)
    opt = _worker(model, cluster, pinned=pinned, overlap=overlap)
    client = tables(opt).client
    asked: list[object] = []
    real_lookup = client.lookup

    def counting(ids, into=None, **how):  # type: ignore[no-untyped-def]
        asked.append(ids)
        return real_lookup(ids, into, **how)

    client.lookup = counting  # type: ignore[method-assign]
    try:
        data = [tuple(t.to(device) for t in batch(step, 0, 8)) for step in range(STEPS)]
        for step, (items, users, y) in enumerate(data):
            log.append(f"forward {step}")
            opt.zero_grad()
            loss_of(model, items, users, y).backward()
            log.append(f"prefetch {step}")
            if step + 1 < STEPS and not overlap:
                model.items.prefetch(data[step + 1][0])
                model.users.prefetch(data[step + 1][1])
            log.append(f"step {step}")
            opt.step()
        lookups = len(asked)
        log.append("end")
        opt.pull()
        rows = table_rows(opt, "items", torch.arange(VOCAB))
        head = [p.detach().cpu().clone() for p in model.head.parameters()]
        return [rows, *head], lookups
    finally:
        opt.close()
        for p in procs:
            stop(p, timeout=5)


def test_a_gpu_workers_copies_begin_early_and_are_waited_for_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With copies that behave as a GPU's (:class:`Deferred`), a worker that prefetches
    trains exactly as with plain ones; the rows a push brings begin their copy to the device
    within that step, not at the forward that uses them; a step's gradients, dense and rows,
    are all begun before one wait, and none is sent before it (it would reach the ps as NaN);
    the next batch's ids begin their copy to the host when they are prefetched, and are read
    after that same wait (before it they are the most negative int64: no table's)."""
    # As on a GPU: the forward asks the source for the batch's rows whole, not in parts.
    monkeypatch.delattr(TableClient, "batch_parts")
    plain, asked_plain = _train("cpu", [])
    deferred = Deferred()
    monkeypatch.setattr("psflow.worker.optimizer.Staging", lambda pinned: deferred)
    got, asked = _train("cpu", deferred.log)
    for x, y in zip(got, plain, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert asked == asked_plain == 2, (asked, asked_plain)  # only the first forward asks
    log = deferred.log
    marks = [
        i for i, entry in enumerate(log) if entry.startswith(("forward", "prefetch", "step", "end"))
    ]
    segments = {log[i]: log[i + 1 : j] for i, j in zip(marks, [*marks[1:], len(log)], strict=True)}
    for step in range(STEPS):
        forward, pushed = segments[f"forward {step}"], segments[f"step {step}"]
        prefetched = segments[f"prefetch {step}"]
        # The first forward's rows come by lookup; later ones' came with the push before.
        assert forward.count("rows") == (2 if step == 0 else 0), (step, forward)
        assert "to_host" not in forward and "wait" not in forward, (step, forward)
        # Both tables' next ids begin for the host, and nothing waits for them there.
        coming = 2 if step + 1 < STEPS else 0
        assert prefetched == ["to_host"] * coming, (step, prefetched)
        # The head's weight and bias, each table's rows: begun, then one wait.
        assert pushed.count("to_host") == 4 and pushed.count("wait") == 1, (step, pushed)
        waited = pushed.index("wait")
        assert "to_host" not in pushed[waited:], (step, pushed)
        # The next batch's rows, both tables', begin for the device when the reply comes.
        assert pushed[waited:].count("rows") == coming, (step, pushed)


def test_a_bad_id_prefetched_from_a_gpu_is_refused_at_the_step_before_anything_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefetch from a GPU only begins its ids' copy to the host (:class:`Deferred`): an id
    out of the table's range is refused as the step takes them, an ``IndexError`` naming the
    table and the id, before the step sends anything; the worker then goes on."""
    deferred = Deferred()
    monkeypatch.setattr("psflow.worker.optimizer.Staging", lambda pinned: deferred)
    cluster = local_cluster(2, 1)
    procs = _ps(cluster)
    model = Recommender()
    opt = _worker(model, cluster)
    try:
        client = tables(opt).client
        pushes: list[object] = []
        real_push = client.push

        def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
            pushes.append(args)
            return real_push(*args, **kwargs)

        client.push = counting  # type: ignore[method-assign]
        items, users, y = batch(0, 0, 8)
        opt.zero_grad()
        loss_of(model, items, users, y).backward()
        model.items.prefetch(torch.tensor([[1, 2], [VOCAB + 3, 4]]))  # its copy only begun
        assert deferred.log[-1] == "to_host"
        with pytest.raises(IndexError, match=rf"table 'items'.*id {VOCAB + 3} is out of range"):
            opt.step()
        assert pushes == []
        opt.zero_grad()
        loss_of(model, items, users, y).backward()
        model.items.prefetch(items)
        opt.step()
        assert len(pushes) == 1
    finally:
        opt.close()
        for p in procs:
            stop(p, timeout=5)


@CUDA
@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "plain"])
def test_a_gpu_worker_trains_as_a_cpu_one(pinned: bool, overlap: bool) -> None:
    """A worker on CUDA takes the steps a worker on the CPU takes (to the float32 sums'
    rounding), pinned or not; prefetching, it asks for rows only at its first forward; with
    ``overlap``, its values come in while it computes the next step."""
    want, asked_cpu = _train("cpu", [], overlap=overlap)
    got, asked = _train("cuda", [], pinned=pinned, overlap=overlap)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert asked == asked_cpu == (2 * STEPS if overlap else 2), (asked, asked_cpu)
