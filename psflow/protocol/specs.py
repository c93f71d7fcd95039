"""Settings that travel between tasks as plain data: what the worker asks of the ps."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

_ARG_TYPES = (int, float, bool, str, type(None))


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """A ``torch.optim`` optimizer named with its arguments, so that it can travel as data.

    Example:
        >>> spec = OptimizerSpec(name="SGD", kwargs={"lr": 0.01, "momentum": 0.9})
        >>> spec.build([torch.zeros(2)]).__class__.__name__
        'SGD'
    """

    name: str = "SGD"
    """The class name in ``torch.optim`` (``SGD``, ``Adam``, ``Adagrad``, ...)."""
    kwargs: Mapping[str, Any] = field(default_factory=lambda: {"lr": 0.01})
    """Its keyword arguments: numbers, strings, booleans, or lists of them."""

    def __post_init__(self) -> None:
        cls = getattr(torch.optim, self.name, None) if isinstance(self.name, str) else None
        is_optimizer = isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        if cls is None or not is_optimizer or cls is torch.optim.Optimizer:
            raise ValueError(f"unknown optimizer {self.name!r}: expected a torch.optim class name")
        if not isinstance(self.kwargs, Mapping):
            raise ValueError(f"optimizer arguments must be a mapping, got {self.kwargs!r}")
        for key, value in self.kwargs.items():
            ok = isinstance(value, _ARG_TYPES) or (
                isinstance(value, list | tuple) and all(isinstance(v, _ARG_TYPES) for v in value)
            )
            if not isinstance(key, str) or not ok:
                raise ValueError(f"optimizer argument {key!r}={value!r} is not a plain value")
        try:
            # Checked here, on the worker, so a misspelt argument is named at once rather
            # than refused by every ps when the chief initialises them.
            inspect.signature(cls).bind([], **self.kwargs)
        except TypeError as e:
            raise ValueError(
                f"cannot build torch.optim.{self.name}({dict(self.kwargs)}): {e}"
            ) from None

    @classmethod
    def of(cls, optimizer: str | OptimizerSpec, **kwargs: Any) -> OptimizerSpec:
        """``optimizer`` itself, or the class it names with ``kwargs`` (default ``lr=0.01``).

        Raises:
            ValueError: for an unknown class, an argument it does not take, or arguments
                given beside a spec.
        """
        if isinstance(optimizer, OptimizerSpec):
            if kwargs:
                raise ValueError(f"give {sorted(kwargs)} in the OptimizerSpec, not beside it")
            return optimizer
        return cls(name=optimizer, kwargs=kwargs or {"lr": 0.01})

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, self.name)
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in self.kwargs.items()}
        try:
            return cls(params, **kwargs)  # type: ignore[no-any-return]
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot build torch.optim.{self.name}({kwargs}): {e}") from None

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "kwargs": {k: _plain(v) for k, v in self.kwargs.items()}}

    @classmethod
    def from_wire(cls, data: Any) -> OptimizerSpec:
        if not isinstance(data, dict):
            raise ValueError(f"optimizer spec must be a map, got {data!r}")
        return cls(name=data.get("name", ""), kwargs=data.get("kwargs", {}))


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v
