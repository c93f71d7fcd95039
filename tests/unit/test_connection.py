"""A server and a client in one process, over real sockets: how tensors and refusals arrive."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from psflow.cluster.ports import free_ports
from psflow.protocol import Code, Key, Op
from psflow.ps.store import GradBuffers
from psflow.transport import (
    Client,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    Request,
    Server,
    TransportConfig,
    wire,
)
from tests.yields import Yields


def _frame_spans(frames: list[object]) -> list[tuple[int, int]]:
    spans = []
    for f in frames:
        buf = np.frombuffer(memoryview(f), dtype=np.uint8)  # type: ignore[call-overload]
        spans.append((buf.ctypes.data, buf.ctypes.data + buf.nbytes))
    return spans


def _received(chunk_bytes: int | None) -> tuple[torch.Tensor, bool, GradBuffers]:
    """Sends a 4 MB tensor through a real socket; what the server got, whether it lies in a
    received frame, and the buffers the server offered to assemble it into."""
    overrides = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    config = TransportConfig(timeout=10, shared_memory=False, **overrides)  # type: ignore[arg-type]
    (port,) = free_ports(1)
    server = Server(f"127.0.0.1:{port}", config)
    client = Client({"ps:0": f"127.0.0.1:{port}"}, config)
    variables = {"w": torch.zeros(1 << 20)}
    buffers = GradBuffers(variables)
    got: dict[str, object] = {}

    def serve() -> None:
        request = server.recv(10)
        if request is None:
            return
        ((_, t),) = server.tensors(request, into=buffers, transient=True)
        ptr = t.data_ptr()
        got["inside"] = any(lo <= ptr < hi for lo, hi in _frame_spans(request.frames))
        got["tensor"] = t.clone()
        server.reply(request, {"op": "ok"})

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        sent = torch.arange(1 << 20, dtype=torch.float32)
        client.request("ps:0", {"op": "push"}, [("w", sent)], timeout=10)
        assert torch.equal(got["tensor"], sent)  # type: ignore[arg-type]
        return sent, bool(got["inside"]), buffers
    finally:
        thread.join(15)  # before closing: the server's socket belongs to that thread now
        client.close()
        server.close()


def test_a_tensor_in_one_frame_is_used_where_it_arrived() -> None:
    if TransportConfig().chunk_bytes != wire.WHOLE_TENSOR_CHUNK_BYTES:
        pytest.skip("the allocator is not tuned here (PSFLOW_MALLOC=system or not glibc)")
    _, inside, buffers = _received(None)
    assert inside
    assert buffers._made == {}  # no buffer was allocated for it


def test_a_tensor_in_pieces_is_assembled_into_its_buffer() -> None:
    _, inside, buffers = _received(1 << 20)
    assert not inside
    assert list(buffers._made) == ["w"]


def test_grad_buffers_are_made_once_on_first_use() -> None:
    buffers = GradBuffers({"a": torch.zeros(3, 2, dtype=torch.float64), "b": torch.zeros(4)})
    assert sorted(buffers) == ["a", "b"] and len(buffers) == 2
    assert buffers._made == {}
    a = buffers["a"]
    assert a.shape == (3, 2) and a.dtype == torch.float64
    assert buffers.get("a") is a
    assert buffers.get("c") is None
    assert list(buffers._made) == ["a"]


def test_a_lane_reply_area_holds_only_the_servers_tensor_set() -> None:
    """Through a lane, a ps answers with its variables (a TensorSet) at fixed places, so a worker
    may keep its parameters there; any other tensors go by socket and leave the area alone."""
    config = TransportConfig(timeout=10, shared_memory=True)
    (port,) = free_ports(1)
    server = Server(f"127.0.0.1:{port}", config)
    client = Client({"ps:0": f"127.0.0.1:{port}"}, config)
    variables = wire.TensorSet([("w", torch.full((1 << 16,), 7.0)), ("b", torch.ones(3))])
    other = [("w", torch.full((1 << 16,), -1.0))]
    answers = {"hello": (), "set": variables, "list": other}
    lanes = []

    stop = threading.Event()

    def serve() -> None:
        for _ in range(4):
            request = None
            while request is None:  # None too after a lane attached: answered inside recv
                if stop.is_set():
                    return
                request = server.recv(0.2)
            lanes.append(request.lane)
            server.tensors(request)
            server.reply(request, {"op": "ok"}, answers[request.header["op"]])

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        grad = [("g", torch.zeros((1 << 16) + 64))]  # its lane fits the set too
        client.request("ps:0", {"op": "hello"}, grad, timeout=10)  # the socket: no lane yet
        rid = client.send("ps:0", {"op": "list"}, grad)
        lane = client.lane("ps:0")
        assert lane is not None
        area = lane.reply
        ((_, got),) = client.wait([rid], 10, lane_views=True)[rid][1]
        assert torch.equal(got, other[0][1]) and not area.any()  # by socket, area untouched
        rid = client.send("ps:0", {"op": "set"}, grad)
        w, b = (t for _, t in client.wait([rid], 10, lane_views=True)[rid][1])
        assert (w == 7).all() and (b == 1).all()
        assert area.ctypes.data <= w.data_ptr() < area.ctypes.data + area.nbytes  # in the lane
        rid = client.send("ps:0", {"op": "list"}, grad)
        client.wait([rid], 10, lane_views=True)
        assert (w == 7).all()  # still the set's values: the list did not come this way
        assert lanes[0] is None and all(x is lanes[1] for x in lanes[1:])
    finally:
        stop.set()
        thread.join(10)  # before closing: the server's socket belongs to that thread now
        client.close()
        server.close()


def _serve(server: Server, answer: Callable[[Request], None], stop: threading.Event) -> None:
    """Answers requests with ``answer`` until ``stop`` is set."""
    while not stop.is_set():
        request = server.recv(0.05)  # None too after a lane attached: answered inside recv
        if request is not None:
            answer(request)


def test_rows_made_in_the_request_area_come_back_as_views_when_asked() -> None:
    """A lookup's rows, gathered by the server where its reply goes (``reply_tensors``: the
    lane's request area), cross without a copy; the client takes them as views of the lane
    (``request_views``) or as copies. Without a lane the server makes no such tensors."""
    config = TransportConfig(timeout=10, shared_memory=True)
    (port,) = free_ports(1)
    server = Server(f"127.0.0.1:{port}", config)
    client = Client({"ps:0": f"127.0.0.1:{port}"}, config)
    made: list[bool] = []

    def answer(request: Request) -> None:
        ids = dict(server.tensors(request))["ids"]  # a copy: the rows overlay it
        rows = server.reply_tensors(request, [(torch.float32, (ids.numel(), 16))])
        made.append(rows is not None)
        (out,) = rows if rows is not None else [torch.empty(ids.numel(), 16)]
        out.copy_(ids.float()[:, None].expand(-1, 16))
        server.reply(request, {"op": "ok"}, [("rows", out)])

    stop = threading.Event()
    thread = threading.Thread(target=_serve, args=(server, answer, stop))
    thread.start()
    try:
        # 256 KB of rows (no header holds them); the padding makes the lane's request area as
        # large (a worker's pushes do that).
        ids = [("ids", torch.arange(4096, dtype=torch.int64)), ("pad", torch.zeros(1 << 16))]
        client.request("ps:0", {"op": "lookup"}, ids, timeout=10)  # by socket: no lane yet
        assert client.lane("ps:0") is None and made == [False]
        want = torch.arange(4096, dtype=torch.float32)[:, None].expand(-1, 16)
        for views in (True, False):
            rid = client.send("ps:0", {"op": "lookup"}, ids)
            ((_, rows),) = client.wait([rid], 10, request_views=views)[rid][1]
            lane = client.lane("ps:0")
            assert lane is not None
            inside = range(lane.request.ctypes.data, lane.request.ctypes.data + lane.request.nbytes)
            assert torch.equal(rows, want)
            assert (rows.data_ptr() in inside) == views
        assert made == [False, True, True]
    finally:
        stop.set()
        thread.join(10)  # before closing: the server's socket belongs to that thread now
        client.close()
        server.close()


def test_a_send_that_cannot_leave_blocks_only_as_long_as_asked() -> None:
    """A peer whose connection cannot take a request (here: nobody listens, and ZeroMQ's queue
    of 1,000 messages is full; a failing handshake does the same) blocks a send for ``block``
    seconds, not the transport's timeout, and says how long it waited."""
    (port,) = free_ports(1)  # nothing listens there
    config = TransportConfig(timeout=60, shared_memory=False)
    client = Client({"ps:0": f"127.0.0.1:{port}"}, config)
    try:
        sent = 0
        start = time.monotonic()
        with pytest.raises(PeerTimeoutError, match=r"could not send within 0\.2 s"):
            while sent < 5000:  # the queue holds 1,000
                client.send("ps:0", {"op": "status"}, block=0.2)
                sent += 1
        assert 0 < sent < 5000 and time.monotonic() - start < 30  # not the 60 s timeout
        with pytest.raises(PeerTimeoutError, match=r"within 0\.1 s"):
            client.send("ps:0", {"op": "status"}, block=0.1)
    finally:
        client.close()


