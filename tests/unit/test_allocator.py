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
