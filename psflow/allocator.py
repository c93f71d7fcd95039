"""The C allocator of a training process: freed tensor memory stays in the heap for reuse.

glibc's ``malloc`` serves every allocation above 32 MB with a fresh ``mmap`` and hands it back
with ``munmap`` when freed. A training step frees and allocates the same large tensors every
step (gradients, activations, received messages), so each step pays for zero-filling those
pages again: one page fault per 4 KB. On the 25M-parameter MLP of the benchmarks this made a
batch-32 forward and backward pass take 166 ms instead of 97 ms (one core, torch 2.13).
TensorFlow avoids it with its own caching allocator; here, three ``mallopt`` settings do: no
``mmap`` for large blocks, no trimming of the heap's free top, and one arena for every thread
that starts afterwards. The last matters for ZeroMQ's I/O thread, which allocates each received
message: a thread's own arena grows in heaps of at most 64 MB, so glibc maps a larger message
afresh whatever the other settings say (a 64 MB frame cost 16,384 page faults per message).
``tune`` therefore runs before the transport creates its first socket.

The cost is memory held after a peak: a process keeps its largest footprint until it exits,
as a caching allocator does. ``PSFLOW_MALLOC=system`` keeps glibc's defaults; another
allocator preloaded with ``LD_PRELOAD`` (jemalloc, tcmalloc) is left alone.

An embedding table's rows and their optimizer state (:func:`table_empty`) are asked for in
transparent huge pages. A step reads and writes a few thousand rows scattered through hundreds
of megabytes: with 4 KB pages, each row is a miss in the TLB too, and the page walk misses the
cache again. With 2 MB pages, a 1M x 64 float32 Adagrad shard's update of 2,048 rows took 154
µs instead of 215 µs, and their gather 75 µs instead of 103 µs, with the caches cold as a
training step leaves them (one core). Linux gives a process huge pages where it asks
(``madvise``) when ``/sys/kernel/mm/transparent_hugepage/enabled`` says ``madvise`` or
``always``; ``PSFLOW_MALLOC=system`` does not ask.

A hashed table's tensors grow as rows come. Past :data:`RESERVE_FROM_BYTES` each grows in a
:class:`Reservation`: address space for as many rows as the memory the process may have could
hold (:func:`physical_memory`: the machine's, or a container's limit),
mapped without memory behind it, so that a page is only taken when first touched. A growth then
takes more of the same mapping: nothing is copied, and the table holds its rows' memory once.
Copying instead stalled the shard's requests for the copy (an 8M-row table of dim 16 with
Adagrad: 0.66 s, one core) and left the old storage in the heap beside the new.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import mmap
import os
import platform
import resource
import sys
import threading
import weakref

import torch

from psflow import env as envvars

log = logging.getLogger(__name__)

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# <sys/mman.h>
_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20
_MAP_NORESERVE = 0x4000
"""Linux's flag (``mmap.MAP_NORESERVE`` only from Python 3.13)."""

RESERVE_FROM_BYTES = 32 << 20
"""A table tensor whose storage would grow to this many bytes or more grows in a
:class:`Reservation`; a smaller one is copied (a few milliseconds at most)."""
RESERVE_AT_MOST_BYTES = 1 << 44
"""Address space a process reserves in all (16 TiB, an eighth of what x86-64 Linux gives a
process): past it a table copies as it grows, and the process's other mappings (its heap,
torch's allocations, ZeroMQ's) always find room."""
_reserved = 0
_reserved_lock = threading.Lock()

_libc: ctypes.CDLL | None = None

_tuned: bool | None = None


def tune() -> bool:
    """Applies the setting of ``PSFLOW_MALLOC`` once per process; True when tuned.

    Raises:
        ValueError: when ``PSFLOW_MALLOC`` is neither ``tuned`` nor ``system``.
    """
    global _tuned
    setting = _setting()
    if _tuned is not None:
        return _tuned
    _tuned = False
    if setting == "system" or platform.libc_ver()[0] != "glibc":
        return False
    preloaded = envvars.text(envvars.LD_PRELOAD) or ""
    if "malloc" in preloaded:
        log.debug("%s is preloaded: leaving it alone", preloaded)
        return False
    libc = _c_library()
    if libc is None:
        return False
    try:
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)) == 1 and ok
        ok = libc.mallopt(_M_ARENA_MAX, 1) == 1 and ok
    except AttributeError as e:
        log.debug("cannot tune malloc: %s", e)
        return False
    _tuned = ok
    return ok


def _c_library() -> ctypes.CDLL | None:
    global _libc
    if _libc is None and platform.libc_ver()[0] == "glibc":
        try:
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError as e:
            log.debug("cannot load the C library: %s", e)
    return _libc


def _setting() -> str:
    return envvars.choice(envvars.PSFLOW_MALLOC, ("tuned", "system"), "tuned")