@pytest.mark.parametrize("shared_memory", [False, True])
def test_an_error_reply_raises_a_peer_error_with_the_peers_code(shared_memory: bool) -> None:
    """The transport hands a refusal up as it came: which codes mean a lost peer is for the
    layer above to say."""
    config = TransportConfig(timeout=10, shared_memory=shared_memory)
    (port,) = free_ports(1)
    server = Server(f"127.0.0.1:{port}", config)
    client = Client({"ps:0": f"127.0.0.1:{port}"}, config)
    codes = {"plain": None, "lost": Code.UNINITIALIZED, "odd": "not-a-known-code"}

    def answer(request: Request) -> None:
        op = request.header[Key.OP]
        if op == Op.PULL:
            server.reply(request, {Key.OP: Op.OK}, [("w", torch.ones(1 << 14))])
        else:
            server.send_error(request, f"refused {op}", codes[op])

    stop = threading.Event()
    thread = threading.Thread(target=_serve, args=(server, answer, stop))
    thread.start()
    try:
        client.request("ps:0", {Key.OP: Op.PULL}, timeout=10)  # answered once: a lane may follow
        for op, code in codes.items():
            client.request("ps:0", {Key.OP: Op.PULL}, [("g", torch.ones(1 << 14))], timeout=10)
            assert (client.lane("ps:0") is not None) == shared_memory
            with pytest.raises(PeerError) as e:
                client.request("ps:0", {Key.OP: op}, [("g", torch.ones(1 << 14))], timeout=10)
            assert type(e.value) is PeerError and not isinstance(e.value, PeerLostError)
            assert (e.value.peer, e.value.detail, e.value.code) == ("ps:0", f"refused {op}", code)
    finally:
        stop.set()
        thread.join(10)
        client.close()
        server.close()


