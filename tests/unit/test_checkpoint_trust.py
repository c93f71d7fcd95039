"""A psflow checkpoint's readers refuse what they cannot trust, alike: ``export``,
``inspect``, the restore's :func:`load_checkpoint` (and so the evaluator and a cluster of one)
check one way (:mod:`psflow.train.checkpoint_check`), and never return a wrong number."""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from psflow.train.checkpoint import export_state_dict, load_checkpoint
from tests import psflow_checkpoint

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SHARD0 = "ckpt-3/shard-0-of-2.safetensors"
SHARD1 = "ckpt-3/shard-1-of-2.safetensors"
MANIFEST = "ckpt-3/manifest.json"


def _export(run: Path) -> dict[str, torch.Tensor]:
    out = run.parent / "out.safetensors"
    export_state_dict(str(run), str(out))
    return load_file(str(out))


def _refused(run: Path, match: str) -> str:
    """Export and restore (load_checkpoint, and the chief's restore into ps, which keeps no
    table rows) all refuse ``run``, export and restore with the same one line."""
    with pytest.raises(ValueError, match=match) as export_error:
        _export(run)
    with pytest.raises(ValueError, match=match) as restore_error:
        load_checkpoint(str(run))
    with pytest.raises(ValueError, match=match):
        load_checkpoint(str(run), table_rows=False)
    message = str(export_error.value)
    assert message == str(restore_error.value) and "\n" not in message
    return message


def _rewrite_shard(
    path: Path,
    change: Callable[[dict[str, torch.Tensor]], None],
    tables: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """The shard file rewritten with ``change`` made to its tensors (and ``tables`` to the
    specs of its metadata), every header consistent: a forgery, not damage."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    change(tensors)
    if tables is not None:
        specs = json.loads(meta["psflow.tables"])
        tables(specs)
        meta["psflow.tables"] = json.dumps(specs)
    save_file(tensors, str(path), metadata=meta)


def _edit_manifest(run: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = run / MANIFEST
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_an_unmutated_checkpoint_exports_what_the_shards_held(tmp_path: Path) -> None:
    run, known = psflow_checkpoint.copy(tmp_path)
    got = _export(run)
    assert sorted(got) == sorted(known)
    for name, value in known.items():
        assert torch.equal(got[name], value), name


def test_a_negative_table_id_is_refused_not_written_into_another_row(tmp_path: Path) -> None:
    """Issue 36, 2: id 21 changed to -20 put row 21's values in row 30 (torch's negative
    index) and left row 21 zero; the restore refused it. Now both refuse, naming it."""
    run, _ = psflow_checkpoint.copy(tmp_path)
    path = run / SHARD1

    def negate(t: dict[str, torch.Tensor]) -> None:
        ids = t["@table/items/ids"]
        ids[ids == 21] = -20

    _rewrite_shard(path, negate)
    message = _refused(run, r"shard-1-of-2\.safetensors: table 'items': id -20 out of range")
    assert "[0, 40)" in message


def test_a_table_id_held_twice_is_refused(tmp_path: Path) -> None:
    run, _ = psflow_checkpoint.copy(tmp_path)

    def repeat(t: dict[str, torch.Tensor]) -> None:
        t["@table/users/ids"][0] = t["@table/users/ids"][1]

    _rewrite_shard(run / SHARD0, repeat)
    _refused(run, r"table 'users': id .* is held twice \(in .*shard-0-of-2")


def test_a_huge_num_embeddings_is_refused_before_allocating(tmp_path: Path) -> None:
    """Issue 36, 3: num_embeddings = 10**8 on a 5 KB checkpoint allocated 1.6 GB. Refused
    against the shard files' own specs; forged there too, against the rows they hold."""
    for size in (10**8, 10**12):
        run, _ = psflow_checkpoint.copy(tmp_path)

        def huge(m: dict[str, Any], size: int = size) -> None:
            m["tables"]["items"]["spec"]["num_embeddings"] = size

        _edit_manifest(run, huge)
        _refused(run, rf"'items': num_embeddings 40 in the file's metadata, {size} in the manifest")
        for shard in (SHARD0, SHARD1):
            _rewrite_shard(
                run / shard,
                lambda t: None,
                tables=lambda specs: huge({"tables": {"items": {"spec": specs["items"]}}}),
            )
        tracemalloc.start()
        try:
            _refused(run, rf"table 'items': the spec says {size} rows .* files hold 40")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: m["tables"]["items"].pop("spec"), r"tables\.items has no spec"),
        (lambda m: m["tables"]["items"].update(spec=[]), r"tables\.items\.spec: .*must be a map"),
        (lambda m: m["tables"]["items"].update(rows={}), r"tables\.items\.rows = \{\} is not"),
        (lambda m: m["tables"]["items"].update(bytes="x"), r"tables\.items\.bytes = 'x' is not"),
        (lambda m: m["params"]["fc.bias"].update(shape=10**12), r"params\.fc\.bias\.shape = "),
        (lambda m: m["params"]["fc.bias"].update(dtype="int32"), r"'fc.bias' is float32, the"),
        (lambda m: m["variables"][1].update(rows=[0, 5]), r"the parts of 'fc.weight' overlap"),
        (lambda m: m["variables"][1].update(rows=[6, 11]), r"'fc.weight' leave rows out"),
        (lambda m: m["variables"].append(m["variables"][0]), r"listed twice"),
    ],
)
def test_a_manifest_that_does_not_fit_its_files_is_refused_by_every_reader(
    tmp_path: Path,
    change: Callable[[dict[str, Any]], None],
    match: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 36, 4: a table without a spec (or a spec ``[]``, rows ``{}``, bytes ``"x"``)
    raised KeyError/AttributeError/TypeError from ``inspect``, a shape of 10**12 a TypeError
    from ``export``. Now one line naming the manifest, from inspect, export and restore."""
    from psflow.cli import main

    run, _ = psflow_checkpoint.copy(tmp_path)
    _edit_manifest(run, change)
    message = _refused(run, match)
    assert "manifest.json" in message or "safetensors" in message
    for command in ("inspect", "export"):
        argv = ["checkpoint", command, str(run)]
        assert main([*argv, str(tmp_path / "o.safetensors")] if command == "export" else argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Error:" not in err and message in err, err


def test_a_float32_tensor_relabelled_int32_is_refused(tmp_path: Path) -> None:
    """Issue 36, 7: the header's dtype changed (the bytes unchanged) was exported as int32."""
    run, _ = psflow_checkpoint.copy(tmp_path)
    path = run / SHARD0
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    header["fc.bias"]["dtype"] = "I32"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    _refused(run, r"shard-0-of-2\.safetensors: 'fc.bias' is int32, the manifest says float32")


@pytest.mark.parametrize("name", ["fc.bias", "fc.bias/opt/exp_avg", "@table/items/values"])
def test_a_value_no_ps_saves_is_refused(tmp_path: Path, name: str) -> None:
    """A ps refuses to save a non-finite value: one in a file was exported and restored as it
    was (a NaN in a parameter, its optimizer state or a table's rows)."""
    run, _ = psflow_checkpoint.copy(tmp_path)

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        key = next(k for k in sorted(tensors) if k.startswith(name))
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] = float("nan")

    _rewrite_shard(run / SHARD0, poison)
    _refused(
        run, rf"shard-0-of-2\.safetensors: '{re.escape(name)}\S*' holds a value that is not finite"
    )


