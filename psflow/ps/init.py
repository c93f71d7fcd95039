"""The ``init`` op: the chief sets up a shard, or restores it from a checkpoint.

An ``init`` carries the shard's initial values, the optimizer and the learning-rate schedule,
the embedding tables to create (and maybe their first rows), and for a restore the optimizer
state, the step and the checkpoint files the tables (and the workers' input positions,
:mod:`psflow.ps.positions`) are read from. A shard initialised already
ignores it unless the chief asks to ``replace`` (a restore after another ps crashed): then the
work in progress of every service is refused as overtaken (:meth:`Service.on_restored`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from psflow.protocol import Key, Op, OptimizerSpec, ScheduleSpec
from psflow.ps.checkpoint import is_checkpoint_of
from psflow.ps.optimizer_state import load_optimizer_state, split_init_tensors
from psflow.ps.positions import restored_positions
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.tables import (
    FirstRows,
    build_tables,
    restore_tables,
    set_initial_rows,
    split_initial_rows,
    table_specs,
)
from psflow.transport import Request

log = logging.getLogger(__name__)


class InitService(Service):
    """The ``init`` op of one ps server (served to the chief alone: the server checks).

    Args:
        host: the server.
        chief: the job's chief, as ``worker:0``, for the log of a restore.
        num_shards: how many ps shards the tables are split over.
        checkpoint_dir: the job's checkpoint directory: a restore reads tables only from its
            ``ckpt-<step>`` directories (anywhere when ``None``).
        restored: called with the reason when the chief replaces the shard's variables, to
            tell every service of the server (:meth:`Service.on_restored`).
        under_way: called once the chief has restored the shard mid-job (after a ps came back
            empty), when every worker has started already (:meth:`Liveness.expect
            <psflow.ps.liveness.Liveness.expect>`).
    """

    def __init__(
        self,
        host: ServiceHost,
        *,
        chief: str,
        num_shards: int,
        checkpoint_dir: str | None,
        restored: Callable[[str], None],
        under_way: Callable[[], None],
    ) -> None:
        self.host = host
        self.under_way = under_way
        self.chief = chief
        self.num_shards = num_shards
        self.checkpoint_dir = checkpoint_dir
        self.restored = restored

    def handlers(self) -> Mapping[Op, Handler]:
        return {Op.INIT: self._init}

    def _init(self, request: Request) -> None:
        host = self.host
        tensors = host.tensors(request)
        if host.store.initialized:
            if request.header.get(Key.REPLACE) is not True:
                host.reply(request, {Key.INITIALIZED: True, Key.ALREADY: True})
                return
            # The chief (the server serves init to it alone) restores every shard after one
            # came back empty (a crashed ps).
            host.store.reset()  # new tensors: values still being sent keep their own memory
            # Synchronous steps in progress belong to the lost timeline: their workers recover.
            self.restored(f"{host.name} was restored from a checkpoint by {self.chief}")
        spec = OptimizerSpec.from_wire(request.header.get(Key.OPTIMIZER))
        wired = request.header.get(Key.LR_SCHEDULE)
        schedule = None if wired is None else ScheduleSpec.from_wire(wired)
        step = request.header.get(Key.STEP, 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bad initial step {step!r}")
        tensors, first_rows = split_initial_rows(request.header, tensors)
        tensors, opt_tensors, opt_plain = split_init_tensors(request.header, tensors)
        specs = table_specs(request.header)
        tables_from = self._tables_from(request)
        tables = build_tables(specs, host.shard, self.num_shards)
        set_initial_rows(tables, first_rows)  # the chief's model held them
        host.store.initialize(tensors, spec, step=step, schedule=schedule, tables=tables)
        try:
            if opt_tensors or opt_plain:
                load_optimizer_state(host.store, opt_tensors, opt_plain)
            if tables_from:
                root = self.checkpoint_dir
                metadata = restore_tables(host.store.tables, tables_from, root)
                host.store.inputs = restored_positions(
                    tables_from, host.shard, self.num_shards, root, metadata
                )
        except (ValueError, KeyError, RuntimeError) as e:
            host.store.reset()  # not initialised: the chief may try again
            raise ValueError(f"cannot restore the optimizer state or tables: {e}") from None
        log.info(
            "%s initialised by %s: %d variables, %d tables%s, %.1f MB, optimizer %s%s",
            host.name,
            host.sender(request),
            len(tensors),
            len(tables),
            " (restored)" if tables_from else _given(first_rows),
            host.store.nbytes() / 1e6,
            spec.name,
            "" if schedule is None else f", lr_schedule {schedule.describe()} at step {step}",
        )
        host.reply(request, {Key.INITIALIZED: True, Key.ALREADY: False})
        if request.header.get(Key.REPLACE) is True:  # what the chief sends after a lost ps
            self.under_way()

    def _tables_from(self, request: Request) -> list[str]:
        """The checkpoint files a restoring init (the chief's) reads its tables from: only
        shard files of a checkpoint under this ps's checkpoint directory, when it has one."""
        urls = request.header.get(Key.TABLES_FROM)
        if urls is None:
            return []
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"'{Key.TABLES_FROM}' must be a list of shard file URLs")
        root = self.checkpoint_dir
        if root is not None:
            outside = [u for u in urls if not is_checkpoint_of(root, u.rsplit("/", 1)[0])]
            if outside:
                raise ValueError(
                    f"tables are restored only from {root}/ckpt-<step> (this ps's checkpoint "
                    f"directory), not {outside[0]!r}"
                )
        return urls


def _given(first_rows: Mapping[str, FirstRows]) -> str:
    """The init's log note on tables whose first rows (and optimizer state) the chief gave."""
    named = [n + (" and its optimizer state" if r.state else "") for n, r in first_rows.items()]
    return f" ({', '.join(sorted(named))} with the chief's rows)" if named else ""
