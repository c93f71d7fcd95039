"""TensorFlow's checkpoints, read without TensorFlow: a trained model's tables and variables for
a job that goes on from them in psflow.

:class:`TFCheckpoint` reads the tensors of a V2 checkpoint (``tf.compat.v1.train.Saver``'s or
``tf.train.Checkpoint``'s, Keras's included) as :class:`~psflow.train.tf_reader.BundleReader`
does, by key or by a TensorFlow 2 variable's own name: the format, partitioned variables and
the checks made are described there. On top, what TensorFlow meant by them:

A partitioned embedding table saved whole is in *partition* order, which is id order only for
``partition_strategy="div"``: with ``"mod"`` (``embedding_lookup``'s default) partition ``p``
holds ids ``p, p + S, p + 2S, ...``. :meth:`TFCheckpoint.embedding` puts the rows in id order
for the strategy the model was trained with (the checkpoint does not record it), ready for
``psflow.nn.Embedding.from_pretrained(rows, freeze=False)``.

The optimizer's slots of a table (:meth:`TFCheckpoint.table_state`) or of a dense variable
(:meth:`TFCheckpoint.optimizer_state`) are read as the state of psflow's row-wise optimizer or of
the ``torch.optim`` optimizer that takes the same step; a TensorFlow 2 checkpoint's object graph
(:mod:`psflow.train.tf_objects`) links the optimizer's slots to their variables.

Example:
    >>> # ckpt = TFCheckpoint("/ckpt/model.ckpt-100000")
    >>> # rows = ckpt.embedding("items", partition_strategy="mod")
    >>> # table = psflow.nn.Embedding.from_pretrained(rows, freeze=False, partition="mod")
"""

from __future__ import annotations

import math
import re

import fsspec
import torch

from psflow.ps import safefile
from psflow.train.tf_objects import Slots
from psflow.train.tf_reader import BundleReader

__all__ = ["TFCheckpoint"]

_SLOTS = {
    "Adagrad": {"sum": "Adagrad"},
    "Ftrl": {"accum": "Ftrl", "linear": "Ftrl_1"},
    "Adam": {"exp_avg": "Adam", "exp_avg_sq": "Adam_1"},
}
"""TensorFlow's slot names for a variable's optimizer state (``<var>/<slot>``), by psflow's
row-wise optimizer and its state key."""

_DENSE_SLOTS = {
    "Adagrad": {"sum": "Adagrad"},
    "Momentum": {"momentum_buffer": "Momentum"},
    "Adam": {"exp_avg": "Adam", "exp_avg_sq": "Adam_1"},
}
"""TensorFlow 1.x's slot names for a dense variable's optimizer state, by the TensorFlow
optimizer (``AdagradOptimizer``, ``MomentumOptimizer``, ``AdamOptimizer``) and the state key of
the ``torch.optim`` optimizer that computes the same update (``Adagrad``, ``SGD`` with
``momentum``, ``Adam``)."""

_GRAPH_SLOTS: dict[str, dict[str, tuple[str, ...]]] = {
    "Adagrad": {"sum": ("accumulator",)},
    "Momentum": {"momentum_buffer": ("momentum", "m")},
    "Adam": {"exp_avg": ("m",), "exp_avg_sq": ("v",)},
    "Ftrl": {"accum": ("accumulator",), "linear": ("linear",)},
}
"""The slot names a TensorFlow 2 checkpoint's object graph gives the same state (Keras's and
TensorFlow's: see :mod:`psflow.train.tf_objects`), by state key. ``tf_keras`` calls SGD's
momentum ``m``."""


