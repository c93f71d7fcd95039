"""A server and a client in one process, over a real socket: how large tensors arrive."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from psflow.cluster.launcher import free_ports
from psflow.ps.store import GradBuffers
from psflow.transport import wire
from psflow.transport.connection import Client, Server, TransportConfig


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
        area = client._lanes["ps:0"].reply
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
