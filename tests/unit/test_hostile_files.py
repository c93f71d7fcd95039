"""Hostile files: truncated, bit-flipped and forged TFRecord files, shard files and manifests.

Every mutation is drawn from ``random.Random(seed)``, so a failure replays. Each case must end
in valid data or in an error that names the file (and the byte offset where the format has
one); never another exception, a hang, or an allocation sized by a corrupted field (memory is
watched with tracemalloc around each loop). ``tests/fuzz_files.py`` runs the same cases for as
long as one likes.
"""

from __future__ import annotations

import functools
import random
import struct
import time
import tracemalloc
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from psflow.data import native
from psflow.data.features import VarLenFeature, parse_examples
from psflow.data.tfrecord import DataLossError, RecordBatch, TFRecordReader, masked_crc32c
from psflow.ps import safefile
from psflow.ps.shard_file import decode_shard, read_shard, safetensors_chunks
from psflow.train.manifest import Manifest
from tests.kernels import need_kernels
from tests.paths import TFRECORD_FIXTURES

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

SEEDS = ["examples.tfrecord", "shard-00000-of-00002.tfrecord", "shard-00001-of-00002.tfrecord"]
SPEC = {
    "label": VarLenFeature(dtype="int64"),
    "x": VarLenFeature(dtype="float32"),
    "ids": VarLenFeature(dtype="int64"),
    "name": VarLenFeature(dtype="bytes"),
}
HUGE = [2**60, 2**63 - 1, 2**64 - 1, 2**40, 2**32, 2**31, 10**9]
MEMORY_BOUND = 64 << 20  # bytes traced at the peak of a whole loop


def _headers(stream: bytes) -> list[int]:
    """Offsets of the record headers of a valid TFRecord stream."""
    out, pos = [], 0
    while pos + 12 <= len(stream):
        out.append(pos)
        pos += 16 + struct.unpack_from("<Q", stream, pos)[0]
    return out


def mutate_records(rng: random.Random, data: bytes) -> bytes:
    """One random corruption of a TFRecord stream: truncation, bit flips, a corrupted length
    field (with its checksum left bad or recomputed), a huge declared length, inserted bytes."""
    buf = bytearray(data)
    kind = rng.randrange(6)
    if kind == 0 or not buf:
        return bytes(buf[: rng.randrange(len(buf) + 1)])
    if kind == 1:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        return bytes(buf)
    heads = _headers(data) or [0]
    at = rng.choice(heads)
    if kind in (2, 3):
        length = rng.choice(HUGE) if rng.random() < 0.5 else rng.randrange(1 << 20)
        field = struct.pack("<Q", length)
        if kind == 3:  # a forged header: the checksum matches the corrupted length
            field += struct.pack("<I", masked_crc32c(field))
        buf[at : at + len(field)] = field
        return bytes(buf[: max(len(data), at + len(field))])
    if kind == 4:
        i = rng.randrange(len(buf) + 1)
        return bytes(buf[:i]) + rng.randbytes(rng.randint(1, 24)) + bytes(buf[i:])
    i = rng.randrange(len(buf))
    return bytes(buf[:i]) + bytes(buf[i + rng.randint(1, 16) :])


def _compress(data: bytes, compression: str) -> bytes:
    wbits = zlib.MAX_WBITS | 16 if compression == "GZIP" else zlib.MAX_WBITS
    c = zlib.compressobj(6, zlib.DEFLATED, wbits, 9)
    return c.compress(data) + c.flush()


def tfrecord_case(rng: random.Random, tmp: Path, compression: str) -> tuple[Path, bytes]:
    """A mutated file: the records mutated then compressed, or the compressed bytes mutated."""
    plain = (TFRECORD_FIXTURES / rng.choice(SEEDS)).read_bytes()
    if not compression:
        data = mutate_records(rng, plain)
    elif rng.random() < 0.5:
        data = _compress(mutate_records(rng, plain), compression)
    else:
        data = mutate_records(rng, _compress(plain, compression))
    path = tmp / f"case.tfrecord{'.gz' if compression == 'GZIP' else '.zz' if compression else ''}"
    path.write_bytes(data)
    return path, data


