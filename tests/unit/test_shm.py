"""Shared-memory lanes: what the server checks before it maps one, and the wire inside it."""

from __future__ import annotations

import os

import pytest
import torch

from psflow.transport import wire
from psflow.transport.shm import _REPLIES, HEADER_BYTES, SHM_DIR, Lane, LaneError
from tests.yields import Yields

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")


@pytest.fixture
def lane() -> Lane:
    lane = Lane.create(65536, 8192)
    yield lane
    lane.unlink()


def test_both_sides_see_one_memory_and_the_name_goes_away(lane: Lane) -> None:
    path = os.path.join(SHM_DIR, lane.name)
    assert lane.name.startswith(f"psflow-{os.getpid()}-")  # whose they are, for a sweep
    for suffix in ("", ".q", ".r"):
        assert oct(os.stat(path + suffix).st_mode & 0o777) == "0o600"
    peer = Lane.attach(lane.name, lane.token, 65536, 8192)
    # The server removes the names once mapped: its client may die before it could.
    assert not any(os.path.exists(path + suffix) for suffix in ("", ".q", ".r"))
    lane.unlink()  # the client's own removal finds nothing left to do
    lane.request[:5] = [1, 2, 3, 4, 5]
    peer.reply[-1] = 7
    assert list(peer.request[:5]) == [1, 2, 3, 4, 5] and lane.reply[-1] == 7
    assert (len(peer.request), len(peer.reply)) == (65536, 8192)
    lane.request[0] = 9  # both mappings outlive the name
    assert peer.request[0] == 9


@pytest.mark.parametrize(
    ("name", "token", "sizes", "message"),
    [
        ("../../etc/passwd", None, (65536, 8192), "not a lane name"),
        ("psflow-" + "0" * 32, None, (65536, 8192), "not a lane name"),  # whose, unsaid
        (f"psflow-{os.getpid()}-1-" + "0" * 32, None, (65536, 8192), "cannot open"),
        (None, b"x" * 16, (65536, 8192), "announced token"),
        (None, b"short", (65536, 8192), "bad lane token"),
        (None, None, (65536, 4096), "holds"),
        (None, None, (-1, 8192), "bad lane size"),
        (None, None, (True, 8192), "bad lane size"),
    ],
    ids=["path", "no-pid", "missing", "token", "short-token", "size", "negative", "bool"],
)
def test_attach_refuses_what_does_not_match(
    lane: Lane, name: str | None, token: bytes | None, sizes: tuple[int, int], message: str
) -> None:
    with pytest.raises(LaneError, match=message):
        Lane.attach(name or lane.name, token or lane.token, *sizes)


@pytest.mark.parametrize(("suffix", "kind"), [("", "file"), (".q", "fifo"), (".r", "fifo")])
def test_attach_refuses_what_others_can_read(lane: Lane, suffix: str, kind: str) -> None:
    os.chmod(os.path.join(SHM_DIR, lane.name + suffix), 0o644)
    with pytest.raises(LaneError, match=f"not a private {kind}"):
        Lane.attach(lane.name, lane.token, 65536, 8192)


def test_attach_refuses_a_file_where_a_fifo_belongs(lane: Lane) -> None:
    path = os.path.join(SHM_DIR, lane.name + ".q")
    os.unlink(path)
    with open(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600), "wb"):
        pass
    with pytest.raises(LaneError, match="not a private fifo"):
        Lane.attach(lane.name, lane.token, 65536, 8192)


def test_headers_ring_across(lane: Lane) -> None:
    server = Lane.attach(lane.name, lane.token, 65536, 8192)
    assert not lane.wait_reply(0)
    assert lane.post_request(b"request one")
    assert server.take_request() == b"request one"
    assert server.post_reply(b"the reply")
    assert lane.wait_reply(1) and lane.take_reply() == b"the reply"
    assert not lane.wait_reply(0)  # taking drained the ring
    assert not lane.post_request(b"x" * HEADER_BYTES)  # does not fit: the caller uses the socket
    lane.close()
    server.close()
    assert not lane.post_request(b"late") and not server.post_reply(b"late")  # closed: nothing


def _rang(fd: int) -> bool:
    """Whether a byte waits in the FIFO ``fd`` (taking it)."""
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False


