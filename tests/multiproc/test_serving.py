"""A served model that follows training (issue 37): a 1-ps job exports a base and a delta; a
real HTTP model server (ONNX Runtime for the dense part, the exported tables for the lookups)
answers fixed requests as the model itself does in eval mode at each export, to 1e-5, applies
the delta as it lands, and answers bad requests with a 400 and a reason, serving on."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import psflow.nn as pnn
from psflow.serve.delta import list_exports
from psflow.serve.dense import export_dense
from psflow.serve.server import Feature, ModelServer, ServerConfig
from psflow.train.checkpoint_export import export_state_dict

from .support import local_cluster, quiet_session, start_ps, stop

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

VOCAB, DIM, PAD = 20, 4, 0
"""``items`` is a fixed table of VOCAB rows; ``users`` hashed, PAD its padding id."""
UNSEEN = 10**12
"""A user id never trained: zeros in eval mode and in the server."""


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2 * DIM, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(torch.cat([items, users], 1)))).squeeze(1)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = pnn.EmbeddingBag(VOCAB, DIM, mode="sum", seed=1)
        self.users = pnn.EmbeddingBag(
            None, DIM, mode="mean", padding_idx=PAD, optimizer="Adagrad", seed=2
        )
        self.head = Head()

    def forward(
        self,
        items: torch.Tensor,
        users: torch.Tensor,
        items_offsets: torch.Tensor | None = None,
        users_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.head(self.items(items, items_offsets), self.users(users, users_offsets))


FEATURES = {
    "items": Feature(table="items", mode="sum"),
    "users": Feature(table="users", mode="mean", padding_idx=PAD),
}
REQUESTS: list[dict[str, list[list[int]]]] = [
    {"items": [[3]], "users": [[5, 7]]},
    {
        "items": [[1, 2], [], [19, 0, 4], [7]],
        # held ids, one never trained, the padding id, an empty bag
        "users": [[1, 2, 3], [UNSEEN], [PAD, 6, UNSEEN], []],
    },
]


def train(sess: Any, model: Model, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    items = torch.randint(0, VOCAB, (8, 2), generator=g)
    users = torch.randint(1, 12, (8, 3), generator=g)
    sess.zero_grad()
    loss = F.mse_loss(model(items, users), torch.randn(8, generator=g))
    loss.backward()
    sess.step(loss=loss)


def flat(bags: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0] + [len(b) for b in bags[:-1]]).cumsum(0)
    return torch.tensor([i for b in bags for i in b], dtype=torch.int64), offsets


def eval_model(ckpt: Path, step: int, out: Path) -> Model:
    """The model as the job held it at ``step``: its checkpoint as a state dict, loaded into
    a model of its own, in eval mode (read independently of the exports)."""
    export_state_dict(str(ckpt), str(out), f"ckpt-{step}")
    model = Model()
    missing, unexpected = model.load_state_dict(load_file(out), strict=False)
    assert not unexpected and all(".opt." in k for k in missing), (missing, unexpected)
    return model.eval()


def want(model: Model, request: dict[str, list[list[int]]]) -> torch.Tensor:
    items, items_off = flat(request["items"])
    users, users_off = flat(request["users"])
    with torch.no_grad():
        return model(items, users, items_off, users_off)


def call(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def raw(url: str, data: bytes) -> bytes:
    """What the server sends back on a connection given ``data``, until it closes it."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def predict(url: str, request: dict[str, Any]) -> tuple[int, Any]:
    return call(url, "POST", "/predict", json.dumps({"features": request}).encode())


def check_serves(server: ModelServer, reference: Model, seq: int) -> list[torch.Tensor]:
    got = []
    for request in REQUESTS:
        # A request's connection closes on the server's side after the client has its answer;
        # with max_connections=2, the next one waits for that, not for a guess of its time.
        assert server.wait_idle(10)
        status, body = predict(server.url, request)
        assert status == 200, body
        assert body["export"] == seq
        out = torch.tensor(body["outputs"]["score"])
        torch.testing.assert_close(out, want(reference, request), rtol=0, atol=1e-5)
        got.append(out)
    return got


