"""How a worker's tensors cross between the host and its GPU: through pinned host memory, by
copies the host does not wait for.

A worker whose model is on a CUDA device meets the host at every step: the rows and dense
values a shard sends arrive in host memory (a lane, or frames) and go to the device; the
gradients come back to be pushed. Copied plainly (``t.to(device)``, ``g.cpu()``), every copy
from or to pageable memory makes the host wait for all the device was given before it: host and
device take turns, and each of the step's tensors is one more turn. Through :class:`Staging`:

- **to the device**, a tensor is first copied into pinned memory (torch's caching host
  allocator, which keeps a block until every copy reading it has run), then to the device
  without the host waiting: the kernels queued after the copy wait for it, the host goes on to
  its next request. The rows a push brings for the next batch start for the device as they
  arrive (:meth:`~psflow.worker.prefetch.RowPrefetch.put`), while the host reads the
  next batch;
- **to the host**, each gradient is copied into pinned memory without waiting, and the host
  waits once for them all (:meth:`Staging.wait`) before any of them is read or sent: one turn a
  step, where the device has finished the backward pass.

Off (``OptimizerConfig.pinned``, ``PSFLOW_PINNED=0``), or without CUDA, every copy is the plain
one. On the CPU nothing is copied at all.
"""

from __future__ import annotations

import torch


class Staging:
    """A worker's copies between the host and its devices (see the module docstring).

    Args:
        pinned: copy through pinned host memory without waiting (where CUDA is available);
            else every copy is ``Tensor.to``'s, waiting for the device.

    Example:
        >>> staging = Staging(pinned=True)
        >>> host = staging.to_host(torch.ones(3))  # a CPU tensor: itself, nothing to wait for
        >>> staging.wait()
        >>> staging.to_device(host, torch.device("cpu")) is host
        True
    """

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned and torch.cuda.is_available()
        self._pending: set[torch.device] = set()
        """The devices whose streams hold copies to the host not yet waited for."""

    def crosses(self, device: torch.device) -> bool:
        """Whether a tensor on ``device`` is copied through pinned memory without waiting."""
        return self.pinned and device.type == "cuda"

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``t`` (on the host) on ``device``: ``t`` itself where it already is. The copy may
        still be under way when this returns: what the device runs next waits for it, the
        host does not, and ``t`` may change at once (the device reads a pinned copy of it),
        unless ``t`` is pinned itself: the device then reads ``t``, which must not change
        until the copy has run (the worker gives none today)."""
        if t.device == device:
            return t
        if not self.crosses(device):
            return t.to(device)
        return self._pinned(t).to(device, non_blocking=True)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies ``src`` (on the host) into ``dst`` (on a device), as :meth:`to_device`."""
        if not self.crosses(dst.device) or src.device.type != "cpu":
            dst.copy_(src)
        else:
            dst.copy_(self._pinned(src), non_blocking=True)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host (``t`` itself if it is there). Crossing (:meth:`crosses`), the
        copy is only begun: its values are there after :meth:`wait`, not before."""
        if t.device.type == "cpu":
            return t
        if not self.crosses(t.device):
            return t.cpu()
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        self._pending.add(t.device)
        return out

    def wait(self) -> None:
        """Returns once every copy :meth:`to_host` began has ended (at once when none is
        under way)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, set()
        for device in pending:
            torch.cuda.current_stream(device).synchronize()

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_pinned() else t.contiguous().pin_memory()