def test_a_looking_side_is_not_rung(lane: Lane) -> None:
    server = Lane.attach(lane.name, lane.token, 65536, 8192)
    assert not server.has_request()
    assert lane.post_request(b"while it looks")
    assert server.has_request() and not _rang(server.requests_fd)  # counted, no wake-up paid
    assert server.take_request() == b"while it looks" and not server.has_request()
    assert server.post_reply(b"answer")
    assert lane.has_reply() and not _rang(lane.replies_fd)
    assert lane.take_reply() == b"answer" and not lane.has_reply()
    server.close()


def test_a_sleeping_side_is_rung(lane: Lane) -> None:
    server = Lane.attach(lane.name, lane.token, 65536, 8192)
    server.sleep_for_requests(True)
    assert lane.post_request(b"wake up")
    assert _rang(server.requests_fd) and server.has_request()
    server.sleep_for_requests(False)
    assert server.take_request() == b"wake up"
    lane.sleep_for_replies(True)
    assert server.post_reply(b"awake")
    assert _rang(lane.replies_fd) and lane.take_reply() == b"awake"
    server.close()


@pytest.mark.parametrize("spin", [0.0, 60.0])
def test_wait_reply_finds_a_reply_posted_meanwhile(lane: Lane, spin: float) -> None:
    """Asleep (no spin) the FIFO wakes the waiter; looking (a spin longer than the test), the
    count alone does, and no byte is written."""
    import threading

    server = Lane.attach(lane.name, lane.token, 65536, 8192)
    waiting = threading.Event()
    got: list[bool] = []

    def wait() -> None:
        waiting.set()
        got.append(lane.wait_reply(60, spin))

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiting.wait(10)
    assert server.post_reply(b"meanwhile")
    waiter.join(60)
    assert got == [True] and lane.take_reply() == b"meanwhile"
    server.close()


def test_a_lost_wake_up_costs_a_nap_not_the_timeout(lane: Lane) -> None:
    """A reply counted without its ring (a wake-up lost) is still found by a sleeper, which
    looks at the count again after each nap."""
    import threading

    server = Lane.attach(lane.name, lane.token, 65536, 8192)
    bells = server._bells  # counted as post_reply counts, but never rung

    def silent_reply() -> None:
        bells[_REPLIES] += 1

    late = threading.Timer(0.2, silent_reply)
    late.start()
    try:
        assert lane.wait_reply(60, 0.0)  # False only after 60 s, were there no naps
    finally:
        late.cancel()
    server.close()


def test_tensors_travel_in_the_lane(lane: Lane) -> None:
    a = torch.arange(300, dtype=torch.float32).view(30, 10)
    b = torch.arange(7, dtype=torch.int64)
    big = torch.randn(5000)  # with a and b: over the inline limit
    header: dict[str, object] = {"op": "push", "id": 1}
    frames = wire.encode(header, [("a", a), ("b", b), ("big", big)], area=lane.request)
    assert len(frames) == 1 and header["s"] == 1 and "c" not in header and "b" not in header
    got = wire.decode_header(frames[0])
    into = {"a": torch.empty(30, 10)}
    out = dict(wire.decode_tensors(got, [], max_bytes=1 << 20, area=lane.request_views, into=into))
    assert out["a"] is into["a"] and torch.equal(out["a"], a)
    assert torch.equal(out["b"], b) and torch.equal(out["big"], big)
    views = dict(
        wire.decode_tensors(got, [], max_bytes=1 << 20, area=lane.request_views, transient=True)
    )
    lane.request[:4] = 0  # a view sees the lane change; the copies above do not
    assert views["a"][0, 0] == 0 and out["a"][0, 0] == 0 and torch.equal(out["big"], big)
    assert views["big"].data_ptr() % 64 == 0


