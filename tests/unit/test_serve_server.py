"""psflow.serve.server on exports written here, in process (no sockets: its ``poll`` and
``predict``; tests/multiproc/test_serving.py serves a real job's exports over HTTP): pooling as
``psflow.nn`` pools in eval mode, a delta never applied during a request, an export that does
not fit the ONNX graph refused while the last good one is served."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import psflow.nn as pnn
from psflow.serve.delta import EXPORT_META, FORMAT, ExportedModel
from psflow.serve.dense import export_dense
from psflow.serve.server import BadRequest, Feature, ModelServer, ServerConfig

pytestmark = pytest.mark.unit

DIM = 3
SPEC = {"name": "users", "embedding_dim": DIM, "num_embeddings": None, "dtype": "float32"}


def write(
    root: Path,
    seq: int,
    since: int | None,
    ids: list[int],
    *,
    base: int = 0,
    gone: tuple[int, ...] = (),
    out: int = 1,
) -> None:
    """Export ``seq``: rows for ``ids`` that depend on ``seq``, and a head ``Linear(DIM, out)``
    whose weights do too (a request computed with parts of two exports would show it)."""
    d = root / f"export-{seq}"
    d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seq)
    tensors = {
        "dense/head.weight": torch.randn(out, DIM, generator=g),
        "dense/head.bias": torch.randn(out, generator=g),
        "table/users/ids": torch.tensor(ids, dtype=torch.int64),
        "table/users/values": torch.randn(len(ids), DIM, generator=g),
        "table/users/tombstones": torch.tensor(gone, dtype=torch.int64),
    }
    meta = {"seq": seq, "base": base, "since": since, "shard": 0, "num_shards": 1, "step": seq}
    tmp = d / "shard-0-of-1.safetensors"
    save_file(tensors, str(tmp), {EXPORT_META: json.dumps(meta)})
    dense = {
        name: {"shape": list(tensors[f"dense/{name}"].shape), "dtype": "float32",
               "pieces": [{"var": name, "shard": 0, "rows": None}]}
        for name in ("head.weight", "head.bias")
    }  # fmt: skip
    manifest = {
        "format": FORMAT, "seq": seq, "kind": "base" if since is None else "delta",
        "base": base, "since": since, "step": seq, "num_shards": 1,
        "files": [tmp.name], "dense": dense, "tables": {"users": SPEC},
    }  # fmt: skip
    part = d / "manifest.json.tmp"
    part.write_text(json.dumps(manifest))
    part.rename(d / "manifest.json")  # last and atomically, as the chief does


def server(tmp_path: Path, feature: Feature) -> ModelServer:
    onnx = tmp_path / "head.onnx"
    export_dense(torch.nn.Linear(DIM, 1), {"users": DIM}, onnx, prefix="head.")
    config = ServerConfig(
        export_dir=str(tmp_path / "exports"), onnx_path=str(onnx), features={"users": feature}
    )
    return ModelServer(config)


def reference(exports: Path, seq: int, feature: Feature) -> torch.nn.Module:
    """``psflow.nn``'s model in eval mode with export ``seq``'s rows and head."""
    model = ExportedModel.load(str(exports), upto=seq)
    bag = pnn.EmbeddingBag(
        None, DIM, mode=feature.mode, padding_idx=feature.padding_idx, optimizer="SGD"
    )
    bag.load_rows(*model.tables["users"])
    head = torch.nn.Linear(DIM, 1)
    head.load_state_dict({k.removeprefix("head."): v for k, v in model.dense.items()})
    return torch.nn.ModuleDict({"bag": bag, "head": head}).eval()


def run_reference(ref: torch.nn.Module, bags: list[list[int]]) -> torch.Tensor:
    offsets = torch.tensor([0] + [len(b) for b in bags[:-1]]).cumsum(0)
    ids = torch.tensor([i for b in bags for i in b], dtype=torch.int64)
    with torch.no_grad():
        return ref["head"](ref["bag"](ids, offsets))  # type: ignore[index,no-any-return]


BAGS = [[1, 2, 3], [], [7], [10**15, 1], [0, 0, 5], [0], [-4, 2, 2], [5, 10**15, 0, 3]]
"""Held ids, an empty bag, ids never held, the padding id (0) alone and among others."""


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_bags_pool_as_psflow_nn_does_in_eval_mode(
    tmp_path: Path, mode: str, padding_idx: int | None
) -> None:
    held = [1, 2, 3, 5, -4] + ([0] if padding_idx is None else [])  # the padding id: never
    write(tmp_path / "exports", 0, None, held)
    feature = Feature(table="users", mode=mode, padding_idx=padding_idx)
    srv = server(tmp_path, feature)
    assert srv.poll() == [0]
    served, out = srv.predict({"users": BAGS})
    assert served.seq == 0
    ref = reference(tmp_path / "exports", 0, feature)
    want = run_reference(ref, BAGS)
    torch.testing.assert_close(torch.from_numpy(out["output"]), want, rtol=0, atol=1e-6)
    # The pooled rows themselves: exactly psflow.nn's (the head is ONNX Runtime's arithmetic).
    offsets = torch.tensor([0] + [len(b) for b in BAGS[:-1]]).cumsum(0)
    ids = torch.tensor([i for b in BAGS for i in b], dtype=torch.int64)
    pooled = torch.from_numpy(served.pool("users", feature, ids, offsets))
    with torch.no_grad():
        assert torch.equal(pooled, ref["bag"](ids, offsets))  # type: ignore[index]


def test_a_delta_is_applied_between_requests_never_during_one(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    feature = Feature(table="users", mode="mean")
    write(exports, 0, None, [1, 2, 3, 4])
    srv = server(tmp_path, feature)
    srv.poll()
    answers: list[tuple[int, torch.Tensor]] = []
    answered = threading.Condition()
    done = threading.Event()
    errors: list[BaseException] = []

    def client() -> None:
        try:
            while not done.is_set():
                served, out = srv.predict({"users": BAGS})
                with answered:
                    answers.append((served.seq, torch.from_numpy(out["output"])))
                    answered.notify_all()
        except BaseException as e:  # the test fails on it below
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for seq in range(1, 9):  # each delta rewrites some rows, evicts one, changes the head
            write(exports, seq, seq - 1, [seq % 4 + 1, seq + 4], gone=(seq + 3,))
            srv.poll()
            assert srv.served is not None and srv.served.seq == seq
            with answered:  # requests run with each export before the next lands
                assert answered.wait_for(lambda s=seq: any(a[0] == s for a in answers), 10)
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    assert list(srv.applied) == list(range(9)) and srv.served_total == 9
    seen = {seq for seq, _ in answers}
    assert seen >= set(range(1, 9)), seen
    refs = {seq: reference(exports, seq, feature) for seq in seen}
    wants = {seq: run_reference(ref, BAGS) for seq, ref in refs.items()}
    for seq, got in answers:
        torch.testing.assert_close(got, wants[seq], rtol=0, atol=1e-6)


def test_an_export_that_does_not_fit_is_refused_and_the_last_good_one_served(
    tmp_path: Path,
) -> None:
    exports = tmp_path / "exports"
    srv = server(tmp_path, Feature(table="users", mode="sum"))
    assert srv.poll() == [] and srv.served is None
    with pytest.raises(BadRequest, match="no export served yet") as e:
        srv.predict({"users": [[1]]})
    assert e.value.status == 503
    write(exports, 0, None, [1, 2])
    assert srv.poll() == [0]
    write(exports, 1, 0, [3], out=2)  # a head of 2 outputs: not the ONNX graph's
    assert srv.poll() == []
    assert srv.served is not None and srv.served.seq == 0
    assert srv.last_error is not None and "dense parameter 'head.weight' is [2, 3]" in (
        srv.last_error
    )
    write(exports, 3, 2, [3])  # follows export-2, which is not there
    srv.poll()
    assert "export-2, which export-3 follows, is missing" in (srv.last_error or "")
    assert srv.served.seq == 0 and srv.predict({"users": [[1, 3]]})[0].seq == 0
    write(exports, 4, None, [5], base=4)  # a new base: served again
    assert srv.poll() == [4] and srv.last_error is None
    with pytest.raises(BadRequest, match=r"feature 'users', example 1: 'x' is not an int64"):
        srv.predict({"users": [[1], ["x"]]})
    with pytest.raises(ValueError, match=r"no input for feature\(s\) \['items'\]"):
        ModelServer(
            ServerConfig(
                export_dir=str(exports),
                onnx_path=srv.config.onnx_path,
                features={"items": Feature(table="users")},
            )
        )
    with pytest.raises(ValueError, match="mode must be one of"):
        Feature(table="users", mode="sqrtn")

    class Rank3(torch.nn.Module):
        def forward(self, users: torch.Tensor) -> torch.Tensor:
            return users.sum((1, 2))

    rank3 = tmp_path / "rank3.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation
        torch.onnx.export(Rank3(), (torch.zeros(2, 2, DIM),), str(rank3), input_names=["users"],
                          dynamo=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"feature\(s\) \['users'\] must be \[batch, dim\]"):
        ModelServer(ServerConfig(export_dir=str(exports), onnx_path=str(rank3),
                                 features={"users": Feature(table="users")}))  # fmt: skip
    with pytest.raises(ValueError, match="not an ONNX model ORT loads"):
        ModelServer(ServerConfig(export_dir=str(exports), onnx_path=str(tmp_path / "none.onnx"),
                                 features={"users": Feature(table="users")}))  # fmt: skip


def test_the_command_line_reads_features_and_refuses_bad_ones() -> None:
    import argparse

    from psflow.serve.__main__ import parse_feature

    assert parse_feature("users=u:max:0") == (
        "users",
        Feature(table="u", mode="max", padding_idx=0),
    )
    assert parse_feature("items=items") == ("items", Feature(table="items", mode="mean"))
    for bad, reason in [
        ("users", "expected NAME=TABLE"),
        ("=u", "expected NAME=TABLE"),
        ("users=u:sum:x", "padding id 'x' is not an integer"),
        ("users=u:sqrtn", "mode must be one of"),
        ("users=u:sum:0:9", "expected NAME=TABLE"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=reason):
            parse_feature(bad)
