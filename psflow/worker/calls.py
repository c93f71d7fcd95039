"""Requests to every ps shard at once: sent together, their replies awaited together.

:class:`ShardCalls` holds the job's connection to the ps shards (one socket, and lane, per
shard) and makes the round trips: :meth:`~ShardCalls.call` sends one request per listed shard
and waits for every reply, turning a refusal that means the ps lost its state
(:data:`LOST_CODES`) into :class:`~psflow.transport.PeerLostError`.
:class:`~psflow.worker.client.ShardedClient` builds every request of the ps protocol on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from psflow import metrics
from psflow.cluster.spec import TaskContext
from psflow.protocol import Code, Key, Op
from psflow.transport import Client, PeerError, PeerLostError, TransportConfig, wire

Tensors = list[tuple[str, torch.Tensor]]
Replies = dict[int, tuple[dict[str, Any], Tensors]]
"""Each shard's reply: its header and its tensors."""

LOST_CODES = frozenset({Code.UNINITIALIZED, Code.RESTORED})
"""Refusals that mean the ps lost the state the request was made against (it restarted empty,
or was restored from a checkpoint since): raised as :class:`PeerLostError`, which a
:class:`~psflow.train.TrainingSession` recovers from."""


class _Pending(NamedTuple):
    """Requests sent whose replies are left in flight (:meth:`ShardCalls.defer`)."""

    rids: dict[int, int]
    finish: Callable[[Replies], object]
    tensors: dict[int, Tensors]
    start: float
    wait: dict[str, Any]


class ShardCalls:
    """Round trips to every ps shard of a job, keyed by shard index."""

    def __init__(self, ctx: TaskContext, config: TransportConfig) -> None:
        self.ctx = ctx
        self.config = config
        self.me = str(ctx.task)
        self.shards = [f"ps:{i}" for i in range(ctx.cluster.num_tasks("ps"))]
        if not self.shards:
            raise ValueError("the cluster has no ps task to hold the variables")
        self._client = Client(
            {
                name: addr
                for name, addr in zip(self.shards, ctx.cluster.addresses("ps"), strict=True)
            },
            config,
        )
        self.metrics = metrics.for_task(self.me, ctx.host).worker(len(self.shards))
        self._held: dict[int, list[Callable[[], None]]] = {}
        self._pending: _Pending | None = None

    def hold(self, shard: int, move_out: Callable[[], None]) -> None:
        """Says that views of ``shard``'s lane (a reply's rows, taken with
        ``request_views``) are kept beyond this request: ``move_out`` is called before the
        next request to ``shard``, which overwrites them, to copy what is still needed."""
        self._held.setdefault(shard, []).append(move_out)

    def defer(
        self,
        rids: dict[int, int],
        finish: Callable[[Replies], object],
        tensors: dict[int, Tensors],
        start: float,
        **wait: Any,
    ) -> None:
        """Leaves the replies to the requests :meth:`send` just made (``rids``, with
        ``tensors``, at ``start``: ``time.perf_counter()``) in flight: the next request of any
        kind, or :meth:`settle`, takes them first (:meth:`wait` with ``wait``'s keywords),
        counts the round trip as :meth:`call` does and hands them to ``finish``. One at a
        time."""
        assert self._pending is None, "a deferred reply is settled before the next request"
        self._pending = _Pending(rids, finish, tensors, start, wait)

    def settle(self) -> None:
        """Takes the replies :meth:`defer` left in flight, if any, and hands them on (a
        refusal or a dead shard raised here, as :meth:`call` raises it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            replies = self.wait(pending.rids, **pending.wait)
            self._observe(pending.start, replies, pending.tensors)
            pending.finish(replies)

    @property
    def transport(self) -> Client:
        """The connection underneath, one socket (and lane) per shard."""
        return self._client

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def call(
        self,
        headers: dict[int, dict[str, Any]],
        tensors: dict[int, Tensors] | None = None,
        *,
        timeout: float | None = None,
        into: dict[str, torch.Tensor] | None = None,
        lane_views: bool = False,
        layouts: dict[int, wire.Layout] | None = None,
        into_of: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        request_views: bool = False,
    ) -> Replies:
        """One request per listed shard (its header, its tensors), sent at once; the replies
        (see :meth:`Client.send` for ``layouts``, :meth:`Client.wait` for ``into``,
        ``lane_views`` and ``request_views``; ``into_of[shard]`` is ``into`` for that shard's
        reply).

        Raises:
            PeerLostError: when a shard lost the state the request was made against
                (:data:`LOST_CODES`), or is gone.
            PeerError: when a shard refused the request or did not answer.
        """
        self.settle()  # a reply in flight is not this call's round trip
        start = time.perf_counter()
        rids = self.send(headers, tensors, layouts=layouts)
        replies = self.wait(
            rids,
            timeout,
            into=into,
            lane_views=lane_views,
            into_of=into_of,
            request_views=request_views,
        )
        self._observe(start, replies, tensors)
        return replies

    def _observe(self, start: float, replies: Replies, tensors: dict[int, Tensors] | None) -> None:
        """Counts a round trip that began at ``start`` (its requests' ``tensors``)."""
        m = self.metrics
        if not m.on:
            return
        # Each shard's round trip ends when the last of the call's replies is in: the shards
        # answer in parallel, and a worker waits for them all.
        seconds = time.perf_counter() - start
        for shard, (_, got) in replies.items():
            m.request_seconds[shard].observe(seconds)
            m.received[shard].inc(sum(t.nbytes for _, t in got))
        if tensors:
            for shard, sent in tensors.items():
                m.sent[shard].inc(sum(t.nbytes for _, t in sent))

    def send(
        self,
        headers: dict[int, dict[str, Any]],
        tensors: dict[int, Tensors] | None = None,
        *,
        layouts: dict[int, wire.Layout] | None = None,
        block: float | None = None,
    ) -> dict[int, int]:
        """The first half of :meth:`call`: sends the requests; returns their ids by shard
        (``block``: see :meth:`Client.send`). A reply left in flight (:meth:`defer`) is
        taken first: a shard answers its requests in order, and a lane holds one."""
        if self._pending is not None:
            self.settle()
        rids = {}
        tensors = tensors or {}
        layouts = layouts or {}
        if self._held:
            for shard in headers:
                for move_out in self._held.pop(shard, ()):
                    move_out()
        for shard, header in headers.items():
            header[Key.TASK] = self.me
            rids[shard] = self._client.send(
                self.shards[shard],
                header,
                tensors.get(shard, []),
                layouts.get(shard),
                block=block,
            )
        return rids

    def wait(
        self,
        rids: dict[int, int],
        timeout: float | None = None,
        *,
        into: dict[str, torch.Tensor] | None = None,
        lane_views: bool = False,
        into_of: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        request_views: bool = False,
    ) -> Replies:
        """The second half of :meth:`call`: the replies to the requests :meth:`send` made."""
        by_rid = None if into_of is None else {rids[s]: t for s, t in into_of.items() if s in rids}
        try:
            replies = self._client.wait(
                rids.values(),
                timeout,
                into=into,
                lane_views=lane_views,
                into_of=by_rid,
                request_views=request_views,
            )
        except PeerError as e:
            if e.code in LOST_CODES:
                raise PeerLostError(e.peer, e.detail, code=e.code) from None
            raise
        return {shard: replies[rid] for shard, rid in rids.items()}

    def _headers(self, op: Op, shards: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        return {s: {Key.OP: op} for s in (range(self.num_shards) if shards is None else shards)}
