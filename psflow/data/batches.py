"""What the stream readers (:mod:`psflow.data.kafka`, :mod:`psflow.data.stream`) share: a
batch of ``tf.train.Example`` records parsed with its bad records found and handed over, and the
batches of a training loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from psflow.data.features import FeatureSpec, parse_examples


def parse_batch(
    values: list[bytes], spec: Mapping[str, FeatureSpec], bad: Callable[[int, str], None]
) -> tuple[dict[str, Any] | None, int]:
    """``values`` parsed by ``spec`` in one call, and how many were; when one does not parse,
    each is parsed alone to find it (``bad(index, reason)`` is told of each, and may raise),
    then the good ones together. ``(None, 0)`` when none is good."""
    if not values:
        return None, 0
    try:
        return parse_examples(values, spec), len(values)
    except ValueError:
        good = []
        for i, value in enumerate(values):
            try:
                parse_examples([value], spec)
            except ValueError as e:
                bad(i, str(e))
                continue
            good.append(value)
        return (parse_examples(good, spec) if good else None), len(good)


def iter_batches(
    read: Callable[[], dict[str, Any] | None], idle_timeout_s: float | None
) -> Iterator[dict[str, Any]]:
    """``read()``'s batches for ever, or until none came for ``idle_timeout_s`` seconds."""
    idle_since = time.monotonic()
    while True:
        batch = read()
        if batch is not None:
            idle_since = time.monotonic()
            yield batch
        elif idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
            return


class ExampleStream:
    """A reader of ``tf.train.Example`` records that come as a stream: what its batches are
    for a training loop, given its own :meth:`read_examples`."""

    def read_examples(
        self, batch_size: int, spec: Mapping[str, FeatureSpec], timeout_s: float | None = None
    ) -> dict[str, Any] | None:
        raise NotImplementedError

    def iter_examples(
        self,
        batch_size: int,
        spec: Mapping[str, FeatureSpec],
        *,
        idle_timeout_s: float | None = None,
    ) -> Iterator[dict[str, Any]]:
        """:meth:`read_examples` batches for a training loop: for ever (a stream), or until
        no record came for ``idle_timeout_s``. After each batch is yielded, :meth:`state` is
        the position just past it.

        Example:
            >>> for batch in reader.iter_examples(512, ctr_spec()):  # doctest: +SKIP
            ...     dense, categorical, label = ctr_arrays(batch)
        """
        return iter_batches(lambda: self.read_examples(batch_size, spec), idle_timeout_s)
