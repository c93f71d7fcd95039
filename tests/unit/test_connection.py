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
        assert request is not None
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
        thread.join(10)
        assert torch.equal(got["tensor"], sent)  # type: ignore[arg-type]
        return sent, bool(got["inside"]), buffers
    finally:
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
