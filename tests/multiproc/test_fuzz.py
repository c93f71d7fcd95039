"""Hostile input: a live ps takes malformed messages while a worker trains, and lives.

The fuzzer is ``tests/fuzz_messages.py`` (its CLI runs the long version); here it sends
:data:`MESSAGES` of them with a fixed seed, and the ROUTER routing-id abort is reproduced
with the ids libzmq hands out when nothing seeds ``rand()``.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from psflow.cluster.spec import TaskSpec
from psflow.protocol import PROTOCOL_VERSION, Key, Op
from psflow.transport import CurveKeys, generate_keys

from ..fuzz_messages import MUST_BE_REFUSED, messages, run
from .forked import Forked
from .support import PS_MAIN, ROOT, local_cluster, stop

pytestmark = pytest.mark.timeout(180)

MESSAGES = 10_000
SEED = 20261122
RSS_GROWTH_LIMIT = 256 << 20
"""Bytes the ps's resident memory may grow by while fuzzed (it holds a 2-variable model)."""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _status(address: str, timeout: float = 10.0, keys: CurveKeys | None = None) -> dict | None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    try:
        sock.connect(f"tcp://{address}")
        sock.send(msgpack.packb({Key.VERSION: PROTOCOL_VERSION, Key.OP: Op.STATUS, Key.ID: 1}))
        if not sock.poll(int(timeout * 1000)):
            return None
        return msgpack.unpackb(sock.recv(), raw=False)  # type: ignore[no-any-return]
    finally:
        sock.close()
        ctx.term()


def _start_ps(cluster, tmp_path: Path, env: dict[str, str]) -> tuple[Forked, Path]:
    """The ps, forked from the server that imported torch, its output into ``ps.log``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "ps.log"
    e = dict(
        os.environ,
        TF_CONFIG=cluster.to_tf_config(TaskSpec(job="ps", index=0)),
        PYTHONUNBUFFERED="1",
        **env,
    )
    # A file, not a pipe: nobody need drain it while fuzzing.
    return Forked(["-c", PS_MAIN], env=e, output=log), log


def _train(tmp_path: Path, *, fuzz: bool) -> tuple[str, dict | None]:
    """The linear-regression example's chief trains against one ps, fuzzed or not; returns
    its ``W=... b=...`` line and the fuzzer's result."""
    # worker:1 is this test: the ps serves until it says 'done', after the fuzzing.
    cluster = local_cluster(1, 2)
    address = cluster.address(TaskSpec(job="ps", index=0))
    ckpt = tmp_path / "ckpt"
    ps, ps_log = _start_ps(cluster, tmp_path, {"PSFLOW_CHECKPOINT_DIR": str(ckpt)})
    chief_env = dict(os.environ, TF_CONFIG=cluster.to_tf_config(TaskSpec(job="worker", index=0)))
    chief = Forked(  # the example, forked from the server that imported torch
        [
            str(ROOT / "examples" / "linear_regression.py"),
            # Twice the example's learning rate for half its steps: the same end values.
            "--train_steps=2000",
            "--lr=0.02",
            f"--logdir={ckpt}",
            "--save_checkpoint_steps=500",
        ],
        env=chief_env,
    )
    result = None
    try:
        deadline = time.monotonic() + 60
        while True:  # the chief has initialised the ps: fuzzing cannot initialise it instead
            reply = _status(address)
            if reply is not None and reply.get(Key.INITIALIZED):
                break
            assert ps.poll() is None and chief.poll() is None, "ps or chief exited early"
            assert time.monotonic() < deadline, "the chief did not initialise the ps"
        if fuzz:
            rss = [_rss(ps.pid)]
            result = run(address, MESSAGES, SEED, on_batch=lambda _: rss.append(_rss(ps.pid)))
            result["rss_mib"] = [r >> 20 for r in rss[::10]]
            result["chief_still_training"] = chief.poll() is None
            print("FUZZ", result)
            assert ps.poll() is None, "the ps died"
            growth = max(rss) - rss[0]
            assert growth < RSS_GROWTH_LIMIT, f"ps RSS grew by {growth >> 20} MiB while fuzzed"
        # The trainers finish: the chief (its final checkpoint under the ps's own directory),
        # then this test as worker:1.
        done = {Key.VERSION: PROTOCOL_VERSION, Key.OP: Op.DONE, Key.ID: 2, Key.TASK: "worker:1"}
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(f"tcp://{address}")
        sock.send(msgpack.packb(done))
        assert sock.poll(10000), "the ps did not answer 'done'"
        sock.close()
        ctx.term()
        out, err = chief.communicate(timeout=120)
        assert chief.returncode == 0, err[-3000:]
        m = re.search(r"W=\S+ b=\S+", out)
        assert m is not None, out
        assert ps.wait(timeout=30) == 0, ps_log.read_text()[-3000:]
        assert list(ckpt.glob("ckpt-*/shard-0-of-1.safetensors")), "no checkpoint was saved"
        log = ps_log.read_text()
        assert "Traceback" not in log, log[-3000:]
        return m.group(0), result
    finally:
        for proc in (chief, ps):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        chief.stdout.close()
        chief.stderr.close()


