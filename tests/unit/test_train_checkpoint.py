"""Checkpoint files, manifests, the latest pointer, retention, repartitioning (no sockets)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from psflow.cli import build_parser
from psflow.protocol import OptimizerSpec
from psflow.ps.checkpoint import ShardCheckpointer, atomic_write, is_checkpoint_of, url_to_fs
from psflow.ps.optimizer_state import (
    flatten_optimizer_state,
    load_optimizer_state,
    split_init_tensors,
)
from psflow.ps.shard_file import read_shard
from psflow.ps.store import ShardStore
from psflow.train.checkpoint import export_state_dict, load_checkpoint
from psflow.train.manifest import CheckpointDir, Manifest, VariableEntry
from psflow.worker.placement import ParamInfo, Piece, place

pytestmark = pytest.mark.unit

ADAM = OptimizerSpec(name="Adam", kwargs={"lr": 0.01})


def _mem() -> str:
    return f"memory://ckpt-{uuid.uuid4().hex}"


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"table": torch.randn(10, 4), "bias": torch.randn(4)}


def _stores(
    params: dict[str, torch.Tensor], pieces: list[Piece], num: int, spec: OptimizerSpec = ADAM
) -> list[ShardStore]:
    stores = [ShardStore() for _ in range(num)]
    for s, store in enumerate(stores):
        vals = [(p.var, _rows(params[p.param], p.rows)) for p in pieces if p.shard == s]
        store.initialize(vals, spec)
    return stores


def _rows(t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    return t if rows is None else t[rows[0] : rows[1]]


def _train(stores: list[ShardStore], pieces: list[Piece], steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    full = {"table": (10, 4), "bias": (4,)}
    for _ in range(steps):
        grads = {n: torch.randn(*shape, generator=g) for n, shape in full.items()}
        for s, store in enumerate(stores):
            store.apply([(p.var, _rows(grads[p.param], p.rows)) for p in pieces if p.shard == s])


def _save(url: str, stores: list[ShardStore], pieces: list[Piece], name: str) -> None:
    """What the ps tasks and the chief do, in one process."""
    ckpt = f"{url}/{name}"
    replies = {}
    for s, store in enumerate(stores):
        saver = ShardCheckpointer(store, shard=s, num_shards=len(stores))
        replies[s] = saver.save({"dir": ckpt})
        saver.wait(10)
        assert saver.status({"dir": ckpt})["state"] == "done"
    n = len(stores)
    manifest = Manifest(
        global_step=stores[0].step,
        num_shards=n,
        optimizer=ADAM.to_wire(),
        variables=[
            VariableEntry(
                var=p.var,
                param=p.param,
                shard=p.shard,
                file=f"shard-{p.shard}-of-{n}.safetensors",
                shape=replies[p.shard]["variables"][p.var][1],
                dtype="float32",
                rows=list(p.rows) if p.rows else None,
            )
            for p in pieces
        ],
        params={"table": {"shape": [10, 4]}, "bias": {"shape": [4]}},
    )
    CheckpointDir(url).publish(name, manifest)


def _pieces(num: int) -> list[Piece]:
    infos = [
        ParamInfo(name="table", shape=(10, 4), dtype=torch.float32),
        ParamInfo(name="bias", shape=(4,), dtype=torch.float32),
    ]
    return place(infos, num, partition_bytes=64)


def test_optimizer_state_round_trips_through_flat_keys() -> None:
    store = _stores(_params(), _pieces(1), 1)[0]
    _train([store], _pieces(1), 3)
    assert store.optimizer is not None
    tensors, plain, groups = flatten_optimizer_state(store.optimizer, list(store.variables))
    assert sorted(tensors) == [
        f"{v}/opt/{k}" for v in ("bias", "table") for k in ("exp_avg", "exp_avg_sq", "step")
    ]
    assert groups[0]["lr"] == 0.01 and "params" not in groups[0]
    header = {"opt_state": plain}
    variables, opt, opt_plain = split_init_tensors(
        header, [*store.variables.items(), *tensors.items()]
    )
    fresh = ShardStore()
    fresh.initialize(variables, ADAM, step=3)
    load_optimizer_state(fresh, opt, opt_plain)
    for s in (store, fresh):
        s.apply([("table", torch.ones(10, 4)), ("bias", torch.ones(4))])
    assert torch.equal(store.variables["table"], fresh.variables["table"])
    # The original init form (no opt_state) still means variables only.
    assert split_init_tensors({}, [("w", torch.zeros(1))])[0][0][0] == "w"


def test_restore_into_a_different_number_of_shards_continues_identically() -> None:
    url = _mem()
    params = _params()
    two = _pieces(2)
    assert {p.var for p in two} == {"table/part_0", "table/part_1", "bias"}
    stores = _stores(params, two, 2)
    _train(stores, two, 5)
    _save(url, stores, two, "ckpt-5")

    ckpt = load_checkpoint(url)
    assert ckpt is not None and ckpt.global_step == 5
    three = _pieces(3)
    values, plain = ckpt.place(three)
    restored = []
    for s in range(3):
        v, opt, op = split_init_tensors({"opt_state": plain.get(s, {})}, values[s])
        store = ShardStore()
        store.initialize(v, ADAM, step=ckpt.global_step)
        load_optimizer_state(store, opt, op)
        restored.append(store)
    _train(stores, two, 4, seed=7)
    _train(restored, three, 4, seed=7)

    def whole(sts: list[ShardStore], pieces: list[Piece]) -> torch.Tensor:
        parts = sorted((p for p in pieces if p.param == "table"), key=lambda p: p.rows or (0, 0))
        return torch.cat([sts[p.shard].variables[p.var] for p in parts])

    assert torch.allclose(whole(stores, two), whole(restored, three), atol=1e-6)


def test_latest_pointer_ignores_incomplete_and_retention_keeps_newest(tmp_path: Path) -> None:
    url = str(tmp_path)
    params = _params()
    pieces = _pieces(1)
    stores = _stores(params, pieces, 1)
    d = CheckpointDir(url)
    assert d.latest() is None and load_checkpoint(url) is None
    for step in (1, 2, 3):
        _train(stores, pieces, 1)
        _save(url, stores, pieces, f"ckpt-{step}")
    (tmp_path / "ckpt-4").mkdir()  # a save killed before its manifest
    (tmp_path / "ckpt-4" / "shard-0-of-1.safetensors.tmp-1-2").write_bytes(b"partial")
    assert d.latest() == "ckpt-3"
    assert [(c.name, c.complete) for c in d.checkpoints()][-1] == ("ckpt-4", False)
    assert d.prune(2, incomplete_below=10) == ["ckpt-1", "ckpt-4"]
    assert [c.name for c in d.checkpoints()] == ["ckpt-2", "ckpt-3"]
    (tmp_path / "latest").write_text("ckpt-99\n")  # pointing nowhere: fall back to manifests
    assert d.latest() == "ckpt-3"
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_atomic_write_replaces_whole_files(tmp_path: Path) -> None:
    fs, path = url_to_fs(str(tmp_path / "a" / "latest"))
    atomic_write(fs, path, b"one")
    seen = []
    atomic_write(fs, path, b"two", before_commit=lambda: seen.append(Path(path).read_bytes()))
    assert seen == [b"one"] and Path(path).read_bytes() == b"two"
    mem_fs, mem_path = url_to_fs(_mem() + "/x/latest")
    atomic_write(mem_fs, mem_path, b"three")
    assert mem_fs.cat_file(mem_path) == b"three"


def test_shard_writer_refuses_non_finite_values_and_bad_dirs() -> None:
    store = ShardStore()
    store.initialize([("w", torch.zeros(3))], OptimizerSpec())
    store.variables["w"][1] = float("nan")
    saver = ShardCheckpointer(store, shard=0, num_shards=1)
    url = _mem() + "/ckpt-0"
    saver.save({"dir": url})
    saver.wait(10)
    status = saver.status({"dir": url})
    assert status["state"] == "error" and "not finite" in status["error"]
    with pytest.raises(ValueError, match="ckpt-<step>"):
        saver.save({"dir": "/tmp/../etc"})
    assert saver.status({"dir": "elsewhere"}) == {"state": "unknown"}


def test_read_shard_rejects_a_non_psflow_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="not a readable psflow shard"):
        read_shard(str(bad))


def test_cli_inspect_and_export_load_into_a_plain_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = str(tmp_path / "run")
    pieces = _pieces(2)
    stores = _stores(_params(), pieces, 2)
    _train(stores, pieces, 2)
    _save(url, stores, pieces, "ckpt-2")
    parser = build_parser()
    args = parser.parse_args(["checkpoint", "inspect", url])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "global step: 2" in out and "table/part_1" in out and "rows 5:10 of table" in out
    args = parser.parse_args(["checkpoint", "inspect", "--json", url])
    args.func(args)
    assert json.loads(capsys.readouterr().out)["global_step"] == 2

    out_file = tmp_path / "model.safetensors"
    args = parser.parse_args(["checkpoint", "export", url, str(out_file)])
    assert args.func(args) == 0

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(10, 4))
            self.bias = torch.nn.Parameter(torch.zeros(4))

    m = M()
    m.load_state_dict(load_file(str(out_file)))
    held = {n: t for st in stores for n, t in st.variables.items()}
    assert torch.equal(m.table.detach(), torch.cat([held["table/part_0"], held["table/part_1"]]))
    ckpt = export_state_dict(url, str(tmp_path / "again.safetensors"))
    assert torch.equal(ckpt.params["table"], m.table.detach())
    assert time.time() >= CheckpointDir(url).manifest("ckpt-2").created


def test_manifest_validation() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        Manifest(global_step=1, num_shards=0, optimizer={}, variables=[])
    with pytest.raises(ValueError, match="format"):
        Manifest.from_json('{"format": 99}')
    with pytest.raises(ValueError, match="checkpoint_dir"):
        CheckpointDir("")


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("{root}/ckpt-5", True),
        ("{root}/ckpt-5/", True),
        ("{root}//ckpt-5", True),
        ("file://{root}/ckpt-5", True),
        ("{root}/sub/ckpt-5", False),
        ("{root}/../elsewhere/ckpt-5", False),
        ("{root}/ckpt-5/../ckpt-6", False),
        ("/tmp/elsewhere/ckpt-5", False),
        ("memory://{root}/ckpt-5", False),
        ("{root}/ckpt-x", False),
        ("{root}", False),
    ],
)
def test_a_ps_saves_only_under_its_checkpoint_directory(tmp_path: Path, url: str, ok: bool) -> None:
    root = str(tmp_path / "job")
    assert is_checkpoint_of(root, url.format(root=root)) is ok
    store = ShardStore()
    store.initialize([("w", torch.zeros(2))], OptimizerSpec())
    saver = ShardCheckpointer(store, shard=0, num_shards=1, root=root)
    if not ok:
        with pytest.raises(ValueError, match=r"refusing to save|ckpt-<step>"):
            saver.save({"dir": url.format(root=root)})
    assert is_checkpoint_of("memory://job", "memory://job/ckpt-1")
    assert not is_checkpoint_of("memory://job", "s3://job/ckpt-1")


def test_a_shard_file_written_in_pieces_is_what_safetensors_writes(tmp_path: Path) -> None:
    """The ps writes its shard file piece by piece from the tensors' own memory: safetensors
    reads it back, every dtype and shape (empty and 0-d ones too), metadata included."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from psflow.ps.files import atomic_write, url_to_fs
    from psflow.ps.shard_file import safetensors_chunks

    tensors = {
        "w": torch.randn(5, 3),
        "b": torch.randn(3, dtype=torch.float64),
        "@table/emb/ids": torch.arange(7),
        "step": torch.tensor(4.0),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "view": torch.randn(4, 6)[:, 1:3],  # not contiguous
    }
    out = tmp_path / "shard.safetensors"
    fs, path = url_to_fs(str(out))
    atomic_write(fs, path, safetensors_chunks(tensors, {"psflow.step": "4"}))
    back = load_file(out)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"psflow.step": "4"}
