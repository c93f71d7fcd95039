"""Incremental exports from real ps processes (issue 37): a base, then deltas of the rows changed
and the ids evicted since, written by each ps and published by the chief's manifest; applied
in order by psflow.serve.delta they give exactly the rows and dense values the ps held."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import psflow.nn as pnn
from psflow.protocol import Key, Op
from psflow.serve.delta import ExportedModel, ExportError, chain, list_exports, read_export
from psflow.train import load_checkpoint
from psflow.transport import PeerError

from .support import local_cluster, quiet_session, start_ps, stop

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

VOCAB, DIM, HASHED_DIM, MAX_ROWS = 40, 4, 3, 6


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.items = pnn.Embedding(VOCAB, DIM, seed=1)
        users = pnn.TableConfig(
            num_embeddings=None,
            embedding_dim=HASHED_DIM,
            optimizer="Adagrad",
            max_rows=MAX_ROWS,  # per ps: most ids are evicted again, so deltas carry tombstones
            ttl_seconds=3600.0,
        )
        self.users = pnn.EmbeddingBag(config=users, mode="sum")
        self.head = torch.nn.Linear(DIM + HASHED_DIM, 4)  # partitioned over the 2 ps below

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.items(items).mean(1), self.users(users)], 1)).sum(1)


def train(sess: object, model: Model, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    items = torch.randint(0, VOCAB, (6, 2), generator=g)
    users = torch.randint(0, 30, (6, 2), generator=g)  # ids come back after eviction
    sess.zero_grad()  # type: ignore[attr-defined]
    loss = F.mse_loss(model(items, users), torch.randn(6, generator=g))
    loss.backward()
    sess.step(loss=loss)  # type: ignore[attr-defined]


def checkpoint_rows(ckpt: Path) -> dict[str, dict[int, torch.Tensor]]:
    """Each table's rows in a checkpoint's shard files, by id."""
    out: dict[str, dict[int, torch.Tensor]] = {"items": {}, "users": {}}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(f)
        for table, rows in out.items():
            ids, values = tensors[f"@table/{table}/ids"], tensors[f"@table/{table}/values"]
            rows.update(zip(ids.tolist(), values, strict=True))
    return out


def test_a_base_and_deltas_reproduce_the_ps_and_bad_orders_are_refused(tmp_path: Path) -> None:
    cluster = local_cluster(2, 1)
    procs = [start_ps(cluster, i) for i in range(2)]
    exports, ckpt = tmp_path / "exports", tmp_path / "ckpt"
    try:
        model = Model()
        with quiet_session(
            model,
            cluster,
            str(ckpt),
            optimizer="Adagrad",
            lr=0.1,
            partition_bytes=64,
            export_dir=str(exports),
            export_every=3600,  # exported when the test says (and at the end)
            export_base_every=2,
        ) as sess:
            assert sess.exporter is not None
            step = 0
            for _ in range(5):  # base 0, deltas 1 2, base 3, delta 4
                for _ in range(2):
                    train(sess, model, step)
                    step += 1
                sess.export()
            # No room left on the disk (as this ps measures it): refused, nothing published,
            # and the previous exports stay whole.
            before = ExportedModel.load(str(exports))
            sess.exporter.config.export_reserve_bytes = 1 << 62
            train(sess, model, step)
            with pytest.raises(ExportError, match="refused, nothing written"):
                sess.export()
            assert [e.seq for e in list_exports(str(exports))] == [0, 1, 2, 3, 4]
            again = ExportedModel.load(str(exports))
            assert again.seq == 4 and set(again.tables) == set(before.tables)
            for name, (ids, rows) in before.tables.items():
                assert torch.equal(again.tables[name][0], ids)
                assert torch.equal(again.tables[name][1], rows)
            sess.exporter.config.export_reserve_bytes = 0
            train(sess, model, step + 1)
            sess.export()  # a base again (the failed one reset what the shards tracked)
            train(sess, model, step + 2)
            last = sess.export()
            stats = sess.opt.engine.exchange.tables.status()  # type: ignore[attr-defined]
            sess.save()  # the ps as they were at the last export: nothing trained since
            # A delta after an export the shards do not track since (a restarted ps, a chief
            # that lost count) is refused by the ps; the chief asks first and exports a base.
            client = sess.exporter.make_client()
            try:
                tracked = client.call({s: {Key.OP: Op.EXPORT_STATUS} for s in (0, 1)})
                assert [h[Key.SINCE] for h, _ in tracked.values()] == [7, 7]
                bad = {
                    Key.OP: Op.EXPORT, Key.DIR: str(exports / "export-99"), Key.EXPORT_SEQ: 99,
                    Key.BASE: 3, Key.SINCE: 4, Key.RESERVE_BYTES: 0,
                }  # fmt: skip
                with pytest.raises(PeerError, match="tracks changes since export 7, not since 4"):
                    client.call({0: bad})
            finally:
                client.close()
        for p in procs:
            code, err = stop(p)
            assert code == 0, err[-3000:]
    finally:
        for p in procs:
            stop(p, timeout=1)
    assert sum(s["users"]["evicted"] for s in stats.values()) > 0
    kinds = {e.seq: (e.kind, e.base, e.since) for e in list_exports(str(exports))}
    # Chains kept: the newest 2 bases (3 and 6) with their deltas; 5, refused, never published.
    assert kinds == {
        3: ("base", 3, None),
        4: ("delta", 3, 3),
        6: ("base", 6, None),
        7: ("delta", 6, 6),
        8: ("delta", 6, 7),  # the session's last, at its close
    }
    assert not (exports / "export-0").exists() and not (exports / "export-5").exists()
    assert last.endswith("export-7")
    # Deltas carry only what changed, and the ids evicted since.
    delta = {k: v for f in sorted((exports / "export-7").glob("*.safetensors")) for k, v in
             load_file(f).items() if k.startswith("table/users/")}  # fmt: skip
    assert delta["table/users/ids"].numel() < 2 * MAX_ROWS
    tombstones = sum(
        load_file(f)["table/users/tombstones"].numel()
        for d in ("export-4", "export-7")
        for f in (exports / d).glob("*.safetensors")
    )
    assert tombstones > 0
    # Applied in order, base and deltas are the ps's rows and dense values at the last export.
    served = ExportedModel.load(str(exports), upto=7)
    assert served.seq == 7 and served.base == 6
    held = checkpoint_rows(ckpt / f"ckpt-{served.step}")
    for table in ("items", "users"):
        ids, rows = served.tables[table]
        assert ids.tolist() == sorted(held[table])
        assert torch.equal(rows, torch.stack([held[table][i] for i in ids.tolist()]))
    assert len(held["users"]) <= 2 * MAX_ROWS  # the hard cap, per ps
    dense = load_checkpoint(str(ckpt), f"ckpt-{served.step}")
    assert dense is not None and set(served.dense) == {"head.weight", "head.bias"}
    for name, value in served.dense.items():
        assert torch.equal(value, dense.params[name]), name
    probe = torch.tensor([ids[0].item(), 10**15])
    assert torch.equal(served.lookup("users", probe)[1], torch.zeros(HASHED_DIM))
    # A delta out of order, of another base, or before any base: refused, the model unchanged.
    e3, e4, e6, e7, e8 = (read_export(str(exports / f"export-{n}")) for n in (3, 4, 6, 7, 8))
    fresh = ExportedModel()
    with pytest.raises(ExportError, match="apply that base first"):
        fresh.apply(e4)
    fresh.apply(e3)
    with pytest.raises(ExportError, match="this model holds base export-3: refused"):
        fresh.apply(e7)
    fresh.apply(e6)
    with pytest.raises(ExportError, match="follows export-7; this model holds export-6"):
        fresh.apply(e8)
    assert fresh.seq == 6
    assert [e.seq for e in chain(str(exports))] == [6, 7, 8]
    assert fresh.follow(str(exports)) == [7, 8] and fresh.seq == 8
    manifest = json.loads((exports / "export-8" / "manifest.json").read_text())
    assert manifest["base"] == 6 and manifest["since"] == 7 and manifest["kind"] == "delta"
