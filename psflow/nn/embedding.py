"""``torch.nn.Embedding`` and ``torch.nn.EmbeddingBag``, with tables a worker can leave on the ps.

Both take torch's arguments and, built locally, compute exactly what torch computes; where their
rows live (local weight, attached to a :class:`RowSource`, hashed) is :class:`TableModule`'s
business (``table.py``), the table's settings :class:`~psflow.nn.config.TableConfig`'s
(``config.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from psflow.nn.config import UNSET, TableConfig, Unset, table_config
from psflow.nn.frozen import snapshot_index, traced
from psflow.nn.gather import BagRows, GatherRows, bag_sizes, lookup
from psflow.nn.table import TableModule
from psflow.protocol import RowOptimizerSpec

__all__ = ["Embedding", "EmbeddingBag"]

_MODES = ("sum", "mean", "max", "sqrtn")


class Embedding(TableModule):
    """``torch.nn.Embedding`` that a worker can place on the parameter servers.

    Takes ``torch.nn.Embedding``'s arguments, and computes the same outputs and gradients for
    the same weight. ``num_embeddings=None`` makes a hashed table (any int64 id is a row).
    See :class:`TableModule` for where the rows live.

    The table's settings (``num_embeddings``, ``embedding_dim``, ``padding_idx``, ``dtype``,
    and psflow's ``partition``, ``seed``, ``init_std``, ``optimizer``, ``min_count``,
    ``max_rows``, ``wire_dtype``) are the fields of :class:`~psflow.nn.config.TableConfig`, described there:
    given as arguments they make the module's config (those left out take its defaults), or
    ``config=`` gives it whole, with none of them beside it.

    Args:
        max_norm: must be ``None`` (refused, see :class:`TableModule`).
        norm_type: kept for torch's signature.
        scale_grad_by_freq: scale gradients by the inverse frequency of each id in the
            batch, as in torch (the same when attached: the frequencies are the batch's).
        sparse: as in torch, for the local weight; an attached table's rows get a dense
            gradient (they are the batch's rows only).
        device: where the weight is built; ``"meta"`` holds none (a table only the ps hold).
        config: the table, instead of its settings as arguments.

    Example:
        >>> import torch
        >>> from psflow.nn import Embedding
        >>> emb = Embedding(10, 3, padding_idx=0)
        >>> ref = torch.nn.Embedding(10, 3, padding_idx=0, _weight=emb.weight.detach().clone())
        >>> ids = torch.tensor([[1, 2, 4], [4, 3, 0]])
        >>> torch.equal(emb(ids), ref(ids))
        True
        >>> hashed = Embedding(None, 3, optimizer="Adagrad")   # any int64 id
        >>> hashed(torch.tensor([7, 10**12])).shape
        torch.Size([2, 3])
        >>> from psflow.nn import TableConfig
        >>> Embedding(config=TableConfig(num_embeddings=None, embedding_dim=3, optimizer="Adagrad"))
        Embedding(None, 3, optimizer='Adagrad')
    """

    def __init__(
        self,
        num_embeddings: int | Unset | None = UNSET,
        embedding_dim: int | Unset = UNSET,
        padding_idx: int | Unset | None = UNSET,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        _freeze: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | Unset | None = UNSET,
        *,
        config: TableConfig | None = None,
        partition: str | Unset = UNSET,
        seed: int | Unset = UNSET,
        init_std: float | Unset = UNSET,
        optimizer: str | RowOptimizerSpec | Unset | None = UNSET,
        min_count: int | Unset = UNSET,
        max_rows: int | Unset | None = UNSET,
        wire_dtype: torch.dtype | Unset | None = UNSET,
    ) -> None:
        config = table_config(
            "Embedding",
            config,
            _weight,
            num_embeddings=num_embeddings,
            embedding_dim=embedding_dim,
            padding_idx=padding_idx,
            dtype=dtype,
            partition=partition,
            seed=seed,
            init_std=init_std,
            optimizer=optimizer,
            min_count=min_count,
            max_rows=max_rows,
            wire_dtype=wire_dtype,
        )
        super().__init__(
            config,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=_weight,
            _freeze=_freeze,
            device=device,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        snap = self._snapshot(input.device)
        if snap is not None:  # a hashed table in eval mode: read-only, zeros for ids not held
            self._check_dtype(input)
            return F.embedding(snapshot_index(snap, input, self.padding_idx), snap.table)
        if not self._uses_rows:
            self._local_ids(input)
            return F.embedding(
                input,
                self.weight,
                self.padding_idx,
                None,
                self.norm_type,
                self.scale_grad_by_freq,
                self.sparse,
            )
        if self.padding_idx is None and not self.scale_grad_by_freq:
            return lookup(self, input)
        positions, rows, padding = self._gather(input)
        if not self.scale_grad_by_freq:  # the padding id's row, if the batch has it, no gradient
            flat = GatherRows.apply(rows, positions.reshape(-1), None, padding)
            return flat.view(*positions.shape, self.embedding_dim)
        return F.embedding(positions, rows, padding, None, 2.0, self.scale_grad_by_freq, False)

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.sparse:
            s += ", sparse=True"
        return s + self._extra()

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        *,
        partition: str = "mod",
        optimizer: str | RowOptimizerSpec | None = None,
        optimizer_state: dict[str, torch.Tensor] | None = None,
    ) -> Embedding:
        """A table holding ``embeddings`` (2-D), as ``torch.nn.Embedding.from_pretrained``;
        ``partition`` and ``optimizer`` as for the constructor. Given to a job unfrozen, it
        trains on the ps from these rows: the chief's init sends them (each shard its part).
        ``optimizer_state``: the row-wise optimizer's state for every row, sent with them, for
        a table that goes on from another's training (TensorFlow's Adagrad accumulator as
        ``{"sum": ...}``: see :meth:`psflow.train.tf_checkpoint.TFCheckpoint.table_state`);
        the keys :meth:`TableModule.give_optimizer_state` lists."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {list(embeddings.shape)}")
        rows, cols = embeddings.shape
        table = cls(
            rows,
            cols,
            padding_idx=padding_idx,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            partition=partition,
            optimizer=optimizer,
            _weight=embeddings,
            _freeze=freeze,
        )
        if optimizer_state is not None:
            table.give_optimizer_state(optimizer_state)
        return table


