"""psflow.serve.delta on files written here: what it refuses, and that a server can import it
without psflow's runtime. (tests/multiproc/test_exports.py: exports of real ps processes.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from psflow.serve.delta import (
    EXPORT_META,
    FORMAT,
    ExportedModel,
    ExportError,
    chain,
    list_exports,
)
from psflow.train.session_config import ExportConfig, SessionConfig

pytestmark = pytest.mark.unit

SPEC = {"name": "t", "embedding_dim": 2, "num_embeddings": None, "dtype": "float32"}


def write(root: Path, seq: int, base: int, since: int | None, ids: list[int], gone: list[int]):
    d = root / f"export-{seq}"
    d.mkdir(parents=True)
    meta = {"seq": seq, "base": base, "since": since, "shard": 0, "num_shards": 1, "step": seq}
    tensors = {
        "dense/w": torch.full((2,), float(seq)),
        "table/t/ids": torch.tensor(ids, dtype=torch.int64),
        "table/t/values": torch.tensor([[float(i), float(seq)] for i in ids]).view(-1, 2),
        "table/t/tombstones": torch.tensor(gone, dtype=torch.int64),
    }
    save_file(tensors, str(d / "shard-0-of-1.safetensors"), {EXPORT_META: json.dumps(meta)})
    manifest = {
        "format": FORMAT, "seq": seq, "kind": "base" if since is None else "delta",
        "base": base, "since": since, "step": seq, "num_shards": 1,
        "files": ["shard-0-of-1.safetensors"],
        "dense": {"w": {"shape": [2], "dtype": "float32",
                        "pieces": [{"var": "w", "shard": 0, "rows": None}]}},
        "tables": {"t": SPEC},
    }  # fmt: skip
    (d / "manifest.json").write_text(json.dumps(manifest))


def test_deltas_apply_in_order_and_bad_files_are_refused(tmp_path: Path) -> None:
    write(tmp_path, 0, 0, None, [1, 2, 3], [])
    write(tmp_path, 1, 0, 0, [2, 4], [3, 9])  # 9: made and evicted between two exports
    write(tmp_path, 2, 0, 1, [1], [4])
    (tmp_path / "export-3").mkdir()  # being written: no manifest, not an export
    assert [e.seq for e in list_exports(str(tmp_path))] == [0, 1, 2]
    model = ExportedModel.load(str(tmp_path))
    ids, rows = model.tables["t"]
    assert ids.tolist() == [1, 2] and rows.tolist() == [[1.0, 2.0], [2.0, 1.0]]
    assert torch.equal(model.dense["w"], torch.full((2,), 2.0))
    assert model.lookup("t", torch.tensor([[2, 7]])).tolist() == [[[2.0, 1.0], [0.0, 0.0]]]
    # A file of another export put in this one's place.
    shutil.copy(tmp_path / "export-1/shard-0-of-1.safetensors", tmp_path / "export-2")
    with pytest.raises(
        ExportError, match=re.escape("export-2/shard-0-of-1.safetensors: the file is of")
    ):
        ExportedModel.load(str(tmp_path))
    # A chain with a link missing.
    shutil.rmtree(tmp_path / "export-1")
    with pytest.raises(ExportError, match="export-1, which export-2 follows, is missing"):
        chain(str(tmp_path))
    (tmp_path / "export-0" / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(ExportError, match="not a psflow-export/1 manifest"):
        ExportedModel.load(str(tmp_path), upto=0)


def test_the_loader_imports_nothing_of_the_runtime() -> None:
    code = (
        "import sys, psflow.serve.delta; "
        "bad = [m for m in sys.modules if m == 'zmq' or m.startswith(('psflow.ps', "
        "'psflow.worker', 'psflow.transport', 'psflow.train'))]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_export_settings_are_checked_and_flat() -> None:
    cfg = SessionConfig.of(export_dir="/tmp/exports", export_base_every=5)
    assert cfg.export.export_every == 300.0 and cfg.export.export_base_every == 5
    assert SessionConfig.of().export.export_dir is None
    with pytest.raises(ValueError, match="export_every must be > 0"):
        ExportConfig(export_dir="/tmp/e", export_every=0)
    with pytest.raises(ValueError, match="export_every=60 needs an export_dir"):
        ExportConfig(export_every=60)
    with pytest.raises(ValueError, match="export_base_every must be >= 1"):
        ExportConfig(export_base_every=0)
    with pytest.raises(ValueError, match="export_reserve_bytes must be >= 0"):
        ExportConfig(export_reserve_bytes=-1)


def test_exports_are_due_by_the_clock(tmp_path: Path) -> None:
    from psflow.train.exports import Exporter

    now = [0.0]
    config = ExportConfig(export_dir=str(tmp_path), export_every=30)
    (tmp_path / "export-4").mkdir()  # an earlier run's: numbering goes on after it
    exporter = Exporter(config, make_client=None, pieces=[], params={}, clock=lambda: now[0])  # type: ignore[arg-type]
    assert not exporter.due() and exporter._seq == 4
    now[0] = 29.9
    assert not exporter.due()
    now[0] = 30.0
    assert exporter.due()
