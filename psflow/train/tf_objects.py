"""The object graph of a TensorFlow 2 checkpoint: which saved tensor is which variable, and
which are an optimizer's slots for it.

``tf.train.Checkpoint`` (and Keras's ``model.save_weights`` in TensorFlow format) saves each
variable under the path the object graph reached it by
(``model/layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE``, or in Keras 3
``optimizer/_trainable_variables/1/.ATTRIBUTES/VARIABLE_VALUE``), and the graph itself as the
string tensor ``_CHECKPOINTABLE_OBJECT_GRAPH`` (a ``TrackableObjectGraph`` proto): its nodes,
their named children, and per node the tensors it saved with each one's ``full_name`` (the
variable's own name: ``head/kernel``).

An optimizer's slots for a variable are linked to it in one of three ways, by Keras version:

- TensorFlow's own and ``tf.keras.optimizers.legacy`` (``OptimizerV2``): the graph's slot
  references (``slot_variables``: the variable's node, the slot name ``m``/``v``/
  ``accumulator``/``momentum``/``linear``, the slot's node); steps in the child ``iter``
  (``tf.compat.v1.train.AdamOptimizer``: in its ``beta1_power`` and ``beta2_power``).
- Keras 3 (TensorFlow 2.16 on): the optimizer's list ``_trainable_variables`` holds the
  variable at index ``i``; its slot lists (``_momentums``, ``_velocities``, ``_accumulators``,
  ``_linears``, SGD's ``momentums``) hold its slots at the same index; steps in
  ``_iterations``.
- ``tf_keras`` (Keras 2.11 on): the optimizer's slot lists hold variables named
  ``<optimizer>/<slot>/<variable>`` (``Adam/m/head/kernel``); steps in ``_iterations``.

``tf.distribute.ParameterServerStrategy`` saves a ``ShardedVariable`` whole (in slices) under
the name ``"ShardedVariable"``, its ``tf_keras`` slots too: such a variable is known by its
path (its key without :data:`VALUE_SUFFIX`), and its slots by shape, where that is one to one.

Parsed with :mod:`psflow.train.tf_proto`; nothing is evaluated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from psflow.train.tf_proto import as_int, as_message, fields

__all__ = ["GRAPH_KEY", "VALUE_SUFFIX", "ObjectGraph", "Slots"]

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
"""The checkpoint key of a TensorFlow 2 checkpoint's object graph."""

_VALUE = "VARIABLE_VALUE"
"""The attribute name a variable's value is saved under."""

VALUE_SUFFIX = "/.ATTRIBUTES/" + _VALUE
"""What a variable's key adds to its path in the object graph."""

_SLOT_LISTS = {
    "_momentums": "m",
    "_velocities": "v",
    "_velocity_hats": "vhat",
    "momentums": "momentum",
    "_accumulators": "accumulator",
    "_linears": "linear",
}
"""A Keras optimizer's slot lists (Keras 3's and ``tf_keras``'s), by the slot name the slot
references give them."""

_STEPS = ("_iterations", "iter")
_LEARNING_RATE = ("_learning_rate", "learning_rate")


@dataclass
class _Node:
    children: list[tuple[str, int]] = field(default_factory=list)
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Attribute name -> (full name, checkpoint key)."""
    slot_refs: list[tuple[int, str, int]] = field(default_factory=list)
    """(original variable's node, slot name, slot's node)."""

    def child(self, *names: str) -> int | None:
        for local, node in self.children:
            if local in names:
                return node
        return None


@dataclass
class Slots:
    """An optimizer's slots for one variable, and where its step count and rate are saved."""

    keys: dict[str, str]
    """Slot name (``m``, ``v``, ``accumulator``, ``momentum``, ``linear``) -> checkpoint key."""
    steps: str | None
    """The key of the optimizer's step count (``iterations``); ``None`` when it has none."""
    learning_rate: str | None
    """The key of its learning rate, when saved as a variable (not a schedule)."""


