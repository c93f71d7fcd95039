"""The model server's HTTP layer: the routes :mod:`psflow.serve.server` documents, over
``http.server``, a thread per connection up to a limit.

:func:`listen` binds an :class:`HTTPServer` whose handler answers each route from its
:class:`Owner` (a :class:`~psflow.serve.server.ModelServer`): it reads a ``POST /predict`` body
(its ``Content-Length``, its size, JSON), hands the request to the owner, and answers a
:class:`~psflow.serve.request.BadRequest` with its status and ``{"error": "<one line>"}``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import numpy as np

from psflow.serve.metrics import ServerMetrics
from psflow.serve.request import BadRequest
from psflow.serve.served import Served

__all__ = ["HTTPServer", "Owner", "listen"]

log = logging.getLogger("psflow.serve.server")  # the server's own lines, by its name


class Owner(Protocol):
    """What the HTTP layer asks of the server behind it
    (:class:`~psflow.serve.server.ModelServer`)."""

    @property
    def served(self) -> Served | None: ...
    @property
    def served_total(self) -> int: ...
    @property
    def metrics(self) -> ServerMetrics: ...
    def predict(
        self, features: Any, numeric: Any = None
    ) -> tuple[Served, dict[str, np.ndarray]]: ...
    def status(self) -> dict[str, Any]: ...


def listen(
    owner: Owner,
    address: tuple[str, int],
    *,
    max_connections: int,
    request_timeout: float,
    max_body_bytes: int,
) -> HTTPServer:
    """An :class:`HTTPServer` bound to ``address`` (port 0: one the OS chooses), answering for
    ``owner`` once its ``serve_forever`` runs; the limits are
    :class:`~psflow.serve.server.ServerConfig`'s."""

    class Handler(_Handler):
        pass

    Handler.owner = owner
    Handler.timeout = request_timeout
    Handler.max_body_bytes = max_body_bytes
    return HTTPServer(address, Handler, max_connections)


class HTTPServer(ThreadingHTTPServer):
    """A thread per connection, ``max_connections`` at most: one more is answered 503 and
    closed at once, so a flood of connections cannot exhaust the host's threads."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[_Handler], limit: int) -> None:
        super().__init__(address, handler)
        self.limit = limit
        self.open = 0
        """Connections being served now."""
        self.changed = threading.Condition()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.changed:
            full = self.open >= self.limit
            self.open += not full
        if full:
            body = json.dumps({"error": f"busy: {self.limit} connections open, the most "
                               "this server takes (max_connections)"}).encode()  # fmt: skip
            try:
                request.settimeout(1.0)
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            except OSError:
                pass  # the client went away: nothing to tell it
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            with self.changed:  # before the close: a client that saw it closed finds a slot
                self.open -= 1
                self.changed.notify_all()
            self.shutdown_request(request)


def _json(body: Mapping[str, Any]) -> bytes:
    """``body`` as JSON; a NaN or infinity raises ``ValueError`` (JSON has neither)."""
    return json.dumps(body, allow_nan=False).encode()


class _Handler(BaseHTTPRequestHandler):
    owner: Owner
    max_body_bytes: int
    protocol_version = "HTTP/1.1"  # keep-alive: a client sends request after request
    # The headers and the body go out as two writes: with Nagle's algorithm the body waits
    # for the client's delayed ACK of the headers (40 ms a request).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _answer(self, status: int, body: Mapping[str, Any]) -> None:
        self._send(status, _json(body), "application/json")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/status":
            self._answer(200, self.owner.status())
        elif self.path == "/metrics":
            served = self.owner.served
            text = self.owner.metrics.text(
                None if served is None else served.seq,
                None if served is None else served.step,
                self.owner.served_total,
            )
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        elif self.path == "/healthz":
            up = self.owner.served is not None
            self._answer(200 if up else 503, {"ok": up})
        else:
            self._answer(
                404, {"error": f"no {self.path}: GET /status, /healthz, /metrics; POST /predict"}
            )

    def do_POST(self) -> None:
        if self.path != "/predict":
            self._answer(404, {"error": f"no {self.path}: POST /predict"})
            return
        start = time.perf_counter()
        try:
            body = self._body()
            served, outputs = self.owner.predict(body.get("features"), body.get("numeric"))
        except BadRequest as e:
            if e.status == 413:
                self.close_connection = True  # its body was not read
            self._answer(e.status, {"error": str(e)})
            self.owner.metrics.request(e.status, time.perf_counter() - start)
            return
        except Exception as e:  # the server keeps serving; the client learns what failed
            log.exception("predict failed")
            self._answer(500, {"error": f"{type(e).__name__}: {e}".splitlines()[0]})
            self.owner.metrics.request(500, time.perf_counter() - start)
            return
        answer = {k: v.tolist() for k, v in outputs.items()}
        try:
            data = _json({"export": served.seq, "step": served.step, "outputs": answer})
        except ValueError:  # NaN or infinity: JSON has neither, and no number is right
            bad = [k for k, v in outputs.items() if not np.isfinite(v).all()]
            log.error("export-%d computed non-finite outputs %s: answered 500", served.seq, bad)
            self._answer(500, {"error": f"export-{served.seq} computed a non-finite value "
                               f"(NaN or infinity) in output(s) {bad}: refused"})  # fmt: skip
            self.owner.metrics.request(500, time.perf_counter() - start)
            return
        self._send(200, data, "application/json")
        examples = len(next(iter(answer.values()), []))
        self.owner.metrics.request(200, time.perf_counter() - start, examples)

    def _body(self) -> dict[str, Any]:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise BadRequest("a request needs a Content-Length", 411)
        size = int(length)
        if size > self.max_body_bytes:
            raise BadRequest(f"request of {size} bytes; at most "
                             f"{self.max_body_bytes}", 413)  # fmt: skip
        raw = self.rfile.read(size)
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"the body is not JSON: {e}") from None
        except RecursionError:
            raise BadRequest("the body is JSON nested too deep") from None
        if not isinstance(body, dict) or "features" not in body:
            raise BadRequest('the body must be {"features": {name: [[id, ...], ...]}}')
        return body
