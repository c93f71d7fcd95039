"""Row-wise optimizers: updates of the rows a step touched, each row from its own state."""

from __future__ import annotations

import torch

import psflow.sparse.kernels as kernels
from psflow import allocator
from psflow.protocol import RowOptimizerSpec
from psflow.sparse import stripes


class RowOptimizer:
    """Applies a :class:`~psflow.protocol.RowOptimizerSpec`'s update to some rows, in place.

    The state is a dict of tensors, one row per row of the values (Adam's ``step``: one count
    per row), so that a row carries everything its updates need: rows move between shards and
    leave and come back (eviction) without any global state.

    - ``SGD``: ``w -= lr * g``.
    - ``Adagrad``: ``torch.optim.Adagrad`` (no decay): ``sum += g^2``,
      ``w -= lr * g / (sqrt(sum) + eps)``.
    - ``RowWiseAdagrad``: TorchRec's (FBGEMM's exact row-wise Adagrad): one accumulator a row,
      ``sum += mean(g^2)``, ``w += g * (-lr / (sqrt(sum) + eps))``; a row's state is one number,
      where ``Adagrad``'s is a row's worth.
    - ``Adam``: ``torch.optim.SparseAdam``'s maths with a step count per row (lazy Adam).
    - ``Ftrl``: TensorFlow's ``FtrlOptimizer`` (the ``ApplyFtrl`` kernel, no l2 shrinkage).

    The methods below are the reference, in torch's index operations; on CPU tables the fused C
    kernels of :mod:`psflow.sparse.kernels` apply the same arithmetic when the install built
    them (each row read and written once).

    Example:
        >>> opt = RowOptimizer(RowOptimizerSpec.of("SGD", lr=0.5))
        >>> w = torch.zeros(4, 2)
        >>> opt.apply(w, opt.new_state(4, 2, w.dtype), torch.tensor([1]), torch.ones(1, 2))
        >>> w[1].tolist()
        [-0.5, -0.5]
    """

    def __init__(self, spec: RowOptimizerSpec) -> None:
        self.spec = spec
        settings = spec.settings
        self.lr = float(settings["lr"])
        self.eps = float(settings.get("eps", 0.0))
        self.initial_accumulator_value = float(settings.get("initial_accumulator_value", 0.0))
        self.beta1, self.beta2 = settings.get("betas", (0.0, 0.0))
        self.lr_power = float(settings.get("lr_power", -0.5))
        self.l1 = float(settings.get("l1", 0.0))
        self.l2 = float(settings.get("l2", 0.0))
        self._apply = {
            "SGD": self._sgd,
            "Adagrad": self._adagrad,
            "RowWiseAdagrad": self._rowwise_adagrad,
            "Adam": self._adam,
            "Ftrl": self._ftrl,
        }[spec.name]

    @property
    def state_names(self) -> tuple[str, ...]:
        return self.spec.state_names

    @property
    def one_a_row(self) -> tuple[str, ...]:
        """The state whose tensors hold one float a row, not a row's worth (for
        :func:`kernels.fused`)."""
        return ("sum",) if self.spec.name == "RowWiseAdagrad" else ()

    def new_state(
        self,
        rows: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        filled: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Fresh state for ``rows`` rows (what a row that was never updated holds); on the CPU,
        in huge pages (:func:`psflow.allocator.table_empty`). ``filled=False``: the memory
        only, for rows the caller gives state (:meth:`reset_rows`) as it takes them, so that
        the pages of rows not yet taken are never touched."""
        name = self.spec.name
        on_cpu = device is None or torch.device(device).type == "cpu"

        def full(value: float, shape: tuple[int, ...] = (rows, dim)) -> torch.Tensor:
            if not on_cpu:
                out = torch.empty(shape, dtype=dtype, device=device)
            else:
                out = allocator.table_empty(shape, dtype)
            return out.fill_(value) if filled else out

        if name == "Adagrad":
            return {"sum": full(self.initial_accumulator_value)}
        if name == "RowWiseAdagrad":
            return {"sum": full(self.initial_accumulator_value, (rows,))}
        if name == "Adam":
            return {
                "exp_avg": full(0.0),
                "exp_avg_sq": full(0.0),
                "step": (torch.zeros if filled else torch.empty)(
                    rows, dtype=torch.int64, device=device
                ),
            }
        if name == "Ftrl":
            return {"accum": full(self.initial_accumulator_value), "linear": full(0.0)}
        return {}

    def reset_rows(self, state: dict[str, torch.Tensor], index: torch.Tensor) -> None:
        """Sets the state of the rows at ``index`` to that of a fresh row."""
        for key, tensor in state.items():
            kernels.fill_rows(tensor, index, self._fresh(key))

    def reset_block(self, state: dict[str, torch.Tensor], rows: slice) -> None:
        """:meth:`reset_rows` of a block of rows."""
        for key, tensor in state.items():
            tensor[rows] = self._fresh(key)

    def _fresh(self, key: str) -> float:
        """A fresh row's value of state ``key``."""
        if key in ("sum", "accum"):
            return self.initial_accumulator_value
        return 0

    def apply(
        self,
        values: torch.Tensor,
        state: dict[str, torch.Tensor],
        index: torch.Tensor,
        grad: torch.Tensor,
    ) -> None:
        """Updates ``values[index]`` and ``state[*][index]`` in place.

        Args:
            values: ``[rows, dim]``.
            state: from :meth:`new_state` (same rows).
            index: 1-D int64, unique rows of ``values``.
            grad: ``[len(index), dim]``, already summed per row.

        Raises:
            IndexError: for an index outside ``values``' rows (nothing changes).
        """
        if not index.numel():
            return
        if index.dtype == torch.int64 and kernels.fused(values, state, grad, self.one_a_row):
            self._fused(values, state, index.contiguous(), grad)
            return
        rows = values.shape[0]
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= rows:  # as the kernels do: before anything changes
            raise IndexError(f"row index {low if low < 0 else high} is out of range [0, {rows})")
        self._apply(values, state, index, grad)

    def settings(self) -> tuple[int, tuple[str, ...], tuple[float, float, float, float]]:
        """What :func:`kernels.map_rows` and :func:`kernels.apply_mapped` take of this
        optimizer: its kind (the place of its name in :data:`kernels.ROW_KINDS`), its state's
        keys in the kernel's order, and its settings (four, unused ones zero), read now (a
        schedule may have moved ``lr``)."""
        name = self.spec.name
        keys: tuple[str, ...]
        if name == "SGD":
            keys, settings = (), (self.lr, 0.0, 0.0, 0.0)
        elif name in ("Adagrad", "RowWiseAdagrad"):
            keys, settings = ("sum",), (self.lr, self.eps, 0.0, 0.0)
        elif name == "Adam":
            keys = ("exp_avg", "exp_avg_sq", "step")
            settings = (self.lr, float(self.beta1), float(self.beta2), self.eps)
        else:
            keys, settings = ("accum", "linear"), (self.lr, self.l1, self.l2, self.lr_power)
        return kernels.ROW_KINDS.index(name), keys, settings

    def _fused(
        self,
        values: torch.Tensor,
        state: dict[str, torch.Tensor],
        index: torch.Tensor,
        g: torch.Tensor,
    ) -> None:
        k = kernels.KERNELS
        assert k is not None
        double = kernels.is_double(values)
        w, i, n = values.data_ptr(), index.data_ptr(), index.numel()
        rows, dim = values.shape
        if g.shape != (n, dim):
            raise ValueError(f"gradients of shape {list(g.shape)} for {n} rows of dim {dim}")
        if len(stripes.bounds(n)) > 1:
            # Each stripe's kernel checks its own indices: all of them first, so that a bad one
            # changes nothing (not the stripes before it).
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= rows:
                kernels.check(int((index == (low if low < 0 else high)).nonzero()[0]), index, rows)
        # Each kernel: (double, w, <state>, index, grad, n, dim, rows, <hyperparameters>).
        name, ptr = self.spec.name, {key: t.data_ptr() for key, t in state.items()}
        head: tuple[int, ...]
        tail: tuple[float, ...]
        if name == "SGD":
            fn, head, tail = k.sgd, (), (self.lr,)
        elif name == "Adagrad":
            fn, head, tail = k.adagrad, (ptr["sum"],), (self.lr, self.eps)
        elif name == "RowWiseAdagrad":
            fn, head, tail = k.rowwise_adagrad, (ptr["sum"],), (self.lr, self.eps)
        elif name == "Adam":
            head = (ptr["exp_avg"], ptr["exp_avg_sq"], ptr["step"])
            fn, tail = k.adam, (self.lr, self.beta1, self.beta2, self.eps)
        else:
            head = (ptr["accum"], ptr["linear"])
            fn, tail = k.ftrl, (self.lr, self.l1, self.l2, self.lr_power)
        gp, step = g.data_ptr(), dim * g.element_size()

        def work(b: int, e: int) -> int:  # rows [b, e) of the index and the gradients
            bad: int = fn(double, w, *head, i + 8 * b, gp + step * b, e - b, dim, rows, *tail)
            return bad

        kernels.check(stripes.run(n, work), index, rows)

    def _sgd(
        self,
        values: torch.Tensor,
        state: dict[str, torch.Tensor],
        index: torch.Tensor,
        g: torch.Tensor,
    ) -> None:
        values.index_add_(0, index, g, alpha=-self.lr)

    def _adagrad(
        self,
        values: torch.Tensor,
        state: dict[str, torch.Tensor],
        index: torch.Tensor,
        g: torch.Tensor,
    ) -> None:
        # torch.optim.Adagrad's single-tensor step on the rows at ``index`` (unique): three
        # index operations instead of a gather and a scatter for each of sum and values.
        state["sum"].index_add_(0, index, g * g)
        std = state["sum"].index_select(0, index).sqrt_().add_(self.eps)
        values.index_add_(0, index, g.div(std).mul_(-self.lr))

    def _rowwise_adagrad(
        self,
        values: torch.Tensor,
        state: dict[str, torch.Tensor],
        index: torch.Tensor,
        g: torch.Tensor,
    ) -> None:
        # TorchRec's RowWiseAdagrad step on the rows at ``index`` (unique) in FBGEMM's CPU
        # kernel's order (a row's step -lr / (sqrt(sum) + eps), then w += g * step), the mean's
        # sum in the C kernel's order (_mean_square).
        state["sum"].index_add_(0, index, _mean_square(g))
        std = state["sum"].index_select(0, index).sqrt_().add_(self.eps)
        step = torch.full_like(std, -self.lr).div_(std)
        values.index_add_(0, index, g * step[:, None])

    def _adam(
        self,
        values: torch.Tensor,
        state: dict[str, torch.Tensor],
        index: torch.Tensor,
        g: torch.Tensor,
    ) -> None:
        # torch.optim.SparseAdam (torch/optim/_functional.py, sparse_adam), with the step
        # counted per row: m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2);
        # w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps).
        b1, b2 = self.beta1, self.beta2
        step = state["step"].index_select(0, index).add_(1)
        state["step"].index_copy_(0, index, step)
        m = state["exp_avg"].index_select(0, index)
        m.add_(g.sub(m).mul_(1 - b1))
        state["exp_avg"].index_copy_(0, index, m)
        v = state["exp_avg_sq"].index_select(0, index)
        v.add_(g.square().sub_(v).mul_(1 - b2))
        state["exp_avg_sq"].index_copy_(0, index, v)
        t = step.to(torch.float64)
        bias1 = 1 - torch.pow(b1, t)
        bias2 = 1 - torch.pow(b2, t)
        step_size = (bias2.sqrt_().div_(bias1).mul_(self.lr)).to(values.dtype)
        update = m.div_(v.sqrt_().add_(self.eps)).mul_(step_size[:, None])
        w = values.index_select(0, index).sub_(update)
        values.index_copy_(0, index, w)

    def _ftrl(
        self,
        values: torch.Tensor,
        state: dict[str, torch.Tensor],
        index: torch.Tensor,
        g: torch.Tensor,
    ) -> None:
        # TensorFlow's ApplyFtrl<CPUDevice> (tensorflow/core/kernels/training_ops.cc), per row.
        lr, l1, l2, power = self.lr, self.l1, self.l2, self.lr_power
        accum = state["accum"].index_select(0, index)
        new_accum = accum + g * g  # as TF's accum + grad.square() (addcmul would fuse: FMA)
        if power == -0.5:
            new_p, old_p = new_accum.sqrt(), accum.sqrt_()
        else:
            new_p, old_p = new_accum.pow(-power), accum.pow_(-power)
        w = values.index_select(0, index)
        linear = state["linear"].index_select(0, index)
        linear.add_(g).sub_(new_p.sub(old_p).div_(lr).mul_(w))
        state["linear"].index_copy_(0, index, linear)
        x = linear.sign().mul_(l1).sub_(linear)
        y = new_p.div_(lr).add_(2 * l2)
        w = torch.where(linear.abs() > l1, x.div_(y), torch.zeros((), dtype=w.dtype))
        values.index_copy_(0, index, w)
        state["accum"].index_copy_(0, index, new_accum)


_LANES = 8
"""The running sums of a row's squares in :func:`_mean_square` (``LANES`` in ``_rows.c``)."""


def _mean_square(g: torch.Tensor) -> torch.Tensor:
    """Each row's mean square, summed in the order of the C kernel's (``_rows.c``,
    ``ROWWISE_ADAGRAD``), so that both give the same bits: element ``j`` into running sum
    ``j % 8``, a row's elements in order (missing ones of a short last group 0, which adds
    nothing), then the eight sums halved pairwise. torch's own ``mean`` sums in an order of its
    vector width."""
    rows, dim = g.shape
    squares = torch.nn.functional.pad(g * g, (0, -dim % _LANES)).view(rows, -1, _LANES)
    lanes = squares[:, 0]
    for k in range(1, squares.shape[1]):
        lanes = lanes + squares[:, k]
    half = _LANES // 2
    while half:
        lanes = lanes[:, :half] + lanes[:, half:]
        half //= 2
    return lanes[:, 0] / dim
