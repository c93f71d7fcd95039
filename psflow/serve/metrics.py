"""The model server's metrics, in Prometheus' text format (``GET /metrics``).

Written here rather than with :mod:`psflow.metrics`: ``psflow.serve`` imports nothing else of
psflow, so that a serving host needs no training runtime.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["LATENCY_BUCKETS", "ServerMetrics"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds (seconds) of the ``psflow_serve_request_seconds`` histogram."""


class ServerMetrics:
    """Requests by status, their latency, examples, and the exports served and refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[int] = Counter()
        self._buckets = [0] * len(LATENCY_BUCKETS)
        self._seconds = 0.0
        self._count = 0
        self._examples = 0
        self.exports_refused = 0
        """Exports (or chains) that could not be served."""

    def request(self, status: int, seconds: float, examples: int = 0) -> None:
        """Counts one ``POST /predict``."""
        with self._lock:
            self._requests[status] += 1
            self._seconds += seconds
            self._count += 1
            self._examples += examples
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self._buckets[i] += 1

    def refused(self) -> None:
        with self._lock:
            self.exports_refused += 1

    def text(self, export: int | None, step: int | None, served_total: int) -> str:
        """The exposition, with the export served now."""
        with self._lock:
            lines = [
                "# TYPE psflow_serve_requests_total counter",
                *(
                    f'psflow_serve_requests_total{{code="{code}"}} {n}'
                    for code, n in sorted(self._requests.items())
                ),
                "# TYPE psflow_serve_examples_total counter",
                f"psflow_serve_examples_total {self._examples}",
                "# TYPE psflow_serve_request_seconds histogram",
                *(
                    f'psflow_serve_request_seconds_bucket{{le="{bound}"}} {n}'
                    for bound, n in zip(LATENCY_BUCKETS, self._buckets, strict=True)
                ),
                f'psflow_serve_request_seconds_bucket{{le="+Inf"}} {self._count}',
                f"psflow_serve_request_seconds_sum {self._seconds}",
                f"psflow_serve_request_seconds_count {self._count}",
                "# TYPE psflow_serve_exports_served_total counter",
                f"psflow_serve_exports_served_total {served_total}",
                "# TYPE psflow_serve_exports_refused_total counter",
                f"psflow_serve_exports_refused_total {self.exports_refused}",
            ]
        if export is not None:
            lines += [
                "# TYPE psflow_serve_export gauge",
                f"psflow_serve_export {export}",
                "# TYPE psflow_serve_export_step gauge",
                f"psflow_serve_export_step {step if step is not None else 0}",
            ]
        return "\n".join(lines) + "\n"
