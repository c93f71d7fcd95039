"""Exports a server must refuse, loudly and by name, while it serves on: a fixed-size table
missing rows or holding others, non-finite values, a dense piece in another ps's file, a
chain that loops, bad manifest fields, a delta that changes a table's spec; a damaged old
export that must block neither serving nor pruning; a ps asked to export outside its export
directory."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from psflow.protocol import Key, Op, SaveState
from psflow.ps.exports import ExportService
from psflow.serve.delta import EXPORT_META, FORMAT, ExportedModel, ExportError, chain
from psflow.serve.dense import export_dense
from psflow.serve.server import Feature, ModelServer, ServerConfig
from psflow.train.exports import Exporter
from tests.unit.test_ps_exports import Host, ask

pytestmark = pytest.mark.unit

HASHED = {"name": "t", "embedding_dim": 2, "num_embeddings": None, "dtype": "float32"}
FIXED = dict(HASHED, num_embeddings=4)


def write(
    root: Path,
    seq: int,
    since: int | None,
    ids: list[int] | list[list[int]],
    *,
    base: int = 0,
    gone: list[int] = (),  # type: ignore[assignment]
    spec: dict[str, Any] = HASHED,
    values: Any = None,
    dense: list[torch.Tensor] | None = None,
    shards: int = 1,
    edit: Any = None,
) -> Path:
    """Export ``seq`` of ``shards`` files (``ids`` per file when more than one); ``edit``
    changes the manifest before it is written."""
    d = root / f"export-{seq}"
    d.mkdir(parents=True, exist_ok=True)
    dim = spec["embedding_dim"] if isinstance(spec, dict) else 2
    for s in range(shards):
        mine = ids[s] if shards > 1 else ids
        rows = values if values is not None else torch.full((len(mine), dim), float(seq))
        meta = {"seq": seq, "base": base, "since": since, "shard": s, "num_shards": shards,
                "step": seq}  # fmt: skip
        tensors = {
            "dense/w": (dense or [torch.full((2,), float(seq))] * shards)[s],
            "table/t/ids": torch.tensor(mine, dtype=torch.int64),
            "table/t/values": rows[s] if isinstance(rows, list) else rows,
            "table/t/tombstones": torch.tensor(gone, dtype=torch.int64),
        }
        name = f"shard-{s}-of-{shards}.safetensors"
        save_file(tensors, str(d / name), {EXPORT_META: json.dumps(meta)})
    manifest = {
        "format": FORMAT, "seq": seq, "kind": "base" if since is None else "delta",
        "base": base, "since": since, "step": seq, "num_shards": shards,
        "files": [f"shard-{s}-of-{shards}.safetensors" for s in range(shards)],
        "dense": {"w": {"shape": [2], "dtype": "float32",
                        "pieces": [{"var": "w", "shard": 0, "rows": None}]}},
        "tables": {"t": dict(spec)},
    }  # fmt: skip
    if edit is not None:
        edit(manifest)
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_a_fixed_size_table_holds_exactly_its_rows(tmp_path: Path) -> None:
    write(tmp_path / "missing", 0, None, [0, 2, 3], spec=FIXED)
    with pytest.raises(ExportError, match="export-0: table 't': a base of a fixed-size table "
                       "of 4 rows holds 3 of them"):  # fmt: skip
        ExportedModel.load(str(tmp_path / "missing"))
    write(tmp_path / "range", 0, None, [0, 1, 2, 3, 99], spec=FIXED)
    with pytest.raises(ExportError, match="id 99 is out of the range of its 4 rows"):
        ExportedModel.load(str(tmp_path / "range"))
    write(tmp_path / "neg", 0, None, [-5, 0, 1, 2], spec=FIXED)
    with pytest.raises(ExportError, match="id -5 is out of the range"):
        ExportedModel.load(str(tmp_path / "neg"))
    ok = tmp_path / "ok"
    write(ok, 0, None, [3, 1, 0, 2], spec=FIXED)
    write(ok, 1, 0, [2], spec=FIXED)
    model = ExportedModel.load(str(ok))
    assert model.tables["t"][0].tolist() == [0, 1, 2, 3]
    write(ok, 2, 1, [], gone=[2], spec=FIXED)  # a fixed table evicts nothing
    with pytest.raises(ExportError, match=r"tombstones \(id 2\) for a fixed-size table"):
        model.follow(str(ok))
    assert model.seq == 1 and model.tables["t"][0].tolist() == [0, 1, 2, 3]
    resized = tmp_path / "resized"
    write(resized, 0, None, [0, 1, 2, 3], spec=FIXED)
    write(resized, 1, 0, [5], spec=dict(FIXED, num_embeddings=8))
    with pytest.raises(ExportError, match="the delta's 'num_embeddings' is 8, its base's 4"):
        ExportedModel.load(str(resized))


def test_non_finite_values_are_refused_by_file_and_tensor(tmp_path: Path) -> None:
    write(tmp_path / "row", 0, None, [5], values=torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ExportError, match=r"export-0/shard-0-of-1.safetensors: tensor "
                       r"'table/t/values' is not finite"):  # fmt: skip
        ExportedModel.load(str(tmp_path / "row"))
    write(tmp_path / "dense", 0, None, [5], dense=[torch.tensor([1.0, float("inf")])])
    with pytest.raises(ExportError, match="tensor 'dense/w' is not finite"):
        ExportedModel.load(str(tmp_path / "dense"))


def test_a_dense_piece_is_taken_from_the_ps_the_manifest_names(tmp_path: Path) -> None:
    # ps:1's file holds a stray 'dense/w' (the manifest places w on ps:0 alone).
    write(tmp_path / "stray", 0, None, [[0], [1]], shards=2, values=[torch.ones(1, 2)] * 2,
          dense=[torch.ones(2), torch.full((2,), 9.0)])  # fmt: skip
    with pytest.raises(ExportError, match=r"shard-1-of-2.safetensors: dense tensor 'dense/w' is "
                       r"no piece the manifest places on ps:1"):  # fmt: skip
        ExportedModel.load(str(tmp_path / "stray"))

    def twice(m: dict[str, Any]) -> None:
        m["dense"]["w"]["pieces"] = [
            {"var": "w", "shard": 0, "rows": [0, 1]},
            {"var": "w", "shard": 0, "rows": [1, 2]},
        ]

    write(tmp_path / "twice", 0, None, [5], edit=twice)
    with pytest.raises(ExportError, match="variable 'w' of ps:0 is named twice"):
        ExportedModel.load(str(tmp_path / "twice"))

    def rows(value: Any) -> Any:
        return lambda m: m["dense"]["w"]["pieces"][0].__setitem__("rows", value)

    for bad, match in [("ab", "'rows' must be"), ([0, 1], r"do not cover the rows of \[2\]"),
                       ([0, 3], "do not cover")]:  # fmt: skip
        write(tmp_path / "rows", 0, None, [5], edit=rows(bad))
        with pytest.raises(ExportError, match=match):
            ExportedModel.load(str(tmp_path / "rows"))
    # Two pieces, each of its ps, rows that tile the parameter: put together in order.
    split = tmp_path / "split"
    write(split, 0, None, [[0], [1]], shards=2, values=[torch.ones(1, 2)] * 2,
          dense=[torch.tensor([1.0]), torch.tensor([2.0])],
          edit=lambda m: m["dense"]["w"].__setitem__("pieces", [
              {"var": "w", "shard": 1, "rows": [1, 2]}, {"var": "w", "shard": 0, "rows": [0, 1]}
          ]))  # fmt: skip
    assert ExportedModel.load(str(split)).dense["w"].tolist() == [1.0, 2.0]
    write(split, 1, 0, [[2], [3]], shards=2, values=[torch.ones(1, 2)] * 2,
          dense=[torch.tensor([1.0]), torch.tensor([2.0, 3.0])],
          edit=lambda m: m["dense"]["w"].__setitem__("pieces", [
              {"var": "w", "shard": 1, "rows": [1, 2]}, {"var": "w", "shard": 0, "rows": [0, 1]}
          ]))  # fmt: skip
    with pytest.raises(ExportError, match=r"piece 'w' of ps:1 \(rows \[1, 2\]\) is \[2\]"):
        ExportedModel.load(str(split))


def test_a_chain_that_loops_is_refused(tmp_path: Path) -> None:
    write(tmp_path, 0, None, [5])
    write(tmp_path, 1, 1, [5])  # follows itself
    with pytest.raises(ExportError, match=r"export-1 is damaged: .*base <= since < seq"):
        chain(str(tmp_path))
    write(tmp_path / "two", 0, None, [5])
    write(tmp_path / "two", 1, 2, [5])
    write(tmp_path / "two", 2, 1, [5])
    with pytest.raises(ExportError, match="base <= since < seq"):
        chain(str(tmp_path / "two"))


@pytest.mark.parametrize(
    ("field", "edit", "match"),
    [
        ("pieces", lambda m: m["dense"]["w"].__setitem__("pieces", ["w"]), r"'pieces'\[0\] must"),
        ("pieces", lambda m: m["dense"]["w"].__setitem__("pieces", []), "'pieces' must be a non"),
        ("pieces", lambda m: m["dense"]["w"].__setitem__("pieces", None), "'pieces' must be"),
        ("dense", lambda m: m["dense"].__setitem__("w", [1]), r"'dense'\['w'\] must be a map"),
        ("shape", lambda m: m["dense"]["w"].__setitem__("shape", 2), "'shape' must be"),
        ("spec", lambda m: m["tables"].__setitem__("t", [1]), r"'tables'\['t'\] must be"),
        ("spec", lambda m: m["tables"].__setitem__("t", "x"), r"'tables'\['t'\] must be"),
        ("dim", lambda m: m["tables"]["t"].__setitem__("embedding_dim", True), "'embedding_dim'"),
        ("dim", lambda m: m["tables"]["t"].__setitem__("embedding_dim", -2), "'embedding_dim'"),
        ("size", lambda m: m["tables"]["t"].__setitem__("num_embeddings", 0), "'num_embeddings'"),
        (
            "files",
            lambda m: m.__setitem__("files", ["../export-0/shard-0-of-1.safetensors"]),
            r"'files'\[0\] is '../export-0",
        ),
        ("files", lambda m: m.__setitem__("files", ["/etc/passwd"]), r"'files'\[0\]"),
        ("num_shards", lambda m: m.__setitem__("num_shards", 0), "'num_shards' must be"),
    ],
)
def test_bad_manifest_fields_are_named(tmp_path: Path, field: str, edit: Any, match: str) -> None:
    write(tmp_path, 0, None, [1, 2])
    write(tmp_path, 1, 0, [3], edit=edit)
    with pytest.raises(ExportError, match=f"export-1/manifest.json: .*{match}"):
        ExportedModel.load(str(tmp_path))
    model = ExportedModel.load(str(tmp_path), upto=0)
    with pytest.raises(ExportError, match=f"export-1/manifest.json: .*{match}"):
        model.follow(str(tmp_path))
    assert model.seq == 0


def test_a_delta_cannot_change_a_tables_width_or_dtype(tmp_path: Path) -> None:
    write(tmp_path / "dim", 0, None, [1, 2])
    write(tmp_path / "dim", 1, 0, [], spec=dict(HASHED, embedding_dim=3))
    with pytest.raises(ExportError, match="export-1: table 't': the delta's 'embedding_dim' is "
                       "3, its base's 2: a delta cannot change it"):  # fmt: skip
        ExportedModel.load(str(tmp_path / "dim"))
    write(tmp_path / "dtype", 0, None, [1, 2])
    write(tmp_path / "dtype", 1, 0, [3], spec=dict(HASHED, dtype="float64"),
          values=torch.ones(1, 2, dtype=torch.float64))  # fmt: skip
    with pytest.raises(ExportError, match="the delta's 'dtype' is 'float64', its base's"):
        ExportedModel.load(str(tmp_path / "dtype"))
    write(tmp_path / "both", 0, None, [1, 2])
    write(tmp_path / "both", 1, 0, [2], gone=[2])
    with pytest.raises(ExportError, match="id 2 is both written and evicted"):
        ExportedModel.load(str(tmp_path / "both"))


def test_a_damaged_old_export_blocks_neither_serving_nor_pruning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, 0, None, [1])
    write(tmp_path, 1, 0, [2])
    write(tmp_path, 2, None, [3], base=2)
    (tmp_path / "export-0/manifest.json").write_text('{"format": "psflow-export/1", "seq": 0')
    with caplog.at_level(logging.WARNING, logger="psflow.serve.delta"):
        assert ExportedModel.load(str(tmp_path)).seq == 2
        assert ExportedModel.load(str(tmp_path)).seq == 2
    logged = [r for r in caplog.records if "export-0/manifest.json" in r.getMessage()]
    assert len(logged) == 1  # once
    with pytest.raises(ExportError, match="export-0, which export-1 follows, is damaged"):
        ExportedModel.load(str(tmp_path), upto=1)
    exporter = Exporter.__new__(Exporter)
    exporter.dir = str(tmp_path)
    exporter.config = SimpleNamespace(export_keep_bases=2)  # type: ignore[assignment]
    exporter._prune(2)  # export-0 is in a kept chain: it stays, damaged
    assert sorted(os.listdir(tmp_path)) == ["export-0", "export-1", "export-2"]
    exporter.config = SimpleNamespace(export_keep_bases=1)  # type: ignore[assignment]
    exporter._prune(2)
    assert sorted(os.listdir(tmp_path)) == ["export-2"]


def test_a_server_refuses_a_bad_export_and_never_answers_nan(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    onnx = tmp_path / "head.onnx"
    export_dense(torch.nn.Linear(2, 1), {"t": 2}, onnx, prefix="")

    def dense(seq: int, edit: Any = None, **kw: Any) -> Path:
        def head(m: dict[str, Any]) -> None:
            m["dense"] = {
                n: {
                    "shape": s,
                    "dtype": "float32",
                    "pieces": [{"var": n, "shard": 0, "rows": None}],
                }
                for n, s in (("weight", [1, 2]), ("bias", [1]))
            }
            if edit is not None:
                edit(m)

        d = write(exports, seq, **kw, edit=head)
        f = d / "shard-0-of-1.safetensors"
        from safetensors import safe_open

        with safe_open(str(f), "pt") as h:
            meta, ts = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118
        del ts["dense/w"]
        ts["dense/weight"], ts["dense/bias"] = torch.ones(1, 2), torch.zeros(1)
        save_file(ts, str(f), meta)
        return d

    dense(0, since=None, ids=[5])
    dense(1, since=0, ids=[6], spec=dict(HASHED, embedding_dim=3), values=torch.ones(1, 3))

    def serve(where: Path) -> ModelServer:
        return ModelServer(ServerConfig(export_dir=str(where), onnx_path=str(onnx),
                                        features={"t": Feature(table="t", mode="sum")}))  # fmt: skip

    with serve(exports) as server:  # start() serves export-0, refuses export-1, serves on
        assert server.served is not None and server.served.seq == 0
        assert "the delta's 'embedding_dim' is 3" in (server.last_error or "")
        assert server.predict({"t": [[5]]})[0].seq == 0
    # A huge row makes an infinite output: JSON has no such number, the answer is a 500.
    exports = tmp_path / "big"
    dense(0, since=None, ids=[5], values=torch.full((1, 2), 3e38))
    with serve(exports) as server:
        request = urllib.request.Request(
            server.url + "/predict", json.dumps({"features": {"t": [[5]]}}).encode()
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=10)
        assert e.value.code == 500
        body = json.loads(e.value.read())  # valid JSON: no NaN, no Infinity
        assert "computed a non-finite value" in body["error"]


def test_a_ps_exports_only_into_its_export_directory(tmp_path: Path) -> None:
    def asked(service: ExportService, url: str, seq: int = 0) -> dict[str, Any]:
        reply = ask(service, **{Key.OP: Op.EXPORT, Key.DIR: url, Key.EXPORT_SEQ: seq,
                                Key.BASE: seq, Key.RESERVE_BYTES: 0})  # fmt: skip
        service.wait(10)
        return reply

    root = tmp_path / "job"
    given = ExportService(Host(), chief="worker:0", num_shards=1, root=str(root))  # type: ignore[arg-type]
    for url in (f"{root}/../elsewhere/export-0", f"{tmp_path}/elsewhere/export-0",
                f"memory://{root}/export-0", f"{root}/sub/export-0"):  # fmt: skip
        with pytest.raises(ValueError, match="refusing to export into"):
            asked(given, url)
    assert not (tmp_path / "elsewhere").exists() and not root.exists()
    asked(given, f"{root}/export-0")
    assert (root / "export-0/shard-0-of-1.safetensors").exists()
    # Not given one: '..' is refused, and the first export directory is the only one.
    first = ExportService(Host(), chief="worker:0", num_shards=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a '\.\.' in its path"):
        asked(first, f"{root}/../elsewhere/export-0")
    asked(first, f"{tmp_path}/exports/export-0")
    with pytest.raises(ValueError, match=r"exports only into .*where its first export went"):
        asked(first, f"{tmp_path}/elsewhere/export-1", seq=1)
    reply = asked(first, f"{tmp_path}/exports/export-1", seq=1)
    assert reply[Key.SAVING].endswith("exports/export-1/shard-0-of-1.safetensors")
    status = ask(first, **{Key.OP: Op.EXPORT_STATUS, Key.DIR: f"{tmp_path}/exports/export-1"})
    assert status[Key.STATE] == SaveState.DONE
    assert not (tmp_path / "elsewhere").exists()


def test_an_error_no_check_foresaw_leaves_the_server_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    onnx = tmp_path / "head.onnx"
    export_dense(torch.nn.Linear(2, 1), {"t": 2}, onnx, prefix="")

    def broken(self: ExportedModel, export_dir: str) -> list[int]:
        raise RuntimeError("shape mismatch\nsecond line")

    monkeypatch.setattr(ExportedModel, "follow", broken)
    config = ServerConfig(export_dir=str(tmp_path / "exports"), onnx_path=str(onnx),
                          features={"t": Feature(table="t", mode="sum")})  # fmt: skip
    with ModelServer(config) as server:  # start() does not raise
        assert server.served is None
        assert server.last_error == f"{tmp_path}/exports: RuntimeError: shape mismatch"
