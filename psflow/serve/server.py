"""A model server that follows training: ONNX Runtime for the dense part, the exported tables
for the lookups, each new export applied as it lands.

The contract between a trained model and this server:

- The job exports incrementally (``TrainingSession(export_dir=D, export_every=S)``): a base,
  then deltas (:mod:`psflow.serve.delta`).
- The user writes the model's dense part once, as ONNX, with
  :func:`~psflow.serve.dense.export_dense`: a graph whose inputs are each request feature's
  pooled rows (``[batch, dim]``, named after the feature) and the dense parameters (named as in
  the export, e.g. ``head.weight``). The file holds no weights: the server feeds it those of the
  export it serves, so a delta that changed the dense layers is served without a new file.
- The server is given each request feature's :class:`~psflow.serve.served.Feature`: the table
  its ids are of and how a bag is pooled (``sum``, ``mean``, ``max``, a padding id), as the
  model's ``psflow.nn.EmbeddingBag`` pools it. An id the export does not hold is a row of
  zeros, as in ``psflow.nn``'s eval mode.

Every ``poll_seconds`` a thread applies the exports that landed since (reading their files off
the request path), checks them against the graph's inputs, and makes them current with one
swap: a request computes with the export current when it began, so a delta is applied between
requests, never during one. An export that cannot be read or applied (out of order, another
base, shapes that do not fit) is logged and refused; the server keeps serving the last good one.

HTTP (JSON, ``Content-Length`` bodies):

- ``POST /predict`` ``{"features": {"users": [[7, 12], [3]], "items": [[1], [4, 4]]}}``: one
  bag of ids per example per feature, every feature the same number of examples; with
  ``numeric`` inputs (:attr:`ServerConfig.numeric`) also ``"numeric": {"counts": [[0.5, 3.0],
  [1.0, 0.0]]}``, a row of numbers per example. Answers
  ``{"export": n, "step": s, "outputs": {"output": [...]}}``; a bad request ``400`` with
  ``{"error": "<one line>"}``; before the first export ``503``.
- ``GET /status``: the export served, its base and step, the last exports served and how many,
  the last refusal.
- ``GET /healthz``: ``200`` once an export is served, else ``503``.
- ``GET /metrics``: Prometheus' text format (:mod:`psflow.serve.metrics`): requests by status,
  their latency, examples, the export served, exports served and refused.

:mod:`psflow.serve.httpd` answers these (a thread per connection, at most
:attr:`ServerConfig.max_connections`); :mod:`psflow.serve.request` checks a request's features
and numbers (:class:`BadRequest` says why one is refused).

Example:
    >>> # server = ModelServer(ServerConfig(export_dir="exports/ctr", onnx_path="head.onnx",
    >>> #     features={"users": Feature(table="users", mode="sum")})).start()
    >>> # server.url  -> "http://127.0.0.1:PORT"; server.stop(5.0)
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from psflow.serve.delta import ExportedModel, ExportError
from psflow.serve.httpd import HTTPServer, listen
from psflow.serve.metrics import ServerMetrics
from psflow.serve.request import BadRequest, feature_ids, numeric_feeds
from psflow.serve.served import ONNX_TYPES, Feature, Served

__all__ = ["BadRequest", "Feature", "ModelServer", "ServerConfig"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServerConfig:
    """What :class:`ModelServer` serves, and its limits."""

    export_dir: str
    """The job's export directory (local or an fsspec URL)."""
    onnx_path: str
    """The dense part (:func:`~psflow.serve.dense.export_dense`)."""
    features: Mapping[str, Feature]
    """Each request feature: its table and pooling. Each is an input of the ONNX graph."""
    numeric: Mapping[str, int] = field(default_factory=dict)
    """Request inputs that are numbers rather than ids (a CTR model's counts), by name: each a
    ``[batch, width]`` input of the ONNX graph, fed as the request gives it."""
    host: str = "127.0.0.1"
    port: int = 0
    """0: one the OS chooses (:attr:`ModelServer.url` says which)."""
    poll_seconds: float = 1.0
    """How often the export directory is read for new exports."""
    request_timeout: float = 10.0
    """Seconds a connection may take to send its request (a socket timeout)."""
    max_body_bytes: int = 64 << 20
    """A larger request is refused (413)."""
    max_batch: int = 65536
    """Examples in one request at most."""
    intra_op_threads: int = 0
    """ONNX Runtime's threads per request (0: its default, one per core)."""
    max_connections: int = 256
    """Connections served at once (a thread each); one more is answered 503 and closed."""

    def __post_init__(self) -> None:
        if not self.export_dir:
            raise ValueError("ServerConfig: export_dir is required")
        if not self.features:
            raise ValueError("ServerConfig: features must name at least one request feature")
        for name, feature in self.features.items():
            if not isinstance(feature, Feature):
                raise TypeError(f"ServerConfig: features[{name!r}] must be a Feature")
        for name, width in self.numeric.items():
            if name in self.features:
                raise ValueError(f"ServerConfig: {name!r} is both a feature and a numeric input")
            if type(width) is not int or width < 1:
                raise ValueError(f"ServerConfig: numeric[{name!r}] must be a width >= 1, "
                                 f"got {width!r}")  # fmt: skip
        for key in ("poll_seconds", "request_timeout"):
            if not getattr(self, key) > 0:
                raise ValueError(f"ServerConfig: {key} must be > 0, got {getattr(self, key)}")
        for key in ("max_body_bytes", "max_batch", "max_connections"):
            if getattr(self, key) < 1:
                raise ValueError(f"ServerConfig: {key} must be >= 1, got {getattr(self, key)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig: port must be in 0..65535, got {self.port}")