def test_the_servers_own_error_replies_carry_a_code() -> None:
    """What the server answers itself (a malformed message, a lane it will not map) says what
    kind of refusal it is."""
    import msgpack
    import zmq

    config = TransportConfig(timeout=10, shared_memory=False)
    (port,) = free_ports(1)
    server = Server(f"127.0.0.1:{port}", config)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{port}")

    def ask(frames: list[bytes]) -> dict[str, object]:
        sock.send_multipart(frames)
        with contextlib.suppress(wire.WireError):
            assert server.recv(5) is None  # answered inside recv
        assert sock.poll(5000)
        return msgpack.unpackb(sock.recv_multipart()[0])  # type: ignore[no-any-return]

    try:
        reply = ask([b"\xc1\xc1"])
        assert (reply[Key.OP], reply[Key.ID], reply[Key.CODE]) == (Op.ERROR, -1, Code.MALFORMED)
        attach = {Key.OP: Op.ATTACH_LANE, Key.ID: 7, Key.LANE_NAME: "psflow-" + "0" * 32}
        reply = ask(wire.encode(attach))
        assert (reply[Key.OP], reply[Key.ID], reply[Key.CODE]) == (Op.ERROR, 7, Code.REFUSED)
        assert "shared memory is off on this server" in str(reply[Key.ERROR])
    finally:
        sock.close(linger=0)
        ctx.term()
        server.close()


