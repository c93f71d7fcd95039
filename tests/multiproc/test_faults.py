"""Bad input and dead peers: the ps keeps serving, nobody waits forever, nothing is orphaned."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

import psflow
from psflow.env import threads_per_task
from psflow.protocol import PROTOCOL_VERSION, Key, Op
from psflow.transport import (
    Client,
    CurveKeys,
    PeerLostError,
    PeerTimeoutError,
    TransportConfig,
)
from psflow.worker.client import ShardedClient

from .support import (
    CLI_MAIN,
    ROOT,
    freeze,
    in_area,
    lanes,
    launch_cmd,
    local_cluster,
    run_forked,
    start_ps,
    stop,
    worker_ctx,
)


def ask(sock: zmq.Socket[bytes], frames: list[bytes]) -> dict[str, object]:
    sock.send_multipart(frames)
    assert sock.poll(5000), "the ps did not answer a malformed message"
    return msgpack.unpackb(sock.recv_multipart()[0])  # type: ignore[no-any-return]


def hdr(op: str, rid: int, **fields: object) -> bytes:
    """A header as it goes on the wire (``fields`` with their wire names: ``t``, ``b``...)."""
    return msgpack.packb({Key.VERSION: PROTOCOL_VERSION, Key.OP: op, Key.ID: rid, **fields})


def test_garbage_messages_get_errors_and_the_ps_keeps_serving() -> None:
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    try:
        model = torch.nn.Linear(2, 1, bias=False)
        with psflow.DistributedOptimizer(model, worker_ctx(cluster), lr=1.0) as opt:
            before = model.weight.detach().clone()
            sock.connect(f"tcp://{cluster.addresses('ps')[0]}")
            f32 = [["weight", "float32", [1, 2]]]
            cases = [
                ([b"\xc1\xc1\xc1"], "not valid msgpack"),
                ([msgpack.packb(42)], "must be a map"),
                ([hdr("steal", 1)], "unknown op 'steal'"),
                (
                    [hdr("push", 2, t=[["nope", "float32", [1, 2]]], b=b"\x00" * 8)],
                    "unknown variable 'nope'",
                ),
                (
                    [hdr("push", 3, t=[["weight", "float32", [2, 1]]], b=b"\x00" * 8)],
                    "does not match the stored",
                ),
                (
                    [hdr("push", 4, t=[["weight", "float64", [1, 2]]], b=b"\x00" * 16)],
                    "dtype float64",
                ),
                ([hdr("push", 5, t=f32, c=4096), b"\x00" * 4], "needs 8 bytes"),  # truncated
                ([hdr("push", 6, t=f32, c=4096)], "expected 1 data frame"),  # frames missing
                ([hdr("push", 7, t=[["weight", "float32", [1 << 40]]], c=4096), b""], "over the"),
                ([hdr("push", 8, t=[["weight", "cfloat", [1, 2]]], b=b"")], "unknown dtype"),
                ([hdr("pull", 9, names="weight")], "must be a list"),
                (
                    [hdr("init", 10, optimizer={"name": "os.system"})],
                    "only the chief (worker:0) may ask for 'init'",
                ),
                (
                    [hdr("init", 14, task="worker:0", optimizer={"name": "os.system"})],
                    "already",
                ),  # no error: ignored
                ([hdr("done", 11, task="worker:7")], "not a worker"),
                (
                    [hdr("_lane", 12, name="../../etc/passwd", token=b"0" * 16, req=8, rep=8)],
                    "not a lane name",
                ),
                ([hdr("push", 13, t=f32, s=1)], "no lane is attached"),
            ]
            for frames, expected in cases:
                reply = ask(sock, frames)
                text = str(reply.get("error", reply))
                assert expected in text, (frames[0][:40], reply)
            assert torch.equal(model.weight, before)
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            assert opt.step() == 1  # still serving, and no garbage was applied
            assert torch.equal(model.weight, before - 1.0)
        code, err = stop(ps)
        assert code == 0, err
        assert "unknown op 'steal'" in err and "rejected a malformed message" in err
    finally:
        sock.close()
        ctx.term()
        stop(ps, timeout=1)


def test_unauthorised_clients_can_neither_read_nor_write(tmp_path: Path) -> None:
    keys_dir, other_dir = tmp_path / "keys", tmp_path / "other"
    for d in (keys_dir, other_dir):
        # `psflow keys generate`, forked from the server that imported torch (:mod:`.forked`).
        out = run_forked(["-c", CLI_MAIN, "keys", "generate", str(d)], timeout=30)
        assert out.returncode == 0, out.stderr
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, env={"PSFLOW_KEYS_DIR": str(keys_dir)})
    keys = CurveKeys.load(keys_dir)
    try:
        model = torch.nn.Linear(2, 1, bias=False)
        good = TransportConfig(keys=keys, timeout=10)
        with psflow.DistributedOptimizer(model, worker_ctx(cluster), lr=1.0, transport=good):
            value = model.weight.detach().clone()
            other = CurveKeys.load(other_dir)
            intruder_keys = CurveKeys(
                server_public=keys.server_public,
                server_secret=None,
                client_public=other.client_public,
                client_secret=other.client_secret,
                authorized_dir=None,
            )
            peers = {"ps:0": cluster.addresses("ps")[0]}
            for config in (
                TransportConfig(keys=intruder_keys, timeout=1.5),
                TransportConfig(timeout=1.5),
            ):
                intruder = Client(peers, config)
                try:
                    with pytest.raises(PeerTimeoutError, match="ps:0"):
                        intruder.request("ps:0", {"op": "pull"})
                    with pytest.raises(PeerTimeoutError):
                        intruder.request(
                            "ps:0", {"op": "push"}, [("weight", torch.full((1, 2), 100.0))]
                        )
                finally:
                    intruder.close()
            trusted = Client(peers, good)
            try:
                _, tensors = trusted.request("ps:0", {"op": "pull"})
            finally:
                trusted.close()
            assert torch.equal(dict(tensors)["weight"], value)  # nothing was written
        code, err = stop(ps)
        assert code == 0, err
    finally:
        stop(ps, timeout=1)


def test_ps_with_no_workers_gives_up_and_names_them() -> None:
    cluster = local_cluster(1, 2)
    start = time.monotonic()
    ps = start_ps(cluster, env={"PSFLOW_PS_IDLE_TIMEOUT": "1"})
    code, err = stop(ps, timeout=20)
    assert code != 0
    assert "still waiting for worker:0, worker:1 to finish" in err
    assert time.monotonic() - start < 15


def test_a_hung_ps_is_named_in_the_workers_error() -> None:
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    try:
        model = torch.nn.Linear(2, 1)
        config = TransportConfig(timeout=20.0)  # a loaded machine may start the ps slowly
        opt = psflow.DistributedOptimizer(model, worker_ctx(cluster), transport=config)
        config.timeout = 1.0
        freeze(ps.pid)
        model(torch.ones(1, 2)).sum().backward()
        address = cluster.addresses("ps")[0]
        with pytest.raises(PeerTimeoutError, match=f"ps:0 at {address}: no answer within 1 s"):
            opt.step()
        os.kill(ps.pid, signal.SIGCONT)
        opt.close()
    finally:
        os.kill(ps.pid, signal.SIGCONT)
        stop(ps, timeout=5)


def test_a_dead_ps_is_named_at_once_through_its_lane() -> None:
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    try:
        model = torch.nn.Linear(256, 512)  # 512 KB: through a shared-memory lane
        config = TransportConfig(timeout=30.0)
        opt = psflow.DistributedOptimizer(model, worker_ctx(cluster), lr=0.1, transport=config)
        for _ in range(2):
            model(torch.ones(1, 256)).sum().backward()
            opt.step()
        assert "ps:0" in lanes(opt)
        ps.kill()
        ps.wait(10)
        start = time.monotonic()
        with pytest.raises(
            PeerLostError, match=r"ps:0 at 127\.0\.0\.1:\d+: the other side hung up"
        ):
            opt.step()
        assert time.monotonic() - start < 5  # not the 30 s timeout
        opt.close(finished=False)
    finally:
        stop(ps, timeout=5)


def test_a_hung_ps_is_named_by_its_silent_link_through_its_lane() -> None:
    """A ps stopped (SIGSTOP) with a push in flight through its shared-memory lane: the lane
    is never rung nor hung up, but the socket beside it goes silent, and the push fails after
    ``link_timeout``, not at its 60 s. The lane is given up (the ps may still write into it);
    once the ps resumes, the next step goes through."""
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    try:
        model = torch.nn.Linear(256, 512)  # 512 KB: through a shared-memory lane
        config = TransportConfig(timeout=60.0, link_timeout=1.0)
        opt = psflow.DistributedOptimizer(model, worker_ctx(cluster), lr=0.1, transport=config)
        for _ in range(2):
            model(torch.ones(1, 256)).sum().backward()
            opt.step()
        lane = lanes(opt)["ps:0"]
        freeze(ps.pid)
        model(torch.ones(1, 256)).sum().backward()
        start = time.monotonic()
        with pytest.raises(PeerLostError, match=r"ps:0 at .*PSFLOW_LINK_TIMEOUT=1 s is closed"):
            opt.step()
        assert time.monotonic() - start < 30  # not the 60 s timeout
        assert lanes(opt).get("ps:0") is not lane  # given up
        os.kill(ps.pid, signal.SIGCONT)
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
        opt.close()
    finally:
        os.kill(ps.pid, signal.SIGCONT)
        stop(ps, timeout=5)


def _status(client: Client) -> dict[str, Any]:
    """ps:0's answer to a status request."""
    ((header, _),) = client.wait([client.send("ps:0", {Key.OP: Op.STATUS})]).values()
    return header


