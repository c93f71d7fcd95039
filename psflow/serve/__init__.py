"""What a model server needs of psflow's exports, importable without psflow's runtime.

- ``delta.py``: the export format (a base, then deltas: changed rows, tombstones, dense
  parameters; a manifest each) and :class:`ExportedModel`, which applies a base and its deltas
  in order and refuses one out of order or of another base.

It imports torch, safetensors and fsspec only: no ZeroMQ, no ``torch.distributed``, nothing of
the ps or the workers, so that a serving process loads exports without the training runtime.
"""

from psflow.serve.delta import Export, ExportedModel, ExportError, list_exports

__all__ = ["Export", "ExportError", "ExportedModel", "list_exports"]