def test_a_fuzzed_ps_serves_on_and_training_is_unchanged(tmp_path: Path) -> None:
    quiet, _ = _train(tmp_path / "quiet", fuzz=False)
    fuzzed, result = _train(tmp_path / "fuzzed", fuzz=True)
    assert result is not None
    assert sum(result["sent"].values()) == MESSAGES
    assert result["alive_checks"] == -(-MESSAGES // 200)
    assert result["errors"] > MESSAGES // 2, result
    assert not any(result["accepted"].get(kind) for kind in MUST_BE_REFUSED), result
    # One worker pushes, so the values are the same, step by step, with or without the fuzz.
    assert fuzzed == quiet
    w, b = (float(v.split("=")[1]) for v in fuzzed.split())
    assert abs(w - 2.0) < 0.05 and abs(b - 0.3) < 0.05, fuzzed
    assert not Path("/tmp/psflow-fuzz-elsewhere").exists()


def test_with_keys_no_fuzz_message_reaches_the_ps(tmp_path: Path) -> None:
    keys_dir = generate_keys(tmp_path / "keys")
    cluster = local_cluster(1, 1)
    address = cluster.address(TaskSpec(job="ps", index=0))
    ps, ps_log = _start_ps(cluster, tmp_path, {"PSFLOW_KEYS_DIR": str(keys_dir)})
    keys = CurveKeys.load(keys_dir)
    try:
        deadline = time.monotonic() + 60
        while _status(address, timeout=1, keys=keys) is None:
            assert ps.poll() is None and time.monotonic() < deadline, ps_log.read_text()
        result = run(address, 1000, SEED, batch=250, alive_timeout=0.5, expect_answers=False)
        assert result["errors"] == 0 and result["alive_checks"] == 0, result
        assert not result["accepted"], result
        # Below ZeroMQ: the fuzz bytes straight into the port, in place of a handshake.
        host, port = address.rsplit(":", 1)
        for _, _, frames in messages(SEED, 200):
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(b"".join(frames)[:65536])
        assert _status(address, keys=keys) is not None and ps.poll() is None
        assert "rejected" not in ps_log.read_text()
    finally:
        ps.kill()
        ps.wait()


_ROUTER_SCRIPT = """
import sys
from psflow.transport import Server, TransportConfig
server = Server(sys.argv[1], TransportConfig(timeout=5, shared_memory=False))
print("ready", flush=True)
while True:
    try:
        request = server.recv(0.5)
    except ValueError:
        continue
    if request is not None:
        server.reply(request, {"op": "ok"})
"""

UNSEEDED_FIRST_ID = 0x6B8B4567
"""glibc's first ``rand()`` without ``srand``: where libzmq's ROUTER ids start unless seeded."""


def test_claiming_the_next_router_ids_does_not_abort_the_server() -> None:
    cluster = local_cluster(1, 1)
    address = cluster.address(TaskSpec(job="ps", index=0))
    server = subprocess.Popen(
        [sys.executable, "-c", _ROUTER_SCRIPT, address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context()
    socks = []
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        hello = msgpack.packb({Key.VERSION: PROTOCOL_VERSION, Key.OP: Op.STATUS, Key.ID: 1})

        def ask(routing_id: bytes | None) -> bool:
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if routing_id is not None:
                sock.routing_id = routing_id
            sock.connect(f"tcp://{address}")
            socks.append(sock)
            sock.send(hello)
            return bool(sock.poll(5000))

        # Claim the ids an unseeded ROUTER hands out next, then connect without one.
        for k in range(16):
            ask(b"\x00" + struct.pack(">I", UNSEEDED_FIRST_ID + k))
        for _ in range(4):
            if not ask(None):
                code, err = stop(server, timeout=1)
                raise AssertionError(f"the server stopped answering (exit {code}): {err[-500:]}")
        assert server.poll() is None, stop(server, timeout=1)[1][-2000:]
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
        server.kill()
        server.wait()