def table_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU for a table's rows or their optimizer
    state, its memory asked for in huge pages before anything touches it (see the module
    docstring): the caller fills it.

    Raises:
        ValueError: when ``PSFLOW_MALLOC`` is neither ``tuned`` nor ``system``.
    """
    out = torch.empty(shape, dtype=dtype)
    if _setting() == "tuned":
        advise_huge_pages(out)
    return out


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks Linux for transparent huge pages under the 2 MB-aligned part of ``t``'s memory
    (a CPU tensor); True when asked. Pages already touched stay as they are until the kernel's
    ``khugepaged`` merges them."""
    nbytes = t.numel() * t.element_size()
    if sys.platform != "linux" or t.device.type != "cpu" or nbytes < 2 * _HUGE_PAGE:
        return False
    libc = _c_library()
    if libc is None:
        return False
    start = (t.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (t.data_ptr() + nbytes) & ~(_HUGE_PAGE - 1)
    if end <= start:
        return False
    try:
        done = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    except AttributeError:
        return False
    if done != 0:  # EINVAL where the kernel has no transparent huge pages
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
        return False
    return True


def freeze_gc() -> bool:
    """Hides every object alive now from Python's cycle collector (``gc.freeze``), once a
    worker is set up; True when done, False with ``PSFLOW_GC_FREEZE=0``.

    What is alive then (torch's modules, the model, psflow's own state) lives as long as the
    process, but each full collection would walk all of it again: with torch imported, about
    50-130 ms a time, a few times a minute in a training loop. Frozen objects are still freed
    by reference counting; only a reference cycle among them is never collected.

    Raises:
        ValueError: when ``PSFLOW_GC_FREEZE`` is not a switch (``1/on/true/yes``,
            ``0/off/false/no``).
    """
    if not envvars.flag(envvars.PSFLOW_GC_FREEZE, True):
        return False
    gc.freeze()
    return True


class Reservation:
    """Address space for up to :attr:`rows` rows of one CPU tensor, mapped without memory
    behind it (``MAP_NORESERVE``): Linux gives each page when it is first touched, zeroed.
    A table's tensor grows by taking more of its rows (:meth:`first`): in place, its rows never
    copied, and the rows never taken never cost memory. Made by :func:`reserve`.

    Example:
        >>> area = reserve((4,), torch.float32, 1 << 20)
        >>> small = area.first(2); small[1] = 1.0
        >>> big = area.first(1024)
        >>> area.holds(small), big.data_ptr() == small.data_ptr(), big[1].tolist()
        (True, True, [1.0, 1.0, 1.0, 1.0])
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, rows: int) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = rows * math.prod(row_shape) * itemsize
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        _take(nbytes)
        try:
            self._map = mmap.mmap(-1, nbytes, flags=flags)
        except BaseException:
            _give(nbytes)
            raise
        # Given back when the mapping goes (its last tensor view with it).
        weakref.finalize(self._map, _give, nbytes)
        if _setting() == "tuned":
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError as e:  # EINVAL where the kernel has no transparent huge pages
                log.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
        self._rows = torch.frombuffer(self._map, dtype=dtype).view(rows, *row_shape)
        self.rows = rows

    def first(self, rows: int) -> torch.Tensor:
        """The first ``rows`` rows: the same memory for every call (rows not yet written are
        zeros)."""
        if not 0 < rows <= self.rows:
            raise ValueError(f"{rows} rows asked of a reservation of {self.rows}")
        return self._rows[:rows]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` begins at this reservation's first row."""
        return t.device.type == "cpu" and t.data_ptr() == self._rows.data_ptr()


def reserve(row_shape: tuple[int, ...], dtype: torch.dtype, rows: int) -> Reservation | None:
    """A :class:`Reservation` of ``rows`` rows, or None where address space cannot be taken
    without committing memory: outside Linux, under strict overcommit accounting
    (``vm.overcommit_memory`` 2 counts every byte mapped), under a finite ``RLIMIT_AS`` (the
    mapping would count against it), past :data:`RESERVE_AT_MOST_BYTES` reserved in all, or
    when the kernel refuses the mapping. The caller then copies as it grows."""
    if sys.platform != "linux" or rows <= 0:
        return None
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            if f.read().strip() == "2":
                return None
    except OSError:
        return None
    if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY:
        return None
    try:
        return Reservation(row_shape, dtype, rows)
    except (OSError, OverflowError, ValueError, MemoryError) as e:
        log.debug("cannot reserve %d rows of %s %s: %s", rows, row_shape, dtype, e)
        return None


def _take(nbytes: int) -> None:
    """Counts ``nbytes`` more reserved; ``MemoryError`` past :data:`RESERVE_AT_MOST_BYTES`."""
    global _reserved
    with _reserved_lock:
        if _reserved + nbytes > RESERVE_AT_MOST_BYTES:
            raise MemoryError(
                f"{nbytes} bytes more would reserve {_reserved + nbytes} in all, past "
                f"{RESERVE_AT_MOST_BYTES}"
            )
        _reserved += nbytes


def _give(nbytes: int) -> None:
    global _reserved
    with _reserved_lock:
        _reserved -= nbytes


def reserved_bytes() -> int:
    """Address space this process holds in reservations now."""
    return _reserved


_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""Where a container's memory limit is read: cgroup v2, then v1 (``max`` or a huge number:
none)."""


def physical_memory() -> int:
    """The memory this process may have, in bytes: the machine's, or its control group's limit
    where lower (a container's, a Kubernetes pod's); 0 where neither says."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 0
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            total = min(total, int(text)) if total else int(text)
    return total
