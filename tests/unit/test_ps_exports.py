"""The ps's export service in process, on a host of its own (no sockets): what it writes, what
it refuses, and what it counts. tests/multiproc/test_exports.py runs it in real ps processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from psflow import metrics
from psflow.protocol import Key, Op, RowOptimizerSpec, SaveState, TableSpec
from psflow.ps.exports import ExportService
from psflow.serve.delta import ExportedModel
from psflow.sparse import make_rows
from psflow.transport import Request

pytestmark = pytest.mark.unit


class Host:
    """What the service sees of a ps: one shard of one, its replies kept."""

    name, shard = "ps:0", 0

    def __init__(self) -> None:
        spec = TableSpec(
            name="t", embedding_dim=2, num_embeddings=None, optimizer=RowOptimizerSpec.of("SGD")
        )
        table = make_rows(spec, 0, 1)
        table.apply(torch.tensor([5, 9]), torch.ones(2, 2))
        self.store = SimpleNamespace(
            tables={"t": table}, variables={"w": torch.arange(3.0)}, step=7
        )
        self.task_metrics = metrics.TaskMetrics("ps:0", enabled=True)
        self.metrics = self.task_metrics.ps(0)
        self.replies: list[dict[str, Any]] = []

    def sender(self, request: Request) -> str:
        return str(request.header[Key.TASK])

    def require_initialized(self) -> None:
        pass

    def reply(self, request: Request, header: dict[str, Any], tensors: object = ()) -> None:
        self.replies.append(header)


def ask(service: ExportService, **header: Any) -> dict[str, Any]:
    host = service.host
    request = Request(identity=b"", header={Key.TASK: "worker:0", **header}, frames=[])
    handler = service.handlers()[header[Key.OP]]
    handler(request)
    return host.replies[-1]  # type: ignore[attr-defined,no-any-return]


def export(service: ExportService, root: Path, seq: int, **header: Any) -> dict[str, Any]:
    url = str(root / f"export-{seq}")
    ask(service, **{Key.OP: Op.EXPORT, Key.DIR: url, Key.EXPORT_SEQ: seq, Key.BASE: seq,
                    Key.RESERVE_BYTES: 0, **header})  # fmt: skip
    service.wait(10)
    return ask(service, **{Key.OP: Op.EXPORT_STATUS, Key.DIR: url})


def test_a_shard_exports_refuses_what_it_must_and_counts_failures(tmp_path: Path) -> None:
    host = Host()
    service = ExportService(host, chief="worker:0", num_shards=1)  # type: ignore[arg-type]
    assert export(service, tmp_path, 0)[Key.STATE] == SaveState.DONE
    failed = export(service, tmp_path, 1, **{Key.BASE: 0, Key.SINCE: 0, Key.RESERVE_BYTES: 1 << 62})
    assert failed[Key.STATE] == SaveState.ERROR
    assert "refused, nothing written" in failed[Key.ERROR]
    assert not list((tmp_path / "export-1").glob("*.safetensors"))
    # The shard no longer tracks since a file never written: a delta after it is refused.
    assert ask(service, **{Key.OP: Op.EXPORT_STATUS})[Key.SINCE] is None
    with pytest.raises(ValueError, match="ps:0 tracks no changes, not since 0"):
        export(service, tmp_path, 2, **{Key.BASE: 0, Key.SINCE: 0})
    with pytest.raises(ValueError, match="must be an export directory"):
        ask(service, **{Key.OP: Op.EXPORT, Key.DIR: str(tmp_path / "ckpt-3")})
    other = Request(identity=b"", header={Key.TASK: "worker:1", Key.OP: Op.EXPORT}, frames=[])
    with pytest.raises(ValueError, match=r"only the chief \(worker:0\)"):
        service.handlers()[Op.EXPORT](other)
    got = metrics.parse(generate_latest(host.task_metrics.registry).decode())
    assert got.total(metrics.PS_EXPORT_FAILED) == 1
    assert got.total(metrics.PS_EXPORT_WRITE + "_count") == 1
    # What it wrote reads back as the shard held it.
    (tmp_path / "export-0" / "manifest.json").write_text(
        '{"format": "psflow-export/1", "seq": 0, "kind": "base", "base": 0, "since": null, '
        '"step": 7, "num_shards": 1, "files": ["shard-0-of-1.safetensors"], '
        '"dense": {"w": {"shape": [3], "dtype": "float32", '
        '"pieces": [{"var": "w", "shard": 0, "rows": null}]}}, '
        '"tables": {"t": {"embedding_dim": 2, "dtype": "float32"}}}'
    )
    model = ExportedModel.load(str(tmp_path))
    assert model.tables["t"][0].tolist() == [5, 9]
    assert torch.equal(model.tables["t"][1], host.store.tables["t"].lookup(torch.tensor([5, 9])))
    assert torch.equal(model.dense["w"], torch.arange(3.0))


class FakeShards:
    """The chief's view of 2 ps: which export each tracks since; every write done at once."""

    num_shards = 2

    def __init__(self, since: list[int | None], sent: list[dict[str, Any]]) -> None:
        self.since, self.sent = since, sent

    def call(self, headers: dict[int, dict[str, Any]]) -> dict[int, tuple[dict[str, Any], list]]:
        out: dict[int, tuple[dict[str, Any], list]] = {}
        for shard, h in headers.items():
            if h[Key.OP] == Op.EXPORT:
                self.sent.append(h)
                out[shard] = ({Key.SNAPSHOT_STEP: 5, Key.TABLES: {}}, [])
            elif Key.DIR in h:
                out[shard] = ({Key.STATE: SaveState.DONE}, [])
            else:
                out[shard] = ({Key.SINCE: self.since[shard]}, [])
        return out

    def close(self) -> None:
        pass


def test_the_chief_exports_a_base_when_the_shards_disagree_on_what_they_track(
    tmp_path: Path,
) -> None:
    from psflow.train.exports import Exporter
    from psflow.train.session_config import ExportConfig

    sent: list[dict[str, Any]] = []
    since: list[int | None] = [None, None]
    config = ExportConfig(export_dir=str(tmp_path), export_base_every=3, export_keep_bases=1)
    exporter = Exporter(config, make_client=lambda: FakeShards(since, sent), pieces=[], params={})  # type: ignore[arg-type,return-value]
    kinds = []
    for restarted in (False, False, True, False, False, False, False):
        if restarted:
            since[1] = None  # ps:1 came back empty
        exporter.export()
        h = sent[-1]
        kinds.append("base" if Key.SINCE not in h else f"delta<{h[Key.SINCE]}")
        since[0] = since[1] = h[Key.EXPORT_SEQ]  # what the shards track after it
    assert kinds == ["base", "delta<0", "base", "delta<2", "delta<3", "delta<4", "base"]
    # One chain kept (the newest base's): the older ones deleted once it was complete.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export-6"]