def _lost_at_once(client: Client, rid: int, match: str) -> None:
    """The wait for ``rid`` fails with :class:`PeerLostError` matching ``match``, well before
    the client's timeout (60 s)."""
    start = time.monotonic()
    with pytest.raises(PeerLostError, match=match):
        client.wait([rid])
    assert time.monotonic() - start < 30


def test_a_dead_ps_is_named_at_once_through_the_socket() -> None:
    """A request by socket to a ps that exits (killed while it had the request) fails as soon
    as its connection closes, not at the transport's timeout: what a worker on another host
    sees when a ps dies, and what starts its recovery."""
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    address = cluster.addresses("ps")[0]
    client = Client({"ps:0": address}, TransportConfig(timeout=60.0, shared_memory=False))
    try:
        _status(client)  # it is up: answered once
        freeze(ps.pid)
        rid = client.send("ps:0", {Key.OP: Op.STATUS})  # in flight: the ps is stopped
        ps.kill()
        ps.wait(10)
        _lost_at_once(client, rid, rf"ps:0 at {address}: its connection closed with a request")
    finally:
        client.close()
        stop(ps, timeout=5)


def test_a_hung_ps_is_named_by_its_silent_link_before_the_request_timeout() -> None:
    """A ps stopped (SIGSTOP) with a request in flight by socket: its I/O thread no longer
    answers ZeroMQ's heartbeats, the connection is closed after ``link_timeout``, and the
    request fails then, not at its 60 s; once the ps resumes, the next request is answered."""
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    address = cluster.addresses("ps")[0]
    config = TransportConfig(timeout=60.0, link_timeout=1.0, shared_memory=False)
    client = Client({"ps:0": address}, config)
    try:
        _status(client)
        freeze(ps.pid)
        rid = client.send("ps:0", {Key.OP: Op.STATUS})
        _lost_at_once(client, rid, r"PSFLOW_LINK_TIMEOUT=1 s is closed")
        os.kill(ps.pid, signal.SIGCONT)
        assert _status(client)[Key.SHARD] == 0
    finally:
        os.kill(ps.pid, signal.SIGCONT)
        client.close()
        ps.kill()  # it would serve on: no worker said done
        stop(ps, timeout=5)


