"""Fuzz cases of psflow's file readers with an oracle for silent results (issue 36): TensorFlow
checkpoints (the fixtures real TensorFlow wrote), psflow checkpoints (``export``, ``inspect``,
the restore's ``load_checkpoint`` and the ps's own table restore), and the Criteo and text
converters' input.

Each case mutates a file, runs the readers on it and returns ``[(reader, outcome), ...]``:

- ``equal``: the reader returned exactly the known values (TensorFlow's, the shards' own, or an
  independent parse of the same text);
- ``refused``: a ``ValueError`` (``KeyError`` for a TensorFlow name) of one line naming the file;
- ``relabelled`` (TensorFlow only): an index entry rebuilt with valid CRCs declares another
  dtype, shape or slice order for the same bytes, which the format cannot tell from the truth
  (TensorFlow's reader returns the same): the bytes returned are exactly the bytes written,
  in some order, nothing else;
- ``undetectable`` (psflow checkpoints only): bits flipped inside a tensor's data, which
  safetensors does not checksum: the export has the known names, dtypes and shapes.

Anything else raises ``AssertionError`` (a wrong value, an error that names no file, another
exception): the fuzzer stops on it with the seed and case that replay it. Special files (FIFO,
directory, symlink out of the checkpoint) are among the mutations: a reader that blocks on one
trips the fuzzer's per-case timeout.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import os
import random
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from psflow.train.tf_proto import fields
from tests import psflow_checkpoint, tf_index

Outcome = list[tuple[str, str]]
FIXTURES = Path(__file__).parent / "fixtures"
HUGE = [2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**64 - 1]


def _special(
    rng: random.Random, path: Path, outside: Path, kinds: tuple[str, ...] = ("symlink",)
) -> str:
    """``path`` replaced by a FIFO, a directory or (in ``kinds``) a symlink out of its
    directory (a converter's input may be a symlink: only a checkpoint's files may not)."""
    what = rng.choice(["fifo", "directory", *kinds])
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        outside.write_bytes(path.read_bytes()) if path.is_file() else None
        path.unlink()
    if what == "fifo":
        os.mkfifo(path)
    elif what == "directory":
        path.mkdir()
    else:
        if not outside.exists():
            outside.write_bytes(b"")
        path.symlink_to(outside)
    return what


def _flip_bits(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None) -> bytes:
    buf = bytearray(data)
    hi = len(buf) if hi is None else hi
    for _ in range(rng.randint(1, 4)):
        if hi > lo:
            buf[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    return bytes(buf)


def _bytes_damage(rng: random.Random, data: bytes) -> bytes:
    kind = rng.randrange(4)
    if kind == 0 or not data:
        return data[: rng.randrange(len(data) + 1)]
    if kind == 1:
        return _flip_bits(rng, data)
    i = rng.randrange(len(data) + 1)
    if kind == 2:
        return data[:i] + rng.randbytes(rng.randint(1, 16)) + data[i:]
    return data[:i] + data[i + rng.randint(1, 16) :]


def _one_line(error: BaseException, *names: str) -> None:
    text = str(error)
    assert "\n" not in text.strip(), f"{type(error).__name__} of several lines: {text!r}"
    assert any(n in text for n in names), f"{type(error).__name__} names no file: {text!r}"


# -- TensorFlow checkpoints ------------------------------------------------------------------


@functools.cache
def tf_fixtures() -> list[Path]:
    """The prefixes of every checkpoint TensorFlow wrote for the tests."""
    return sorted(p.with_suffix("") for p in FIXTURES.glob("tf_*/**/*.index"))


@functools.cache
def tf_reference(prefix: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Each numeric tensor of a pristine fixture: dtype, shape and bytes. For the checkpoint
    whose ``expected.json`` holds TensorFlow's own values, checked against them."""
    from psflow.train.tf_checkpoint import TFCheckpoint

    ckpt = TFCheckpoint(str(prefix))
    out = {}
    for key in ckpt.names():
        if ckpt.dtype(key) is None:
            continue
        t = ckpt.tensor(key)
        out[key] = (str(t.dtype), list(t.shape), _raw(t))
    expected = prefix.parent / "expected.json"
    if prefix.parent.name == "tf_checkpoint" and expected.exists():
        for name, want in json.loads(expected.read_text())["tensors"].items():
            dtype = getattr(torch, want["dtype"])
            value = torch.tensor(want["values"], dtype=dtype).reshape(want["shape"])
            assert out[name][2] == _raw(value), f"{name}: our reading is not TensorFlow's"
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _decode(buf: bytes) -> list[list[Any]]:
    """A message's fields as ``[number, value]`` (bytes for a length-delimited one)."""
    return [[n, v] for n, v in fields(buf)]


