"""Sealed sockets over real connections (``psflow.transport.seal``): with CurveZMQ keys a client
that reaches a server only by socket moves to its sealed socket and gets the same answers;
what reaches the sealed port without a session's keys is refused and the server serves on; a
server without one, or a restarted one, leaves nobody stuck."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.utils.monitor

from psflow.cluster.ports import free_ports
from psflow.protocol import PROTOCOL_VERSION, Key, Op
from psflow.transport import (
    Client,
    CurveKeys,
    PeerError,
    PeerLostError,
    Server,
    TransportConfig,
    generate_keys,
    seal,
)
from psflow.transport.auth import configure_server
from psflow.transport.receiver import SEAL_BREAKS, SEAL_FROM_BYTES

from ..fuzz_messages import messages
from .support import ROOT

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not seal.available(), reason="needs the cryptography package"),
]


class Echo:
    """A server on a thread answering each request with its tensors doubled; it counts the
    requests that came through its sealed socket and through its own."""

    def __init__(
        self, address: str, config: TransportConfig, context: zmq.Context[Any] | None = None
    ) -> None:
        self.server = Server(address, config, context=context)
        self.by: dict[str, int] = {"sealed": 0, "own": 0}
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        server = self.server
        while not self._stop.is_set():
            try:
                request = server.recv(0.05)
            except ValueError:  # wire.WireError: a refused message, answered by the server
                self.refused += 1
                continue
            if request is None:
                continue
            sealed = request.sock is not None and request.sock is not server._sock
            self.by["sealed" if sealed else "own"] += 1
            tensors = [(n, t * 2) for n, t in server.tensors(request)]
            server.reply(request, {Key.OP: Op.OK, "sealed": sealed}, tensors)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.server.close()


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    return CurveKeys.load(generate_keys(tmp_path / "keys"))


@pytest.fixture
def pair(keys: CurveKeys) -> Iterator[tuple[Echo, Client]]:
    """An echo server with keys, and a client of it through the socket alone."""
    (port,) = free_ports(1)
    echo = Echo(f"127.0.0.1:{port}", _config(keys))
    client = Client({"ps:0": f"127.0.0.1:{port}"}, _config(keys))
    try:
        yield echo, client
    finally:
        client.close()
        echo.stop()


def _config(keys: CurveKeys, **overrides: Any) -> TransportConfig:
    """Through the socket alone unless ``shared_memory=True``."""
    settings: dict[str, Any] = {"timeout": 10, "link_timeout": 5, "shared_memory": False}
    return TransportConfig(keys=keys, **{**settings, **overrides})


def _until_sealed(client: Client, peer: str, limit: float = 30.0) -> int:
    """Sends requests until one is answered through the sealed socket; how many it took."""
    deadline = time.monotonic() + limit
    sent = 0
    while True:
        # Large enough for sealing to pay (SEAL_FROM_BYTES): small messages stay inside CurveZMQ.
        x = torch.arange(SEAL_FROM_BYTES // 4, dtype=torch.float32) + sent
        header, ((_, y),) = client.request(peer, {Key.OP: "echo"}, [("x", x)])
        sent += 1
        assert torch.equal(y, x * 2)
        if header["sealed"]:
            return sent
        assert time.monotonic() < deadline, "requests never moved to the sealed socket"
        time.sleep(0.01)


def test_requests_move_to_the_sealed_socket_and_arrive_unchanged(pair: tuple[Echo, Client]) -> None:
    echo, client = pair
    own_port = int(client._peers["ps:0"].address.rsplit(":", 1)[1])
    assert echo.server.sealed_port not in (None, own_port)
    _until_sealed(client, "ps:0")
    own = echo.by["own"]
    # From now on every request goes sealed, large tensors (several frames) included.
    for i in range(20):
        big = torch.randn(1 << 18 if i % 2 else 17)
        ids = torch.arange(i, dtype=torch.int64)
        header, got = client.request("ps:0", {Key.OP: "echo"}, [("big", big), ("ids", ids)])
        assert header["sealed"]
        assert torch.equal(got[0][1], big * 2) and torch.equal(got[1][1], ids * 2)
    assert echo.by["own"] == own and echo.refused == 0


def test_without_a_sealed_socket_everything_stays_inside_curvezmq(keys: CurveKeys) -> None:
    (port,) = free_ports(1)
    echo = Echo(f"127.0.0.1:{port}", _config(keys, sealed=False))
    client = Client({"ps:0": f"127.0.0.1:{port}"}, _config(keys))
    try:
        assert echo.server.sealed_port is None
        large = torch.ones(SEAL_FROM_BYTES // 4)
        for _ in range(10):
            header, _ = client.request("ps:0", {Key.OP: "echo"}, [("x", large)])
            assert not header["sealed"]
        assert client._peers["ps:0"].sealed is None  # asked once, refused, not again
        assert echo.by == {"sealed": 0, "own": 10}
    finally:
        client.close()
        echo.stop()


def _handshake_refused(port: int, plain: tuple[bytes, bytes] | None) -> None:
    """Asserts that a DEALER of its own (with ZeroMQ's PLAIN user name and password ``plain``)
    fails its handshake with ``port``: no message of it can be delivered."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if plain is not None:
        sock.plain_username, sock.plain_password = plain
    monitor = sock.get_monitor_socket()
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and monitor.poll(int(left * 1000)), "no word of the handshake"
            event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
            assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, f"{plain} connected"
            if event in (
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                return
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()


def _send_raw(port: int, frames: list[Any], plain: tuple[bytes, bytes] | None = None) -> Any:
    """Frames sent to ``port`` by a DEALER of its own (with ZeroMQ's PLAIN user name and
    password ``plain``); the answer, if one comes within a second."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if plain is not None:
        sock.plain_username, sock.plain_password = plain
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.sndtimeo = 1000
        try:
            sock.send_multipart(frames)
        except zmq.Again:  # no connection took it
            return None
        return sock.recv_multipart() if sock.poll(1000) else None
    finally:
        sock.close()


def test_the_sealed_port_refuses_what_no_session_sealed_and_serves_on(
    pair: tuple[Echo, Client],
) -> None:
    echo, client = pair
    _until_sealed(client, "ps:0")
    sealed_port = echo.server.sealed_port
    assert sealed_port is not None
    served = dict(echo.by)
    status = msgpack.packb({Key.VERSION: PROTOCOL_VERSION, Key.OP: Op.STATUS, Key.ID: 1})
    fuzz = [frames for _, _, frames in messages(20261128, 60)]
    # Without a session's token no connection completes: nothing can reach the server.
    session = client._peers["ps:0"].sealed.sock.seal.session  # type: ignore[union-attr]
    for plain in (None, (session.hex().encode(), b"0" * 64), (b"x" * 32, b"y" * 64)):
        _handshake_refused(sealed_port, plain)
    for _, _, frames in messages(7, 50):  # below ZeroMQ: bytes in place of a handshake
        with socket.create_connection(("127.0.0.1", sealed_port), timeout=5) as raw:
            raw.sendall(b"".join(frames)[:65536])
    assert echo.refused == 0
    # One who learned a session's token on the wire connects, and still opens nothing:
    # its messages are refused, in the clear, and never reach the service.
    token = bytes.fromhex(echo.server._sealed.sessions.tokens[session.hex()])  # type: ignore[union-attr]
    plain = (session.hex().encode(), token.hex().encode())
    forged = seal.Seal(session, send=os.urandom(32), receive=os.urandom(32))
    attempts = [[status], *fuzz, [bytes(memoryview(p)) for p in forged.seal([status])]]
    for frames in attempts:
        answer = _send_raw(sealed_port, frames, plain)
        assert answer is not None
        header = msgpack.unpackb(answer[0], raw=False)
        assert header[Key.OP] == Op.ERROR and header[Key.ID] == -1, header
    # Nor can it speak in another session than the one its token is for.
    other = seal.Seal(os.urandom(16), send=os.urandom(32), receive=os.urandom(32))
    answer = _send_raw(sealed_port, [bytes(memoryview(p)) for p in other.seal([status])], plain)
    assert answer is not None
    assert "other than its connection's" in msgpack.unpackb(answer[0], raw=False)[Key.ERROR]
    assert echo.by == served, "a message without the session's keys reached the service"
    assert echo.refused >= 1
    # The true client's session goes on.
    header, ((_, y),) = client.request("ps:0", {Key.OP: "echo"}, [("x", torch.ones(3))])
    assert header["sealed"] and torch.equal(y, torch.full((3,), 2.0))


def test_a_restarted_server_gets_a_new_session(keys: CurveKeys) -> None:
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    echo = Echo(address, _config(keys))
    client = Client({"ps:0": address}, _config(keys))
    try:
        _until_sealed(client, "ps:0")
        first_port = echo.server.sealed_port
        echo.stop()
        sealed = client._peers["ps:0"].sealed
        assert sealed is not None
        deadline = time.monotonic() + 30
        while not sealed.lost:  # the monitor's word that the connection closed
            assert time.monotonic() < deadline, "the sealed connection's close was not seen"
            time.sleep(0.01)
        echo = Echo(address, _config(keys))
        assert echo.server.sealed_port != first_port
        began = time.monotonic()
        header: dict[str, Any] = {}
        for _ in range(3):  # the first may have gone to the old port: lost at once, not late
            try:
                header, _ = client.request("ps:0", {Key.OP: "echo"}, [("x", torch.ones(2))])
                break
            except PeerLostError:
                pass
        assert time.monotonic() - began < client.config.timeout
        assert not header["sealed"]  # back inside CurveZMQ, then a new session
        _until_sealed(client, "ps:0")
    finally:
        client.close()
        echo.stop()


def test_small_messages_stay_inside_curvezmq(pair: tuple[Echo, Client]) -> None:
    """Sealing costs each message some Python, which only large ones repay: a peer whose
    messages stay small (a linear regression's) never moves."""
    echo, client = pair
    small = torch.ones(SEAL_FROM_BYTES // 8)
    for _ in range(30):
        header, _ = client.request("ps:0", {Key.OP: "echo"}, [("x", small)])
        assert not header["sealed"]
    assert client._peers["ps:0"].sealed.endpoint is None  # type: ignore[union-attr]
    assert echo.server._sealed.sessions.opened == 0  # type: ignore[union-attr]
    # One large message, and the next requests move.
    client.request("ps:0", {Key.OP: "echo"}, [("x", torch.ones(SEAL_FROM_BYTES // 4))])
    _until_sealed(client, "ps:0")


@pytest.fixture(scope="module")
def ctr_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ctr")
    cmd = [sys.executable, "-m", "psflow.cli", "data", "synth-ctr", str(out)]
    cmd += ["--examples", "3000", "--test-examples", "500", "--scale", "0.001"]
    made = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr[-3000:]
    return out


def _launch_ctr(data: Path, tmp_path: Path, env: dict[str, str]) -> tuple[str, str]:
    """``psflow launch`` (its fresh keys) of the CTR example, one ps and one worker, through the
    socket alone; its RESULT line and its output."""
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--ps", "1", "--workers", "1"]
    cmd += [str(ROOT / "examples" / "ctr.py"), "--data", str(data), "--train_steps", "40"]
    cmd += ["--batch_size", "64", "--logdir", str(tmp_path)]
    base = {k: v for k, v in os.environ.items() if k != "PSFLOW_KEYS_DIR"}
    run = subprocess.run(
        cmd,
        env={**base, "PSFLOW_SHM": "0", "PSFLOW_LOG_LEVEL": "DEBUG", **env},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if "RESULT " in ln]
    assert len(lines) == 1, run.stdout[-3000:]
    return lines[0].split("RESULT ", 1)[1], run.stdout + run.stderr


def test_a_launched_job_trains_the_same_on_its_sealed_socket(
    ctr_data: Path, tmp_path: Path
) -> None:
    sealed, out = _launch_ctr(ctr_data, tmp_path / "sealed", {})
    assert "requests move to its sealed socket" in out
    inside, out = _launch_ctr(ctr_data, tmp_path / "curve", {"PSFLOW_SEALED": "0"})
    assert "sealed socket" not in out
    # One worker: every step the same, so the same result to the last digit printed.
    speed = "samples_per_s_per_worker"
    a, b = json.loads(sealed), json.loads(inside)
    assert a.pop(speed) > 0 and b.pop(speed) > 0
    assert a == b and "test_auc" in a


def test_a_session_the_server_lost_fails_at_once_and_losing_every_one_ends_sealing(
    pair: tuple[Echo, Client],
) -> None:
    echo, client = pair
    sessions = echo.server._sealed.sessions  # type: ignore[union-attr]

    def echo_once() -> dict[str, Any]:
        header, ((_, y),) = client.request("ps:0", {Key.OP: "echo"}, [("x", torch.ones(2))])
        assert torch.equal(y, torch.full((2,), 2.0))
        return header

    # A session lost now and then (as if evicted by MAX_SESSIONS newer ones): the request
    # in it fails at once, the next goes inside CurveZMQ, and a new session follows.
    for _ in range(SEAL_BREAKS + 1):
        _until_sealed(client, "ps:0")
        sessions._by_id.clear()
        began = time.monotonic()
        with pytest.raises(PeerLostError, match="ps:0"):
            echo_once()
        assert time.monotonic() - began < client.config.timeout
        assert not echo_once()["sealed"]
    _until_sealed(client, "ps:0")
    # Every session lost before it answers once: given up after SEAL_BREAKS in a row.
    lost = 0
    deadline = time.monotonic() + 30
    while client._peers["ps:0"].sealed is not None:
        assert time.monotonic() < deadline, "sealing was never given up"
        sessions._by_id.clear()
        try:
            assert not echo_once()["sealed"]
        except PeerLostError:
            lost += 1
    assert lost == SEAL_BREAKS
    for _ in range(5):  # inside CurveZMQ from now on, nothing lost on the way
        assert not echo_once()["sealed"]


def test_a_sealed_port_that_leads_elsewhere_ends_sealing(
    keys: CurveKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_port, b_port = free_ports(2)
    a = Echo(f"127.0.0.1:{a_port}", _config(keys))
    # Its own context: a context has one authenticator endpoint, as a process has one ps.
    b_context: zmq.Context[Any] = zmq.Context()
    b = Echo(f"127.0.0.1:{b_port}", _config(keys), b_context)
    elsewhere = b.server.sealed_port
    # A names B's sealed port (a host port mapped to another process): B refuses the token.
    monkeypatch.setattr(Server, "sealed_port", property(lambda self: elsewhere))
    client = Client({"ps:0": f"127.0.0.1:{a_port}"}, _config(keys))
    try:
        deadline = time.monotonic() + 30
        while client._peers["ps:0"].sealed is not None:
            assert time.monotonic() < deadline, "sealing was never given up"
            x = torch.ones(SEAL_FROM_BYTES // 4)
            header, ((_, y),) = client.request("ps:0", {Key.OP: "echo"}, [("x", x)])
            assert not header["sealed"] and torch.equal(y, x * 2)
            time.sleep(0.01)
        assert b.by == {"sealed": 0, "own": 0}
    finally:
        client.close()
        a.stop()
        b.stop()
        b_context.term()


def test_a_malformed_session_answer_keeps_the_client_inside_curvezmq_and_out_of_the_log(
    keys: CurveKeys, caplog: pytest.LogCaptureFixture
) -> None:
    """A server of the job's keys (a bug, another version) answers a session with a port of
    the wrong type: the client stays inside CurveZMQ, and its log names the fields' types,
    never their bytes."""
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    configure_server(server, keys)  # CurveZMQ without an authenticator: any client key
    port = server.bind_to_random_port("tcp://127.0.0.1")
    secret = os.urandom(64)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not server.poll(50):
                continue
            identity, raw, *_ = server.recv_multipart()
            header = msgpack.unpackb(raw, raw=False)
            reply = {Key.VERSION: PROTOCOL_VERSION, Key.OP: Op.OK, Key.ID: header[Key.ID]}
            if header[Key.OP] == Op.SEAL:
                fields = {"session": os.urandom(16), "keys": secret, "token": os.urandom(32)}
                reply.update(fields, port="22")
            server.send_multipart([identity, msgpack.packb(reply, use_bin_type=True)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = Client({"ps:0": f"127.0.0.1:{port}"}, _config(keys))
    try:
        with caplog.at_level("WARNING", logger="psflow.transport.client"):
            for _ in range(3):
                client.request("ps:0", {Key.OP: "echo"}, [("x", torch.ones(SEAL_FROM_BYTES))])
        assert client._peers["ps:0"].sealed is None
        logged = caplog.text
        assert "answered a session with" in logged and "str[2]" in logged
        assert secret.hex() not in logged and repr(secret)[2:40] not in logged
    finally:
        client.close()
        stop.set()
        thread.join(10)
        server.close()


def test_a_server_serves_lanes_and_its_sealed_socket_at_once(keys: CurveKeys) -> None:
    """A ps with workers on its host (shared-memory lanes) and elsewhere (its sealed socket):
    both kinds of request are served, in turn, and neither waits on the other."""
    (port,) = free_ports(1)
    echo = Echo(f"127.0.0.1:{port}", _config(keys, shared_memory=True))
    local = Client({"ps:0": f"127.0.0.1:{port}"}, _config(keys, shared_memory=True))
    remote = Client({"ps:0": f"127.0.0.1:{port}"}, _config(keys))
    try:
        _until_sealed(remote, "ps:0")
        x = torch.randn(SEAL_FROM_BYTES // 2)
        for i in range(40):
            rids = {c: c.send("ps:0", {Key.OP: "echo"}, [("x", x + i)]) for c in (local, remote)}
            for client, rid in rids.items():
                header, ((_, y),) = client.wait([rid])[rid]
                assert torch.equal(y, (x + i) * 2)
                assert header["sealed"] == (client is remote)
        assert local.lane("ps:0") is not None  # the local client's requests went by lane
        assert echo.refused == 0
    finally:
        local.close()
        remote.close()
        echo.stop()


def test_a_session_is_only_asked_for_through_the_servers_own_socket(
    pair: tuple[Echo, Client],
) -> None:
    _, client = pair
    _until_sealed(client, "ps:0")
    with pytest.raises(PeerError, match="through the server's own socket"):
        client.request("ps:0", {Key.OP: Op.SEAL})  # on the sealed socket now
    header, _ = client.request("ps:0", {Key.OP: "echo"}, [("x", torch.ones(3))])
    assert header["sealed"]