class EmbeddingBag(TableModule):
    """``torch.nn.EmbeddingBag`` that a worker can place on the parameter servers.

    Takes ``torch.nn.EmbeddingBag``'s arguments (``mode`` ``"sum"``, ``"mean"`` or ``"max"``;
    bags given by ``offsets``, with or without ``include_last_offset``, or as the rows of a 2-D
    input; ``per_sample_weights`` with ``"sum"``), and computes the same outputs and gradients
    for the same weight. The other arguments are :class:`Embedding`'s.

    Two of TensorFlow's combiners (``embedding_lookup_sparse``, ``embedding_column``) that
    torch lacks: ``mode="sqrtn"``, a bag's weighted sum divided by the square root of the sum
    of its squared weights (of its size, without weights), and ``mode="mean"`` with
    ``per_sample_weights``, the weighted sum divided by the sum of the weights. The padding id
    counts in neither sum; an empty bag is zeros.

    Example:
        >>> import torch
        >>> from psflow.nn import EmbeddingBag
        >>> bag = EmbeddingBag(10, 3, mode="sum")
        >>> ref = torch.nn.EmbeddingBag(10, 3, mode="sum", _weight=bag.weight.detach().clone())
        >>> ids, offsets = torch.tensor([1, 2, 4, 4, 3]), torch.tensor([0, 2])
        >>> torch.equal(bag(ids, offsets), ref(ids, offsets))
        True
    """

    mode: str
    include_last_offset: bool

    def __init__(
        self,
        num_embeddings: int | Unset | None = UNSET,
        embedding_dim: int | Unset = UNSET,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        _weight: torch.Tensor | None = None,
        include_last_offset: bool = False,
        padding_idx: int | Unset | None = UNSET,
        device: torch.device | str | None = None,
        dtype: torch.dtype | Unset | None = UNSET,
        *,
        config: TableConfig | None = None,
        partition: str | Unset = UNSET,
        seed: int | Unset = UNSET,
        init_std: float | Unset = UNSET,
        optimizer: str | RowOptimizerSpec | Unset | None = UNSET,
        min_count: int | Unset = UNSET,
        max_rows: int | Unset | None = UNSET,
        wire_dtype: torch.dtype | Unset | None = UNSET,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"EmbeddingBag: mode must be one of {_MODES}, got {mode!r}")
        config = table_config(
            "EmbeddingBag",
            config,
            _weight,
            num_embeddings=num_embeddings,
            embedding_dim=embedding_dim,
            padding_idx=padding_idx,
            dtype=dtype,
            partition=partition,
            seed=seed,
            init_std=init_std,
            optimizer=optimizer,
            min_count=min_count,
            max_rows=max_rows,
            wire_dtype=wire_dtype,
        )
        super().__init__(
            config,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse,
            _weight=_weight,
            device=device,
        )
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        snap = self._snapshot(input.device)
        onnx_by_tracing = torch.onnx.is_in_onnx_export() and torch.jit.is_tracing()
        if self.padding_idx is not None and onnx_by_tracing:
            raise RuntimeError(
                f"{self._label()} has a padding id, and torch.onnx.export(dynamo=False) "
                "cannot export embedding_bag with one: use torch.onnx.export(..., "
                "dynamo=True), the default"
            )
        self._check_last_offset(input, offsets)
        mode = self.mode
        checked = mode == "sqrtn" or (mode == "mean" and per_sample_weights is not None)
        if checked:  # TensorFlow's combiner: torch's "sum", each weight over its bag's norm
            self._check_bags(input, offsets, per_sample_weights)
            per_sample_weights = self._normalised(input, offsets, per_sample_weights)
            mode = "sum"
        if snap is not None:  # a hashed table in eval mode: read-only, zeros for ids not held
            if not checked:
                self._check_bags(input, offsets, per_sample_weights)
            self._check_dtype(input)
            return F.embedding_bag(
                snapshot_index(snap, input, self.padding_idx),
                snap.table,
                offsets,
                None,
                2.0,
                False,
                mode,
                False,
                per_sample_weights,
                self.include_last_offset,
                None if self.padding_idx is None else snap.padding,
            )
        if not self._uses_rows:
            self._local_ids(input)
            return F.embedding_bag(
                input,
                self.weight,
                offsets,
                None,
                self.norm_type,
                self.scale_grad_by_freq,
                mode,
                self.sparse,
                per_sample_weights,
                self.include_last_offset,
                self.padding_idx,
            )
        if not checked:
            self._check_bags(input, offsets, per_sample_weights)
        if (
            input.dim() == 2
            and input.shape[1] == 1
            and per_sample_weights is None
            and self.padding_idx is None
            and not self.scale_grad_by_freq
        ):
            # Bags of one id each (a CTR model's categorical features): every mode's bag is
            # its row, and its gradient the bag's, as Embedding's lookup gives them (gathered
            # and scatter-added by the kernels, from the rows where they came in).
            return lookup(self, input).view(input.shape[0], self.embedding_dim)
        positions, rows, padding = self._gather(input)
        if (
            (mode == "sum" or (mode == "mean" and per_sample_weights is None))
            and not self.scale_grad_by_freq
            and rows.requires_grad
            and torch.is_grad_enabled()
            and not traced()
        ):
            # Multi-hot features, a wide term's columns, TensorFlow's combiners: torch's
            # forward, the gradient scatter-added by the kernels instead of torch's sorted
            # backward.
            last = self.include_last_offset
            bags = bag_sizes(positions, offsets, last)
            if bags is not None:
                sizes, covered = bags
                return BagRows.apply(  # type: ignore[no-any-return]
                    rows, positions, offsets, sizes, covered, mode, last, per_sample_weights,
                    padding,
                )  # fmt: skip
        return F.embedding_bag(
            positions,
            rows,
            offsets,
            None,
            2.0,
            self.scale_grad_by_freq,
            mode,
            False,
            per_sample_weights,
            self.include_last_offset,
            padding,
        )

    def _normalised(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None,
        weights: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """``mode="sqrtn"``, or ``"mean"`` with weights, as ``"sum"``: each id's weight (1
        without weights, 0 for the padding id) over its bag's norm, the square root of the sum
        of its squared weights (``"sqrtn"``) or the sum of its weights (``"mean"``). ``None``
        where every bag is one id with no weight (the sum is then the same)."""
        sqrtn = self.mode == "sqrtn"
        one_each = input.dim() == 2 and input.shape[1] == 1
        if weights is None and one_each and self.padding_idx is None:
            return None
        weight = self._parameters.get("weight")
        dtype = self._dtype if weight is None else weight.dtype
        w = (
            torch.ones(input.shape, device=input.device, dtype=dtype)
            if weights is None
            else weights
        )
        if self.padding_idx is not None:
            w = w.masked_fill(input == self.padding_idx, 0)
        if input.dim() == 2:
            norm = (w.square() if sqrtn else w).sum(dim=1, keepdim=True)
            return _divided(w, norm.sqrt() if sqrtn else norm)
        assert offsets is not None
        ends = (
            offsets[1:]
            if self.include_last_offset
            else torch.cat([offsets[1:], offsets.new_tensor([input.numel()])])
        )
        starts = offsets[:-1] if self.include_last_offset else offsets
        if traced():
            # No value-dependent size or check recorded: each id's bag is the last one
            # starting at or before it (the same for offsets that cover the ids in order).
            at = torch.arange(input.numel(), device=input.device)
            bag = torch.searchsorted(starts, at, right=True) - 1
            norm = torch.zeros(len(starts), device=w.device, dtype=w.dtype).index_add(
                0, bag, w.square() if sqrtn else w
            )
            return _divided(w, (norm.sqrt() if sqrtn else norm)[bag])
        bag = torch.repeat_interleave(
            torch.arange(len(starts), device=input.device), (ends - starts).clamp_min(0)
        )
        if bag.numel() != input.numel():
            raise ValueError(
                f"{self._label()}: offsets {offsets.tolist()} do not cover the input's "
                f"{input.numel()} ids in order"
            )
        norm = torch.zeros(len(starts), device=w.device, dtype=w.dtype).index_add(
            0, bag, w.square() if sqrtn else w
        )
        return _divided(w, (norm.sqrt() if sqrtn else norm)[bag])

    def _check_last_offset(self, input: torch.Tensor, offsets: torch.Tensor | None) -> None:
        """With ``include_last_offset``, refuses a last offset that is not the number of ids
        (torch's contract), in every path, before any row is asked for. Short of the ids,
        torch takes them without a word and its numbers disagree: its forward leaves the ids
        after the last offset out, or adds them to the last bag with a ``padding_idx``, and its
        CPU backward without one gives their rows uninitialised memory. Past the ids, torch's
        CPU kernel refuses too (a RuntimeError). Not when traced (a value-dependent check is
        not recorded). On an accelerator the check reads the last offset back (a wait)."""
        if not self.include_last_offset or input.dim() != 1 or traced():
            return
        if offsets is None or offsets.dim() != 1 or not len(offsets):
            return  # torch's own checks (and _check_bags) say what is wrong
        last, n = int(offsets[-1]), input.numel()
        if last != n:
            raise ValueError(
                f"{self._label()}: with include_last_offset=True the last offset closes the "
                f"last bag and must be the number of ids: got offsets[-1] = {last} for "
                f"{n} ids ({'short of them' if last < n else 'past them'})"
            )

    def _check_bags(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
    ) -> None:
        """torch's checks of the bags, made before any row is asked for."""
        if input.dim() == 2 and offsets is not None:
            raise ValueError(
                f"{self._label()}: offsets must be None with a 2-D input (each row is a bag), "
                f"got offsets of shape {list(offsets.shape)}"
            )
        if input.dim() == 1 and (offsets is None or offsets.dim() != 1):
            raise ValueError(f"{self._label()}: a 1-D input needs 1-D offsets")
        if input.dim() not in (1, 2):
            raise ValueError(
                f"{self._label()}: input must be 1-D (with offsets) or 2-D, got {input.dim()}-D"
            )
        if per_sample_weights is not None:
            if self.mode == "max":
                raise NotImplementedError(
                    f"{self._label()}: per_sample_weights work with mode 'sum', 'mean' "
                    "(TensorFlow's weighted mean) or 'sqrtn', not 'max'"
                )
            if per_sample_weights.shape != input.shape:
                raise ValueError(
                    f"{self._label()}: per_sample_weights has shape "
                    f"{list(per_sample_weights.shape)}, expected the input's "
                    f"{list(input.shape)}"
                )

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        s += f", mode={self.mode!r}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s + self._extra()

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = False,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        *,
        partition: str = "mod",
        optimizer: str | RowOptimizerSpec | None = None,
        optimizer_state: dict[str, torch.Tensor] | None = None,
    ) -> EmbeddingBag:
        """A table holding ``embeddings`` (2-D), as ``torch.nn.EmbeddingBag.from_pretrained``;
        ``partition``, ``optimizer`` and ``optimizer_state`` as for
        :meth:`Embedding.from_pretrained`."""
        if embeddings.dim() != 2:
            raise ValueError(f"embeddings must be 2-D, got shape {list(embeddings.shape)}")
        rows, cols = embeddings.shape
        bag = cls(
            rows,
            cols,
            max_norm=max_norm,
            norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq,
            mode=mode,
            sparse=sparse,
            _weight=embeddings,
            include_last_offset=include_last_offset,
            padding_idx=padding_idx,
            partition=partition,
            optimizer=optimizer,
        )
        bag.weight.requires_grad = not freeze
        if optimizer_state is not None:
            bag.give_optimizer_state(optimizer_state)
        return bag


def _divided(w: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``w / norm``, 0 where the norm is 0 (an empty bag, or one of zero weights)."""
    return torch.where(norm != 0, w / torch.where(norm != 0, norm, 1), 0)