def test_tensors_made_in_the_lane_are_sent_without_a_copy(lane: Lane) -> None:
    """``lane_tensors`` lays tensors out where ``encode`` would copy them; filled there and
    encoded with ``placed``, they are not copied, and the receiver reads what was written."""
    made = wire.lane_tensors(lane.request_views, [(torch.float32, (100, 16)), (torch.int64, (3,))])
    assert made is not None
    rows, ids = made
    rows.copy_(torch.arange(1600, dtype=torch.float32).view(100, 16))
    ids.copy_(torch.tensor([7, 8, 9]))
    tensors = [("rows", rows), ("ids", ids)]
    assert wire.placed_in(tensors, lane.request_views)
    assert not wire.placed_in(tensors[::-1], lane.request_views)  # not where encode puts them
    assert not wire.placed_in([("rows", rows.clone())], lane.request_views)
    header: dict[str, object] = {"op": "lookup", "id": 1}
    frames = wire.encode(header, tensors, area=lane.request, placed=True)
    assert len(frames) == 1 and header["s"] == 1
    got = dict(
        wire.decode_tensors(
            wire.decode_header(frames[0]), [], max_bytes=1 << 20, area=lane.request_views
        )
    )
    assert torch.equal(got["rows"], rows) and torch.equal(got["ids"], torch.tensor([7, 8, 9]))
    assert (
        wire.lane_tensors(lane.request_views, [(torch.float32, (20000,))]) is None
    )  # 80 KB > 64 KB


def test_small_tensors_use_the_lane_and_their_views_are_made_once(lane: Lane) -> None:
    w, b = torch.tensor([[2.0]]), torch.tensor([0.3])
    header: dict[str, object] = {"op": "push", "id": 1}
    frames = wire.encode(header, [("w", w), ("b", b)], area=lane.request)
    assert len(frames) == 1 and header["s"] == 1 and "b" not in header  # not inline
    got = wire.decode_header(frames[0])
    views = wire.AreaViews(lane.request)
    first = wire.decode_tensors(got, [], max_bytes=1 << 20, area=views, transient=True)
    again = wire.decode_tensors(
        wire.decode_header(frames[0]),
        [],
        max_bytes=1 << 20,
        area=views,
        transient=True,
    )
    # The same views, from the lane's cache.
    assert all(x is y for (_, x), (_, y) in zip(first, again, strict=True))
    assert torch.equal(again[0][1], w) and torch.equal(again[1][1], b)
    wire.encode({"op": "push", "id": 2}, [("w", w * 3), ("b", b)], area=lane.request)
    assert again[0][1].item() == 6.0  # they see the lane
    other = wire.encode({"op": "push", "id": 3}, [("b", b)], area=lane.request)
    (only_b,) = wire.decode_tensors(
        wire.decode_header(other[0]),
        [],
        max_bytes=1 << 20,
        area=views,
        transient=True,
    )
    assert only_b[1] is not first[1][1] and torch.equal(only_b[1], b)  # a new description


def test_what_does_not_fit_the_lane_is_framed(lane: Lane) -> None:
    header: dict[str, object] = {"op": "push", "id": 1}
    frames = wire.encode(header, [("x", torch.zeros(25000))], area=lane.request)  # 100 KB > 64 KB
    assert "s" not in header and len(frames) == 2


@pytest.mark.parametrize(
    ("t", "area", "frames", "message"),
    [
        ([["x", "float32", [10]]], None, [], "no lane is attached"),
        ([["x", "float32", [20000]]], "lane", [], "lane, it holds 65536"),
        ([["x", "float32", [10]]], "lane", [b"\x00" * 40], "no data frames"),
    ],
)
def test_bad_lane_messages(
    lane: Lane, t: list[object], area: str | None, frames: list[bytes], message: str
) -> None:
    header = {"v": wire.PROTOCOL_VERSION, "op": "push", "id": 1, "t": t, "s": 1}
    with pytest.raises(wire.WireError, match=message):
        wire.decode_tensors(
            header, frames, max_bytes=1 << 20, area=lane.request_views if area else None
        )


def test_a_gone_client_hangs_up_its_lane() -> None:
    import zmq

    client = Lane.create(0, 0)
    server = Lane.attach(client.name, client.token, 0, 0)
    client.unlink()
    poller = zmq.Poller()
    poller.register(server.requests_fd, zmq.POLLIN)
    assert poller.poll(0) == []
    client.close()  # as when the client exits or dies
    assert poller.poll(0) == [(server.requests_fd, zmq.POLLERR)]
    # A reply posted now lands where nobody reads it: the server drops a lane whose FIFO polls
    # hung up (Server.recv), and nothing is lost but the reply to a client that has gone.
    server.post_reply(b"nobody reads this")
    server.close()


