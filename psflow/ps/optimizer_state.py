"""A shard's optimizer state as named tensors and plain data, and back.

``optimizer.state_dict()`` is split into tensors keyed ``<var>/opt/<key>`` (``exp_avg``,
``momentum_buffer``, Adam's ``step``) and JSON-able data (:func:`flatten_optimizer_state`), as a
shard file holds them (:mod:`psflow.ps.shard_file`) and as an ``init`` request carries them to
restore a shard (:func:`split_init_tensors`, :func:`load_optimizer_state`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from psflow.protocol import Key, OptimizerSpec
from psflow.protocol.messages import OPT_SEP, optimizer_state_tensor_name
from psflow.ps.store import ShardStore


def flatten_optimizer_state(
    optimizer: torch.optim.Optimizer, names: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Splits ``optimizer.state_dict()`` into tensors keyed ``<var>/opt/<key>`` and plain data.

    ``names`` are the variables in the order they were given to the optimizer. Returns the
    tensors (not copied), the non-tensor state per variable, and the ``param_groups`` without
    their parameter indices.
    """
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        var = names[index]
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[optimizer_state_tensor_name(var, key)] = value
            else:
                plain.setdefault(var, {})[key] = _json_value(value, f"{var}/{key}")
    groups = [
        {k: _json_value(v, k) for k, v in g.items() if k != "params"} for g in sd["param_groups"]
    ]
    return tensors, plain, groups


def _json_value(value: Any, what: str) -> Any:
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except TypeError:
        raise ValueError(f"optimizer state {what!r} is not plain data: {value!r}") from None
    return value


def split_opt_key(name: str) -> tuple[str, str] | None:
    """``("fc.weight", "exp_avg")`` for ``"fc.weight/opt/exp_avg"``, ``None`` for a variable."""
    var, sep, key = name.rpartition(OPT_SEP)
    return (var, key) if sep and var and key else None


def load_optimizer_state(
    store: ShardStore,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    plain: Mapping[str, Mapping[str, Any]],
) -> None:
    """Loads per-variable optimizer state into an initialised shard.

    The hyperparameters stay those of the shard's current :class:`OptimizerSpec` (the running
    script's, as in TensorFlow where they are part of the graph); only the state is restored.

    Raises:
        ValueError: naming a variable the shard does not hold, or a state tensor whose shape
            matches neither the variable nor a scalar.
    """
    assert store.optimizer is not None and store.optimizer_spec is not None
    spec = store.optimizer_spec
    names = list(store.variables)
    index = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    given = sorted(set(tensors) | set(plain))
    unknown = [var for var in given if var not in index]
    if unknown:
        raise ValueError(f"optimizer state for unknown variable {unknown[0]!r}")
    # Refused now, by name, rather than failing every push for want of the key.
    lacking = spec.lacking(
        (var, store.variables[var].dtype, {*tensors.get(var, {}), *plain.get(var, {})})
        for var in given
    )
    if lacking is not None:
        raise ValueError(f"optimizer state: {lacking}")
    kept: dict[torch.dtype, dict[str, tuple[bool, torch.dtype]]] = {}
    for var in given:
        entry: dict[str, Any] = dict(plain.get(var, {}))
        variable = store.variables[var]
        if variable.dtype not in kept:
            kept[variable.dtype] = _state_keys(spec, variable.dtype)
        for key, t in tensors.get(var, {}).items():
            # What the optimizer keeps under that key: the variable's shape (Adam's moments,
            # which its fused kernels read and write without a check of their own: a scalar
            # there had them write past it), or a scalar (``step``).
            shaped = kept[variable.dtype].get(key, (t.dim() != 0, t.dtype))[0]
            if (t.shape != variable.shape) if shaped else (t.dim() != 0):
                want = list(variable.shape) if shaped else "a scalar"
                raise ValueError(
                    f"optimizer state {var!r}/{key!r} has shape {list(t.shape)}: "
                    f"{spec.name} keeps {want} there (the variable is {list(variable.shape)})"
                )
            entry[key] = t.detach().clone()
        state[index[var]] = entry
    sd = store.optimizer.state_dict()
    store.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def _state_keys(spec: OptimizerSpec, dtype: torch.dtype) -> dict[str, tuple[bool, torch.dtype]]:
    """:meth:`OptimizerSpec.state_keys`, or none known for an optimizer that steps only with a
    closure (its state is then checked against the variable's shape or a scalar only)."""
    try:
        return spec.state_keys(dtype)
    except ValueError:
        return {}


def split_init_tensors(
    header: Mapping[str, Any], tensors: list[tuple[str, torch.Tensor]]
) -> tuple[
    list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]], dict[str, dict[str, Any]]
]:
    """Splits an ``init`` request into variables and optimizer state (``opt_state`` header).

    An ``init`` without ``opt_state`` (the original form) has only variables.
    """
    opt_plain = header.get(Key.OPT_STATE)
    if opt_plain is None:
        return tensors, {}, {}
    if not isinstance(opt_plain, dict) or not all(
        isinstance(k, str) and isinstance(v, dict) for k, v in opt_plain.items()
    ):
        raise ValueError("'opt_state' must map variable names to maps")
    variables: list[tuple[str, torch.Tensor]] = []
    opt: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        split = split_opt_key(name)
        if split is None:
            variables.append((name, t))
        else:
            opt.setdefault(split[0], {})[split[1]] = t
    return variables, opt, opt_plain
