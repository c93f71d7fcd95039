"""Worker liveness on the ps, without sockets: who is dead, and what stops waiting for them."""

from __future__ import annotations

import pytest

from psflow.cluster import ClusterSpec, TaskContext, TaskSpec
from psflow.ps import ParameterServer
from psflow.ps.liveness import Liveness
from psflow.ps.staleness import ClockTable
from psflow.transport import Request
from psflow.worker.heartbeat import worker_timeout

pytestmark = pytest.mark.unit


def test_only_a_joined_unfinished_worker_silent_past_the_timeout_is_dead() -> None:
    live = Liveness({"chief:0", "worker:0", "worker:1"}, timeout=3.0)
    live.heard("chief:0", 0.0)
    live.heard("worker:0", 0.0)
    live.heard("evaluator:0", 0.0)  # not a trainer: ignored
    assert live.check(3.0, finished=set()) == []  # not past the bound yet
    live.heard("chief:0", 2.0)
    assert live.check(3.5, finished=set()) == ["worker:0"]  # worker:1 never joined
    assert live.check(9.0, finished={"chief:0"}) == []  # declared once; a finished one never
    assert live.dead == {"worker:0"} and live.deaths == 1
    assert live.heard("worker:0", 9.5) is True  # back: it rejoins
    assert live.dead == set()
    assert live.check(13.0, finished={"chief:0"}) == ["worker:0"]
    assert live.deaths == 2


def test_a_ps_restored_mid_job_expects_every_worker_it_has_not_heard_from() -> None:
    live = Liveness({"chief:0", "worker:0", "worker:1", "worker:2"}, timeout=3.0)
    live.heard("chief:0", 0.0)  # the chief restores it
    # worker:2 has said 'done' to this ps already: not expected.
    assert live.expect(1.0, finished={"worker:2"}) == ["worker:0", "worker:1"]
    assert live.expected == {"worker:0", "worker:1"}
    assert live.heard("worker:0", 2.0) is False  # it speaks: joined as any other
    assert live.expected == {"worker:1"}
    live.heard("chief:0", 3.5)
    assert live.check(4.5, finished={"worker:2"}) == ["worker:1"]  # never spoke since
    assert live.expect(5.0, finished=set()) == ["worker:2"]  # the others were heard already
    assert live.heard("worker:1", 6.0) is True  # dead, it speaks: it rejoins
    assert live.expected == {"worker:2"}


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="worker timeout must be > 0"):
        Liveness({"worker:0"}, timeout=0)


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "nan", "inf"])
def test_a_bad_worker_timeout_is_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PSFLOW_WORKER_TIMEOUT", raw)
    match = f"PSFLOW_WORKER_TIMEOUT must be a number of seconds > 0, got '{raw}'"
    with pytest.raises(ValueError, match=match):
        worker_timeout()
    ctx = TaskContext(
        cluster=ClusterSpec(jobs={"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}),
        task=TaskSpec(job="ps", index=0),
    )
    with pytest.raises(ValueError, match=match):
        ParameterServer(ctx)  # the ps reads it alike


def _req(i: int) -> Request:
    return Request(identity=b"x", header={"id": i}, frames=[])


def test_a_dead_worker_holds_nobody_back_and_rejoins_level_with_the_others() -> None:
    table = ClockTable({"worker:0", "worker:1"})
    table.wait("worker:1", 3, 1, _req(1))
    table.wait("worker:0", 8, 1, _req(2))  # 5 ahead of worker:1
    assert [r.header["id"] for r, _ in table.release()] == [1]
    table.dead = {"worker:1"}
    assert [r.header["id"] for r, _ in table.release()] == [2]
    # worker:1 comes back (SIGCONT) at its old clock: rebased to worker:0's, not waited for.
    table.dead = set()
    table.rejoin("worker:1")
    table.wait("worker:1", 4, 1, _req(3))
    table.wait("worker:0", 9, 1, _req(4))
    assert sorted(r.header["id"] for r, _ in table.release()) == [3, 4]
    assert table.clocks["worker:1"] == 8
    table.wait("worker:1", 5, 1, _req(5))  # its next steps count from there
    assert table.clocks["worker:1"] == 9


def test_a_restarted_worker_whose_clock_went_back_is_rebased() -> None:
    table = ClockTable({"worker:0", "worker:1"})
    table.wait("worker:0", 50, 2, _req(1))
    table.wait("worker:1", 50, 2, _req(2))
    table.release()
    table.wait("worker:1", 0, 2, _req(3))  # restarted before the ps declared it dead
    table.wait("worker:0", 52, 2, _req(4))
    assert sorted(r.header["id"] for r, _ in table.release()) == [3, 4]
    assert table.clocks["worker:1"] == 50
