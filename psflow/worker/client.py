"""The worker's view of the ps shards: init, wait, pull, push, done — all shards at once."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from psflow.cluster.spec import TaskContext
from psflow.protocol import OptimizerSpec
from psflow.transport import Client, PeerError, TransportConfig, wire
from psflow.worker.placement import Piece

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]


class ShardedClient:
    """Requests to every ps shard of a job, keyed by shard index.

    Shard 0 keeps the global step, so every step's push includes it even when it holds no
    variable of this model.
    """

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
    ) -> dict[int, tuple[dict[str, Any], Tensors]]:
        """One request per listed shard (its header, its tensors), sent at once; the replies
        (see :meth:`Client.send` for ``layouts``, :meth:`Client.wait` for ``into`` and
        ``lane_views``)."""
        rids = {}
        tensors = tensors or {}
        layouts = layouts or {}
        for shard, header in headers.items():
            header["task"] = self.me
            rids[shard] = self._client.send(
                self.shards[shard], header, tensors.get(shard, []), layouts.get(shard)
            )
        replies = self._client.wait(rids.values(), timeout, into=into, lane_views=lane_views)
        return {shard: replies[rid] for shard, rid in rids.items()}

    def status(self) -> dict[int, dict[str, Any]]:
        return {
            s: h
            for s, (h, _) in self.call(
                {s: {"op": "status"} for s in range(self.num_shards)}
            ).items()
        }

    def initialize(self, values: dict[int, Tensors], spec: OptimizerSpec, step: int = 0) -> bool:
        """Sends the initial values; returns False when the shards were already initialised."""
        headers = {
            s: {"op": "init", "optimizer": spec.to_wire(), "step": step}
            for s in range(self.num_shards)
        }
        replies = self.call(headers, values)
        already = [s for s, (h, _) in replies.items() if h.get("already")]
        if already and len(already) != self.num_shards:
            log.warning("shards %s were already initialised, the others were not", already)
        return not already

    def initialize_restored(
        self,
        values: dict[int, Tensors],
        opt_state: dict[int, dict[str, dict[str, Any]]],
        spec: OptimizerSpec,
        step: int,
        *,
        replace: bool = False,
    ) -> bool:
        """Like :meth:`initialize`, with optimizer state from a checkpoint.

        ``values[s]`` holds shard ``s``'s variables followed by its optimizer-state tensors
        (named ``<var>/opt/<key>``); ``opt_state[s]`` its non-tensor state per variable. With
        ``replace`` (the chief only), shards already initialised take these values too.
        """
        headers = {
            s: {
                "op": "init",
                "optimizer": spec.to_wire(),
                "step": step,
                "opt_state": opt_state.get(s, {}),
                "replace": replace,
            }
            for s in range(self.num_shards)
        }
        replies = self.call(headers, values)
        return not any(h.get("already") for h, _ in replies.values())

    def save(self, url_of: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Asks each shard to snapshot itself and write the file under ``url_of[shard]``."""
        replies = self.call({s: {"op": "save", "dir": url} for s, url in url_of.items()})
        return {s: h for s, (h, _) in replies.items()}

    def save_status(self, url_of: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Each shard's progress on the save into ``url_of[shard]``."""
        replies = self.call({s: {"op": "save_status", "dir": url} for s, url in url_of.items()})
        return {s: h for s, (h, _) in replies.items()}

    def wait_ready(self, timeout: float, *, initialized: bool = True) -> None:
        """Waits until every shard answers and (with ``initialized``) the chief has set it up.

        Raises:
            TimeoutError: naming the shards still unreachable or uninitialised (and the chief).
        """
        deadline = time.monotonic() + timeout
        pending = set(range(self.num_shards))
        delay = 0.01
        while True:
            try:
                headers = {s: {"op": "status"} for s in pending}
                left = max(0.1, min(self.config.timeout, deadline - time.monotonic()))
                for s, (h, _) in self.call(headers, timeout=left).items():
                    if h.get("initialized") or not initialized:
                        pending.discard(s)
            except PeerError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:g} s for the ps tasks: {e}") from e
                log.debug("waiting for the ps: %s", e)
            if not pending:
                return
            if time.monotonic() > deadline:
                names = ", ".join(self.shards[s] for s in sorted(pending))
                if not initialized:
                    raise TimeoutError(f"{names} did not answer within {timeout:g} s")
                raise TimeoutError(
                    f"{self.ctx.cluster.chief} (the chief) did not initialise {names} "
                    f"within {timeout:g} s"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def pull(
        self, into: dict[str, torch.Tensor] | None = None, *, lane_views: bool = False
    ) -> dict[int, tuple[dict[str, Any], Tensors]]:
        """Every shard's variables (large ones received straight into ``into[name]``)."""
        return self.call(
            {s: {"op": "pull"} for s in range(self.num_shards)}, into=into, lane_views=lane_views
        )

    def push(
        self,
        grads: dict[int, Tensors],
        *,
        pull: bool,
        into: dict[str, torch.Tensor] | None = None,
        lane_views: bool = False,
        layouts: dict[int, wire.Layout] | None = None,
    ) -> dict[int, tuple[dict[str, Any], Tensors]]:
        """Pushes each shard's gradients (always including shard 0) in one round trip each."""
        op = "push_pull" if pull else "push"
        headers = {s: {"op": op} for s in grads}
        headers.setdefault(0, {"op": op})
        return self.call(headers, grads, into=into, lane_views=lane_views, layouts=layouts)

    def done(self, timeout: float = 5.0) -> None:
        """Tells every shard this task has finished (best effort: a dead shard is logged)."""
        rids = {}
        for shard, name in enumerate(self.shards):
            rids[shard] = self._client.send(name, {"op": "done", "task": self.me})
        try:
            self._client.wait(rids.values(), timeout=timeout)
        except PeerError as e:
            log.warning("%s could not tell the ps it finished: %s", self.me, e)

    def close(self) -> None:
        self._client.close()


def group_by_shard(pieces: Sequence[Piece]) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = defaultdict(list)
    for p in pieces:
        out[p.shard].append(p)
    return dict(out)
