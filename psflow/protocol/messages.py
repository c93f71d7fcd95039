"""Every word of psflow's protocol: request ops, reply codes and header keys, each said once.

A message is a msgpack header (a map keyed by :class:`Key`) plus raw tensor frames (see
:mod:`psflow.transport.wire`). Its :attr:`Key.OP` names the request (:class:`Op`); a refusal is
answered with :attr:`Op.ERROR`, whose :attr:`Key.CODE` (:class:`Code`) tells the client what
kind of refusal it is, so that it can act on it. Nothing else in psflow spells these strings:
a new request type is one line here, one handler on the ps (a
:class:`~psflow.ps.service.Service`) and one call on the worker.

The members are ``str`` enums: they pack as plain strings and compare and hash equal to them,
so a received header (plain strings) is read with the members directly.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from enum import Enum
from typing import Any

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, Enum):
        """``enum.StrEnum`` before Python 3.11."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


PROTOCOL_VERSION = 9
"""Carried in every header (:attr:`Key.VERSION`); a peer speaking another version is refused.
2: sync requests name their settings in full (``replicas_to_aggregate``, not ``r``), and every
error reply carries a :class:`Code`. 3: an init may carry a learning-rate schedule
(:attr:`Key.LR_SCHEDULE`), which a ps of version 2 would ignore without a word. 4: embedding
tables (:attr:`Key.TABLES`, :attr:`Op.LOOKUP`, row gradients in pushes, :attr:`Key.ROWS`). 5: a
save may ask for its directory to be named by the snapshot's step (:attr:`Key.BY_STEP`), which
a ps of version 4 would ignore, writing where the chief guessed. 6: a lookup may ask for zeros
where a hashed table holds no row (:attr:`Key.ABSENT_ZEROS`), which a ps of version 5 would
answer with seeded rows; and incremental exports (:attr:`Op.EXPORT`). 7: rows on the wire in
another dtype (:attr:`Key.ROW_DTYPES`). 8: a push may carry its worker's input position
(:attr:`Key.INPUT_SEQ`, :attr:`Key.INPUT_POSITION`, :attr:`Key.INPUT_EPOCH`), which a ps of
version 7 would apply again after a restart. 9: a save or an export refused because the shard
still writes an earlier one says so (:attr:`Code.BUSY`), which a client of version 8 took for a
request refused for good."""


WORKER_TIMEOUT = 30.0
"""Seconds of silence after which a ps declares a worker that has joined dead (the default of
``PSFLOW_WORKER_TIMEOUT``; see :mod:`psflow.ps.liveness`)."""

HEARTBEATS_PER_TIMEOUT = 5
"""A worker sends :attr:`Op.HEARTBEAT` this many times per worker timeout: four may be lost or
late before the ps declares it dead."""


ROW_IDS = "#ids"
"""Suffix of the tensor that carries a table's ids in a push (``emb#ids``), and of the ids of a
hashed table's first rows in an init (:func:`initial_ids_tensor_name`)."""
ROW_GRADS = "#grad"
"""Suffix of the tensor that carries their gradients, one row per id (``emb#grad``)."""


ROW_NEXT = "#next"
"""Suffix of the tensor that carries the ids of a table to prefetch with a push (``emb#next``)."""
ROW_VALUES = "#rows"
"""Suffix of the tensor of their rows in the push's reply (``emb#rows``), and of a shard's first
rows of a table in an init (:func:`initial_rows_tensor_name`)."""


def prefetch_tensor_names(table: str) -> tuple[str, str]:
    """The names of the ids a push asks ``table``'s rows of, and of those rows in the reply."""
    return table + ROW_NEXT, table + ROW_VALUES


ROW_STATE = "#state/"
"""Infix of the tensors of a table's row-wise optimizer state in an init (``emb#state/sum``)."""


def initial_rows_tensor_name(table: str) -> str:
    """The name of the tensor of a shard's first rows of ``table`` in an init (all its rows, in
    the shard's storage order): the rows the chief's model held, instead of the seeded ones."""
    return table + ROW_VALUES


def initial_ids_tensor_name(table: str) -> str:
    """The name of the tensor of the ids of a shard's first rows of a hashed ``table`` in an
    init (int64, unique, each on that shard; the rows in the same order): the rows the chief's
    model was given (:meth:`psflow.nn.TableModule.load_rows`)."""
    return table + ROW_IDS