def test_replies_from_several_peers_are_collected_in_one_wait() -> None:
    """Requests to two servers at once, some through lanes and some through sockets."""
    config = TransportConfig(timeout=10, shared_memory=True)
    ports = free_ports(2)
    servers = [Server(f"127.0.0.1:{port}", config) for port in ports]
    client = Client({f"ps:{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports)}, config)
    stop = threading.Event()
    threads = []
    for i, server in enumerate(servers):

        def answer(request: Request, server: Server = server, i: int = i) -> None:
            ((_, t),) = server.tensors(request)
            server.reply(request, {Key.OP: Op.OK}, [("y", t + i)])

        threads.append(threading.Thread(target=_serve, args=(server, answer, stop)))
        threads[-1].start()
    try:
        for step in range(4):  # the first: all by socket; then one lane each, and sockets
            rids = {}
            for i in range(2):
                for k in range(2):
                    x = torch.full((1 << 12,), float(10 * step + k))
                    rids[i, k] = client.send(f"ps:{i}", {Key.OP: Op.PUSH}, [("x", x)])
            replies = client.wait(rids.values(), 10)
            for (i, k), rid in rids.items():
                ((_, y),) = replies[rid][1]
                assert (y == 10 * step + k + i).all()
        assert all(client.lane(f"ps:{i}") is not None for i in range(2))
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        client.close()
        for server in servers:
            server.close()


def test_a_port_held_for_a_moment_is_bound_once_free_and_one_held_on_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process may hold a task's port for a moment (a launcher trying ports as it picks
    free ones): the server tries again for a while, then names the port."""
    import socket

    import psflow.transport.server as server_module

    monkeypatch.setattr(server_module, "_BIND_RETRY_SECONDS", 60.0)  # far past the release
    config = TransportConfig(timeout=10, shared_memory=False)
    (port,) = free_ports(1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    released = threading.Event()

    def release() -> None:
        time.sleep(0.3)
        holder.close()
        released.set()

    threading.Thread(target=release, daemon=True).start()
    server = Server(f"127.0.0.1:{port}", config)  # waits out the holder
    try:
        assert released.is_set()
    finally:
        server.close()
    monkeypatch.setattr(server_module, "_BIND_RETRY_SECONDS", 0.2)
    (port,) = free_ports(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}.*in use"):
            Server(f"127.0.0.1:{port}", config)


@pytest.mark.parametrize("odds", [0.75, 0.0])
def test_a_wait_on_several_lanes_looks_by_the_odds_of_whole_waits(
    odds: float, yields: Yields
) -> None:
    """A wait for two servers' replies, each through its lane: the client looks at the lanes
    (yielding its core) while its last such waits ended within the spin time, else it sleeps
    at once; either way both replies are taken, and the whole wait counts in the odds (once
    one reply is in, the wait for the other is its lane's, by that lane's odds)."""
    from psflow.transport.shm import _CLIENT_ASLEEP

    config = TransportConfig(timeout=30, shared_memory=True, spin_seconds=60.0)
    ports = free_ports(2)
    servers = [Server(f"127.0.0.1:{port}", config) for port in ports]
    client = Client({f"ps:{i}": f"127.0.0.1:{port}" for i, port in enumerate(ports)}, config)
    stop, release = threading.Event(), threading.Event()
    threads = []
    for server in servers:

        def answer(request: Request, server: Server = server) -> None:
            if request.lane is not None:  # the wait under test: replies once released
                release.wait(30)
            server.reply(request, {Key.OP: Op.OK})

        threads.append(threading.Thread(target=_serve, args=(server, answer, stop)))
        threads[-1].start()
    waiter: threading.Thread | None = None
    try:
        for _ in range(2):  # the first round trip attaches each lane, the second goes by it
            rids = [client.send(f"ps:{i}", {Key.OP: Op.PUSH}) for i in range(2)]
            if all(client.lane(f"ps:{i}") is not None for i in range(2)):
                break
            release.set()
            client.wait(rids, 30)
            release.clear()
        lanes = [client.lane(f"ps:{i}") for i in range(2)]
        assert all(lane is not None for lane in lanes)
        client._looks.odds = odds
        for lane in lanes:  # the last reply's wait is on its lane alone: that lane's odds
            lane._looks.odds = odds  # type: ignore[union-attr]
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(client.wait(rids, 30)))
        yields.thread = waiter
        waiter.start()
        if odds:
            assert yields.looked.wait(30)  # looking: the replies come while it looks
        else:  # asleep: the replies come once it said so on both lanes
            for _ in range(3000):
                if all(lane._bells[_CLIENT_ASLEEP] for lane in lanes):  # type: ignore[union-attr]
                    break
                yields.looked.wait(0.01)
            assert all(lane._bells[_CLIENT_ASLEEP] for lane in lanes)  # type: ignore[union-attr]
        release.set()
        waiter.join(30)
        assert len(got) == 1 and len(got[0]) == 2  # type: ignore[arg-type]
        assert bool(yields.count) == bool(odds)
        assert client._looks.odds > odds  # the whole wait counted, within the spin time
    finally:
        release.set()
        stop.set()
        for thread in threads:
            thread.join(10)
        if waiter is not None:
            waiter.join(10)
        client.close()
        for server in servers:
            server.close()