def _encode(msg: list[list[Any]]) -> bytes:
    out = b""
    for number, value in msg:
        if isinstance(value, bytes):
            out += tf_index.field(number, value)
        else:
            out += tf_index.varint(number << 3) + tf_index.varint(value % (1 << 64))
    return out


def _mutate_entry(rng: random.Random, value: bytes) -> bytes:
    """One field of a ``BundleEntryProto`` changed: dtype, shard, offset, size, a dimension,
    a slice's start or length; or a slice copied over another (issue 36's overlap)."""
    msg = _decode(value)
    slices = [i for i, (n, _) in enumerate(msg) if n == 7]
    if len(slices) > 1 and rng.random() < 0.3:
        a, b = rng.sample(slices, 2)
        msg[b][1] = msg[a][1]
        return _encode(msg)
    choice = rng.randrange(3)
    nested = [i for i, (n, _) in enumerate(msg) if n in (2, 7)]
    if choice == 0 and nested:
        i = rng.choice(nested)
        outer = _decode(msg[i][1])  # shape: dims (2); slice: extents (1)
        if outer:
            j = rng.randrange(len(outer))
            inner = _decode(outer[j][1])
            if inner and rng.random() < 0.8:
                k = rng.randrange(len(inner))
                inner[k][1] = _new_number(rng, inner[k][1])
            else:
                inner.append([rng.choice([1, 2]), rng.choice([0, 1, 3, *HUGE])])
            outer[j][1] = _encode(inner)
            if rng.random() < 0.2:
                outer.append(outer[j]) if rng.random() < 0.5 else outer.pop(j)
            msg[i][1] = _encode(outer)
            return _encode(msg)
    numbers = [i for i, (n, v) in enumerate(msg) if isinstance(v, int)]
    if numbers:
        i = rng.choice(numbers)
        msg[i][1] = _new_number(rng, msg[i][1])
    return _encode(msg)


def _new_number(rng: random.Random, old: Any) -> int:
    old = old if isinstance(old, int) else 0
    return rng.choice([0, 1, 2, 3, 4, 9, 19, 7, old + 1, max(old - 1, 0), old * 2, *HUGE])


def tf_case(rng: random.Random, tmp: Path, i: int) -> Outcome:
    """One mutated TensorFlow checkpoint through TFCheckpoint, ``inspect`` and ``export``."""
    from psflow.train import cli
    from psflow.train.tf_bundle import index_entries
    from psflow.train.tf_checkpoint import TFCheckpoint

    fixture = rng.choice(tf_fixtures())
    reference = tf_reference(fixture)
    case = tmp / "tf"
    if case.exists():
        shutil.rmtree(case)
    case.mkdir()
    for f in fixture.parent.iterdir():
        if f.is_file() and f.name.startswith(fixture.name + "."):
            shutil.copy(f, case / f.name)
    prefix = case / fixture.name
    index = Path(str(prefix) + ".index")
    data_files = sorted(case.glob(fixture.name + ".data-*"))
    kind = rng.choice(["none", "bytes", "bytes", "entry", "entry", "entry", "drop", "special"])
    rebuilt = False
    if kind == "bytes":
        target = rng.choice([index, *data_files])
        target.write_bytes(_bytes_damage(rng, target.read_bytes()))
    elif kind in ("entry", "drop"):
        entries = list(index_entries(index.read_bytes(), "fixture"))
        j = rng.randrange(1, len(entries))
        if kind == "drop":
            entries.pop(j)
        else:
            entries[j] = (entries[j][0], _mutate_entry(rng, entries[j][1]))
        index.write_bytes(tf_index.index_file(entries))
        rebuilt = True
    elif kind == "special":
        _special(rng, rng.choice([index, *data_files]), tmp / "tf-outside")
    name = str(prefix)
    out: Outcome = []
    try:
        ckpt = TFCheckpoint(name)
        keys = ckpt.names()
    except (ValueError, KeyError) as e:
        _one_line(e, name)
        return [("tf.open", "refused")]
    outcome = "equal"
    for key in keys:
        try:
            if ckpt.dtype(key) is None:
                continue
            got = ckpt.tensor(key)
        except (ValueError, KeyError) as e:
            _one_line(e, name)
            outcome = "refused"
            continue
        want = reference.get(key)
        if want is None:
            continue  # a key a mutation renamed: no reference to hold it to
        if (str(got.dtype), list(got.shape), _raw(got)) == want:
            continue
        assert rebuilt, f"{key}: a mutation no check caught changed the value ({kind})"
        got_raw = _raw(got)
        assert len(got_raw) == len(want[2]) and _histogram(got_raw) == _histogram(want[2]), (
            f"{key}: {list(got.shape)} {got.dtype} returned bytes TensorFlow did not write"
        )
        outcome = "refused" if outcome == "refused" else "relabelled"
    out.append(("tf.tensor", outcome))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for reader, run in (
            ("tf.inspect", lambda: cli._inspect_tf(name)),
            ("tf.export", lambda: cli._export_tf(name, str(tmp / "tf.safetensors"), [])),
        ):
            if reader == "tf.export" and i % 4:
                continue
            try:
                run()
                out.append((reader, "read"))
            except (ValueError, KeyError) as e:
                _one_line(e, name)
                out.append((reader, "refused"))
    return out


