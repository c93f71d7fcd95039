"""The next batch's rows ride the step: a coming batch's ids go with a push, and its reply
brings their rows, read right after that push is applied.

:class:`RowPrefetch` keeps what a :class:`~psflow.worker.tables.TableClient` was asked to
prefetch, hands the ids to the exchange for the next push (:meth:`RowPrefetch.take`), takes
the rows out of that push's reply (:meth:`RowPrefetch.put`), and gives them to the forward
that asks for exactly those ids (:meth:`RowPrefetch.hit`). The rows stay where they came (a
shard's lane) until a request to that shard would overwrite them; a batch on a GPU has them
begin their copy there as they come.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from psflow.nn import TableModule
from psflow.protocol.messages import prefetch_tensor_names
from psflow.worker.client import ShardedClient, Tensors
from psflow.worker.row_layout import Grouped, TableLayout
from psflow.worker.staging import Staging


class Prefetched(NamedTuple):
    """Rows that came with a push for a coming batch (:meth:`RowPrefetch.put`)."""

    grouped: Grouped
    parts: dict[int, torch.Tensor]
    """Each shard's rows, where they came (its lane, until the next request to it); empty
    once they went to the batch's device (``on_device``)."""
    on_device: torch.Tensor | None
    """The rows, shard after shard, on the batch's device: their copy there began as they
    came (:class:`~psflow.worker.staging.Staging`)."""


class RowPrefetch:
    """A worker's prefetched rows, per table (see the module docstring).

    Args:
        layout: the tables, as requests see them.
        client: the requests to the shards (a shard's lane is held while rows lie in it).
        staging: the copies to a model's GPU.
    """

    def __init__(self, layout: TableLayout, client: ShardedClient, staging: Staging) -> None:
        self.layout = layout
        self.client = client
        self.staging = staging
        self.asked: dict[str, tuple[torch.Tensor, torch.device, TableModule | None]] = {}
        """Per table, a coming batch's ids, whose rows the next push brings back, the batch's
        device, and the table whose range they are still to be checked against (ids whose
        copy from a GPU was only begun), else ``None``."""
        self._sent: dict[str, Grouped] = {}
        self.kept: dict[str, Prefetched] = {}
        """Per table, rows that came with the last push: used by the forward that asks for
        exactly those ids."""

    def ask(
        self,
        name: str,
        ids: torch.Tensor,
        device: torch.device,
        *,
        check: TableModule | None = None,
    ) -> None:
        """Asks for the rows of a coming batch's ``ids`` (flat, on the host) of table ``name``
        with the next push; ``device``: the batch's. ``check``: the table, when the ids are
        not checked yet (their copy from the device only begun, :meth:`Staging.to_host`):
        :meth:`take` checks them."""
        self.asked[name] = (ids, device, check)

    def take(self) -> tuple[dict[int, Tensors], dict[int, list[str]]]:
        """The ids to send with the next push, as tensors per shard, and the tables per shard.

        Raises:
            IndexError: naming the table and the id, for an id out of its range (nothing of
                the push is sent then).
        """
        asked, self.asked = self.asked, {}
        self._sent = {}
        if any(check is not None for _, _, check in asked.values()):
            self.staging.wait()  # (the step's gradients waited for them already)
            for ids, _, check in asked.values():
                if check is not None and ids.numel():
                    check.check_range(*torch.aminmax(ids))
        tensors: dict[int, Tensors] = {}
        tables: dict[int, list[str]] = {}
        for name, (ids, device, _) in asked.items():
            unique, positions, split = self.layout.group(name, ids)
            self._sent[name] = Grouped(ids, unique, positions, split, device)
            ids_name = prefetch_tensor_names(name)[0]
            for s, (shard_ids, _) in split.items():
                tensors.setdefault(s, []).append((ids_name, shard_ids))
                tables.setdefault(s, []).append(name)
        return tensors, tables

    def put(self, tensors: dict[int, Tensors]) -> dict[int, Tensors]:
        """Takes the prefetched rows out of each shard's reply tensors and returns the rest.
        The rows are kept for the next forward where they came (a shard's lane, until the next
        request to it moves them out), or, for a batch on a GPU, begin their copy there now:
        under way while this worker reads its next batch (:class:`~psflow.worker.staging.Staging`)."""
        if not self._sent:
            return tensors
        rows_of = {prefetch_tensor_names(n)[1]: n for n in self._sent}
        got: dict[str, dict[int, torch.Tensor]] = {}
        rest: dict[int, Tensors] = {}
        for s, shard_tensors in tensors.items():
            kept = []
            for tensor_name, value in shard_tensors:
                table = rows_of.get(tensor_name)
                if table is None:
                    kept.append((tensor_name, value))
                else:
                    got.setdefault(table, {})[s] = value
            rest[s] = kept
        layout = self.layout
        for name, grouped in self._sent.items():
            parts = got.get(name, {})
            layout.check_parts(name, grouped.split, parts)
            on_device = None
            if self.staging.crosses(grouped.device):
                rows = (
                    layout.widened(name, grouped.split, parts, views=False)[0]
                    if name in layout.wire
                    else layout.joined(grouped.split, parts)
                )
                on_device, parts = self.staging.to_device(rows, grouped.device), {}
            self.kept[name] = Prefetched(grouped, parts, on_device)
        for s in {s for hit in self.kept.values() for s in hit.parts}:
            self.client.hold(s, functools.partial(self._move_out, s))
        self._sent = {}
        return rest

    def hit(self, name: str, ids: torch.Tensor, *, views: bool, eval: bool) -> Prefetched | None:
        """The rows kept for table ``name`` when they are of exactly ``ids`` (flat, on the
        host) and fit the forward asking (``views``: the CPU's way, rows left where they came;
        ``eval``: never rows prefetched for training). Forgets them either way."""
        hit = self.kept.pop(name, None)
        if hit is None or eval or (views and hit.on_device is not None):
            return None  # rows gone to a GPU serve a forward there
        return hit if torch.equal(hit.grouped.ids, ids) else None

    def _move_out(self, shard: int) -> None:
        """Copies the prefetched rows that still lie in ``shard``'s lane into memory of their
        own (a request to it is about to overwrite them)."""
        for hit in self.kept.values():
            if shard in hit.parts:
                hit.parts[shard] = hit.parts[shard].clone()
