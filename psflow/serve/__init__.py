"""What a model server needs of psflow's exports, importable without psflow's runtime.

- ``delta.py``: :class:`ExportedModel`, which applies a base and its deltas in order and
  refuses one out of order or of another base; the names below are importable from it too.
  ``manifest.py``: the export format (a base, then deltas: changed rows, tombstones, dense
  parameters; a manifest each), its names, :class:`Export`, :class:`ExportError` and
  :func:`~psflow.serve.manifest.read_export`, which checks a manifest's every field;
  ``listing.py``: :func:`list_exports`, the damaged exports and the chain of a base and its
  deltas; ``shard_file.py``: one ps's file of an export, read and checked; ``merge.py``: a
  delta's rows and tombstones merged into a table held sorted.
- ``server.py``: :class:`~psflow.serve.server.ModelServer`, an HTTP model server that serves
  the newest export and applies each new one between requests (``python -m psflow.serve``,
  ``__main__.py``); ``httpd.py``: its HTTP layer (the routes, a thread per connection up to a
  limit); ``request.py``: a request's features and numbers, checked, and
  :class:`~psflow.serve.request.BadRequest`; ``served.py``: one export's tables as lookups and
  its dense values, fixed, and the request :class:`~psflow.serve.served.Feature`; ``dense.py``:
  :func:`~psflow.serve.dense.export_dense`, a model's dense part as ONNX whose parameters are
  inputs; ``metrics.py``: the server's ``GET /metrics``. These import onnxruntime (the server
  only): import them by their module.

It imports torch, safetensors and fsspec only: no ZeroMQ, no ``torch.distributed``, nothing of
the ps or the workers, so that a serving process loads exports without the training runtime.
"""

from psflow.serve.delta import Export, ExportedModel, ExportError, list_exports

__all__ = ["Export", "ExportError", "ExportedModel", "list_exports"]
