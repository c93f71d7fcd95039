"""Several threads on one request's rows: the rows split into stripes, one thread each.

A push's row ids are unique (coalesced before they are sent), so contiguous stripes of them
name disjoint rows: threads that update a stripe each never touch one row together, and each
row's arithmetic is the same as on one thread (results are bit-identical). The row kernels
release the GIL, so the stripes run at once. A ps task sets the count once
(:func:`set_threads`: ``PSFLOW_PS_THREADS``, or the threads its task was given); one request is
still served at a time, so a snapshot between two requests stays consistent.

On a host whose cores are all busy, more threads cost more than they save (a thread handed a
stripe waits for a core): the count is the cores a ps task is given, 1 unless told.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

MIN_STRIPE = 512
"""The fewest rows a stripe gets: below it, handing rows to another thread costs more than
updating them (a 64-float row takes tens of nanoseconds; waking a thread, microseconds)."""

_lock = threading.Lock()
_threads = 1
_pool: ThreadPoolExecutor | None = None


class StripeError(RuntimeError):
    """A stripe failed while others ran: the rows of the request may be half-updated. Not a
    request's fault (every index is checked before the stripes start): the shard must stop
    rather than serve on (a ps task does, naming this error), and be restored from its last
    checkpoint."""


def set_threads(n: int, *, flush_denormals: bool = False) -> None:
    """The threads one request's rows use from now on (this one and ``n - 1`` helpers); the
    helpers take subnormal floats as zero with ``flush_denormals`` (the caller's thread sets
    its own mode: ``torch.set_flush_denormal``)."""
    global _threads, _pool
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"row threads must be an integer >= 1, got {n!r}")
    with _lock:
        old, _pool = _pool, None
        _threads = n
        if n > 1:
            _pool = ThreadPoolExecutor(
                max_workers=n - 1,
                thread_name_prefix="psflow-rows",
                initializer=torch.set_flush_denormal,
                initargs=(flush_denormals,),
            )
    if old is not None:
        old.shutdown(wait=True)


def threads() -> int:
    return _threads


def bounds(n: int) -> list[tuple[int, int]]:
    """``[0, n)`` in at most :func:`threads` contiguous stripes of at least :data:`MIN_STRIPE`
    rows (one stripe when ``n`` is small)."""
    k = max(1, min(_threads, n // MIN_STRIPE))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def run(n: int, work: Callable[[int, int], int], *, writes: bool = True) -> int:
    """Calls ``work(begin, end)`` on each stripe of ``[0, n)``, the first on this thread, the
    others on the pool's, and waits for all; returns the first stripe's non-negative result
    offset to the whole range (a kernel's bad index), else ``-1``.

    An exception in a stripe is raised once every stripe has ended (nothing runs on after the
    call returns): as :class:`StripeError` when there were several stripes of ``work`` that
    ``writes`` the shard's rows (the others may have written theirs); as itself for work that
    only reads them (a gather: nothing is half-done, the request fails alone).
    """
    stripes = bounds(n)
    pool = _pool
    if len(stripes) == 1 or pool is None:
        return work(0, n)
    futures: list[Future[int]] = [pool.submit(work, b, e) for b, e in stripes[1:]]
    results: list[int] = []
    error: BaseException | None = None
    try:
        results.append(work(*stripes[0]))
    except BaseException as e:  # the others still end before this returns
        error = e
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as e:
            error = error or e
    if error is not None and not writes:
        raise error
    if error is not None:
        raise StripeError(
            f"a stripe of {n} rows on {len(stripes)} threads failed while the others ran "
            f"({type(error).__name__}: {error}): the rows may be half-updated"
        ) from error
    for (begin, _), bad in zip(stripes, results, strict=True):
        if bad >= 0:
            return begin + bad
    return -1
