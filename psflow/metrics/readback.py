"""Reading a task's metrics back (:func:`scrape`), for ``psflow top`` and the launcher's
progress line."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from psflow.metrics.names import PATH


@dataclass
class Sample:
    """The samples of one scrape: ``{name: [(labels, value), ...]}``."""

    values: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def total(self, name: str, **match: str) -> float | None:
        """The sum of ``name``'s samples whose labels include ``match``; ``None`` if none."""
        found = [
            v
            for labels, v in self.values.get(name, [])
            if all(labels.get(k) == want for k, want in match.items())
        ]
        return sum(found) if found else None

    def by(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed per value of ``label``."""
        out: dict[str, float] = {}
        for labels, v in self.values.get(name, []):
            key = labels.get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
        return out


def parse(text: str) -> Sample:
    """The samples of a Prometheus text exposition."""
    out = Sample()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.values.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def scrape(address: str, timeout: float = 2.0) -> Sample:
    """The metrics a task serves at ``address`` (``host:port``).

    Raises:
        OSError: when nothing answers there within ``timeout`` seconds.
    """
    url = f"http://{address}{PATH}"
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return parse(reply.read().decode())
