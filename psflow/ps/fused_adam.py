"""A shard's fused Adam step without ``torch.optim``'s Python around its two kernels.

``torch.optim.Adam(fused=True).step()`` ends in two calls: the step counts' ``_foreach_add_``
and ``_fused_adam_``, which updates every parameter, its moments and nothing else. Before
them it walks the parameter groups in Python (``_init_group``: each parameter's state, dtype,
sparsity and complexity checked, its lists made anew) and groups the lists by device and dtype.
A ps runs that step once per worker's push: for the CTR model's 14 dense tensors it cost about
260 us of the 740 us step on one core here (the kernel itself 480 us), and a shard with a
quarter of the model pays the same Python for a quarter of the work.

:class:`FusedAdam` makes the lists once and calls the same two kernels with the same arguments,
so the update is the same to the bit (``tests/unit/test_fused_adam.py`` holds it to
``Adam.step``). It steps only while that is certain: one parameter group of plain
``torch.optim.Adam`` with ``fused=True`` on CPU float tensors (no ``capturable``,
``differentiable``, decoupled weight decay or complex parameters), every parameter given a
gradient, every parameter's state made (the first step is ``Adam.step``'s), and the
optimizer's state and group the very objects the lists were made from (a restore's
``load_state_dict`` replaces both: the lists are made again). The rate and the other settings
are read from the group every step, so a schedule moves them as it moves ``Adam.step``'s.
"""

from __future__ import annotations

from typing import Any

import torch


class FusedAdam:
    """``optimizer.step()`` for a fused ``torch.optim.Adam``, its kernels called directly.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> opt = torch.optim.Adam([p], lr=0.1, fused=True)
        >>> fast = FusedAdam.of(opt)
        >>> fast is not None and fast.step([torch.ones(3)])  # no state yet: Adam.step's
        False
        >>> p.grad = torch.ones(3); opt.step(); p.grad = None
        >>> fast.step([torch.ones(3)])
        True
    """

    def __init__(self, optimizer: torch.optim.Adam) -> None:
        self.optimizer = optimizer
        self._made_from: tuple[Any, Any, bool] | None = None
        """What the lists were made from: the optimizer's state and group, held (a restore
        replaces both; held, neither's identity can pass to a new one), and ``amsgrad``."""
        self._lists: tuple[list[torch.Tensor], ...] = ()

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> FusedAdam | None:
        """A fast step for ``optimizer`` when it is one this class can take, else ``None``."""
        if type(optimizer) is not torch.optim.Adam or len(optimizer.param_groups) != 1:
            return None
        group = optimizer.param_groups[0]
        params = group["params"]
        if not params or not all(_plain(p) for p in params):
            return None
        return cls(optimizer) if _settings_fit(group) else None

    def step(self, grads: list[torch.Tensor]) -> bool:
        """One Adam step with ``grads`` (one a parameter, in the group's order), as
        ``optimizer.step()`` with them as the parameters' ``.grad`` would make it; ``False``,
        with nothing changed, where only ``optimizer.step()`` can make it."""
        opt = self.optimizer
        group = opt.param_groups[0]
        amsgrad = group["amsgrad"]  # the lists hold the maxima only with it
        made = self._made_from
        fresh = (
            made is not None and made[0] is opt.state and made[1] is group and made[2] == amsgrad
        )
        if not fresh and not self._make(group):
            return False
        params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = self._lists
        if not _settings_fit(group) or len(grads) != len(params):
            return False
        beta1, beta2 = group["betas"]
        with torch.no_grad():
            torch._foreach_add_(steps, 1)
            torch._fused_adam_(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                amsgrad=amsgrad, lr=group["lr"], beta1=beta1, beta2=beta2,
                weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=group["maximize"], grad_scale=None, found_inf=None,
            )  # fmt: skip
        return True

    def _make(self, group: dict[str, Any]) -> bool:
        """The kernels' lists from the optimizer's state; ``False`` while a parameter has none
        (its first step is ``Adam.step``'s, which makes it)."""
        opt = self.optimizer
        params = list(group["params"])
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
        lists: list[list[torch.Tensor]] = [[] for _ in keys]
        for p in params:
            state = opt.state.get(p)
            if not state or not _plain(p):
                return False
            for key, out in zip(keys, lists, strict=True):
                if key == "max_exp_avg_sq" and not group["amsgrad"]:
                    continue  # as Adam.step: kept in the state, not given to the kernel
                t = state.get(key)
                if not isinstance(t, torch.Tensor) or t.device != p.device:
                    return False
                out.append(t)
        exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
        self._lists = (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        self._made_from = (opt.state, group, group["amsgrad"])
        return True


def _plain(p: torch.Tensor) -> bool:
    """A parameter ``_fused_adam_`` takes as ``Adam.step`` gives it: a dense float tensor on
    the CPU (a complex one ``Adam.step`` views as real first)."""
    return p.device.type == "cpu" and p.is_floating_point() and not p.is_sparse


def _settings_fit(group: dict[str, Any]) -> bool:
    """Settings with which ``Adam.step`` ends in ``_fused_adam_`` exactly as :class:`FusedAdam`
    calls it."""
    lr = group["lr"]
    return (
        group.get("fused") is True
        and not group.get("capturable", False)
        and not group.get("differentiable", False)
        and not group.get("decoupled_weight_decay", False)
        and type(lr) in (float, int)
    )