def read_case(rng: random.Random, path: Path, compression: str, parse: bool) -> str:
    """Reads one file to the end; ``"ok"`` or ``"error"``, raising on anything else."""
    chunk = rng.choice([64, 1000, 1 << 16])
    try:
        with TFRecordReader(path, compression=compression, chunk_size=chunk) as reader:
            for batch in reader.iter_batches():
                assert isinstance(batch, RecordBatch)
                if parse:
                    try:
                        parse_examples(batch, SPEC)
                    except ValueError as e:
                        assert str(path) in str(e), e
        return "ok"
    except DataLossError as e:
        assert str(path) in str(e) and "offset" in str(e), e
        return "error"


def _bounded(loop: Callable[[], Counter[str]]) -> tuple[Counter[str], float]:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        counts = loop()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"peak {peak} bytes traced"
    return counts, time.perf_counter() - start


@pytest.mark.parametrize(("compression", "cases"), [("", 1200), ("GZIP", 600), ("ZLIB", 600)])
def test_mutated_tfrecord_files_end_in_records_or_named_errors(
    tmp_path: Path, compression: str, cases: int
) -> None:
    rng = random.Random(f"tfrecord-{compression}")

    def loop() -> Counter[str]:
        counts: Counter[str] = Counter()
        for i in range(cases):
            path, _ = tfrecord_case(rng, tmp_path, compression)
            counts[read_case(rng, path, compression, parse=i % 10 == 0)] += 1
        return counts

    counts, _ = _bounded(loop)
    assert sum(counts.values()) == cases and counts["error"] > cases // 2


def _outcome(
    path: Path, chunk: int, skip: bool, shard: tuple[int, int, int] | None, verify: bool
) -> object:
    """Everything a read of ``path`` shows: the records with their indices, the skipped count,
    the error."""
    got: list[tuple[int, bytes]] = []
    reader = TFRecordReader(path, chunk_size=chunk, skip_corrupt=skip, shard=shard, verify=verify)
    try:
        for batch in reader.iter_batches():
            got += zip(batch.indices.tolist(), batch.tolist(), strict=True)
    except DataLossError as e:
        return got, reader.skipped, str(e)
    return got, reader.skipped, None


