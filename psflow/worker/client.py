"""The worker's view of the ps shards: every request a worker makes, to all shards at once.

This is the one place on the worker side that speaks the ps protocol (:mod:`psflow.protocol`):
the engines and the session call these methods and never build a header themselves. The round
trips underneath (one request per shard, sent at once, replies awaited together) are
:class:`~psflow.worker.calls.ShardCalls`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from psflow import env as envvars
from psflow.protocol import Key, Op, OptimizerSpec, ScheduleSpec
from psflow.protocol.messages import InputMark
from psflow.transport import PeerError, PeerTimeoutError, wire
from psflow.worker.calls import Replies, ShardCalls, Tensors
from psflow.worker.placement import Piece

# Replies and Tensors are imported from here too (the engines, the tables, psflow.train).
__all__ = ["InputStanding", "Replies", "ShardedClient", "Tensors", "group_by_shard"]

log = logging.getLogger(__name__)


_ASK_AGAIN_S = 1.0
"""The longest :meth:`ShardedClient.wait_ready` waits for one status request's answer before it
asks again (a ps that came back answers within milliseconds; a lost request no longer waits
out ``PSFLOW_TIMEOUT``)."""


class InputStanding(NamedTuple):
    """Where a task's input stands on one shard (:meth:`ShardedClient.input_positions`)."""

    epoch: int
    """The shard's epoch: a push's mark made against another is refused."""
    mark: InputMark | None
    """The number and reader position of the last input of the task the shard applied."""