class _Relay:
    """A TCP relay from a port of its own to ``target`` whose connections a test can cut with
    a reset, as a NAT or a load balancer between two hosts may: the ps stays up."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = target
        self.sent = 0
        """Bytes relayed towards the target."""
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                far = socket.create_connection(self.target)
            except OSError:  # the ps not listening yet: the client connects again
                near.close()
                continue
            with self._lock:
                self._pairs.append((near, far))
            for a, b, outward in ((near, far, True), (far, near, False)):
                threading.Thread(target=self._pump, args=(a, b, outward), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, outward: bool) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
                if outward:
                    self.sent += len(data)

    def cut(self) -> None:
        """Resets every connection relayed so far (both sides); new ones are relayed again."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    # Before the close: it wakes the pump blocked in recv (a close alone would
                    # wait for it, and the peers would see nothing).
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_cut_connection_fails_its_request_at_once_and_the_next_goes_through() -> None:
    """A connection reset between the hosts, the ps alive: the request in flight on it fails
    at once (its reply cannot come back on another connection), and the next request, on the
    connection ZeroMQ makes again, is answered."""
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    host, port = cluster.addresses("ps")[0].rsplit(":", 1)
    relay = _Relay((host, int(port)))
    client = Client({"ps:0": relay.address}, TransportConfig(timeout=60.0, shared_memory=False))
    try:
        _status(client)
        freeze(ps.pid)  # it holds the next request: no reply before the cut
        before = relay.sent
        rid = client.send("ps:0", {Key.OP: Op.STATUS})
        deadline = time.monotonic() + 20
        while relay.sent == before:  # on the connection about to be cut
            assert time.monotonic() < deadline, "the request never left"
            time.sleep(0.001)
        relay.cut()
        _lost_at_once(client, rid, "its connection closed with a request in flight")
        os.kill(ps.pid, signal.SIGCONT)
        assert _status(client)[Key.SHARD] == 0
    finally:
        os.kill(ps.pid, signal.SIGCONT)
        client.close()
        relay.close()
        ps.kill()  # it would serve on: no worker said done
        stop(ps, timeout=5)


