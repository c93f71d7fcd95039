"""TFRecord framing against TensorFlow-written fixtures: reading, byte-identical writing, corruption."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import struct
from pathlib import Path

import fsspec
import google_crc32c
import numpy as np
import pytest

from psflow.data import fs, native
from psflow.data.tfrecord import (
    DataLossError,
    RecordBatch,
    TFRecordReader,
    TFRecordWriter,
    encode_record,
    masked_crc32c,
    read_records,
    write_records,
)
from psflow.data.tfrecord_framing import _crc32c_8
from tests.paths import TFRECORD_FIXTURES

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("path")]

FIX = TFRECORD_FIXTURES
EXPECTED = json.loads((FIX / "expected.json").read_text())


def sha(records: list[bytes]) -> list[str]:
    return [hashlib.sha256(r).hexdigest() for r in records]


@pytest.mark.parametrize(
    "name", ["examples.tfrecord", "examples.tfrecord.gz", "examples.tfrecord.zlib"]
)
@pytest.mark.parametrize("chunk_size", [64, 1000, 4 << 20])
def test_reads_tensorflow_files(name: str, chunk_size: int) -> None:
    with TFRecordReader(FIX / name, chunk_size=chunk_size) as r:
        records = list(r)
    assert sha(records) == EXPECTED["record_sha256"]


def test_reads_shards_round_robin_and_raw_payloads() -> None:
    s0 = list(read_records(FIX / "shard-00000-of-00002.tfrecord"))
    s1 = list(read_records(FIX / "shard-00001-of-00002.tfrecord"))
    assert sha(s0) == EXPECTED["record_sha256"][0::2]
    assert sha(s1) == EXPECTED["record_sha256"][1::2]
    raw = list(read_records(FIX / "raw.tfrecord"))
    assert [len(r) for r in raw] == EXPECTED["raw_lengths"]
    assert sha(raw) == EXPECTED["raw_sha256"]


@pytest.mark.parametrize(
    ("name", "compression"),
    [
        ("examples.tfrecord", ""),
        ("examples.tfrecord.gz", "GZIP"),
        ("examples.tfrecord.zlib", "ZLIB"),
    ],
)
def test_writes_byte_identical_files(name: str, compression: str, tmp_path: Path) -> None:
    records = list(read_records(FIX / "examples.tfrecord"))
    out = tmp_path / "out.tfrecord"
    assert write_records(out, records, compression=compression) == 50
    assert out.read_bytes() == (FIX / name).read_bytes()
    raw = list(read_records(FIX / "raw.tfrecord"))
    buf = io.BytesIO()
    with TFRecordWriter(buf, compression="") as w:
        w.write_all(raw)
    assert buf.getvalue() == (FIX / "raw.tfrecord").read_bytes()
    assert b"".join(map(encode_record, raw)) == buf.getvalue()


def test_checksums_match_google_crc32c() -> None:
    assert masked_crc32c(b"") == 0xA282EAD8  # TF's Mask(0)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 800, dtype=np.uint8)
    pos = np.arange(0, 792, 8)
    want = [google_crc32c.value(data[p : p + 8].tobytes()) for p in pos]
    assert _crc32c_8(data, pos).tolist() == want


def test_the_compiled_checksum_is_google_crc32c(path: str) -> None:
    """By SSE4.2's instruction where the CPU has it, and by the table path (``soft``)."""
    rng = np.random.default_rng(1)
    for n in [*range(40), 1000, 4097, 65_537]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        got = {native.crc32c(data), native.crc32c(data, soft=True)}
        assert got == ({google_crc32c.value(data)} if path == "native" else {None}), n


def test_bad_checksum_names_file_offset_and_index(tmp_path: Path) -> None:
    with pytest.raises(DataLossError) as e:
        list(read_records(FIX / "corrupt_crc.tfrecord"))
    assert "corrupt_crc.tfrecord" in str(e.value)
    assert e.value.offset == 0 and e.value.index == 0
    assert "byte offset 0 (record index 0)" in str(e.value)
    assert "data checksum" in str(e.value)