class ShardedClient(ShardCalls):
    """Requests to every ps shard of a job, keyed by shard index.

    Shard 0 keeps the global step, so every step's push includes it even when it holds no
    variable of this model.
    """

    # -- state ------------------------------------------------------------------------------

    def status(self, shards: Sequence[int] | None = None) -> dict[int, dict[str, Any]]:
        """Each shard's state: whether initialised, its step, who has finished."""
        return {s: h for s, (h, _) in self.call(self._headers(Op.STATUS, shards)).items()}

    def input_positions(self) -> dict[int, InputStanding]:
        """Where this task's input stands on each shard: the number and reader position of
        the last push of it the shard applied, and the shard's epoch they belong to."""
        out: dict[int, InputStanding] = {}
        for s, h in self.status().items():
            mark = h.get(Key.INPUT_POSITION)
            # The ps checked both when it recorded them.
            out[s] = InputStanding(
                epoch=int(h[Key.INPUT_EPOCH]),
                mark=None if mark is None else (tuple(int(n) for n in mark[0]), dict(mark[1])),
            )
        return out

    def initialize(
        self,
        values: dict[int, Tensors],
        spec: OptimizerSpec,
        step: int = 0,
        *,
        schedule: ScheduleSpec | None = None,
        tables: list[dict[str, Any]] | None = None,
        initial_rows: list[str] | None = None,
        opt_state: Mapping[int, dict[str, dict[str, Any]]] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Sends the initial values, the optimizer, the learning-rate schedule and the
        embedding tables' specs (each shard creates its rows); returns False when the shards
        were already initialised. ``initial_rows``: the tables whose first rows ``values``
        carries (each shard's part, :func:`~psflow.protocol.messages.initial_rows_tensor_name`)
        instead of the seeded ones. ``opt_state``: per shard, the variables whose optimizer
        state ``values`` carries too
        (:func:`~psflow.protocol.messages.optimizer_state_tensor_name`), each with its
        non-tensor state. ``timeout``: for the replies (default: the transport's)."""
        headers = self._headers(Op.INIT)
        for s, h in headers.items():
            if opt_state and s in opt_state:
                h[Key.OPT_STATE] = opt_state[s]
            h.update({Key.OPTIMIZER: spec.to_wire(), Key.STEP: step})
            if schedule is not None:
                h[Key.LR_SCHEDULE] = schedule.to_wire()
            if tables:
                h[Key.TABLES] = tables
            if initial_rows:
                h[Key.ROWS] = initial_rows
        replies = self.call(headers, values, timeout=timeout)
        already = [s for s, (h, _) in replies.items() if h.get(Key.ALREADY)]
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
        schedule: ScheduleSpec | None = None,
        tables: list[dict[str, Any]] | None = None,
        tables_from: list[str] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Like :meth:`initialize`, with optimizer state from a checkpoint.

        ``values[s]`` holds shard ``s``'s variables followed by its optimizer-state tensors
        (named ``<var>/opt/<key>``); ``opt_state[s]`` its non-tensor state per variable. With
        ``replace`` (the chief only), shards already initialised take these values too. The
        ``tables`` are restored by each shard from the checkpoint files ``tables_from``.
        """
        headers = self._headers(Op.INIT)
        for s, h in headers.items():
            h.update(
                {
                    Key.OPTIMIZER: spec.to_wire(),
                    Key.STEP: step,
                    Key.OPT_STATE: opt_state.get(s, {}),
                    Key.REPLACE: replace,
                }
            )
            if schedule is not None:
                h[Key.LR_SCHEDULE] = schedule.to_wire()
            if tables:
                h[Key.TABLES] = tables
                h[Key.TABLES_FROM] = tables_from or []
        # ``timeout``: a ps loads the checkpoint's tables before it answers (longer than one
        # request's PSFLOW_TIMEOUT for a large one, or on a loaded machine).
        replies = self.call(headers, values, timeout=timeout)
        return not any(h.get(Key.ALREADY) for h, _ in replies.values())

    def wait_ready(
        self,
        timeout: float,
        *,
        initialized: bool = True,
        setting: str = envvars.PSFLOW_READY_TIMEOUT,
    ) -> None:
        """Waits until every shard answers and (with ``initialized``) the chief has set it up.

        ``timeout`` bounds the whole wait (``PSFLOW_READY_TIMEOUT`` where psflow calls it,
        ``PSFLOW_RECOVERY_TIMEOUT`` while a session waits for a lost ps: ``setting`` names the
        one the error should name);
        each status request within it, a second (then it is asked again) or the transport's
        timeout (``PSFLOW_TIMEOUT``) if shorter. Every
        ``wait_log_seconds`` of the transport (``PSFLOW_WAIT_LOG_SECONDS``, 10 s) it logs who
        is still awaited and why (nothing listening, no answer, not initialised by the chief),
        how long it has waited and how long it still will, as TensorFlow's "waiting for"
        lines did.

        Raises:
            TimeoutError: naming the shards still unreachable or uninitialised (and the chief).
            PeerError: at once, when a shard refused this task's CurveZMQ key (ZeroMQ does not
                connect again: waiting longer would be in vain).
        """
        start = time.monotonic()
        deadline = start + timeout
        interval = self.config.wait_log_seconds
        next_log = start + interval
        pending = set(range(self.num_shards))
        why: dict[int, str] = {}
        delay = 0.01
        while True:
            # One round: every pending shard asked at once; the round ends by the next log line,
            # and within a second: a request sent as a ps restarts can be lost with its old
            # connection, and the new one answers at once (asked again, not waited out).
            now = time.monotonic()
            round_end = min(deadline, next_log, now + self.config.timeout, now + _ASK_AGAIN_S)
            rids = {}
            for s in sorted(pending):
                # A shard whose connection cannot take a request yet (down, or its handshake
                # failing) blocks the send: for this round at most, so that the wait goes on
                # saying why.
                try:
                    block = max(0.05, round_end - time.monotonic())
                    rids[s] = self.send(self._headers(Op.STATUS, [s]), block=block)[s]
                except PeerTimeoutError:
                    why[s] = self._silence(s)
            for s, rid in rids.items():
                # A reply already here is taken even when the round is over.
                left = max(0.05, round_end - time.monotonic())
                try:
                    header = self.wait({s: rid}, left)[s][0]
                except PeerTimeoutError:
                    why[s] = self._silence(s)
                    continue
                except PeerError as e:  # refused, or gone while answering: asked again
                    why[s] = f"{e.detail} (asking again)"
                    continue
                if header.get(Key.INITIALIZED) or not initialized:
                    pending.discard(s)
                    why.pop(s, None)
                else:
                    why[s] = f"not initialised yet by {self.ctx.cluster.chief} (the chief)"
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise self._not_ready(pending, why, timeout, initialized, setting)
            if now >= next_log:
                log.info(
                    "%s is waiting for %s; waited %.0f s, gives up in %.0f s",
                    self.me,
                    "; ".join(f"{self.shards[s]}: {why[s]}" for s in sorted(pending)),
                    now - start,
                    deadline - now,
                )
                next_log = now + interval
            time.sleep(max(0.0, min(delay, next_log - now, deadline - now)))
            delay = min(delay * 2, 0.5)

    def _silence(self, shard: int) -> str:
        """Why ``shard`` did not answer, as far as its connection tells.

        Raises:
            PeerError: when it refused this task's CurveZMQ key.
        """
        name = self.shards[shard]
        link = self._client.link(name)
        if link.refused:
            address = self.ctx.cluster.addresses("ps")[shard]
            raise PeerError(f"{name} at {address}", str(link.problem))
        return link.problem or "no answer yet"

    def _not_ready(
        self,
        pending: set[int],
        why: dict[int, str],
        timeout: float,
        initialized: bool,
        setting: str,
    ) -> TimeoutError:
        names = ", ".join(self.shards[s] for s in sorted(pending))
        chief = f"{self.ctx.cluster.chief} (the chief)"
        kind = "recovery" if setting == envvars.PSFLOW_RECOVERY_TIMEOUT else "ready"
        limit = f"within {timeout:g} s (the {kind} timeout, {setting})"
        if initialized and all(why.get(s, "").startswith("not initialised") for s in pending):
            return TimeoutError(f"{chief} did not initialise {names} {limit}")
        reasons = "; ".join(f"{self.shards[s]}: {why.get(s, 'no answer')}" for s in sorted(pending))
        return TimeoutError(f"{names} not ready {limit}: {reasons}")

    def done(self, timeout: float = 5.0) -> None:
        """Tells every shard this task has finished (best effort: a dead shard is logged)."""
        try:
            self.call(self._headers(Op.DONE), timeout=timeout)
        except PeerError as e:
            log.warning("%s could not tell the ps it finished: %s", self.me, e)

    # -- variables --------------------------------------------------------------------------

    def pull(
        self, into: dict[str, torch.Tensor] | None = None, *, lane_views: bool = False
    ) -> Replies:
        """Every shard's variables (large ones received straight into ``into[name]``)."""
        return self.call(self._headers(Op.PULL), into=into, lane_views=lane_views)

    def push(
        self,
        grads: dict[int, Tensors],
        *,
        pull: bool,
        into: dict[str, torch.Tensor] | None = None,
        lane_views: bool = False,
        layouts: dict[int, wire.Layout] | None = None,
        global_step: int | None = None,
        rows: dict[int, list[str]] | None = None,
        prefetch: dict[int, list[str]] | None = None,
        row_dtypes: dict[int, dict[str, str]] | None = None,
        request_views: bool = False,
        input_mark: InputMark | None = None,
        input_epochs: Mapping[int, int] | None = None,
        deferred: Callable[[Replies], object] | None = None,
    ) -> Replies:
        """Pushes each shard's gradients (always including shard 0) in one round trip each.

        ``global_step``, the last one this worker saw, goes to the shards other than 0: with
        a learning-rate schedule, they follow the global step by it. ``rows[s]``: the tables
        whose row gradients shard ``s``'s tensors carry; ``prefetch[s]``, the tables whose rows
        of the ids they carry the reply brings back (read after the update), as views of the
        lanes with ``request_views`` (see :meth:`Client.wait`); ``row_dtypes[s]``, the dtypes
        some of those tables' rows come in (:attr:`Key.ROW_DTYPES`). ``input_mark``, the
        number of the input these gradients come from and the reader's position past it, goes
        to every shard, with gradients or without, with ``input_epochs[s]``, the epoch of
        shard ``s`` it was learnt at (:meth:`input_positions`, :mod:`psflow.ps.positions`).
        With ``deferred``, the replies are left in flight for it (:meth:`defer`) and none is
        returned.
        """
        op = Op.PUSH_PULL if pull else Op.PUSH
        headers: dict[int, dict[str, Any]] = {s: {Key.OP: op} for s in grads}
        headers.setdefault(0, {Key.OP: op})
        if input_mark is not None:
            assert input_epochs is not None, "an input mark comes with the shards' epochs"
            for s in range(self.num_shards):
                h = headers.setdefault(s, {Key.OP: op})
                h[Key.INPUT_SEQ], h[Key.INPUT_POSITION] = list(input_mark[0]), input_mark[1]
                h[Key.INPUT_EPOCH] = input_epochs[s]
        for s, tables in (rows or {}).items():
            headers[s][Key.ROWS] = tables
        for s, tables in (prefetch or {}).items():
            headers.setdefault(s, {Key.OP: op})[Key.PREFETCH] = tables
        for s, dtypes in (row_dtypes or {}).items():
            headers[s][Key.ROW_DTYPES] = dtypes
        if global_step is not None and len(headers) > 1:
            for s, h in headers.items():
                if s:
                    h[Key.STEP] = global_step
        if deferred is not None:
            self.settle()  # not this push's round trip
            start = time.perf_counter()
            rids = self.send(headers, grads, layouts=layouts)
            wait = {"into": into, "lane_views": lane_views, "request_views": request_views}
            self.defer(rids, deferred, grads, start, **wait)
            return {}
        return self.call(
            headers,
            grads,
            into=into,
            lane_views=lane_views,
            layouts=layouts,
            request_views=request_views,
        )

    # -- embedding tables -------------------------------------------------------------------

    def lookup(
        self,
        ids: dict[int, Tensors],
        into: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        *,
        views: bool = False,
        absent_zeros: bool = False,
        row_dtypes: Mapping[str, str] | None = None,
    ) -> Replies:
        """The rows of each table's ids (``(table, ids)`` per listed shard), all shards at once;
        a shard's rows that come through its lane are received into ``into[shard][table]``
        where given (a tensor of their shape and dtype), or with ``views`` are left there:
        views of the lane, valid until the next request to that shard. With ``absent_zeros``,
        ids a hashed table does not hold read zeros (a model in eval mode). ``row_dtypes``: the
        dtypes some tables' rows come in instead of their own (:attr:`Key.ROW_DTYPES`)."""
        headers = self._headers(Op.LOOKUP, sorted(ids))
        for s, header in headers.items():
            if absent_zeros:
                header[Key.ABSENT_ZEROS] = True
            if row_dtypes:
                asked = {n: row_dtypes[n] for n, _ in ids[s] if n in row_dtypes}
                if asked:
                    header[Key.ROW_DTYPES] = asked
        return self.call(headers, ids, into_of=into, request_views=views)

    def table_status(self) -> dict[int, Any]:
        """Each shard's counters per table."""
        return {
            s: h.get(Key.TABLES, {})
            for s, (h, _) in self.call(self._headers(Op.TABLE_STATUS)).items()
        }

    # -- synchronous steps and bounded staleness --------------------------------------------

    def sync_stage(
        self,
        grads: dict[int, Tensors],
        step: int,
        replicas: tuple[int, int],
        *,
        rows: dict[int, list[str]] | None = None,
    ) -> None:
        """Stages each listed shard's gradients for ``step`` (acknowledged at once); ``rows``
        as for :meth:`push`."""
        headers = {s: self._sync_header(Op.SYNC_STAGE, step, replicas) for s in grads}
        for s, tables in (rows or {}).items():
            if s in headers:
                headers[s][Key.ROWS] = tables
        self.call(headers, grads)

    def sync_push(
        self,
        grads: Tensors,
        step: int,
        replicas: tuple[int, int],
        *,
        timeout: float,
        into: dict[str, torch.Tensor],
        rows: list[str] | None = None,
    ) -> Replies:
        """Pushes ps:0's gradients for ``step`` (``rows``: the tables whose row gradients they
        carry); answered once the step is decided, with ps:0's values and its decisions."""
        header = self._sync_header(Op.SYNC_PUSH, step, replicas)
        if rows:
            header[Key.ROWS] = rows
        return self.call(
            {0: header},
            {0: grads},
            timeout=timeout,
            into=into,
            lane_views=True,
        )

    def sync_pull(
        self, shards: Sequence[int], decisions: Any, *, into: dict[str, torch.Tensor]
    ) -> Replies:
        """The listed shards' values, after they applied ``decisions`` (ps:0's) they lack."""
        headers = self._headers(Op.SYNC_PULL, shards)
        if decisions is not None:
            for h in headers.values():
                h[Key.DECISIONS] = decisions
        return self.call(headers, into=into, lane_views=True)

    def sync_status(self, timeout: float | None = None, *, shard: int = 0) -> dict[str, Any]:
        """A shard's synchronous state (ps:0's by default, the step authority): step,
        arrivals, dropped gradients per worker, decisions, clocks."""
        return self.call(self._headers(Op.SYNC_STATUS, [shard]), timeout=timeout)[shard][0]

    def ssp_wait(self, clock: int, max_staleness: int, *, timeout: float) -> dict[str, Any]:
        """Returns once ps:0 lets this worker (at ``clock``) go on; the reply header."""
        header: dict[str, Any] = {
            Key.OP: Op.SSP_WAIT,
            Key.CLOCK: clock,
            Key.MAX_STALENESS: max_staleness,
        }
        return self.call({0: header}, timeout=timeout)[0][0]

    @staticmethod
    def _sync_header(op: Op, step: int, replicas: tuple[int, int]) -> dict[str, Any]:
        return {
            Key.OP: op,
            Key.STEP: step,
            Key.REPLICAS_TO_AGGREGATE: replicas[0],
            Key.TOTAL_NUM_REPLICAS: replicas[1],
        }

    # -- checkpoints ------------------------------------------------------------------------

    def save(self, url_of: dict[int, str], *, by_step: bool = False) -> dict[int, dict[str, Any]]:
        """Asks each shard to snapshot itself and write the file under ``url_of[shard]`` (with
        ``by_step``, under the ``ckpt-<step>`` beside it of its snapshot's step)."""
        header: dict[str, Any] = (
            {Key.OP: Op.SAVE, Key.BY_STEP: True} if by_step else {Key.OP: Op.SAVE}
        )
        replies = self.call({s: {**header, Key.DIR: url} for s, url in url_of.items()})
        return {s: h for s, (h, _) in replies.items()}

    def save_status(self, url_of: dict[int, str]) -> dict[int, dict[str, Any]]:
        """Each shard's progress on the save into ``url_of[shard]``."""
        replies = self.call(
            {s: {Key.OP: Op.SAVE_STATUS, Key.DIR: url} for s, url in url_of.items()}
        )
        return {s: h for s, (h, _) in replies.items()}

    def close(self) -> None:
        self._client.close()


def group_by_shard(pieces: Sequence[Piece]) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = defaultdict(list)
    for p in pieces:
        out[p.shard].append(p)
    return dict(out)