def test_a_shard_file_in_the_wrong_place_is_refused(tmp_path: Path) -> None:
    run, _ = psflow_checkpoint.copy(tmp_path)
    a, b = run / SHARD0, run / SHARD1
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)
    _refused(run, r"shard-0-of-2\.safetensors: the file says it is shard 1 of 2")


@pytest.mark.parametrize("what", ["fifo", "directory", "symlink", "device"])
@pytest.mark.parametrize("where", [SHARD1, MANIFEST, "latest"])
def test_special_files_are_refused_before_they_are_opened(
    tmp_path: Path, what: str, where: str
) -> None:
    """Issue 36, 5: a shard replaced by a FIFO blocked ``export`` in ``open`` for ever."""
    run, _ = psflow_checkpoint.copy(tmp_path)
    path = run / where
    outside = tmp_path / "elsewhere"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    if what == "fifo":
        os.mkfifo(path)
    elif what == "directory":
        path.mkdir()
    elif what == "symlink":
        path.symlink_to(outside)
    else:
        path.symlink_to("/dev/zero")
    kind = {
        "fifo": "a FIFO",
        "directory": "a directory",
        "symlink": "a symlink to .*elsewhere, outside",
        "device": "a symlink to /dev/zero, outside",
    }[what]
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            _refused(run, rf"{where}: {kind}")
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(20), "the reader blocked"
    if errors:
        raise errors[0]


def test_a_device_inside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """A device node is no file, whatever its name (refused by kind, not by place)."""
    from psflow.ps import safefile

    with pytest.raises(ValueError, match=r"/dev/null: a character device where a file belongs"):
        safefile.read_bytes("/dev/null")


def test_the_savers_own_reads_refuse_a_fifo_instead_of_blocking(tmp_path: Path) -> None:
    """The chief's saves and prunes read ``latest`` and manifests through CheckpointDir: a
    FIFO there is passed over (``latest``: the newest complete checkpoint stands, and the next
    publish replaces it) or refused (a manifest), never waited on."""
    from psflow.train.manifest import CheckpointDir

    run, _ = psflow_checkpoint.copy(tmp_path)
    (run / "latest").unlink()
    os.mkfifo(run / "latest")
    d = CheckpointDir(str(run))
    results: list[object] = []

    def read() -> None:
        try:
            results.append(d.latest())
            d.publish("ckpt-3", d.manifest("ckpt-3"))  # replaces the FIFO with a file
            (run / MANIFEST).unlink()
            os.mkfifo(run / MANIFEST)
            d.manifest("ckpt-3")
        except BaseException as e:
            results.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "a read blocked on a FIFO"
    assert results[0] == "ckpt-3"
    assert (run / "latest").read_text().strip() == "ckpt-3"
    assert isinstance(results[1], ValueError) and "a FIFO" in str(results[1])


def test_the_chiefs_restore_checks_every_table_but_keeps_only_their_ids(tmp_path: Path) -> None:
    """The chief restoring into ps reads each shard file, checks its rows and lets them go:
    the ps read their own, and a table is never whole in the chief's memory."""
    run, _ = psflow_checkpoint.copy(tmp_path)
    full = load_checkpoint(str(run))
    lean = load_checkpoint(str(run), table_rows=False)
    assert full is not None and lean is not None and full.tables
    assert set(lean.tables) == set(full.tables)
    for table, parts in full.tables.items():
        assert [set(p) for p in lean.tables[table]] == [{"ids"}] * len(parts)
        for kept, whole in zip(lean.tables[table], parts, strict=True):
            assert torch.equal(kept["ids"], whole["ids"])
    assert lean.params.keys() == full.params.keys()
    assert all(torch.equal(lean.params[k], full.params[k]) for k in full.params)