def _histogram(raw: bytes) -> list[int]:
    return np.bincount(np.frombuffer(raw, dtype=np.uint8), minlength=256).tolist()


# -- psflow checkpoints ------------------------------------------------------------------------


def _mutate_header(rng: random.Random, path: Path) -> None:
    """A shard file's JSON header changed: a number, a dtype, a shape, a name."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    name = rng.choice([k for k in header if k != "__metadata__"])
    entry = header[name]
    what = rng.randrange(4)
    if what == 0:
        entry["dtype"] = rng.choice(["F32", "I32", "F64", "I64", "F16", "BF16", "U8", "BOOL"])
    elif what == 1:
        entry["shape"] = [rng.choice([0, 1, 2, 3, 4, 5, 6, *HUGE[:3]]) for _ in entry["shape"]]
    elif what == 2:
        k = rng.randrange(2)
        entry["data_offsets"][k] = _new_number(rng, entry["data_offsets"][k]) % (1 << 63)
    else:
        header[rng.choice(["@table/items/ids", "@table/users/values", "x/opt/y"])] = entry
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _mutate_tables(rng: random.Random, path: Path) -> bool:
    """A table's ids rewritten (as a file rebuilt with valid headers would hold them); whether
    the change is one the format cannot tell from the truth (a hashed table's id made another
    id, unique and of the same shard: safetensors has no checksum)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    table = rng.choice(["items", "users"])
    ids = tensors[f"@table/{table}/ids"]
    silent = False
    if len(ids):
        j = rng.randrange(len(ids))
        new = rng.choice([-int(ids[j]) - 1, int(ids[0]), int(ids[-1]), 40, 2**62, -(2**62)])
        shard = int(meta["psflow.shard"])
        silent = table == "users" and new not in ids.tolist() and new % 2 == shard
        ids[j] = new
    if rng.random() < 0.2:
        tensors[f"@table/{table}/values"] = tensors[f"@table/{table}/values"][1:]
        silent = False
    save_file(tensors, str(path), metadata=meta)
    return silent


def _mutate_manifest(rng: random.Random, path: Path) -> None:
    data = json.loads(path.read_text())
    places: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            places.append((node, k))
            if isinstance(v, dict | list):
                walk(v)

    walk(data)
    node, key = rng.choice(places)
    what = rng.randrange(4)
    if what == 0:
        node[key] = rng.choice([-1, 0, 1, 3, 5, 40, 10**8, 10**12, *HUGE, 1.5, True])
    elif what == 1:
        node[key] = rng.choice([None, "x", [], {}, [0, 5], [5, 10]])
    elif what == 2 and isinstance(node, dict):
        del node[key]
    elif isinstance(node, list):
        node.append(node[key])
    path.write_text(json.dumps(data))


class _Model(torch.nn.Module):
    """What the test checkpoint's export loads into: its parameters and psflow.nn tables."""

    def __init__(self) -> None:
        import psflow.nn as pnn

        super().__init__()
        self.fc = torch.nn.Module()
        self.fc.weight = torch.nn.Parameter(torch.zeros(10, 4))
        self.fc.bias = torch.nn.Parameter(torch.zeros(4))
        self.items = pnn.Embedding(40, 3, optimizer="Adagrad")
        self.users = pnn.Embedding(None, 3, optimizer="Adagrad")