def test_a_lane_whose_request_timed_out_is_never_used_again() -> None:
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 512)  # 512 KB: through a shared-memory lane
        x = torch.randn(8, 256)
        config = TransportConfig(timeout=20.0)
        with psflow.DistributedOptimizer(
            model, worker_ctx(cluster), lr=0.1, transport=config
        ) as opt:
            model(x).square().mean().backward()
            assert opt.step() == 1
            first = lanes(opt)["ps:0"]
            assert in_area(model.weight, first.reply)  # pulls land in the model in place
            config.timeout = 1.0
            freeze(ps.pid)
            with pytest.raises(PeerTimeoutError, match="ps:0"):
                opt.step()
            # The ps may still read that request and write its reply there when it wakes:
            # the weights moved out of the lane.
            assert "ps:0" not in lanes(opt)
            assert not in_area(model.weight, first.reply)
            before, area = model.weight.detach().clone(), first.reply.copy()
            os.kill(ps.pid, signal.SIGCONT)
            # A client of its own, through the socket: a new lane from the worker would replace
            # the old one before the ps has read the late request from it.
            probe = ShardedClient(
                worker_ctx(cluster), TransportConfig(timeout=10.0, shared_memory=False)
            )
            deadline = time.monotonic() + 20
            while probe.status()[0]["step"] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # until the ps has applied the late push and answered it
            probe.close()
            assert torch.equal(model.weight, before)
            assert (first.reply != area).any()  # the late reply was written: not into the model
            config.timeout = 20.0
            opt.zero_grad()
            model(x).square().mean().backward()
            assert opt.step() == 3  # the late push was applied when the ps woke, then this one
            assert lanes(opt)["ps:0"] is not first
            values = model.weight.detach().clone()
            opt.pull()
            assert torch.equal(model.weight, values) and torch.isfinite(values).all()
        code, err = stop(ps)
        assert code == 0, err
    finally:
        if ps.poll() is None:
            os.kill(ps.pid, signal.SIGCONT)
        stop(ps, timeout=5)


def _pids(d: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in d.glob("*.pid") if p.read_text()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead; its parent (the launcher) may not have reaped it yet.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(") ")[1][0] != "Z"


def launch(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        launch_cmd(ROOT / "tests" / "multiproc" / "scripts" / "sleeper.py", str(tmp_path)),
        env={
            **{
                k: v
                for k, v in os.environ.items()
                if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")
            },
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_launcher_names_the_failed_task_and_stops_the_others(tmp_path: Path) -> None:
    proc = launch(tmp_path, FAIL_WORKER1="1")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "task worker:1 failed with exit code 3; stopping the other tasks" in err
    assert "[worker:0] started worker:0" in out and "[ps:0] started ps:0" in out
    # The launcher's defaults: OpenMP's threads wait passively, and the cores are shared out
    # over the 3 tasks (as torchrun does).
    threads = threads_per_task(3)
    assert f"[worker:0] started worker:0 OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS={threads}" in out
    pids = _pids(tmp_path)
    assert sorted(pids) == ["ps:0", "worker:0", "worker:1"]
    assert not any(_alive(p) for p in pids.values())


def test_ctrl_c_stops_every_task(tmp_path: Path) -> None:
    proc = launch(tmp_path, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="7")
    deadline = time.monotonic() + 30
    while len(_pids(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_pids(tmp_path)) == 3
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    # The user's settings win.
    assert "[ps:0] started ps:0 OMP_WAIT_POLICY=ACTIVE OMP_NUM_THREADS=7" in out
    assert proc.returncode == 130
    assert "received SIGINT; stopping every task" in err
    assert not any(_alive(p) for p in _pids(tmp_path).values())