class ModelServer:
    """Serves the newest export of a job over HTTP, following the exports as they land.

    Args:
        config: what to serve.

    Raises:
        ValueError: for an ONNX file that is unreadable or lacks a feature's input.
    """

    def __init__(self, config: ServerConfig) -> None:
        import onnxruntime as ort  # only the server needs it: the ps imports psflow.serve

        self.config = config
        options = ort.SessionOptions()
        if config.intra_op_threads:
            options.intra_op_num_threads = config.intra_op_threads
        try:
            self.session = ort.InferenceSession(
                config.onnx_path, options, providers=["CPUExecutionProvider"]
            )
        except Exception as e:  # ORT raises its own exception types
            raise ValueError(f"{config.onnx_path}: not an ONNX model ORT loads: {e}") from None
        self.inputs = {i.name: (list(i.shape), str(i.type)) for i in self.session.get_inputs()}
        missing = [f for f in (*config.features, *config.numeric) if f not in self.inputs]
        if missing:
            raise ValueError(
                f"{config.onnx_path}: no input for feature(s) {missing}; its inputs are "
                f"{list(self.inputs)} (export_dense names them after the features)"
            )
        flat = [f for f in config.features if len(self.inputs[f][0]) != 2]
        if flat:
            raise ValueError(
                f"{config.onnx_path}: the input of feature(s) {flat} must be [batch, dim] (a "
                f"pooled row per example), not {[self.inputs[f][0] for f in flat]}"
            )
        for name, width in config.numeric.items():
            shape, kind = self.inputs[name]
            if len(shape) != 2 or shape[1] != width or kind not in ONNX_TYPES:
                raise ValueError(
                    f"{config.onnx_path}: the numeric input {name!r} is {shape} {kind}; "
                    f"expected [batch, {width}] of floats"
                )
        self._graph_inputs = {k: v for k, v in self.inputs.items() if k not in config.numeric}
        """What an export must feed: the features' rows and the dense parameters."""
        self._numeric_types = {name: ONNX_TYPES[self.inputs[name][1]] for name in config.numeric}
        """The dtype each numeric input is fed as."""
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._model = ExportedModel()  # the poller's alone
        self._tried: int | None = None
        """The last export the poller tried to serve."""
        self._served: Served | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.applied: deque[int] = deque(maxlen=64)
        """The exports served, in order (the last 64)."""
        self.served_total = 0
        """How many exports were served."""
        self.metrics = ServerMetrics()
        """What ``GET /metrics`` answers."""
        self.last_error: str | None = None
        """Why the last export was refused; ``None`` once one is served again."""
        self._http: HTTPServer | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ModelServer:
        """Applies what the export directory holds now, then listens and follows it.
        Returns self; :attr:`url` is where it listens."""
        self.poll()
        self._http = listen(
            self,
            (self.config.host, self.config.port),
            max_connections=self.config.max_connections,
            request_timeout=self.config.request_timeout,
            max_body_bytes=self.config.max_body_bytes,
        )
        self._threads = [
            threading.Thread(target=self._http.serve_forever, name="psflow-serve-http"),
            threading.Thread(target=self._follow, name="psflow-serve-follow"),
        ]
        for t in self._threads:
            t.daemon = True
            t.start()
        log.info("serving %s on %s", self.config.export_dir, self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops listening and following; waits at most ``timeout`` seconds for both."""
        self._stop.set()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"ModelServer.stop: {alive} still running after {timeout}s")

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://host:port`` it listens on."""
        assert self._http is not None, "start() first"
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- following the exports ---------------------------------------------------------------

    def _follow(self) -> None:
        while not self._stop.wait(self.config.poll_seconds):
            try:
                self.poll()
            except Exception as e:  # the thread lives on: the next poll may read a good one
                log.exception("reading the exports failed; serving the last one")
                with self._cond:
                    self.last_error = f"{type(e).__name__}: {e}".splitlines()[0]

    def poll(self) -> list[int]:
        """Applies the exports that landed since the one served; returns those made current.
        (The following thread calls it every ``poll_seconds``.)"""
        model, before = self._model, self._served
        error = None
        try:
            model.follow(self.config.export_dir)
        except (ExportError, OSError) as e:  # an export pruned or refused: the rest stand
            error = f"{self.config.export_dir}: {e}"
        except Exception as e:  # a check missed: refused all the same, the server serves on
            log.exception("applying an export failed")
            error = f"{self.config.export_dir}: {type(e).__name__}: {e}".splitlines()[0]
        if model.seq is not None and model.seq != self._tried:
            self._tried = model.seq
            try:
                served = Served(model, self.config.features, self._graph_inputs)
            except (ExportError, ValueError, TypeError) as e:
                # Kept applied (the next delta applies on it), not served: the last good
                # export is.
                error = str(e)
            else:
                with self._cond:
                    self._served = served
                    self.applied.append(served.seq)
                    self.served_total += 1
                    self.last_error = None
                    self._cond.notify_all()
                log.info("serving export-%d (step %d)", served.seq, served.step)
        if error is not None:
            if error != self.last_error:
                log.warning("export refused, serving the last one: %s", error)
                self.metrics.refused()
            with self._cond:
                self.last_error = error
                self._cond.notify_all()
        now = self._served
        return [] if now is None or now is before else [now.seq]

    def wait_for_export(self, seq: int, timeout: float) -> bool:
        """Waits until export ``seq`` (or a newer one) is served; whether it is."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._served is not None and self._served.seq >= seq, timeout
            )

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no connection is open; whether none is."""
        assert self._http is not None, "start() first"
        http = self._http
        with http.changed:
            return http.changed.wait_for(lambda: http.open == 0, timeout)

    @property
    def served(self) -> Served | None:
        """The export requests compute with now."""
        return self._served

    # -- predictions -------------------------------------------------------------------------

    def predict(self, features: Any, numeric: Any = None) -> tuple[Served, dict[str, np.ndarray]]:
        """The outputs for one request's ``features`` (``{"users": [[7, 12], [3]], ...}``)
        and ``numeric`` inputs (``{"counts": [[0.5, 3.0], [1.0, 0.0]]}``), with the export
        they were computed with.

        Raises:
            BadRequest: naming what is wrong with the request, or 503 before any export.
        """
        served = self._served  # one export for the whole request
        if served is None:
            raise BadRequest(f"no export served yet from {self.config.export_dir}", 503)
        ids = feature_ids(features, self.config.features, self.config.max_batch)
        feeds: dict[str, np.ndarray] = dict(served.feeds)
        batch = len(ids[next(iter(self.config.features))][1])
        feeds.update(numeric_feeds(numeric, self.config.numeric, self._numeric_types, batch))
        for name, feature in self.config.features.items():
            flat, offsets = ids[name]
            try:
                feeds[name] = served.pool(name, feature, flat, offsets)
            except ValueError as e:
                raise BadRequest(str(e)) from None
        outputs = self.session.run(self.output_names, feeds)
        return served, dict(zip(self.output_names, outputs, strict=True))

    def status(self) -> dict[str, Any]:
        """What ``GET /status`` answers."""
        served = self._served
        return {
            "export_dir": self.config.export_dir,
            "export": None if served is None else served.seq,
            "base": None if served is None else served.base,
            "step": None if served is None else served.step,
            "applied": list(self.applied),
            "served_total": self.served_total,
            "last_error": self.last_error,
        }