def test_truncated_file_names_the_last_record() -> None:
    with pytest.raises(DataLossError, match=r"truncated.tfrecord.*offset 6118 \(record index 49\)"):
        list(read_records(FIX / "truncated.tfrecord"))


def test_skip_corrupt_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    for name in ("corrupt_crc.tfrecord", "truncated.tfrecord"):
        caplog.clear()
        with caplog.at_level(logging.WARNING), TFRecordReader(FIX / name, skip_corrupt=True) as r:
            records = list(r)
        assert len(records) == 49 and r.skipped == 1
        assert name in caplog.text and "record index" in caplog.text
    good = EXPECTED["record_sha256"]
    assert sha(list(read_records(FIX / "corrupt_crc.tfrecord", skip_corrupt=True))) == good[1:]


def _corrupt_middle(tmp_path: Path, where: str) -> tuple[Path, list[bytes], int]:
    records = [bytes([i]) * (10 + i) for i in range(20)]
    data = bytearray(b"".join(map(encode_record, records)))
    offset = sum(len(r) + 16 for r in records[:7])
    if where == "length":
        data[offset + 1] ^= 0x40  # a wrong length whose checksum no longer matches
    elif where == "length-crc":
        data[offset + 9] ^= 0x01
    else:
        data[offset + 14] ^= 0x01
    path = tmp_path / f"{where}.tfrecord"
    path.write_bytes(bytes(data))
    return path, records, offset


@pytest.mark.parametrize("where", ["length", "length-crc", "data"])
@pytest.mark.parametrize("chunk_size", [64, 4096])
def test_corrupt_record_in_the_middle(tmp_path: Path, where: str, chunk_size: int) -> None:
    path, records, offset = _corrupt_middle(tmp_path, where)
    with pytest.raises(DataLossError) as e:
        list(TFRecordReader(path, chunk_size=chunk_size))
    assert (e.value.offset, e.value.index) == (offset, 7)
    with TFRecordReader(path, chunk_size=chunk_size, skip_corrupt=True) as r:
        got = list(r)
    # A bad header cannot be trusted: the reader resynchronises on the next valid record.
    assert got == records[:7] + records[8:]
    assert r.skipped == 1


def test_garbage_and_bad_gzip_are_data_loss(tmp_path: Path) -> None:
    p = tmp_path / "junk.tfrecord"
    p.write_bytes(b"\xff" * 100)
    with pytest.raises(DataLossError, match="record index 0"):
        list(read_records(p))
    with TFRecordReader(p, skip_corrupt=True) as r:
        assert list(r) == []
    g = tmp_path / "junk.tfrecord.gz"
    g.write_bytes(b"\x1f\x8b" + b"\x00" * 50)
    with pytest.raises(DataLossError, match=r"junk\.tfrecord\.gz"):
        list(read_records(g))
    cut = tmp_path / "cut.tfrecord.gz"
    cut.write_bytes((FIX / "examples.tfrecord.gz").read_bytes()[:-40])
    with pytest.raises(DataLossError, match=r"cut\.tfrecord\.gz"):
        list(read_records(cut))


def test_empty_file_and_empty_records(tmp_path: Path) -> None:
    p = tmp_path / "e.tfrecord"
    write_records(p, [])
    assert p.read_bytes() == b""
    assert list(read_records(p)) == []
    write_records(p, [b"", b"", b"x"])
    assert list(read_records(p)) == [b"", b"", b"x"]