class ObjectGraph:
    """A ``TrackableObjectGraph``, parsed.

    Args:
        data: the serialized proto (the ``_CHECKPOINTABLE_OBJECT_GRAPH`` tensor's one string).

    Raises:
        ValueError: for bytes that are not such a proto, or references to nodes it lacks.
    """

    def __init__(self, data: bytes) -> None:
        self.nodes: list[_Node] = []
        for number, value in fields(data):
            if number == 1:
                self.nodes.append(_node(as_message(value)))
        count = len(self.nodes)
        for node in self.nodes:
            refs = [n for _, n in node.children] + [
                n for orig, _, slot in node.slot_refs for n in (orig, slot)
            ]
            if any(not 0 <= n < count for n in refs):
                raise ValueError(f"the object graph refers to a node outside its {count}")
        self._by_key = {
            key: i
            for i, node in enumerate(self.nodes)
            for attr, (_, key) in node.tensors.items()
            if attr == _VALUE
        }
        self._names: dict[str, list[str]] = {}
        for key, i in self._by_key.items():
            if not self._nameless(i):
                self._names.setdefault(self.nodes[i].tensors[_VALUE][0], []).append(key)

    def variables(self) -> dict[str, list[str]]:
        """Each variable's own name (``full_name``: ``head/kernel``) -> its checkpoint keys
        (one, unless two variables of the graph share the name)."""
        return {name: list(keys) for name, keys in self._names.items()}

    def saved_keys(self) -> list[str]:
        """The checkpoint key of every variable value the graph names."""
        return list(self._by_key)

    def keys_of(self, name: str) -> list[str]:
        """The keys of the variables named ``name`` (none, one, or more that share it)."""
        return list(self._names.get(name, ()))

    def nameless(self) -> list[str]:
        """The keys of the variables saved without a name of their own (``ShardedVariable``)."""
        return [key for key, i in self._by_key.items() if self._nameless(i)]

    def slots(
        self, key: str, shape_of: Callable[[str], tuple[int, ...]] | None = None
    ) -> Slots | None:
        """The optimizer's slots for the variable saved under ``key``; ``None`` when no
        optimizer in the graph keeps any for it.

        ``shape_of`` (a key's shape) links the slots of a ``tf_keras`` optimizer to a variable
        that has no name of its own (a ``ShardedVariable`` of ``ParameterServerStrategy``,
        which TensorFlow names ``"ShardedVariable"``, slots and all): by shape, when exactly
        one such variable and one such slot per slot list have it.

        Raises:
            ValueError: when the slots by shape are not one to one.
        """
        target = self._by_key.get(key)
        if target is None:
            return None
        for find in (self._by_reference, self._by_list_index, self._by_name):
            found = find(target)
            if found is not None:
                return self._slots(*found)
        if shape_of is not None and self._nameless(target):
            found = self._by_shape(target, shape_of)
            if found is not None:
                return self._slots(*found)
        return None

    def _by_reference(self, target: int) -> tuple[int, dict[str, str]] | None:
        """``OptimizerV2`` (and TensorFlow 1.x's optimizers): the graph's slot references."""
        for owner, node in enumerate(self.nodes):
            found = {name: self._key(slot) for orig, name, slot in node.slot_refs if orig == target}
            if found:
                return owner, found
        return None

    def _by_list_index(self, target: int) -> tuple[int, dict[str, str]] | None:
        """Keras 3: the slot lists at the variable's index in ``_trainable_variables``."""
        for owner, node in enumerate(self.nodes):
            listed = node.child("_trainable_variables")
            if listed is None:
                continue
            index = next((i for i, n in self.nodes[listed].children if n == target), None)
            if index is None:
                continue
            found = {}
            for local, list_node in node.children:
                name = _SLOT_LISTS.get(local)
                slot = self.nodes[list_node].child(index) if name else None
                if name and slot is not None:
                    found[name] = self._key(slot)
            if found:
                return owner, found
        return None

    def _by_name(self, target: int) -> tuple[int, dict[str, str]] | None:
        """``tf_keras``: slots named ``<optimizer>/<slot>/<variable>`` in the slot lists."""
        if self._nameless(target):
            return None
        var_name = self.nodes[target].tensors[_VALUE][0]
        for owner, node in enumerate(self.nodes):
            if node.child(*_STEPS) is None:
                continue
            found = {}
            for _, list_node in node.children:
                for _, slot in self.nodes[list_node].children:
                    saved = self.nodes[slot].tensors.get(_VALUE)
                    if saved is None or not saved[0].endswith("/" + var_name):
                        continue
                    head = saved[0][: -len(var_name) - 1]  # "<optimizer>/<slot>"
                    if head.count("/") == 1:
                        found[head.split("/")[1]] = saved[1]
            if found:
                return owner, found
        return None

    def _by_shape(
        self, target: int, shape_of: Callable[[str], tuple[int, ...]]
    ) -> tuple[int, dict[str, str]] | None:
        """A nameless variable's slots in a ``tf_keras`` optimizer's slot lists, by shape."""
        shape = shape_of(self._key(target))
        in_lists = {
            slot
            for node in self.nodes
            if node.child(*_STEPS) is not None
            for _, list_node in node.children
            for _, slot in self.nodes[list_node].children
        }
        twins = [
            i
            for i in self._by_key.values()
            if i not in in_lists and self._nameless(i) and shape_of(self._key(i)) == shape
        ]
        for owner, node in enumerate(self.nodes):
            if node.child(*_STEPS) is None:
                continue
            found = {}
            for local, list_node in node.children:
                name = _SLOT_LISTS.get(local)
                if name is None:
                    continue
                same = [
                    slot
                    for _, slot in self.nodes[list_node].children
                    if self._nameless(slot) and shape_of(self._key(slot)) == shape
                ]
                if len(same) > 1 or (same and len(twins) > 1):
                    raise ValueError(
                        f"the optimizer's {local} holds {len(same)} slots of shape "
                        f"{list(shape)} for {len(twins)} unnamed variables of that shape "
                        "(ShardedVariables): which is whose is not recorded; read them by key"
                    )
                if same:
                    found[name] = self._key(same[0])
            if found:
                return owner, found
        return None

    def _nameless(self, node: int) -> bool:
        """Whether ``node`` saved a variable with no name of its own."""
        saved = self.nodes[node].tensors.get(_VALUE)
        return saved is not None and saved[0] in ("", "ShardedVariable")

    def _slots(self, owner: int, found: dict[str, str]) -> Slots:
        """The slots ``found`` for a variable, with the step count and rate of ``owner``."""
        node = self.nodes[owner]
        steps, rate = node.child(*_STEPS), node.child(*_LEARNING_RATE)
        return Slots(
            keys=found,
            steps=None if steps is None else self._key(steps),
            learning_rate=None if rate is None else self._key(rate),
        )

    def _key(self, node: int) -> str:
        """The checkpoint key of the variable ``node`` saved."""
        saved = self.nodes[node].tensors.get(_VALUE)
        if saved is None:
            raise ValueError(f"the object graph's node {node} saved no variable value")
        return saved[1]


def _node(buf: bytes) -> _Node:
    node = _Node()
    for number, value in fields(buf):
        if number == 1:
            ref = {n: v for n, v in fields(as_message(value))}
            node.children.append((_text(ref.get(2, b"")), as_int(ref.get(1, 0))))
        elif number == 2:
            tensor = {n: v for n, v in fields(as_message(value))}
            name = _text(tensor.get(1, b""))
            node.tensors[name] = (_text(tensor.get(2, b"")), _text(tensor.get(3, b"")))
        elif number == 3:
            ref = {n: v for n, v in fields(as_message(value))}
            node.slot_refs.append(
                (as_int(ref.get(1, 0)), _text(ref.get(2, b"")), as_int(ref.get(3, 0)))
            )
    return node


def _text(value: int | bytes) -> str:
    try:
        return as_message(value).decode()
    except UnicodeDecodeError:
        raise ValueError("a name in the object graph is not UTF-8") from None