def test_a_gone_server_hangs_up_its_lane() -> None:
    client = Lane.create(0, 0)
    server = Lane.attach(client.name, client.token, 0, 0)
    client.unlink()
    assert server.post_reply(b"the last reply")
    server.close()  # as when the ps exits or dies, after answering
    assert client.wait_reply(0) and client.take_reply() == b"the last reply"
    with pytest.raises(LaneError, match="hung up"):
        client.wait_reply(5)  # at once, not after 5 s
    client.close()


def test_a_forked_child_lets_go_of_the_lanes(lane: Lane) -> None:
    import zmq

    server = Lane.attach(lane.name, lane.token, 65536, 8192)
    poller = zmq.Poller()
    poller.register(server.requests_fd, zmq.POLLIN)
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: like a DataLoader process, alive and never using the lane
        os.read(release_r, 1)
        os._exit(0 if lane.closed else 1)
    try:
        assert not lane.closed  # the parent's lane works on
        lane.close()  # the parent goes away while its child lives: the ps must see it
        assert poller.poll(2000) == [(server.requests_fd, zmq.POLLERR)]
    finally:
        os.write(release_w, b"x")
        _, status = os.waitpid(pid, 0)
        os.close(release_r)
        os.close(release_w)
    assert os.waitstatus_to_exitcode(status) == 0
    server.close()


def test_attach_refuses_a_sparse_or_oversized_lane_before_mapping_it() -> None:
    # A forged lane: the lane form, a private file, the announced size and token, but sparse.
    from psflow.cluster import shmfiles

    name = shmfiles.new_name()
    path = os.path.join(SHM_DIR, name)
    token = os.urandom(16)
    sizes = (32 << 30, 1 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, Lane.size(*sizes))
        os.pwrite(fd, token, 0)
        os.close(fd)
        with pytest.raises(LaneError, match="exceeds this server's"):
            Lane.attach(name, token, *sizes, max_bytes=8 << 30)
        with pytest.raises(LaneError, match="sparse"):
            Lane.attach(name, token, *sizes)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("raw", ["-1", "abc", "nan", "inf"])
def test_a_bad_spin_names_its_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    from psflow.transport.config import TransportConfig

    monkeypatch.setenv("PSFLOW_SPIN_US", raw)
    with pytest.raises(ValueError, match="PSFLOW_SPIN_US must be a number of microseconds >= 0"):
        TransportConfig()


def test_spin_is_given_in_microseconds(monkeypatch: pytest.MonkeyPatch) -> None:
    from psflow.transport.config import TransportConfig

    monkeypatch.setenv("PSFLOW_SPIN_US", "500")
    assert TransportConfig().spin_seconds == 0.0005
    monkeypatch.setenv("PSFLOW_SPIN_US", "0")  # never look: sleep at once
    assert TransportConfig().spin_seconds == 0.0


@pytest.mark.parametrize("odds", [0.75, 0.0])
def test_a_lane_looks_only_while_replies_have_been_coming_soon(
    lane: Lane, odds: float, yields: Yields
) -> None:
    """A waiter looks at the count (yielding its core at each look) while its last replies came
    within the spin time, else it sleeps at once; either way the reply is found, and the wait
    counts in the odds."""
    import threading

    from psflow.transport.shm import _CLIENT_ASLEEP

    server = Lane.attach(lane.name, lane.token, 65536, 8192)
    lane._looks.odds = odds
    got: list[bool] = []
    yields.thread = threading.Thread(target=lambda: got.append(lane.wait_reply(60, 60.0)))
    yields.thread.start()
    if odds:
        assert yields.looked.wait(30)  # looking: the reply comes while it looks
    else:
        for _ in range(3000):  # asleep: the reply comes once it said so
            if lane._bells[_CLIENT_ASLEEP]:
                break
            yields.looked.wait(0.01)
        assert lane._bells[_CLIENT_ASLEEP]
    assert server.post_reply(b"late")
    yields.thread.join(60)
    assert got == [True] and lane.take_reply() == b"late"
    assert bool(yields.count) == bool(odds)
    assert lane._looks.odds > odds  # the wait counted: within the spin time, it paid
    server.close()