def _load_export(got: dict[str, torch.Tensor], known: dict[str, torch.Tensor], same: bool) -> str:
    """The export loaded by ``load_state_dict`` into a model of psflow.nn tables: it must
    take it, and hold the known values after."""
    model = _Model()
    model.load_state_dict(got)
    state = model.state_dict()
    for name, value in known.items():
        assert not same or torch.equal(state[name], value), f"load_state_dict: {name}"
    return "equal" if same else "undetectable"


def export_case(rng: random.Random, tmp: Path, i: int) -> Outcome:
    """One mutated psflow checkpoint through ``export``, ``inspect``, the restore's
    ``load_checkpoint`` and, when that accepts it, each ps's own table restore."""
    import argparse

    from psflow.ps.tables import build_tables, restore_tables
    from psflow.train import cli
    from psflow.train.checkpoint import export_state_dict, load_checkpoint
    from psflow.train.manifest import CheckpointDir

    run, known = psflow_checkpoint.copy(tmp)
    ckpt_dir = run / psflow_checkpoint.NAME
    shards = sorted(ckpt_dir.glob("shard-*"))
    kind = rng.choice(
        ["none", "bytes", "data", "header", "header", "tables", "manifest", "manifest", "special"]
    )
    if kind == "bytes":
        target = rng.choice(shards)
        raw = target.read_bytes()
        damaged = _bytes_damage(rng, raw)
        target.write_bytes(damaged)
        start = 8 + struct.unpack("<Q", raw[:8])[0]
        if len(damaged) == len(raw) and damaged[:start] == raw[:start]:
            kind = "data"  # the flips all fell in the tensors' bytes
    elif kind == "data":  # inside the tensors' bytes: safetensors has no checksum
        target = rng.choice(shards)
        raw = target.read_bytes()
        start = 8 + struct.unpack("<Q", raw[:8])[0]
        target.write_bytes(_flip_bits(rng, raw, start))
    elif kind == "header":
        _mutate_header(rng, rng.choice(shards))
    elif kind == "tables" and _mutate_tables(rng, rng.choice(shards)):
        kind = "data"  # undetectable by the format, as a flip in the data
    elif kind == "manifest":
        _mutate_manifest(rng, ckpt_dir / "manifest.json")
    elif kind == "special":
        target = rng.choice([*shards, ckpt_dir / "manifest.json", run / "latest"])
        _special(rng, target, tmp / "ckpt-outside")
    names = (str(run),)
    out: Outcome = []
    exported = tmp / "export.safetensors"
    try:
        export_state_dict(str(run), str(exported))
        from safetensors.torch import load_file

        got = load_file(str(exported))
        assert sorted(got) == sorted(known), f"exported {sorted(got)} ({kind})"
        same = all(torch.equal(got[n], known[n]) for n in known)
        if not same:
            assert kind == "data", f"a {kind} mutation changed the export's values unnoticed"
            for n, t in known.items():
                assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        out.append(("export", "equal" if same else "undetectable"))
        if i % 5 == 0:
            out.append(("load_state_dict", _load_export(got, known, same)))
    except ValueError as e:
        _one_line(e, *names)
        out.append(("export", "refused"))
    try:
        ckpt = load_checkpoint(str(run))
        assert ckpt is not None or kind in ("manifest", "special")
        if ckpt is not None:
            urls = CheckpointDir(str(run)).shard_urls(ckpt.name, ckpt.manifest.num_shards)
            for s in range(3):  # the ps's own reading of the tables, re-sharded to 3
                tables = build_tables(list(ckpt.table_specs.values()), s, 3)
                restore_tables(tables, urls)
                if kind != "data":
                    ids = tables["items"].partition.ids_on(s)  # type: ignore[attr-defined]
                    assert torch.equal(tables["items"].lookup(ids), known["items.weight"][ids])
            out.append(("restore", "read"))
        else:
            out.append(("restore", "none"))
    except ValueError as e:
        _one_line(e, *names)
        out.append(("restore", "refused"))
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.inspect(argparse.Namespace(dir=str(run), name=None, json=bool(i % 2)))
            out.append(("inspect", "read"))
        except ValueError as e:
            _one_line(e, *names)
            out.append(("inspect", "refused"))
    verdicts = {o for r, o in out if r in ("export", "inspect")}
    restore = dict(out)["restore"]
    # One validation: what export refuses, the restore and inspect refuse too.
    if "refused" in verdicts or restore == "refused":
        assert verdicts == {"refused"} and restore == "refused", f"readers disagree: {out}"
    return out


# -- Criteo and text converters ----------------------------------------------------------------