class TFCheckpoint(BundleReader):
    """A TensorFlow V2 checkpoint, read (see the module docstring).

    Args:
        prefix: the checkpoint's prefix, ``<dir>/model.ckpt-<step>`` (what
            ``tf.train.latest_checkpoint`` returns); a local path or an fsspec URL.

    Raises:
        FileNotFoundError: when the index is missing.
        ValueError: when the index is not a checkpoint's or fails a check.
    """

    @staticmethod
    def latest(directory: str) -> str | None:
        """The prefix of the latest checkpoint in ``directory``, as
        ``tf.train.latest_checkpoint`` finds it (the ``checkpoint`` state file's
        ``model_checkpoint_path``); ``None`` without that file."""
        fs, path = fsspec.core.url_to_fs(directory)
        state = path.rstrip("/") + "/checkpoint"
        if not fs.exists(state):
            return None
        # A FIFO (or a directory, a device) there is refused, not opened: an open would block.
        with safefile.open_regular(directory.rstrip("/") + "/checkpoint", directory) as f:
            text = f.read(1 << 20).decode(errors="replace")
        found = re.search(r'^model_checkpoint_path:\s*"((?:[^"\\]|\\.)*)"', text, re.MULTILINE)
        if found is None:
            raise ValueError(f"{state}: no model_checkpoint_path")
        # The text format's C escapes (octal bytes of a UTF-8 name included) back to the name.
        raw = found.group(1).encode().decode("unicode_escape").encode("latin-1")
        prefix = raw.decode(errors="replace")
        here = f"{directory.rstrip('/')}/{prefix.rsplit('/', 1)[-1]}"
        if not (prefix.startswith("/") or "://" in prefix):
            return f"{directory.rstrip('/')}/{prefix}"
        # An absolute path TensorFlow wrote: the directory may have moved since.
        moved = not fs.exists(fsspec.core.url_to_fs(prefix)[1] + ".index")
        return here if moved and fs.exists(fsspec.core.url_to_fs(here)[1] + ".index") else prefix

    def embedding(self, name: str, partition_strategy: str = "mod") -> torch.Tensor:
        """A (partitioned) embedding table's rows in id order: row ``i`` is what
        ``embedding_lookup(table, i, partition_strategy=...)`` returned in TensorFlow.

        Raises:
            ValueError: for a tensor that is not 2-D, a strategy other than ``"mod"`` or
                ``"div"``, or partitions that are not the ones ``embedding_lookup`` assumes.
        """
        if partition_strategy not in ("mod", "div"):
            raise ValueError(
                f"partition_strategy must be 'mod' or 'div', got {partition_strategy!r}"
            )
        whole = self.tensor(name)
        if whole.dim() != 2:
            raise ValueError(f"{name!r} has shape {list(whole.shape)}: not an embedding table")
        parts = self.partitions(name)
        if len(parts) <= 1:
            return whole
        n, shards = whole.shape[0], len(parts)
        # embedding_lookup's layout for both strategies: the first n % S partitions hold one more.
        expected = [len(range(p, n, shards)) for p in range(shards)]
        if [rows for _, rows in parts] != expected:
            raise ValueError(
                f"{name!r} is saved in partitions of {[rows for _, rows in parts]} rows; "
                f"embedding_lookup over {shards} partitions assumes {expected}"
            )
        if partition_strategy == "div":
            return whole
        out = torch.empty_like(whole)
        for p, (start, rows) in enumerate(parts):
            out[p::shards] = whole[start : start + rows]
        return out

    def hash_table(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the hash table ``name`` (a ``MutableHashTable`` of rows:
        ``<name>-keys`` and ``<name>-values`` as ``tf.compat.v1.train.Saver`` writes them,
        ``<name>/.ATTRIBUTES/table-keys`` and ``table-values`` as ``tf.train.Checkpoint``
        does), in the table's own order: for a hashed table's
        :meth:`~psflow.nn.TableModule.load_rows`.

        Raises:
            KeyError: when the checkpoint holds no such pair.
            ValueError: when the keys are not 1-D int64 or the values not one row per key.
        """
        pairs = [(f"{name}-keys", f"{name}-values")]
        pairs.append((f"{name}/.ATTRIBUTES/table-keys", f"{name}/.ATTRIBUTES/table-values"))
        for keys_name, values_name in pairs:
            if keys_name in self._entries and values_name in self._entries:
                keys, values = self.tensor(keys_name), self.tensor(values_name)
                if keys.dtype != torch.int64 or keys.dim() != 1:
                    raise ValueError(
                        f"{self.prefix}: the keys of hash table {name!r} are {keys.dtype} "
                        f"{list(keys.shape)}, not 1-D int64"
                    )
                if values.dim() < 1 or values.shape[0] != keys.numel():
                    raise ValueError(
                        f"{self.prefix}: hash table {name!r} has {keys.numel()} keys and "
                        f"values of shape {list(values.shape)}"
                    )
                return keys, values
        tried = ", ".join(f"{k} and {v}" for k, v in pairs)
        raise KeyError(f"{self.prefix} holds no hash table {name!r} (looked for {tried})")

    def table_state(
        self,
        name: str,
        optimizer: str,
        partition_strategy: str = "mod",
        *,
        beta1: float = 0.9,
        beta2: float = 0.999,
        beta_powers: tuple[str, str] = ("beta1_power", "beta2_power"),
    ) -> dict[str, torch.Tensor]:
        """The slots TensorFlow's ``optimizer`` kept for table ``name``, in id order, as
        psflow's row-wise form of it keeps them: ``Adagrad``'s accumulator (``<name>/Adagrad``)
        as ``sum``; ``Ftrl``'s (``<name>/Ftrl``, ``<name>/Ftrl_1``) as ``accum`` and
        ``linear``; ``Adam``'s (``<name>/Adam``, ``<name>/Adam_1``) as ``exp_avg`` and
        ``exp_avg_sq``, with every row's ``step`` the optimizer's global count (from its beta
        powers, as for :meth:`optimizer_state`; ``beta1``, ``beta2``, ``beta_powers`` as
        there). For ``from_pretrained(rows, optimizer=..., optimizer_state=...)``: the table
        goes on from TensorFlow's training, not from fresh state. From a TensorFlow 2
        checkpoint, the slots its object graph names (as for :meth:`optimizer_state`: Keras's
        ``Adagrad``, ``Ftrl`` and ``Adam``), ``step`` the optimizer's ``iterations``.

        psflow's row-wise Adam is lazy (``LazyAdamOptimizer``'s update, TensorFlow's bias
        correction by the global step): from this state its next step of a row is the one
        TensorFlow took. ``tf.compat.v1.train.AdamOptimizer`` itself is not lazy on a table:
        it also decays the moments of rows a step does not touch, and moves them.

        Raises:
            ValueError: for another optimizer, or slots the checkpoint lacks.
        """
        slots = _SLOTS.get(optimizer)
        if slots is None:
            raise ValueError(
                f"a table's optimizer state is read for {sorted(_SLOTS)}, not {optimizer!r}"
            )
        keys, found = self._slot_keys(name, optimizer, slots)
        state = {key: self.embedding(slot, partition_strategy) for key, slot in keys.items()}
        if optimizer == "Adam":
            steps = self._steps(found, beta1, beta2, beta_powers)
            rows = state["exp_avg"].shape[0]
            state["step"] = torch.full((rows,), steps, dtype=torch.int64)
        return state

    def optimizer_state(
        self,
        name: str,
        optimizer: str,
        *,
        transpose: bool = False,
        slot_prefix: str | None = None,
        beta1: float = 0.9,
        beta2: float = 0.999,
        beta_powers: tuple[str, str] = ("beta1_power", "beta2_power"),
        lr: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """The slots TensorFlow 1.x's ``optimizer`` kept for the dense variable ``name``, as
        the state of the ``torch.optim`` optimizer that takes the same step: for
        ``DistributedOptimizer(..., optimizer_state={param: ...})`` (or ``TrainingSession``), so
        that training goes on from TensorFlow's, not from fresh state.

        - ``"Adagrad"`` (``AdagradOptimizer``, for ``torch.optim.Adagrad``): ``<name>/Adagrad``
          as ``sum``, and ``step`` (the checkpoint's ``global_step``, else 0; only
          ``lr_decay`` reads it).
        - ``"Momentum"`` (``MomentumOptimizer``, for ``torch.optim.SGD(momentum=...)``, with
          ``nesterov`` as ``use_nesterov``): ``<name>/Momentum`` as ``momentum_buffer``.
        - ``"Adam"`` (``AdamOptimizer``, for ``torch.optim.Adam``): ``<name>/Adam`` and
          ``<name>/Adam_1`` as ``exp_avg`` and ``exp_avg_sq``, and ``step``: the steps taken,
          from the optimizer's ``beta1_power`` (``beta1 ** (steps + 1)``: exact while it is a
          normal float32, about 800 steps); then from ``beta2_power`` (to within a few steps,
          when a step hardly moves the bias correction); from the ``global_step`` when both
          have run out of float32's range. TensorFlow adds ``epsilon`` to ``sqrt(v)`` before
          the bias correction, torch after it: the steps differ by less than ``epsilon`` in
          the denominator.

        A TensorFlow 2 checkpoint (``tf.train.Checkpoint`` of a Keras model and its optimizer:
        Keras 3, ``tf_keras``, ``tf.keras.optimizers.legacy``) names its slots through its
        object graph (:mod:`psflow.train.tf_objects`); ``name`` is then the variable's own
        name (``head/kernel``) or its key. Keras's ``Adagrad`` (``accumulator``), ``SGD`` with
        ``momentum`` and ``Adam`` (``m``, ``v``) give the same state; the steps are the
        optimizer's ``iterations``. Keras's momentum is ``momentum * m - lr * g``, added to
        the variable: it becomes torch's buffer as ``-m / lr``, the rate the checkpoint saved
        (or ``lr``). Keras's ``Adagrad`` adds ``epsilon`` inside the square root, torch
        outside: the steps differ by far less than 1e-6 at Keras's default ``1e-7``.

        Args:
            name: the variable, as saved (``dense/kernel``; a TensorFlow 2 variable's name or
                key).
            optimizer: ``"Adagrad"``, ``"Momentum"`` or ``"Adam"``.
            transpose: transpose 2-D slots, as for a TensorFlow kernel (``[in, out]``) that
                becomes a ``torch.nn.Linear`` weight (``[out, in]``).
            slot_prefix: the optimizer's name when it was given one (``AdamOptimizer(name=
                "Adam2")`` keeps ``<var>/Adam2`` and ``<var>/Adam2_1``); default the class's.
            beta1, beta2: ``AdamOptimizer``'s, to count its steps.
            beta_powers: the names of Adam's ``beta1_power`` and ``beta2_power`` (TensorFlow
                numbers them ``beta1_power_1``, ... when a graph has several Adam optimizers).
            lr: Keras's learning rate at its last step, for ``"Momentum"``, when the checkpoint
                saved none (a schedule).

        Raises:
            ValueError: for another optimizer, slots or beta powers the checkpoint lacks, or a
                slot whose shape is not the variable's.
        """
        slots = _DENSE_SLOTS.get(optimizer)
        if slots is None:
            raise ValueError(
                f"a dense variable's optimizer state is read for {sorted(_DENSE_SLOTS)}, not "
                f"{optimizer!r}"
            )
        if slot_prefix is not None:
            slots = {key: slot.replace(optimizer, slot_prefix, 1) for key, slot in slots.items()}
        keys, found = self._slot_keys(name, optimizer, slots)
        shape = self.shape(name)
        state = {}
        for key, slot in keys.items():
            value = self.tensor(slot)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"{self.prefix}: slot {slot} has shape {list(value.shape)}, the variable "
                    f"{name!r} {list(shape)}"
                )
            if transpose:
                if value.dim() != 2:
                    raise ValueError(f"transpose: {name!r} has shape {list(shape)}, not 2-D")
                value = value.T.contiguous()
            state[key] = value
        if optimizer == "Momentum" and found is not None and found.steps is not None:
            # Keras keeps m = momentum * m - lr * g and adds it; torch's buffer is
            # momentum * buf + g, subtracted times lr: buf = -m / lr (exact for a constant lr).
            rate = lr if lr is not None else self._learning_rate(found, name)
            state["momentum_buffer"] = state["momentum_buffer"].div(-rate)
        if optimizer == "Adagrad":
            steps = self._scalar_int(found.steps) if found and found.steps else None
            state["step"] = torch.tensor(float(steps or self._global_step() or 0))
        elif optimizer == "Adam":
            state["step"] = torch.tensor(float(self._steps(found, beta1, beta2, beta_powers)))
        return state

    def _slot_keys(
        self, name: str, optimizer: str, tf1_slots: dict[str, str]
    ) -> tuple[dict[str, str], Slots | None]:
        """The key of each state key's slot of ``name``, and the object graph's account of
        them (``None``: a TensorFlow 1.x checkpoint's ``<name>/<slot>`` names)."""
        key = self._key(name)
        graph = self._object_graph()
        found = graph.slots(key, self.shape) if graph is not None else None
        if found is None:
            missing = [f"{name}/{s}" for s in tf1_slots.values() if f"{name}/{s}" not in self]
            if missing:
                raise ValueError(f"{self.prefix} holds no {optimizer} slot {missing} for {name!r}")
            return {k: f"{name}/{s}" for k, s in tf1_slots.items()}, None
        keys = {}
        for state_key, options in _GRAPH_SLOTS[optimizer].items():
            slot = next((found.keys[o] for o in options if o in found.keys), None)
            if slot is None:
                raise ValueError(
                    f"{self.prefix}: the optimizer keeps slots {sorted(found.keys)} for "
                    f"{name!r}; {optimizer} keeps {' or '.join(options)} (was it trained with "
                    "another optimizer?)"
                )
            keys[state_key] = slot
        return keys, found

    def _steps(
        self, found: Slots | None, beta1: float, beta2: float, beta_powers: tuple[str, str]
    ) -> int:
        """The steps an Adam optimizer took: a Keras optimizer's ``iterations``, else counted
        from ``AdamOptimizer``'s beta powers."""
        if found is not None and found.steps is not None:
            return self._scalar_int(found.steps)
        return self._adam_steps(beta1, beta2, beta_powers)

    def _learning_rate(self, found: Slots, name: str) -> float:
        if found.learning_rate is None:
            raise ValueError(
                f"{self.prefix}: the optimizer of {name!r} saved no learning rate (a schedule?): "
                "give lr=, its rate at the last step, to turn Keras's momentum into torch's"
            )
        rate = self.tensor(found.learning_rate)
        if rate.numel() != 1 or not rate.dtype.is_floating_point or not float(rate.sum()) > 0:
            raise ValueError(f"{self.prefix}: the learning rate of {name!r} is {rate.tolist()}")
        return float(rate.sum())

    def _scalar_int(self, key: str) -> int:
        value = self.tensor(key)
        if value.numel() != 1 or value.dtype.is_floating_point:
            raise ValueError(f"{self.prefix}: {key} is {value.dtype} {list(value.shape)}")
        return int(value.reshape(()).item())

    def _global_step(self) -> int | None:
        return self._scalar_int("global_step") if "global_step" in self else None

    def _adam_steps(self, beta1: float, beta2: float, names: tuple[str, str]) -> int:
        """The steps an ``AdamOptimizer`` took: its ``beta_power`` variables hold
        ``beta ** (steps + 1)`` (the power its next step uses)."""
        missing = [n for n in names if n not in self]
        if missing:
            raise ValueError(
                f"{self.prefix} holds no {missing} (AdamOptimizer's beta powers; name them with "
                "beta_powers=)"
            )
        for beta in (beta1, beta2):
            if not 0.0 < beta < 1.0:
                raise ValueError(f"beta {beta} must lie in (0, 1)")
        # beta1's power counts exactly while it is a normal float32 (about 800 steps); then
        # beta2's (about 87,000), to within a few steps: its float32 products drift by about
        # 6e-8 each, a step's worth being 1e-3. By then bias correction hardly moves.
        for power_name, beta, exact in ((names[0], beta1, True), (names[1], beta2, False)):
            power = self.tensor(power_name)
            if power.numel() != 1 or not power.dtype.is_floating_point:
                raise ValueError(
                    f"{self.prefix}: {power_name} is {power.dtype} {list(power.shape)}"
                )
            value = float(power.reshape(()).item())
            if not value >= torch.finfo(torch.float32).tiny:
                continue
            steps = math.log(value) / math.log(beta) - 1
            if value > 1.0 or (exact and abs(steps - round(steps)) > 0.01):
                raise ValueError(
                    f"{self.prefix}: {power_name} = {value} is no power of beta {beta} "
                    "(give AdamOptimizer's beta1 and beta2)"
                )
            return max(0, round(steps))
        step = self._global_step()
        if step is None:
            raise ValueError(
                f"{self.prefix}: Adam's beta powers have reached 0 and there is no global_step "
                "to count its steps"
            )
        return step
