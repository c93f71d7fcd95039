"""The lookups a worker's tables made since the last step (:class:`Lookups`), which the step
pushes (:class:`~psflow.worker.tables.TableClient`) or applies (a cluster of one,
:class:`~psflow.train.alone.LocalTables`): ``zero_grad()`` clears their gradients and keeps
them, as torch keeps the graph."""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any, Generic, TypeVar

import torch

L = TypeVar("L")


class Lookups(Generic[L]):
    """The lookups made since the last step, each what it looked up (``about``: its table and
    ids) and its leaf, the rows on which autograd leaves their gradient; a table's
    :class:`~psflow.nn.RowSource` keeps them for the step to take (:meth:`take`).

    ``zero_grad()`` clears gradients, not the graph, as in torch, where ``out = model(x);
    opt.zero_grad(); loss.backward(); opt.step()`` applies that backward's gradients:
    :meth:`zero_grad` sets each leaf's gradient to ``None`` and keeps its lookup for a
    backward still to come. A kept lookup is held by a weak reference until a gradient reaches
    its leaf (a hook on the leaf holds it again then); one that gets none (a forward with no
    backward, scoring in training mode) goes with its graph, so that a loop with no step does
    not pile them up. A step forgets every lookup, and pushes only those with a gradient.
    """

    def __init__(self) -> None:
        self._held: list[tuple[L, torch.Tensor]] = []
        self._zeroed: dict[int, tuple[L, weakref.ref[torch.Tensor]]] = {}
        self._keys = itertools.count()

    def __len__(self) -> int:
        """The lookups still kept: held, or zeroed with a graph that may still reach them."""
        return len(self._held) + sum(1 for _, leaf in self._zeroed.values() if leaf() is not None)

    def add(self, about: L, leaf: torch.Tensor) -> None:
        """Keeps a forward's lookup: ``leaf``, a tensor that requires grad, holds its rows."""
        self._held.append((about, leaf))

    def take(self) -> list[tuple[L, torch.Tensor]]:
        """The lookups whose leaves have a gradient (the step's), in the order they were held;
        forgets every lookup."""
        held, self._held = self._held, []
        self._zeroed.clear()
        return [(about, leaf) for about, leaf in held if leaf.grad is not None]

    def zero_grad(self) -> None:
        """Sets the gradient of every lookup's leaf to ``None`` (never zeroed in place: a push
        in flight may still be sending the last step's) and keeps the lookups, weakly, until a
        gradient reaches them again (see the class docstring)."""
        me = weakref.ref(self)
        for about, leaf in self._held:
            leaf.grad = None
            key = next(self._keys)
            self._zeroed[key] = (about, weakref.ref(leaf))
            leaf.register_post_accumulate_grad_hook(functools.partial(_regained, me, key))
        self._held = []
        self._zeroed = {k: z for k, z in self._zeroed.items() if z[1]() is not None}

    def clear(self) -> None:
        """Forgets every lookup."""
        self._held = []
        self._zeroed.clear()

    def _regained(self, key: int, leaf: torch.Tensor) -> None:
        zeroed = self._zeroed.pop(key, None)
        if zeroed is not None:  # else taken by a step, or cleared, since
            self._held.append((zeroed[0], leaf))


def _regained(lookups: weakref.ref[Lookups[Any]], key: int, leaf: torch.Tensor) -> None:
    """The hook on a zeroed lookup's leaf (:meth:`Lookups.zero_grad`): a gradient reached it,
    so its lookup is held again for the step. The hook holds its :class:`Lookups` weakly: a
    leaf the lookups hold must not keep them alive."""
    held = lookups()
    if held is not None:
        held._regained(key, leaf)
