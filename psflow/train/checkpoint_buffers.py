"""A model's buffers in its checkpoints: what the ps do not hold.

The ps hold a model's parameters and tables; its persistent buffers (a BatchNorm's
``running_mean``, ``running_var`` and ``num_batches_tracked``) live on each worker. As
TensorFlow keeps a batch norm's moving statistics as (non-trainable) variables of its
checkpoints, the chief saves its own model's buffers with each checkpoint: copied in the
training thread when it asks the ps to save (no request to the ps: they are the chief's), then
written by the :class:`~psflow.train.checkpoint.Checkpointer`'s background thread as
``buffers.safetensors`` in the checkpoint's directory (an atomic replace, as a ps writes its
shard), before the manifest that lists them (``buffers``: each one's shape and dtype;
``buffers_file``). Every reader checks the file against the manifest
(:func:`~psflow.train.checkpoint_check.check_buffers`); the chief's restore, the evaluator and
``psflow checkpoint export`` then load them (:meth:`Checkpoint.load_buffers
<psflow.train.checkpoint_read.Checkpoint.load_buffers>`).

A buffer is a ``state_dict()`` entry of the model that is not a parameter and not inside a
:mod:`psflow.nn` table (whose rows are on the ps): :func:`model_buffers`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from psflow.nn import TableModule
from psflow.ps.files import atomic_write, url_to_fs
from psflow.ps.shard_file import safetensors_chunks
from psflow.transport.wire import DTYPE_NAMES, dtype_name

__all__ = ["buffer_meta", "model_buffers", "snapshot_buffers", "write_buffers"]

log = logging.getLogger(__name__)


def model_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s persistent buffers that a checkpoint holds, by their ``state_dict()`` name
    (the tensors themselves, not copies): every module's buffers not registered
    ``persistent=False``, less those of its :mod:`psflow.nn` tables (which hold only rows, on
    the ps) and those of a dtype a checkpoint cannot hold (complex, ``uint16``, ...). A buffer
    reached by two names is under both, as in ``state_dict()``."""
    return {n: b for n, b in _persistent(model).items() if b.dtype in DTYPE_NAMES}


def _persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    tables: list[str] = []
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        if isinstance(module, TableModule):
            tables.append(prefix)
        if any(prefix.startswith(t) for t in tables):
            continue
        skip = module._non_persistent_buffers_set
        for name, buf in module._buffers.items():
            if buf is not None and name not in skip:
                out[prefix + name] = buf
    return out


def snapshot_buffers(
    model: nn.Module, *, warned: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """Copies of :func:`model_buffers` on the CPU, taken now (training goes on while they are
    written). A buffer of a dtype a checkpoint cannot hold (complex, ``uint16``, ...) is left
    out with a warning (once per name given ``warned``)."""
    out = {}
    for name, buf in _persistent(model).items():
        if buf.dtype not in DTYPE_NAMES:
            if warned is None or name not in warned:
                log.warning(
                    "buffer %r is %s: not checkpointed (no such dtype there)", name, buf.dtype
                )
                if warned is not None:
                    warned.add(name)
            continue
        out[name] = buf.detach().to("cpu", copy=True)
    return out


def buffer_meta(buffers: dict[str, torch.Tensor]) -> dict[str, dict[str, object]]:
    """The manifest's ``buffers``: each one's ``shape`` and ``dtype``."""
    return {n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in buffers.items()}


def write_buffers(url: str, buffers: dict[str, torch.Tensor]) -> None:
    """Writes ``buffers`` as a safetensors file at ``url`` (an atomic replace: temporary name,
    fsync, rename), refusing a non-finite one as a ps refuses a non-finite shard.

    Raises:
        ValueError: naming the buffer that is not finite.
    """
    for name, t in buffers.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"buffer {name!r} is not finite: refusing to checkpoint it")
    fs, path = url_to_fs(url)
    atomic_write(fs, path, safetensors_chunks(buffers, {"psflow.buffers": "1"}))
