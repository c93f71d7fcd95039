"""A dense optimizer's first state, given by the script: training that goes on from another's.

``DistributedOptimizer(..., optimizer_state={"fc.weight": {"exp_avg": ..., ...}})`` starts the
``torch.optim`` optimizer from that state instead of a fresh one: a model moved from TensorFlow
(:meth:`~psflow.train.tf_checkpoint.TFCheckpoint.optimizer_state` reads its slots) or from a
single-process torch run. The state is keyed by the model's parameter names, each a map of the
optimizer's own state keys, as ``optimizer.state_dict()["state"]`` holds them per parameter.

It is checked here, on the worker, against what torch's optimizer of the job's spec keeps
(:meth:`~psflow.protocol.OptimizerSpec.state_keys`: which keys, per element or scalars), so a
misspelt key or a wrong shape is named before anything is sent. The chief sends it to the ps
with the model's first values, each parameter's piece with its piece of the state; a ps
already initialised (restored from a checkpoint, or restarted) keeps what it has, as for the
values. In all-reduce mode every rank loads it into its own optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from psflow.protocol import OptimizerSpec
from psflow.protocol.messages import optimizer_state_tensor_name
from psflow.worker.client import Tensors
from psflow.worker.placement import Piece

State = dict[str, dict[str, torch.Tensor]]
"""Optimizer state by parameter name, then by the optimizer's state key."""


def check_optimizer_state(
    spec: OptimizerSpec,
    params: Mapping[str, nn.Parameter],
    state: Mapping[str, Mapping[str, Any]],
    *,
    tables: Sequence[str] = (),
) -> State:
    """``state`` checked against the optimizer and the parameters it trains, as CPU tensors:
    each parameter's keys those torch's optimizer keeps (all of them), a per-element one of
    the parameter's shape (in its dtype), a scalar one a number or one-element tensor.

    Args:
        spec: the job's optimizer.
        params: the parameters the optimizer trains, by name.
        state: the state by parameter name.
        tables: the model's embedding tables (their state goes with their rows:
            ``from_pretrained(..., optimizer_state=...)``), named in the error for one.

    Raises:
        ValueError: naming the parameter and key at fault.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"optimizer_state must map parameter names to state, got {state!r}")
    checked: State = {}
    kept: dict[torch.dtype, dict[str, tuple[bool, torch.dtype]]] = {}
    for name, given in state.items():
        param = params.get(name) if isinstance(name, str) else None
        if param is None:
            table = next((t for t in tables if name == t or str(name).startswith(t + ".")), None)
            if table is not None:
                raise ValueError(
                    f"optimizer_state: {name!r} is embedding table {table!r}, which the ps "
                    "hold by rows: give its state with its rows "
                    "(from_pretrained(rows, optimizer_state=...))"
                )
            raise ValueError(
                f"optimizer_state: the model has no trained parameter {name!r} "
                f"(it has {sorted(params)[:8]}{' ...' if len(params) > 8 else ''})"
            )
        if not param.requires_grad:
            raise ValueError(f"optimizer_state: {name!r} does not train (requires_grad=False)")
        if not isinstance(given, Mapping):
            raise ValueError(f"optimizer_state[{name!r}] must map state keys to tensors")
        keys = kept.get(param.dtype)
        if keys is None:
            try:
                keys = kept[param.dtype] = spec.state_keys(param.dtype)
            except ValueError as e:
                raise ValueError(f"optimizer_state: {e}") from None
        if not keys:
            raise ValueError(
                f"optimizer_state: torch.optim.{spec.describe()} keeps no state "
                "(SGD without momentum): there is nothing to start from"
            )
        missing = sorted(set(keys) - set(given))
        extra = sorted(set(given) - set(keys))
        if missing or extra:
            raise ValueError(
                f"optimizer_state[{name!r}]: torch.optim.{spec.name} keeps {sorted(keys)}; "
                f"missing {missing}, not its {extra}"
            )
        entry = {}
        for key, (per_element, dtype) in keys.items():
            entry[key] = _value(name, key, given[key], param, per_element, dtype)
        checked[name] = entry
    return checked


def _value(
    name: str, key: str, value: Any, param: torch.Tensor, per_element: bool, dtype: torch.dtype
) -> torch.Tensor:
    what = f"optimizer_state[{name!r}][{key!r}]"
    if per_element:
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what} must be a tensor of shape {list(param.shape)}")
        if value.shape != param.shape:
            raise ValueError(
                f"{what} has shape {list(value.shape)}, the parameter {list(param.shape)}"
            )
        if not (value.is_floating_point() or value.is_complex()) and param.is_floating_point():
            raise ValueError(f"{what} is {value.dtype}, the parameter {param.dtype}")
        return value.detach().to("cpu", param.dtype).contiguous().clone()
    if isinstance(value, bool) or not isinstance(value, torch.Tensor | int | float):
        raise ValueError(f"{what} must be a number (a scalar), got {value!r}")
    t = torch.as_tensor(value).detach()
    if t.numel() != 1:
        raise ValueError(f"{what} must be a scalar, got shape {list(t.shape)}")
    return t.to("cpu", dtype).reshape(()).clone()


def place_optimizer_state(
    pieces: Sequence[Piece],
    state: Mapping[str, Mapping[str, torch.Tensor]],
    plain: Mapping[str, Mapping[str, Any]] | None = None,
) -> tuple[dict[int, Tensors], dict[int, dict[str, dict[str, Any]]]]:
    """Each shard's tensors of ``state`` (named for the variable its piece of a parameter is:
    a per-element tensor's rows with the piece's rows, a scalar whole with each piece) and its
    ``opt_state`` header: the variables given state, each with its non-tensor state
    (``plain``, by parameter; none for state given by a script)."""
    plain = plain or {}
    tensors: dict[int, Tensors] = {}
    header: dict[int, dict[str, dict[str, Any]]] = {}
    for p in pieces:
        given = state.get(p.param, {})
        if not given and p.param not in plain:
            continue
        out = tensors.setdefault(p.shard, [])
        for key, t in given.items():
            part = t if t.dim() == 0 or p.rows is None else t[p.rows[0] : p.rows[1]].contiguous()
            out.append((optimizer_state_tensor_name(p.var, key), part))
        header.setdefault(p.shard, {})[p.var] = dict(plain.get(p.param, {}))
    return tensors, header


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor], state: State
) -> None:
    """Loads ``state`` (checked) into a fresh ``optimizer`` over ``params``: all-reduce mode,
    where each rank holds the optimizer."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    by_index = {index[id(params[name])]: dict(entry) for name, entry in state.items()}
    groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": by_index, "param_groups": groups})