MAX_LINE = 4096


def _compress(data: bytes, how: str) -> bytes:
    wbits = zlib.MAX_WBITS | 16 if how == "GZIP" else zlib.MAX_WBITS
    c = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return c.compress(data) + c.flush()


def _inflate(data: bytes, how: str) -> bytes | None:
    """The text a compressed file holds, by Python's own gzip/zlib modules; ``None`` when they
    find it damaged (concatenated GZIP members read as one stream, zero padding allowed)."""
    try:
        if how == "GZIP":
            return gzip.decompress(data) if data else b""
        if not data:
            return b""
        d = zlib.decompressobj()
        text = d.decompress(data)
        return text if d.eof and not d.unused_data else None
    except (OSError, EOFError, zlib.error):
        return None


def _text_case(
    rng: random.Random, tmp: Path, base: bytes, suffix: str
) -> tuple[Path, bytes | None]:
    """A mutated text file (plain, GZIP or ZLIB): its path and the text it holds (``None``:
    the compressed stream is damaged, so every reader must refuse it)."""
    text = base
    if rng.random() < 0.5:
        text = _benign(rng, text)
    if rng.random() < 0.4:
        text = _bytes_damage(rng, text)
    if rng.random() < 0.15:
        i = rng.randrange(len(text) + 1)
        text = text[:i] + b"y" * rng.choice([MAX_LINE - 2, MAX_LINE + 1, 3 * MAX_LINE]) + text[i:]
    if rng.random() < 0.1:
        i = rng.randrange(len(text) + 1)
        text = text[:i] + rng.choice([b"\r", b"\r\n", b"\n\n", b"\t", b"\xff", b"\xc3"]) + text[i:]
    how = rng.choice(["", "", "GZIP", "ZLIB"])
    case = tmp / "text-input"
    if case.exists():
        shutil.rmtree(case)
    case.mkdir()
    path = case / ("input" + {"": suffix, "GZIP": ".gz", "ZLIB": ".zlib"}[how])
    if not how:
        path.write_bytes(text)
        return path, text
    data = _compress(text, how)
    if rng.random() < 0.5:
        data = _bytes_damage(rng, data)
    if rng.random() < 0.1 and how == "GZIP":
        data += _compress(b"1\t2\n", how)
    path.write_bytes(data)
    return path, _inflate(data, how)


def _benign(rng: random.Random, text: bytes) -> bytes:
    """Changes that keep well-formed text well-formed (or nearly): a digit for a digit, a
    value emptied, line endings as CRLF, hex in upper case, blank lines at the end."""
    buf = bytearray(text)
    for _ in range(rng.randint(1, 6)):
        what = rng.randrange(5)
        i = rng.randrange(len(buf)) if buf else 0
        if what == 0 and buf and 48 <= buf[i] <= 57:
            buf[i] = 48 + rng.randrange(10)
        elif what == 1 and buf:
            j = buf.find(b"\t", i)
            k = buf.find(b"\t", j + 1)
            if 0 <= j < k and b"\n" not in buf[j + 1 : k]:
                del buf[j + 1 : k]
        elif what == 2:
            buf = bytearray(bytes(buf).replace(b"\n", b"\r\n"))
        elif what == 3:
            buf = bytearray(bytes(buf).upper())
        else:
            buf += b"\n" * rng.randint(1, 3)
    return bytes(buf)


def _lines(text: bytes) -> list[bytes] | None:
    """Lines as the converters take them; ``None`` when one is over :data:`MAX_LINE`."""
    if text and not text.endswith(b"\n"):
        text += b"\n"
    lines = text.split(b"\n")[:-1]
    if any(len(line) > MAX_LINE for line in lines):
        return None
    return lines


def _criteo_reference(text: bytes) -> np.ndarray | None:
    """Criteo's lines parsed in plain Python: ``[n, 40]`` int64, or ``None`` for text that
    is not Criteo's."""
    lines = _lines(text)
    if lines is None:
        return None
    lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
    while lines and not lines[-1]:
        lines.pop()
    rows = []
    for line in lines:
        f = line.split(b"\t")
        if len(f) != 40 or f[0] not in (b"0", b"1"):
            return None
        row = [int(f[0])]
        for v in f[1:14]:
            digits = v[1:] if v[:1] == b"-" else v
            if v and (not digits or len(digits) > 18 or not all(48 <= c <= 57 for c in digits)):
                return None
            row.append(int(v) if v else 0)
        for v in f[14:]:
            if v and (len(v) != 8 or any(chr(c) not in "0123456789abcdefABCDEF" for c in v)):
                return None
            row.append(int(v, 16) if v else 0)
        rows.append(row)
    return np.array(rows, dtype=np.int64).reshape(len(rows), 40)