def test_a_chunk_of_more_records_than_one_compiled_call_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """150,000 records of 0-2 bytes lie in one 4 MB chunk: the compiled framer takes them in
    several calls (at most 65,536 a call), the shard's record indices counted across them, as
    the Python path reads them."""
    path = tmp_path / "tiny.tfrecord"
    write_records(path, [bytes(i % 3) for i in range(150_000)])
    for shard in (None, (1, 3, 2)):
        with TFRecordReader(path, shard=shard) as reader:
            batches = list(reader.iter_batches())
        got = [(int(i), r) for b in batches for i, r in zip(b.indices, b.tolist(), strict=True)]
        with monkeypatch.context() as m:
            m.setattr(native, "NATIVE", None)
            with TFRecordReader(path, shard=shard) as reader:
                want = [
                    (int(i), r)
                    for b in reader.iter_batches()
                    for i, r in zip(b.indices, b.tolist(), strict=True)
                ]
        assert got == want and len(got) == (150_000 if shard is None else 50_000)


def test_record_batch_views_and_packing() -> None:
    with TFRecordReader(FIX / "examples.tfrecord") as r:
        (batch,) = list(r.iter_batches())
    assert len(batch) == 50 and batch.indices.tolist() == list(range(50))
    packed = RecordBatch.from_records(batch.tolist())
    assert packed.tolist() == batch.tolist() and packed[3] == batch[3]


def test_record_sharding_partitions_and_skips_others_checksums() -> None:
    parts = [list(TFRecordReader(FIX / "examples.tfrecord", shard=(i, 3, 1))) for i in range(3)]
    assert sorted(r for p in parts for r in p) == sorted(read_records(FIX / "examples.tfrecord"))
    # Record 0 is corrupt: only the shard that owns it ((0 + 1) % 3 == 1) notices.
    assert len(list(TFRecordReader(FIX / "corrupt_crc.tfrecord", shard=(0, 3, 1)))) == 16
    with pytest.raises(DataLossError):
        list(TFRecordReader(FIX / "corrupt_crc.tfrecord", shard=(1, 3, 1)))


def test_fsspec_memory_urls_and_globs() -> None:
    mem = fsspec.filesystem("memory")
    records = list(read_records(FIX / "examples.tfrecord"))
    try:
        for i in range(3):
            write_records(f"memory://psflow-test/d/part-{i}.tfrecord.gz", records[i::3])
        mem.pipe("/psflow-test/d/_SUCCESS", b"")
        files = fs.expand_paths("memory://psflow-test/d/*.tfrecord.gz")
        assert files == [f"memory:///psflow-test/d/part-{i}.tfrecord.gz" for i in range(3)]
        assert fs.expand_paths("memory://psflow-test/d") == files
        got = [r for f in files for r in read_records(f)]
        assert sorted(got) == sorted(records)
        with pytest.raises(FileNotFoundError, match="nothing"):
            fs.expand_paths("memory://psflow-test/nothing*")
    finally:
        mem.rm("/psflow-test", recursive=True)


def test_local_globs_and_directories(tmp_path: Path) -> None:
    for i in range(3):
        write_records(tmp_path / f"a-{i}.tfrecord", [b"%d" % i])
    (tmp_path / "_SUCCESS").write_bytes(b"")
    assert fs.expand_paths(str(tmp_path / "a-*.tfrecord")) == fs.expand_paths(str(tmp_path))
    assert len(fs.expand_paths([str(tmp_path / "a-1.tfrecord"), str(tmp_path)])) == 3
    with pytest.raises(FileNotFoundError):
        fs.expand_paths(str(tmp_path / "nope"))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="compression"):
        TFRecordReader(FIX / "examples.tfrecord", compression="LZ4")
    with pytest.raises(ValueError, match="chunk_size"):
        TFRecordReader(FIX / "examples.tfrecord", chunk_size=1)
    w = TFRecordWriter(io.BytesIO(), compression="")
    w.close()
    with pytest.raises(ValueError, match="after close"):
        w.write(b"x")


def test_header_layout() -> None:
    rec = encode_record(b"abc")
    assert struct.unpack("<Q", rec[:8]) == (3,)
    assert struct.unpack("<I", rec[8:12]) == (masked_crc32c(rec[:8]),)
    assert rec[12:15] == b"abc" and struct.unpack("<I", rec[15:]) == (masked_crc32c(b"abc"),)
