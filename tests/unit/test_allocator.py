"""The C allocator tuning: large tensors come from the heap, not from a fresh mmap each time."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Prints how many mmapped blocks glibc holds while a 64 MB tensor is alive, before and after
# tune(), and what tune() returned.
_PROBE = """
import ctypes, sys, threading, torch
from psflow import allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def mmapped_blocks_with_big_tensor():
    t = torch.ones(16 << 20)
    n = libc.mallinfo2().hblks
    del t
    return n

def in_a_new_thread():
    # A thread started now, as ZeroMQ's I/O thread starts after tune(): its own arena, when it
    # gets one, cannot hold 64 MB and maps it whatever M_MMAP_MAX says.
    out = []
    th = threading.Thread(target=lambda: out.append(mmapped_blocks_with_big_tensor()))
    th.start()
    th.join()
    return out[0]

before = mmapped_blocks_with_big_tensor()
tuned = allocator.tune()
after = mmapped_blocks_with_big_tensor()
print(before, tuned, after, in_a_new_thread())
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")


def _probe(setting: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PSFLOW_MALLOC", "LD_PRELOAD")}
    if setting is not None:
        env["PSFLOW_MALLOC"] = setting
    return subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )


@glibc
def test_tuned_process_serves_large_tensors_from_the_heap() -> None:
    out = _probe(None)
    assert out.returncode == 0, out.stderr
    before, tuned, after, thread = out.stdout.split()
    assert int(before) >= 1  # glibc's default: a fresh mmap for 64 MB
    assert tuned == "True"
    assert int(after) == int(before) - 1  # the new 64 MB block came from the heap
    assert int(thread) == int(after)  # in another thread too


@glibc
def test_system_setting_leaves_malloc_alone() -> None:
    out = _probe("system")
    assert out.returncode == 0, out.stderr
    before, tuned, after, thread = out.stdout.split()
    assert tuned == "False"
    assert int(after) == int(before)
    assert int(thread) == int(before)


def test_bad_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from psflow import allocator

    monkeypatch.setenv("PSFLOW_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match=r"PSFLOW_MALLOC.*'jemalloc'"):
        allocator.tune()


@pytest.mark.parametrize(("setting", "frozen"), [(None, True), ("0", False)])
def test_freeze_gc_hides_what_is_alive_from_the_collector(
    setting: str | None, frozen: bool
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PSFLOW_GC_FREEZE"}
    if setting is not None:
        env["PSFLOW_GC_FREEZE"] = setting
    probe = "import gc; from psflow import allocator; print(allocator.freeze_gc(), gc.get_freeze_count())"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    done, count = out.stdout.split()
    assert done == str(frozen)
    assert (int(count) > 1000) is frozen  # torch's objects, among others


# Prints whether the memory of a table's rows and of its Adagrad state is advised for huge
# pages ("hg" in the flags of the mapping that holds it), and what an 8 MB table_empty holds.
_HUGE_PROBE = """
import torch
from psflow import allocator
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse import FixedRows

def advised(t):
    middle = t.data_ptr() + t.numel() * t.element_size() // 2
    start = end = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            start, end = (int(x, 16) for x in head[0].split("-"))
        elif line.startswith("VmFlags:") and start <= middle < end:
            return "hg" in line.split()
    raise AssertionError("no mapping holds the tensor")

spec = TableSpec(name="emb", embedding_dim=64, num_embeddings=200_000, dtype="float32",
                 optimizer=RowOptimizerSpec.of("Adagrad", lr=0.1, initial_accumulator_value=0.5))
rows = FixedRows(spec, shard=0, num_shards=2)
t = allocator.table_empty((2048, 1024), torch.float32)
print(advised(rows.values), advised(rows.state["sum"]), advised(t), list(t.shape), t.dtype,
      float(rows.state["sum"].min()), float(rows.state["sum"].max()))
"""


def _transparent_huge_pages() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            setting = f.read()
    except OSError:
        return False
    return "[madvise]" in setting or "[always]" in setting


@pytest.mark.skipif(
    not _transparent_huge_pages(), reason="Linux with transparent huge pages (madvise or always)"
)
@pytest.mark.parametrize(("setting", "advised"), [(None, "True"), ("system", "False")])
def test_table_memory_is_asked_for_in_huge_pages(setting: str | None, advised: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PSFLOW_MALLOC", "LD_PRELOAD")}
    if setting is not None:
        env["PSFLOW_MALLOC"] = setting
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    values, state, empty, *rest = out.stdout.split()
    assert (values, state, empty) == (advised, advised, advised)
    # The state still holds Adagrad's initial accumulator in every row.
    assert rest == ["[2048,", "1024]", "torch.float32", "0.5", "0.5"]


def test_small_tensors_are_not_advised() -> None:
    import torch

    from psflow import allocator

    assert not allocator.advise_huge_pages(torch.empty(1024))
    assert not allocator.advise_huge_pages(torch.empty(3 << 20, dtype=torch.uint8))
