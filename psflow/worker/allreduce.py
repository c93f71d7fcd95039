"""``mode="allreduce"``: dense synchronous data parallelism without ps, over torch.distributed.

Every worker (the chief included) is one rank: rank 0 is the chief, whose address is the
rendezvous (its port is free in this mode: no psflow server binds it). The backend is gloo on
CPU and NCCL when the model is on a GPU. At start rank 0 broadcasts the parameters, so every
worker begins from the chief's values; each step sums the gradients with ``all_reduce``,
divides by the number of workers and applies the optimizer locally, so the workers stay
identical and the result equals synchronous ps mode (same optimizer, same mean gradient).

Gradients live in a few flat buckets (``bucket_bytes`` each, like DDP's
``gradient_as_bucket_view``): each parameter's ``.grad`` is a view into its bucket, autograd
accumulates straight into it, and one ``all_reduce`` per bucket moves it without any copy. A
gradient replaced behind our back (``model.zero_grad()`` sets them to ``None``) is copied in.

The ranks must agree on when to stop, or the ones still training wait in a collective for a
rank that left. One more element at the end of the last bucket carries each rank's request
(:meth:`AllReduceEngine.request_stop`, a SIGTERM): the sum travels with the gradients at no
extra cost, and every rank sees it after the same step (:attr:`AllReduceEngine.stop_requested`).
State that is not a parameter (a restored optimizer's, the global step) goes from rank 0 to
the others as bytes (:meth:`AllReduceEngine.broadcast_bytes`) in the caller's format.

A collective that fails (gloo's timeout: a rank hung or gone) names the ranks that did not take
part: every rank adds to a counter of its own in the rendezvous store (rank 0's) from a thread,
a few times per timeout (:class:`_Liveness`; nothing per step), and the rank whose collective
failed reads the counters twice, a few beats apart: a rank whose counter did not move is hung
(SIGSTOP stops its thread with the rest) or dead (:meth:`AllReduceEngine._failed`).
"""

from __future__ import annotations

import datetime
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from psflow.cluster.spec import TaskContext, parse_address
from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.transport import PeerTimeoutError, TransportConfig
from psflow.worker.modes import Engine, Mode, ModeConfig
from psflow.worker.opt_state import State, load_optimizer_state

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 << 20
"""DDP's default bucket size."""

BEATS_PER_TIMEOUT = 8
"""How often a rank adds to its counter in the store (:class:`_Liveness`), per group timeout."""

_T = TypeVar("_T")


