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
"""

from __future__ import annotations

import datetime
import gc
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from psflow.cluster.spec import TaskContext, parse_address
from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.transport import TransportConfig
from psflow.worker.modes import Engine, Mode, ModeConfig
from psflow.worker.opt_state import State, load_optimizer_state

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 << 20
"""DDP's default bucket size."""


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
        elif dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks, the cluster "
                f"{self.world_size} workers"
            )
        self.backend = dist.get_backend()
        self._stop_asked = False
        try:
            self.buckets = self._make_buckets(bucket_bytes)
            last = self.buckets[-1][0]
            # Every rank's stop request, summed by the last bucket's all_reduce.
            self._stop_flag = last[last.numel() - 1 :]
            self._stop_seen = torch.zeros_like(self._stop_flag)
            with torch.no_grad():
                for bucket, params in self.buckets:
                    flat = torch.cat([p.detach().reshape(-1) for p in params])
                    dist.broadcast(flat, src=0)
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
        for i, params in enumerate(groups):
            flag = int(i == len(groups) - 1)  # the stop flag's element (see the module's doc)
            bucket = torch.zeros(
                sum(p.numel() for p in params) + flag, dtype=params[0].dtype, device=self.device
            )
            self._attach(bucket, params)
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

    def _gather(self, bucket: torch.Tensor, params: list[nn.Parameter]) -> None:
        """Makes the bucket hold every gradient (a parameter whose grad was replaced)."""
        off = 0
        for p in params:
            n = p.numel()
            view = bucket[off : off + n]
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view.view_as(p)
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g.reshape(-1))
                p.grad = view.view_as(p)
            off += n

    def step(self) -> int:
        works = []
        self._stop_flag.fill_(float(self._stop_asked))
        for bucket, params in self.buckets:
            self._gather(bucket, params)
            works.append(dist.all_reduce(bucket, op=dist.ReduceOp.SUM, async_op=True))
        for (bucket, _), work in zip(self.buckets, works, strict=True):
            assert work is not None
            work.wait()
            bucket.div_(self.world_size)
        # Kept apart from the bucket, which zero_grad clears; read only when asked (on a GPU
        # a read waits for the device).
        self._stop_seen.copy_(self._stop_flag)
        self.optimizer.step()
        self._global_step += 1
        if self.schedule is not None:
            self.schedule.advance(self._global_step)
        return self._global_step

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
        dist.broadcast(size, src=0)
        n = int(size.item())
        if n == 0:
            return b""
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        dist.broadcast(buf, src=0)
        return mine if self.rank == 0 else bytes(buf.cpu().numpy().tobytes())

    def start_at(self, step: int) -> None:
        """Counts the global step from ``step`` (a restored checkpoint's), on every rank."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._global_step = step

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

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "backend": self.backend,
            "rank": self.rank,
            "world_size": self.world_size,
            "buckets": len(self.buckets),
        }

    def close(self, *, finished: bool = True) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            # Gloo's objects still held by reference cycles would otherwise be destroyed during
            # interpreter shutdown, where torch 2.13 aborts now and then ("terminate called
            # without an active exception", about 1 exit in 15 on 2 cores).
            gc.collect()
