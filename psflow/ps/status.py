"""The ``hello``, ``status``, ``heartbeat`` and ``done`` ops: the shard's state, and who is done.

- ``hello``/``status``: shard index, whether initialised, the step, who has finished, who is
  dead, the variables' dtypes and shapes, and where the sender's input stands
  (:mod:`psflow.ps.positions`).
- ``heartbeat``: a worker is alive (the serving loop notes every sender:
  :mod:`psflow.ps.liveness`); the reply tells it that its ps is alive too.
- ``done``: the sender (a worker, or the chief) has finished; after the last one the server
  exits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from psflow.cluster.spec import TaskSpec
from psflow.protocol import Key, Op
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.transport import Request, wire

log = logging.getLogger(__name__)


class StatusService(Service):
    """The ``hello``, ``status``, ``heartbeat`` and ``done`` ops of one ps server.

    Args:
        host: the server.
        finished: the server's set of finished workers, which ``done`` adds to.
        worker_finished: called with a worker once ``done`` is answered, to tell every
            service of the server (:meth:`Service.on_worker_finished`).
    """

    def __init__(
        self,
        host: ServiceHost,
        *,
        finished: set[str],
        worker_finished: Callable[[str], None],
    ) -> None:
        self.host = host
        self.finished = finished
        self.worker_finished = worker_finished

    def handlers(self) -> Mapping[Op, Handler]:
        return {
            Op.HELLO: self._status,
            Op.STATUS: self._status,
            Op.DONE: self._done,
            Op.HEARTBEAT: self._heartbeat,
        }

    def _status(self, request: Request) -> None:
        host = self.host
        host.reply(
            request,
            {
                Key.SHARD: host.shard,
                Key.INITIALIZED: host.store.initialized,
                Key.FINISHED: sorted(self.finished),
                Key.DEAD: sorted(host.dead),
                Key.VARIABLES: {
                    n: [wire.dtype_name(t.dtype), list(t.shape)]
                    for n, t in host.store.variables.items()
                },
                Key.INPUT_POSITION: host.store.inputs.of(host.sender(request)),
                Key.INPUT_EPOCH: host.store.inputs.epoch,
            },
        )

    def _heartbeat(self, request: Request) -> None:
        # Heard already (the serving loop notes every sender); the reply tells the worker its
        # ps is alive too.
        self.host.reply(request, {})

    def _done(self, request: Request) -> None:
        # The task that finishes is the sender (the header's one name for both): a peer
        # cannot finish another, except by claiming its name (as for the chief's requests).
        task = request.header.get(Key.TASK)
        job, _, index = task.partition(":") if isinstance(task, str) else ("", "", "")
        try:
            name = str(TaskSpec(job=job, index=int(index)))
        except ValueError:
            raise ValueError(
                f"'done' must name the finished task as job:index, got {task!r}"
            ) from None
        trainers = self.host.trainers
        if name not in trainers:
            raise ValueError(f"{name} is not a worker of this job")
        self.finished.add(name)
        log.info("%s: %s finished (%d/%d)", self.host.name, name, len(self.finished), len(trainers))
        self.host.reply(request, {})
        self.worker_finished(name)