class _Liveness:
    """Every rank's sign of life, in the rendezvous store (a ``TCPStore`` in rank 0's process):
    a thread adds 1 to this rank's counter every :attr:`interval` seconds, through a
    connection of its own. :meth:`silent` says which ranks' counters stand still.

    A store in a process that is stopped does not answer, and its client then waits without
    end (its timeout bounds the poll, not the read): whatever may meet it runs in a daemon
    thread, waited for a bounded time.
    """

    KEY = "psflow/alive/"

    def __init__(self, host: str, port: int, rank: int, timeout: float) -> None:
        self.interval = min(max(timeout / BEATS_PER_TIMEOUT, 0.1), 2.0)
        self.window = 4 * self.interval
        """How long :meth:`silent` watches the counters: three beats at least."""
        self._rank = rank
        store_timeout = datetime.timedelta(seconds=max(2 * self.interval, 1.0))

        def client() -> dist.TCPStore:
            return dist.TCPStore(
                host, port, is_master=False, timeout=store_timeout, wait_for_workers=False
            )

        # Both connected now, while every rank is known to be up (the group just formed).
        self._beats: dist.TCPStore | None = client()
        self._probe: dist.TCPStore | None = client()
        self._beats.add(self.KEY + str(rank), 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name=f"psflow-allreduce-alive-{rank}", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        store, key = self._beats, self.KEY + str(self._rank)
        while store is not None and not self._stop.wait(self.interval):
            try:
                store.add(key, 1)
            except Exception as e:  # the store is gone (rank 0 exited): nothing to tell
                log.debug("rank %d: the heartbeat ends: %s", self._rank, e)
                return

    def silent(self, ranks: list[int]) -> list[int] | None:
        """The ranks of ``ranks`` whose counter did not move in :attr:`window` seconds (hung or
        dead); ``None`` when the store did not answer (rank 0, its host, is hung or dead)."""
        store = self._probe
        if store is None:
            return None
        out: list[list[int]] = []

        def watch() -> None:
            first = [store.add(self.KEY + str(r), 0) for r in ranks]
            time.sleep(self.window)
            second = [store.add(self.KEY + str(r), 0) for r in ranks]
            out.append([r for r, a, b in zip(ranks, first, second, strict=True) if a == b])

        thread = threading.Thread(
            target=_quietly(watch), name="psflow-allreduce-probe", daemon=True
        )
        thread.start()
        thread.join(self.window + 2 * self.interval + 1.0)
        if not out:
            self._probe = None  # maybe held by the thread, waiting still: not used again
            return None
        return out[0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.interval + 1.0)  # a beat to a stopped rank 0 waits: left
        if not self._thread.is_alive():
            self._beats = None
        self._probe = None


def _reached(used: list[bool], index: int, _: torch.Tensor) -> None:
    """A parameter's gradient hook: a backward reached it (``used[index]``)."""
    used[index] = True


def _quietly(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception as e:  # the store failed: the caller sees no result
            log.debug("the liveness probe failed: %s", e)

    return run


class AllReduceEngine(Engine):
    """One rank of an all-reduce job; :class:`DistributedOptimizer` delegates to it.

    Example:
        >>> # with psflow.DistributedOptimizer(model, ctx, mode="allreduce", lr=0.1) as opt:
        >>> #     ...same loop as with a ps...   (`psflow launch --workers 2 --mode allreduce`)
    """

    mode = Mode.ALLREDUCE

    def __init__(
        self,
        model: nn.Module,
        ctx: TaskContext,
        spec: OptimizerSpec,
        config: ModeConfig,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        lr_schedule: ScheduleSpec | None = None,
        optimizer_state: State | None = None,
        transport: TransportConfig | None = None,
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        trainers = ctx.cluster.trainers
        if ctx.task not in trainers:
            raise ValueError(f"{ctx.task} is not a worker: all-reduce runs on the workers")
        self.rank = trainers.index(ctx.task)
        self.world_size = len(trainers)
        self._names = [str(t) for t in trainers]
        self._liveness: _Liveness | None = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameter that requires a gradient")
        devices = {p.device for p in self.params}
        if len(devices) != 1:
            raise ValueError(
                f"all-reduce needs the model on one device, got {sorted(map(str, devices))}"
            )
        self.device = devices.pop()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = config.timeout or (transport or TransportConfig.from_env()).timeout
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            host, port = parse_address(ctx.cluster.address(ctx.cluster.chief))
            init = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
            dist.init_process_group(
                backend,
                init_method=init,
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=timeout),
            )
            try:
                self._liveness = _Liveness(host, port, self.rank, timeout)
            except Exception as e:  # the failures still fail, less well named
                log.warning("%s: no liveness counters in the store (%s)", ctx.task, e)
        elif dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks, the cluster "
                f"{self.world_size} workers"
            )
        self.backend = dist.get_backend()
        self._stop_asked = False
        # A parameter no rank's backward reached is left alone, as torch's optimizers and a
        # sync ps leave one without a gradient (its gradient here is a zeroed bucket view,
        # which Adam, momentum or weight decay would still step on).
        self._used = [False] * len(self.params)
        self._used_flags: list[torch.Tensor] = []
        self._indices: list[list[int]] = []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(_reached, self._used, i))
        try:
            self.buckets = self._make_buckets(bucket_bytes)
            last = self.buckets[-1][0]
            # Every rank's stop request, summed by the last bucket's all_reduce.
            self._stop_flag = last[last.numel() - 1 :]
            self._stop_seen = torch.zeros_like(self._stop_flag)
            with torch.no_grad():
                for bucket, params in self.buckets:
                    flat = torch.cat([p.detach().reshape(-1) for p in params])
                    self._collective(
                        "the broadcast of rank 0's parameters at start",
                        functools.partial(dist.broadcast, flat, src=0),
                    )
                    self._unflatten(flat, params, grads=False)
                    bucket.zero_()
            self.optimizer = spec.build(self.params)
            if optimizer_state:  # the same on every rank, as the model's first values
                load_optimizer_state(
                    self.optimizer, dict(model.named_parameters()), optimizer_state
                )
            # Every rank steps alike: the schedule follows the step here as on a ps.
            self.schedule = lr_schedule.build(self.optimizer) if lr_schedule else None
        except BaseException:
            self.close()
            raise
        self._global_step = 0
        log.info(
            "%s is rank %d of %d (%s), %d bucket(s)",
            ctx.task,
            self.rank,
            self.world_size,
            self.backend,
            len(self.buckets),
        )

    def _make_buckets(self, bucket_bytes: int) -> list[tuple[torch.Tensor, list[nn.Parameter]]]:
        groups: list[list[nn.Parameter]] = []
        size = 0
        # Reverse order, as DDP: the last layers' gradients are ready first.
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            same_dtype = groups and groups[-1][0].dtype == p.dtype
            if not groups or not same_dtype or size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        out = []
        index = {id(p): i for i, p in enumerate(self.params)}
        for i, params in enumerate(groups):
            flag = int(i == len(groups) - 1)  # the stop flag's element (see the module's doc)
            grads = sum(p.numel() for p in params)
            bucket = torch.zeros(
                grads + len(params) + flag, dtype=params[0].dtype, device=self.device
            )
            self._attach(bucket, params)
            # Which of its parameters any rank's backward reached: summed with the gradients.
            self._used_flags.append(bucket[grads : grads + len(params)])
            self._indices.append([index[id(p)] for p in params])
            out.append((bucket, params))
        return out

    @staticmethod
    def _attach(bucket: torch.Tensor, params: list[nn.Parameter]) -> None:
        off = 0
        for p in params:
            p.grad = bucket[off : off + p.numel()].view_as(p)
            off += p.numel()

    @staticmethod
    def _unflatten(flat: torch.Tensor, params: list[nn.Parameter], *, grads: bool) -> None:
        off = 0
        for p in params:
            n = p.numel()
            dst = p.grad if grads else p.data
            assert dst is not None
            dst.copy_(flat[off : off + n].view_as(p))
            off += n

    def _gather(self, bucket: torch.Tensor, params: list[nn.Parameter], indices: list[int]) -> None:
        """Makes the bucket hold every gradient (a parameter whose grad was replaced: reached,
        as by a backward)."""
        off = 0
        for p, i in zip(params, indices, strict=True):
            n = p.numel()
            view = bucket[off : off + n]
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view.view_as(p)
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g.reshape(-1))
                p.grad = view.view_as(p)
                self._used[i] = True
            off += n

    def _unreached(self) -> list[nn.Parameter]:
        """The parameters no rank's backward reached this step (their summed flags are 0)."""
        out = []
        for flags, indices in zip(self._used_flags, self._indices, strict=True):
            out += [self.params[i] for i, f in zip(indices, flags.tolist(), strict=True) if not f]
        return out

    def step(self) -> int:
        works = []
        self._stop_flag.fill_(float(self._stop_asked))
        every = all(self._used)
        for (bucket, params), flags, indices in zip(
            self.buckets, self._used_flags, self._indices, strict=True
        ):
            self._gather(bucket, params, indices)
            if every:
                flags.fill_(1)
            else:
                flags.copy_(torch.tensor([float(self._used[i]) for i in indices]))
            works.append(dist.all_reduce(bucket, op=dist.ReduceOp.SUM, async_op=True))
        for (bucket, _), work in zip(self.buckets, works, strict=True):
            assert work is not None
            self._collective(f"the all-reduce of step {self._global_step + 1}", work.wait)
            bucket.div_(self.world_size)
        # Kept apart from the bucket, which zero_grad clears; read only when asked (on a GPU
        # a read waits for the device).
        self._stop_seen.copy_(self._stop_flag)
        # Read back only where this rank's backward missed a parameter (another may not have).
        unreached = [] if every else self._unreached()
        for p in unreached:
            p.grad = None
        self.optimizer.step()
        if unreached:  # their buckets' views again, for the next backward to fill
            for (bucket, params), indices in zip(self.buckets, self._indices, strict=True):
                self._gather(bucket, params, indices)
        self._global_step += 1
        if self.schedule is not None:
            self.schedule.advance(self._global_step)
        return self._global_step

    def _collective(self, what: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, a collective (or the wait for one); its failure as :meth:`_failed`'s."""
        start = time.monotonic()
        try:
            return fn()
        except RuntimeError as e:  # gloo's timeout or lost connection (DistBackendError...)
            raise self._failed(what, e, time.monotonic() - start) from e

    def _failed(self, what: str, error: BaseException, waited: float) -> PeerTimeoutError:
        """The error for ``what``, failed with ``error`` after ``waited`` seconds: it names the
        ranks that did not take part, found by their liveness counters (:class:`_Liveness`);
        without them, every other rank as the possible culprits."""
        me = f"{self._names[self.rank]} (rank {self.rank})"
        others = [r for r in range(self.world_size) if r != self.rank]
        cause = " ".join(str(error).split())[:300]
        failed = f"{what} failed on {me} after {waited:.1f} s: {cause}"
        probe = self._liveness
        silent = None if probe is None else probe.silent(others)

        def named(ranks: list[int]) -> str:
            return ", ".join(f"{self._names[r]} (rank {r})" for r in ranks)

        if probe is None:
            detail = f"one of them did not take part (the culprit is not known): {failed}"
            return PeerTimeoutError(named(others), detail)
        if silent is None:  # the store is rank 0's: unreachable, rank 0 is hung or dead
            if self.rank == 0:
                detail = f"no answer from the store in this rank (hung?): {failed}"
                return PeerTimeoutError(named(others), detail)
            detail = (
                "did not take part: neither it nor the rendezvous store it serves answers "
                f"(hung or dead): {failed}"
            )
            return PeerTimeoutError(named([0]), detail)
        if silent:
            window = f"{probe.window:.1f} s"
            detail = f"did not take part: no sign of life in {window} (hung or dead): {failed}"
            return PeerTimeoutError(named(silent), detail)
        detail = (
            "one of them did not take part, although every rank is alive (busy elsewhere, or "
            f"stuck in its own code): {failed}"
        )
        return PeerTimeoutError(named(others), detail)

    def request_stop(self) -> None:
        """Asks every rank to stop: after the next :meth:`step`, :attr:`stop_requested` is
        true on all of them (this rank included), so that all stop after the same step."""
        self._stop_asked = True

    @property
    def stop_requested(self) -> bool:
        """Whether some rank asked to stop (:meth:`request_stop`) before the last step."""
        return bool(self._stop_seen.item() > 0)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass ``None``; ``None`` from rank 0 gives
        ``b""`` everywhere). Every rank must call it, in the same order as the others.

        For state that is not a parameter, such as a restored optimizer's: bytes in a format of
        the caller's (a safetensors shard file), so that nothing received is ever unpickled.
        """
        mine = data if self.rank == 0 and data else b""
        size = torch.tensor([len(mine)], dtype=torch.int64, device=self.device)
        what = "a broadcast of rank 0's state"
        self._collective(what, lambda: dist.broadcast(size, src=0))
        n = int(size.item())
        if n == 0:
            return b""
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._collective(what, lambda: dist.broadcast(buf, src=0))
        return mine if self.rank == 0 else bytes(buf.cpu().numpy().tobytes())

    def start_at(self, step: int) -> None:
        """Counts the global step from ``step`` (a restored checkpoint's), on every rank, with
        the schedule's rate there."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._global_step = step
        if self.schedule is not None:  # the restored step's rate (its first step took step 0's)
            self.schedule.advance(step)

    @property
    def global_step(self) -> int:
        return self._global_step

    @property
    def learning_rate(self) -> float | None:
        return None if self.schedule is None else self.schedule.lr

    def pull(self) -> int:
        return self._global_step  # the parameters are already local and identical everywhere

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The gradients stay views of the buckets: zeroed, never set to None.
        for bucket, _ in self.buckets:
            bucket.zero_()
        self._used[:] = [False] * len(self._used)

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "backend": self.backend,
            "rank": self.rank,
            "world_size": self.world_size,
            "buckets": len(self.buckets),
        }

    def close(self, *, finished: bool = True) -> None:
        if self._liveness is not None:
            self._liveness.close()
            self._liveness = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            # Gloo's objects still held by reference cycles would otherwise be destroyed during
            # interpreter shutdown, where torch 2.13 aborts now and then ("terminate called
            # without an active exception", about 1 exit in 15 on 2 cores).
            gc.collect()