def initial_state_tensor_name(table: str, key: str) -> str:
    """The name of the tensor of a shard's first row-wise optimizer state ``key`` of ``table``
    in an init (beside its first rows: a model that goes on from another's training)."""
    return table + ROW_STATE + key


InputMark = tuple[tuple[int, ...], dict[str, Any]]
"""An input's number (:attr:`Key.INPUT_SEQ`) and its sender's reader position past it
(:attr:`Key.INPUT_POSITION`)."""

MAX_INPUT_DEPTH = 16
"""The most numbers an :attr:`Key.INPUT_SEQ` holds (a replay of a replay ... adds one)."""


def input_key(seq: Sequence[int]) -> tuple[float, ...]:
    """An :attr:`Key.INPUT_SEQ`'s place in the order: by its numbers in turn, a missing one
    above any (``[7]``, input 7 whole, is after ``[7, 2]``, a batch replaying up to it, which
    is after ``[7, 1, 9]``)."""
    return (*seq, math.inf)


def input_name(seq: Sequence[int]) -> str:
    """An :attr:`Key.INPUT_SEQ` for people: ``"7"``, or ``"7.2"`` (a batch replaying up to 7)."""
    return ".".join(str(n) for n in seq)


OPT_SEP = "/opt/"
"""Separates a variable's name from its optimizer-state key, in an init (the state the chief
gives the ps, restored or given by the script) and in a shard file (``fc.weight/opt/exp_avg``)."""


def optimizer_state_tensor_name(var: str, key: str) -> str:
    """The name of the tensor of variable ``var``'s optimizer state ``key`` (``exp_avg``)."""
    return var + OPT_SEP + key


def row_tensor_names(table: str) -> tuple[str, str]:
    """The names of the two tensors that carry ``table``'s row gradients in a push: its ids
    (int64, unique) and their gradients (one row per id, summed over the batch)."""
    return table + ROW_IDS, table + ROW_GRADS


class Op(StrEnum):
    """What a message asks for (requests) or is (replies and the transport's own notes)."""

    # -- replies ---------------------------------------------------------------------------
    OK = "ok"
    """Reply: the request was carried out; its results are in the header and tensors."""
    ERROR = "error"
    """Reply: the request was refused; :attr:`Key.ERROR` says why, :attr:`Key.CODE` what kind."""

    # -- the transport's own (answered by :class:`~psflow.transport.server.Server` itself) ----
    ATTACH_LANE = "_lane"
    """A client on the same host offers a shared-memory lane for its next requests."""
    USE_SOCKET = "_socket"
    """Note through a lane: the reply is too large for it and follows through the socket."""
    SEAL = "_seal"
    """Through CurveZMQ, a client asks for a session on the server's sealed socket
    (:mod:`psflow.transport.seal`); the reply carries :attr:`Key.SEAL_SESSION`,
    :attr:`Key.SEAL_KEYS`, :attr:`Key.SEAL_TOKEN` and :attr:`Key.SEAL_PORT`."""

    # -- a ps shard: state and variables ---------------------------------------------------
    HELLO = "hello"
    """Alias of :attr:`STATUS` (kept for clients of protocol 1's vocabulary)."""
    STATUS = "status"
    """The shard's index, whether it is initialised, its step, who has finished."""
    INIT = "init"
    """The chief's initial (or restored) values, optimizer, schedule and step for the shard."""
    PULL = "pull"
    """The current values of the shard's variables (all, or :attr:`Key.NAMES`)."""
    PUSH = "push"
    """Gradients, applied at once with the shard's optimizer; replies with the new step."""
    PUSH_PULL = "push_pull"
    """:attr:`PUSH`, then :attr:`PULL` of every variable, in one round trip."""
    DONE = "done"
    """A worker has finished; the ps exits after the last one."""
    HEARTBEAT = "heartbeat"
    """A worker is alive (sent while it computes or waits; any request of its counts too)."""

    # -- a ps shard: embedding tables (psflow.ps.tables) -------------------------------------
    LOOKUP = "lookup"
    """The rows of the ids given per table (one int64 tensor named by each table)."""
    TABLE_STATUS = "table_status"
    """Each table's part on the shard: rows held, bytes, admissions and evictions."""

    # -- a ps shard: synchronous training and bounded staleness (psflow.ps.sync) -----------
    SYNC_STAGE = "sync_stage"
    """Shards 1..k: keep a worker's gradients for a step until ps:0 decides it."""
    SYNC_PUSH = "sync_push"
    """ps:0: a worker's gradients for a step; answered once the step has been decided."""
    SYNC_PULL = "sync_pull"
    """Apply ps:0's decisions not yet applied here, then the values of every variable."""
    SYNC_STATUS = "sync_status"
    """The synchronous state: step, arrivals, drops per worker, decisions, clocks."""
    SSP_WAIT = "ssp_wait"
    """ps:0: answered once this worker is within ``max_staleness`` of the slowest."""

    # -- a ps shard: checkpoints (psflow.ps.checkpoint) ------------------------------------
    SAVE = "save"
    """Snapshot the shard and write it under :attr:`Key.DIR` in the background."""
    SAVE_STATUS = "save_status"
    """How the write into :attr:`Key.DIR` is going (:class:`SaveState`)."""

    # -- a ps shard: incremental exports for serving (psflow.ps.exports) --------------------
    EXPORT = "export"
    """Snapshot the shard's dense variables and its tables' rows (all: a base; changed since
    export :attr:`Key.SINCE` and evicted ids: a delta) and write them under :attr:`Key.DIR`."""
    EXPORT_STATUS = "export_status"
    """How the export write into :attr:`Key.DIR` is going (:class:`SaveState`)."""