def test_the_server_serves_each_export_as_the_model_predicts_and_refuses_bad_requests(
    tmp_path: Path,
) -> None:
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster, 0)
    exports, ckpt, onnx = tmp_path / "exports", tmp_path / "ckpt", tmp_path / "head.onnx"
    model = Model()
    export_dense(model.head, {"items": DIM, "users": DIM}, onnx, prefix="head.",
                 output_names=["score"])  # fmt: skip
    with pytest.raises(ValueError, match=r"no input for feature\(s\) \['clicks'\]"):
        ModelServer(ServerConfig(export_dir=str(exports), onnx_path=str(onnx),
                                 features={**FEATURES, "clicks": Feature(table="users")}))  # fmt: skip
    config = ServerConfig(
        export_dir=str(exports),
        onnx_path=str(onnx),
        features=FEATURES,
        poll_seconds=0.05,
        request_timeout=1.0,
        max_body_bytes=1 << 18,
        max_connections=2,
    )
    server = ModelServer(config).start()  # before any export: it waits for the first
    try:
        assert call(server.url, "GET", "/healthz")[0] == 503
        assert server.wait_idle(10)
        status, body = predict(server.url, REQUESTS[0])
        assert status == 503 and "no export served yet" in body["error"]
        with quiet_session(
            model,
            cluster,
            str(ckpt),
            optimizer="Adagrad",
            lr=0.1,
            export_dir=str(exports),
            export_every=3600,  # exported when the test says
        ) as sess:
            for step in range(3):
                train(sess, model, step)
            first = int(Path(sess.export() or "").name.removeprefix("export-"))
            sess.save()
            at_first = eval_model(ckpt, sess.global_step, tmp_path / "first.safetensors")
            assert server.wait_for_export(first, timeout=20), server.status()
            before = check_serves(server, at_first, first)
            assert server.wait_idle(10)
            assert call(server.url, "GET", "/healthz")[0] == 200

            for bad, reason in [
                (b"{not json", "not JSON"),
                (b'{"features": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deep"),
                (b'{"feature": {}}', 'must be {"features"'),
                (json.dumps({"features": {**REQUESTS[0], "ads": [[1]]}}).encode(), "unknown"),
                (json.dumps({"features": {"items": [[1]]}}).encode(), "'users': expected"),
                (json.dumps({"features": {"items": [[1]], "users": [[1], [2]]}}).encode(),
                 "has 2 examples, the others 1"),
                (json.dumps({"features": {"items": [[1.5]], "users": [[1]]}}).encode(),
                 "1.5 is not an int64 id"),
                (json.dumps({"features": {"items": [[1]], "users": [[2**63]]}}).encode(),
                 "is not an int64 id"),
                (json.dumps({"features": {"items": [[VOCAB]], "users": [[1]]}}).encode(),
                 f"id {VOCAB} is out of range for table 'items' of {VOCAB} rows"),
                (json.dumps({"features": {"items": [], "users": []}}).encode(), "1..65536"),
            ]:  # fmt: skip
                assert server.wait_idle(10)
                status, body = call(server.url, "POST", "/predict", bad)
                assert status == 400 and reason in body["error"], (bad, body)
                assert "\n" not in body["error"]
            assert server.wait_idle(10)
            assert call(server.url, "GET", "/nowhere")[0] == 404
            head = b"POST /predict HTTP/1.1\r\nHost: t\r\n"
            assert server.wait_idle(10)
            assert raw(server.url, head + b"Content-Length: 99999999\r\n\r\n").startswith(
                b"HTTP/1.1 413"
            )
            assert server.wait_idle(10)
            assert raw(server.url, head + b"\r\n").startswith(b"HTTP/1.1 411")
            # A client that never finishes its request holds a thread for request_timeout
            # only; the server answers others meanwhile, then closes that connection.
            host, port = server.url.removeprefix("http://").split(":")
            body = json.dumps({"features": REQUESTS[0]}).encode()
            whole = b"POST /predict HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
            whole += b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            assert server.wait_idle(10)  # the connections above all closed by the server
            with socket.create_connection((host, int(port)), timeout=10) as slow:
                slow.sendall(head)
                assert raw(server.url, whole).startswith(b"HTTP/1.1 200")
                with socket.create_connection((host, int(port)), timeout=10) as slow2:
                    slow2.sendall(head)  # the second of max_connections=2
                    busy = raw(server.url, whole)
                    assert busy.startswith(b"HTTP/1.1 503") and b"max_connections" in busy
                assert slow.recv(1024) == b""  # closed by the server, within 10 s

            for step in range(3, 6):
                train(sess, model, step)
            second = int(Path(sess.export() or "").name.removeprefix("export-"))
            sess.save()
            at_second = eval_model(ckpt, sess.global_step, tmp_path / "second.safetensors")
            assert server.wait_for_export(second, timeout=20), server.status()
            after = check_serves(server, at_second, second)
        assert stop(ps)[0] == 0
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        conn.close()
    finally:
        server.stop(5)
        stop(ps, timeout=1)
    assert 'psflow_serve_requests_total{code="200"} 5' in metrics, metrics
    assert 'psflow_serve_requests_total{code="400"} 10' in metrics, metrics
    assert 'code="411"} 1' in metrics and 'code="413"} 1' in metrics and 'code="503"} 1' in metrics
    assert "psflow_serve_examples_total 11" in metrics and "psflow_serve_export " in metrics
    kinds = [(e.seq, e.kind) for e in list_exports(str(exports))]
    assert (first, "base") in kinds and (second, "delta") in kinds
    assert list(server.applied)[:2] == [first, second]
    # The delta changed what is served (rows and dense layers both trained since).
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(before, after, strict=True))
    status = server.status()
    assert status["export"] >= second and status["last_error"] is None
