"""One ps's file of an export (safetensors): its tensors and its own description
(``psflow.export`` metadata), read whole, refused when it is not a readable psflow export file.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load

from psflow.serve.manifest import EXPORT_META, ExportError

_MAX_HEADER = 100_000_000


def _read_shard_file(url: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    fs, path = fsspec.core.url_to_fs(url)
    try:
        data = fs.cat_file(path)
    except OSError as e:
        raise ExportError(f"{url}: unreadable: {e}") from None
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if n < 0 or n > min(len(data) - 8, _MAX_HEADER):
        raise ExportError(f"{url}: not a safetensors file (header length {n}, {len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + n])
        meta = json.loads(header.get("__metadata__", {}).get(EXPORT_META, "null"))
        tensors = st_load(data)
    except Exception as e:  # safetensors' own errors are not ValueError
        raise ExportError(f"{url}: not a readable export file: {e}") from None
    if not isinstance(meta, dict):
        raise ExportError(f"{url}: no {EXPORT_META} metadata: not a psflow export file")
    return tensors, meta