class Code(StrEnum):
    """What kind of refusal an :attr:`Op.ERROR` reply is: what the client can do about it."""

    MALFORMED = "malformed"
    """The message could not be read (not msgpack, wrong version, frames that do not match)."""
    REFUSED = "refused"
    """A well-formed request the server will not carry out (unknown op, bad values, wrong
    shapes): the same request would be refused again."""
    UNINITIALIZED = "uninitialized"
    """The ps holds no variables (yet, or again: it restarted after a crash)."""
    RESTORED = "restored"
    """Overtaken by a restore of the ps from a checkpoint: the step it was made for is gone."""
    STOPPING = "stopping"
    """The server stopped (or the step can no longer complete) while the request waited."""
    BUSY = "busy"
    """The shard still writes an earlier checkpoint or export (one asked before the chief
    restarted): the same request succeeds once that is written."""


class SaveState(StrEnum):
    """Progress of one shard's checkpoint write (the :attr:`Key.STATE` of a save_status)."""

    WRITING = "writing"
    DONE = "done"
    ERROR = "error"
    UNKNOWN = "unknown"
    """No save into that directory was asked of this shard (or it restarted since)."""


class Key(StrEnum):
    """The keys of a message header.

    The framing keys, in every message, are one letter on the wire; the others say what they
    hold.
    """

    # -- framing (psflow.transport.wire) ---------------------------------------------------
    VERSION = "v"
    """:data:`PROTOCOL_VERSION` of the sender."""
    ID = "id"
    """The request's id, chosen by the client; its reply carries the same."""
    OP = "op"
    """An :class:`Op`."""
    TENSORS = "t"
    """The tensors that follow, as ``[name, dtype, shape]`` triples."""
    INLINE = "b"
    """The tensors' bytes inside the header (small messages)."""
    CHUNK = "c"
    """The tensors' bytes follow in frames of at most this many bytes."""
    IN_LANE = "s"
    """The tensors' bytes lie in the shared-memory lane the message came through: ``1`` in the
    area of its direction, ``2`` (a reply only) in the request area (:data:`IN_REQUEST_AREA`)."""
    ERROR = "error"
    """Why a request was refused (:attr:`Op.ERROR`), for people."""
    CODE = "code"
    """What kind of refusal (:class:`Code`), for programs."""

    # -- shared-memory lanes (psflow.transport.shm) -----------------------------------------
    LANE_NAME = "name"
    """The lane's shared-memory file name."""
    LANE_TOKEN = "token"
    """The secret the server checks in the lane's file, so it maps only the client's own."""
    LANE_REQUEST_BYTES = "req"
    """Bytes of the lane's request area."""
    LANE_REPLY_BYTES = "rep"
    """Bytes of the lane's reply area."""
    NEED = "need"
    """With :attr:`Op.USE_SOCKET`: lane bytes the reply would have needed."""
    SEAL_SESSION = "session"
    """A sealed socket's session id (16 random bytes)."""
    SEAL_KEYS = "keys"
    """A session's two AES-256-GCM keys, the client's sending key then the server's (64 random
    bytes; only ever sent through CurveZMQ)."""
    SEAL_TOKEN = "token"
    """What a client's connection to a sealed socket presents (ZeroMQ's PLAIN password: 32
    random bytes, in hex on the wire of that connection's handshake)."""
    SEAL_PORT = "port"
    """The port of the server's sealed socket, on the host the client reached it at."""

    # -- requests to a ps -------------------------------------------------------------------
    TASK = "task"
    """The sending task (``worker:1``)."""
    STEP = "step"
    """A global step: of an init or restore, of a sync gradient, and in an asynchronous push
    to shards 1..k the one its worker last saw (they follow the schedule by it); in replies,
    the shard's."""
    NAMES = "names"
    """Variables to pull (default: all)."""
    OPTIMIZER = "optimizer"
    """An :class:`~psflow.protocol.specs.OptimizerSpec` as data."""
    LR_SCHEDULE = "lr_schedule"
    """A :class:`~psflow.protocol.specs.ScheduleSpec` as data (an init; a save's reply)."""
    OPT_STATE = "opt_state"
    """Restored optimizer state that is not a tensor, per variable."""
    TABLES = "tables"
    """An init: the embedding tables' specs (:class:`~psflow.protocol.TableSpec` as data);
    a table_status reply: each table's counters."""
    ROWS = "rows"
    """A push: the tables whose row gradients it carries (tensors named by
    :func:`row_tensor_names`). An init: the tables whose first rows it carries
    (:func:`initial_rows_tensor_name`), the chief's instead of the seeded ones, and maybe their
    row-wise optimizer state (:func:`initial_state_tensor_name`)."""
    ABSENT_ZEROS = "absent_zeros"
    """A lookup: an id a hashed table does not hold reads zeros, not its seeded initial row (a
    model in eval mode: what an export and a model server give such an id)."""
    ROW_DTYPES = "row_dtypes"
    """A lookup, or a push with :attr:`PREFETCH`: per table it asks rows of, the dtype they
    come back in (``float16``, ``bfloat16``, ``float32``:
    :data:`~psflow.protocol.tables.WIRE_DTYPES`) instead of the table's own; the ps keeps its rows and their optimizer state in theirs. A row that does
    not fit that dtype (not finite after the cast) is refused, never sent."""
    PREFETCH = "prefetch"
    """A push: the tables whose rows of the ids it carries (:func:`prefetch_tensor_names`) the
    reply brings back, read after the push is applied: the next batch's rows ride the step."""
    INPUT_SEQ = "input_seq"
    """A push: the number of its sender's input (the batch whose gradients it carries), a list
    of 1 to :data:`MAX_INPUT_DEPTH` integers ordered by :func:`input_key`, higher for each push
    (:mod:`psflow.train.input_position`). A shard that has applied a push of that sender with
    this number or a higher one drops it (answering as for any push): a restarted worker's
    replay of what the shard already holds."""
    INPUT_POSITION = "input_position"
    """A push with :attr:`INPUT_SEQ`: where its sender's reader is past that batch (plain data,
    the reader's ``state()``), which the shard keeps with the update and in its checkpoint. A
    status reply: the sender's last ``[input_seq, input_position]`` the shard applied (or
    ``None``)."""
    INPUT_EPOCH = "input_epoch"
    """A status reply: a number the shard draws whenever its state is set (an init, a restore,
    a restart); a push with :attr:`INPUT_SEQ` carries the one its worker last learnt, and a
    shard that has drawn another since refuses it (:attr:`Code.RESTORED`): the worker asks
    where its input stands again instead of reading on past what the shard lost."""
    TABLES_FROM = "tables_from"
    """A restoring init: the checkpoint's shard files, from which each ps reads its rows of
    every table (in any number of shards)."""
    REPLACE = "replace"
    """The chief replaces initialised variables (a restore after a ps crashed)."""
    DIR = "dir"
    """A checkpoint directory ``.../ckpt-<step>``."""
    BY_STEP = "by_step"
    """A save: the directory is named by the step the shard's snapshot holds, beside the one
    :attr:`DIR` names (``.../ckpt-<snapshot step>``); the reply's :attr:`SAVING` says where.
    The chief asks shard 0 (the global step) so, then the others into the same directory."""
    REPLICAS_TO_AGGREGATE = "replicas_to_aggregate"
    """Sync: gradients averaged per step."""
    TOTAL_NUM_REPLICAS = "total_num_replicas"
    """Sync: workers in the job (more than aggregated makes backup workers)."""
    DECISIONS = "decisions"
    """Sync: ``[[step, [worker, ...]], ...]``, the workers whose gradients made each step."""
    CLOCK = "clock"
    """Bounded staleness: steps this worker has completed."""
    MAX_STALENESS = "max_staleness"
    """Bounded staleness: how many steps ahead of the slowest a worker may be."""

    # -- replies from a ps -------------------------------------------------------------------
    SHARD = "shard"
    """The shard's index."""
    LEARNING_RATE = "lr"
    """From a shard with a schedule: the learning rate it applies at the reply's step."""
    INITIALIZED = "initialized"
    """Whether the shard holds variables."""
    ALREADY = "already"
    """An init found the shard initialised already (and left it as it was)."""
    FINISHED = "finished"
    """The workers that have finished."""
    DEAD = "dead"
    """The workers the ps has not heard from for ``PSFLOW_WORKER_TIMEOUT`` seconds."""
    VARIABLES = "variables"
    """Each variable's ``[dtype, shape]``."""
    STAGED = "staged"
    """Sync: the gradients were kept for their step (not stale)."""
    ACCEPTED = "accepted"
    """Sync: this worker's gradients were among those averaged for the step."""
    ARRIVED = "arrived"
    """Sync: the workers counted so far for the current step."""
    PENDING = "pending"
    """Sync: the workers whose pushes wait for the current step."""
    DROPPED_STALE = "dropped_stale"
    """Sync: gradients dropped because their step had passed."""
    DROPPED_BY_WORKER = "dropped_by_worker"
    """Sync: dropped gradients, per worker."""
    ACCEPTED_BY_WORKER = "accepted_by_worker"
    """Sync: averaged gradients, per worker."""
    CLOCKS = "clocks"
    """Bounded staleness: each worker's clock, the slowest, who lags, who waits."""
    SLOWEST = "slowest"
    """Bounded staleness: the lowest clock among unfinished workers."""
    LAGGARDS = "laggards"
    """Bounded staleness: the workers at the slowest clock."""
    WAITING = "waiting"
    """Bounded staleness: the workers held back."""
    WAITS = "waits"
    """Bounded staleness: requests that had to wait for a slower worker."""
    AHEAD = "ahead"
    """Bounded staleness: how far this worker is ahead of the slowest."""
    HELD = "held"
    """Bounded staleness: this request had to wait."""
    SAVING = "saving"
    """The shard file being written."""
    SNAPSHOT_STEP = "snapshot_step"
    """The shard's step in the snapshot being written."""
    SNAPSHOT_SECONDS = "snapshot_seconds"
    """How long taking the snapshot paused serving."""
    STATE = "state"
    """A :class:`SaveState`."""
    FILE = "file"
    """The shard file a save writes."""
    SECONDS = "seconds"
    """How long the write took."""
    EXPORT_SEQ = "export_seq"
    """An export: its number in the export directory (``export-<n>``)."""
    SINCE = "since"
    """An export: the export a delta follows (its changes since it); absent for a base."""
    BASE = "base"
    """An export: the base export its chain of deltas starts from (its own number for a base)."""
    RESERVE_BYTES = "reserve_bytes"
    """An export: bytes the disk must keep free after the write, or the write is refused."""


IN_REQUEST_AREA = 2
""":attr:`Key.IN_LANE` of a reply whose tensors the server wrote into the lane's request area
(the request's own tensors are done with by then): rows a lookup returns, which must not enter
the reply area, where the client's parameters may still be in use."""