def test_the_compiled_framer_reads_every_mutated_file_as_the_python_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records, indices, skips and errors alike on both paths, whatever the corruption (the
    compiled framer hands a chunk with a bad checksum to the Python one)."""
    need_kernels()
    rng = random.Random("framer")
    for _ in range(300):
        path, _ = tfrecord_case(rng, tmp_path, "")
        args = (
            rng.choice([64, 1000, 1 << 16]),
            rng.random() < 0.5,
            rng.choice([None, (1, 3, 2), (0, 2, 0)]),
            rng.random() < 0.8,  # without checksums, the same records (garbage ones too)
        )
        native_read = _outcome(path, *args)
        with monkeypatch.context() as m:
            m.setattr(native, "NATIVE", None)
            assert _outcome(path, *args) == native_read, args


@pytest.mark.parametrize("compression", ["", "GZIP", "ZLIB"])
@pytest.mark.parametrize("length", [2**60, 2**64 - 1, 3 << 30])
def test_a_forged_huge_record_length_is_refused_before_allocating(
    tmp_path: Path, compression: str, length: int
) -> None:
    field = struct.pack("<Q", length)
    data = field + struct.pack("<I", masked_crc32c(field)) + b"x" * 100
    path = tmp_path / "huge.tfrecord"
    path.write_bytes(_compress(data, compression) if compression else data)
    tracemalloc.start()
    try:
        with pytest.raises(DataLossError, match=r"huge\.tfrecord.*offset.* 0 \(record index 0\)"):
            list(TFRecordReader(path, compression=compression, verify=length != 2**60))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND


def test_a_zip_bomb_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """64 MiB of zeros in 64 KiB of GZIP: refused at offset 0 without inflating it all, and
    skipped with ``skip_corrupt`` in memory bounded by the chunk size."""
    c = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    zeros = bytes(1 << 20)
    data = b"".join(c.compress(zeros) for _ in range(64)) + c.flush()
    path = tmp_path / "bomb.tfrecord.gz"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(DataLossError, match=r"bomb\.tfrecord\.gz.*offset.* 0 "):
            list(TFRecordReader(path))
        assert tracemalloc.get_traced_memory()[1] < MEMORY_BOUND
        with TFRecordReader(path, skip_corrupt=True, chunk_size=1 << 20) as reader:
            assert list(reader) == []
        assert tracemalloc.get_traced_memory()[1] < MEMORY_BOUND
    finally:
        tracemalloc.stop()


# -- checkpoint shard files and manifests ------------------------------------------------------


def _shard_bytes() -> bytes:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "fc.weight": torch.randn(6, 4, generator=g),
        "fc.weight/opt/exp_avg": torch.randn(6, 4, generator=g),
        "fc.weight/opt/step": torch.tensor(3.0),
        "@table/emb/ids": torch.arange(5),
        "@table/emb/values": torch.randn(5, 3, generator=g),
        "flags": torch.tensor([True, False]),
    }
    metadata = {
        "psflow.format": "1",
        "psflow.shard": "0",
        "psflow.num_shards": "2",
        "psflow.step": "3",
        "psflow.optimizer": '{"name": "Adam", "kwargs": {"lr": 0.01}}',
        "psflow.opt_state": "{}",
        "psflow.param_groups": '[{"lr": 0.01}]',
    }
    return b"".join(bytes(c) for c in safetensors_chunks(tensors, metadata))


@functools.cache
def _good_shard() -> bytes:
    return _shard_bytes()


def mutate_safetensors(rng: random.Random, data: bytes) -> bytes:
    """A corrupted shard file: the generic corruptions, or a forged header length."""
    if rng.random() < 0.25:
        n = rng.choice([*HUGE, len(data), len(data) - 7, 0, rng.randrange(len(data))])
        return struct.pack("<Q", n) + data[8:]
    buf = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:
        return bytes(buf[: rng.randrange(len(buf) + 1)])
    if kind == 1:
        n = int.from_bytes(data[:8], "little")
        region = rng.choice([(0, len(buf)), (8, 8 + n)])  # anywhere, or in the JSON header
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(*region)
            buf[i] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if kind == 2:  # a number of the JSON header (a dim, an offset) made huge or negative
        n = int.from_bytes(data[:8], "little")
        header = data[8 : 8 + n].decode()
        digits = [i for i, ch in enumerate(header) if ch.isdigit()]
        i = rng.choice(digits)
        new = str(rng.choice([0, -1, 2**62, 2**64, 10**30, 7]))
        header = header[:i] + new + header[i + 1 :]
        raw = header.encode()
        return len(raw).to_bytes(8, "little") + raw + data[8 + n :]
    i = rng.randrange(len(buf) + 1)
    return bytes(buf[:i]) + rng.randbytes(rng.randint(1, 16)) + bytes(buf[i:])


def shard_case(rng: random.Random, tmp: Path, i: int) -> str:
    """Reads one mutated shard file (every fifth from disk, the others from memory): ``"ok"``
    or ``"error"`` (naming the file), raising on anything else."""
    data = mutate_safetensors(rng, _good_shard())
    on_disk = i % 5 == 0
    path = tmp / "shard-0-of-2.safetensors"
    if on_disk:
        path.write_bytes(data)
    source = str(path) if on_disk else f"case {i}"
    try:
        shard = read_shard(source) if on_disk else decode_shard(data, source)
        assert all(isinstance(t, torch.Tensor) for t in shard.tensors.values())
        return "ok"
    except ValueError as e:
        assert source in str(e), e
        return "error"


def test_mutated_shard_files_end_in_tensors_or_named_errors(tmp_path: Path) -> None:
    rng = random.Random("shard")
    assert decode_shard(_good_shard(), "good").tensors["fc.weight"].shape == (6, 4)

    def loop() -> Counter[str]:
        return Counter(shard_case(rng, tmp_path, i) for i in range(1500))

    counts, _ = _bounded(loop)
    assert counts["error"] > 750 and counts["ok"] > 0


def test_a_header_length_past_the_end_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "forged.safetensors"
    path.write_bytes(struct.pack("<Q", 2**60) + b"{}" + bytes(100))

    def no_read(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("the file was read whole")

    from fsspec.implementations.local import LocalFileSystem

    monkeypatch.setattr(LocalFileSystem, "cat_file", no_read)
    with pytest.raises(ValueError, match=r"forged\.safetensors.*header length .* byte offset 0"):
        read_shard(str(path))
    with pytest.raises(ValueError, match=r"forged\.safetensors.*past the end"):
        safefile.read(str(path))


@functools.cache
def _manifest_json() -> str:
    return Manifest.from_json(
        '{"format": 1, "global_step": 7, "num_shards": 2, "optimizer": {"name": "SGD",'
        ' "kwargs": {"lr": 0.1}}, "variables": [{"var": "w/part_0", "param": "w", "shard": 0,'
        ' "file": "shard-0-of-2.safetensors", "shape": [3, 4], "dtype": "float32",'
        ' "rows": [0, 3]}, {"var": "w/part_1", "param": "w", "shard": 1,'
        ' "file": "shard-1-of-2.safetensors", "shape": [2, 4], "dtype": "float32",'
        ' "rows": [3, 5]}], "params": {"w": {"shape": [5, 4], "dtype": "float32"}},'
        ' "shard_steps": [7, 7]}'
    ).to_json()


def manifest_case(rng: random.Random) -> str:
    """Reads one mutated manifest: ``"ok"`` or ``"error"`` (naming the file), raising on
    anything else."""
    data = bytearray(_manifest_json().encode())
    kind = rng.randrange(4)
    if kind == 0:
        data = data[: rng.randrange(len(data) + 1)]
    elif kind == 1:
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 2:
        digits = [i for i, b in enumerate(data) if chr(b).isdigit()]
        i = rng.choice(digits)
        data[i : i + 1] = str(rng.choice([-1, 2**64, 10**400, 99])).encode()
    else:
        i = rng.randrange(len(data))
        data[i:i] = rng.choice([b"[" * 100_000, b'"x"', b"null", b"{}", rng.randbytes(8)])
    try:
        m = Manifest.from_json(bytes(data), "ckpt-7/manifest.json")
        assert all(e.file == f"shard-{e.shard}-of-{m.num_shards}.safetensors" for e in m.variables)
        return "ok"
    except ValueError as e:
        assert "ckpt-7/manifest.json" in str(e), e
        return "error"


def test_mutated_manifests_end_in_a_manifest_or_named_errors() -> None:
    rng = random.Random("manifest")
    counts = Counter(manifest_case(rng) for _ in range(1500))
    assert counts["error"] > 750 and counts["ok"] > 0


def test_a_manifest_json_error_names_the_byte_offset() -> None:
    with pytest.raises(ValueError, match=r"m\.json: malformed manifest: bad JSON at byte offset 5"):
        Manifest.from_json('{"é"', "m.json")
    with pytest.raises(ValueError, match=r"file 'shard-0-of-2.safetensors/../x'"):
        Manifest.from_json(
            _manifest_json().replace(
                '"shard-0-of-2.safetensors"', '"shard-0-of-2.safetensors/../x"'
            )
        )