def criteo_case(rng: random.Random, tmp: Path, i: int) -> Outcome:
    """A mutated Criteo text file through the converter's reader (the oracle: a plain Python
    parse of the same text) and, one case in five, the whole conversion."""
    from psflow.data.criteo import convert_criteo, read_criteo

    base = b"".join((FIXTURES / "criteo_text.txt").read_bytes().splitlines(True)[:20])
    path, text = _text_case(rng, tmp, base, ".txt")
    if rng.random() < 0.03:
        _special(rng, path, tmp / "criteo-outside", ())
        text = None
    want = None if text is None else _criteo_reference(text)
    out: Outcome = []
    try:
        parts = list(read_criteo([str(path)], MAX_LINE))
        got = (
            np.concatenate(
                [np.concatenate([p.label[:, None], p.dense, p.categorical], axis=1) for p in parts]
            )
            if parts
            else np.zeros((0, 40), dtype=np.int64)
        )
        assert want is not None, "the converter read text that is not Criteo's (or damaged)"
        assert np.array_equal(got, want), "the converter's rows are not the text's"
        out.append(("criteo", "equal"))
    except ValueError as e:
        _one_line(e, str(path))
        assert want is None, f"refused text a plain parse reads: {e}"
        out.append(("criteo", "refused"))
    if i % 5 == 0:
        try:
            convert_criteo([str(path)], str(tmp / "criteo-out"), shards=1, max_line_bytes=MAX_LINE)
            out.append(("criteo.convert", "read"))
        except ValueError as e:
            _one_line(e, str(path))
            out.append(("criteo.convert", "refused"))
    return out


@functools.cache
def _tsv() -> bytes:
    rng = random.Random(5)
    words = ["alpha", "βeta", "gamma", "δ", "épée", "x1", "日本", "tab", "z"]
    lines = [f"{rng.choice('abc')}\t{' '.join(rng.choices(words, k=8))}" for _ in range(60)]
    return ("\n".join(lines) + "\n").encode()


def text_case(rng: random.Random, tmp: Path, i: int) -> Outcome:
    """A mutated tab-separated file through ``psflow data text``'s reader (the oracle: the
    lines of the same text decoded in plain Python)."""
    from psflow.data.line_input import iter_lines
    from psflow.data.text import read_tsv

    path, text = _text_case(rng, tmp, _tsv(), ".tsv")
    if rng.random() < 0.03:
        _special(rng, path, tmp / "text-outside", ())
        text = None
    want: list[str] | None = None
    lines = None if text is None else _lines(text)
    if lines is not None:
        try:
            want = [line.decode("utf-8") for line in lines]
            want = [w[:-1] if w.endswith("\r") else w for w in want]
        except UnicodeDecodeError:
            want = None
    out: Outcome = []
    try:
        got = [line for _, line in iter_lines(str(path), max_line_bytes=MAX_LINE)]
        assert want is not None, "read text a plain decode refuses (or damaged input)"
        assert got == want, "the lines are not the text's"
        out.append(("text.lines", "equal"))
    except ValueError as e:
        _one_line(e, str(path))
        assert want is None, f"refused text a plain decode reads: {e}"
        out.append(("text.lines", "refused"))
    try:
        list(read_tsv(str(path), MAX_LINE))
        out.append(("text", "read"))
    except ValueError as e:
        _one_line(e, str(path))
        out.append(("text", "refused"))
    return out


def warm(tmp: Path) -> None:
    """What every case shares, made before memory is watched: the modules imported, the
    checkpoint written once, TensorFlow's references read."""
    import psflow.data.criteo
    import psflow.data.text
    import psflow.ps.tables
    import psflow.train.checkpoint
    import psflow.train.cli
    import psflow.train.tf_checkpoint  # noqa: F401

    psflow_checkpoint.copy(tmp)
    for prefix in tf_fixtures():
        tf_reference(prefix)
    _tsv()
    rng = random.Random("warm")
    for case in CASES.values():
        with contextlib.suppress(Exception):
            case(rng, tmp, 0)


CASES: dict[str, Callable[[random.Random, Path, int], Outcome]] = {
    "tf_checkpoint": tf_case,
    "psflow_checkpoint": export_case,
    "criteo": criteo_case,
    "text": text_case,
}
