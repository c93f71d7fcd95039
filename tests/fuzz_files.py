"""A seeded fuzzer of the file readers, for long runs: mutated TFRecord files (plain, GZIP,
ZLIB), checkpoint shard files and manifests; TensorFlow checkpoints (the fixtures TensorFlow
wrote), whole psflow checkpoints through ``export``, ``inspect`` and the restores, and the
Criteo and text converters' input, each against an oracle for silent results
(``tests/fuzz_readers.py``).

    python tests/fuzz_files.py --cases 100000 --seed 7          # each kind in turn, JSON last
    python tests/fuzz_files.py --kinds gzip zlib --minutes 30
    python tests/fuzz_files.py --kinds tf_checkpoint psflow_checkpoint criteo text

The mutations and the checks are those of the suite's short runs
(``tests/unit/test_hostile_files.py``, ``tests/unit/test_fuzz_readers.py``): each case must end
in the known values or in an error that names the file (and the byte offset where the format
has one). Anything else stops the run with the kind, the seed and the case's number, which
replay it: a wrong value, another exception, a case that takes longer than ``--case-timeout``
(a hang: a FIFO opened, say), or memory traced past the bound while a kind runs (an
allocation sized by a corrupted field). Each reader's outcomes are counted per kind.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz_readers import CASES, warm
from tests.unit.test_hostile_files import (
    MEMORY_BOUND,
    manifest_case,
    read_case,
    shard_case,
    tfrecord_case,
)

KINDS = ("tfrecord", "gzip", "zlib", "shard", "manifest", *CASES)
_COMPRESSION = {"tfrecord": "", "gzip": "GZIP", "zlib": "ZLIB"}


class CaseTimeout(Exception):
    """A case ran past ``--case-timeout``."""


class FuzzFailure(Exception):
    """A case broke the rule; its message names the kind, the seed and the case."""


def _case(kind: str, rng: random.Random, tmp: Path, i: int) -> str | list[tuple[str, str]]:
    """One case of ``kind``: ``"ok"`` or ``"error"`` (named), or each reader's outcome;
    raising on anything else."""
    if kind in CASES:
        return CASES[kind](rng, tmp, i)
    if kind in _COMPRESSION:
        compression = _COMPRESSION[kind]
        path, _ = tfrecord_case(rng, tmp, compression)
        return read_case(rng, path, compression, parse=i % 10 == 0)
    if kind == "shard":
        return shard_case(rng, tmp, i)
    return manifest_case(rng)


def run(
    kind: str, seed: int, cases: int, seconds: float, case_timeout: float, tmp: Path
) -> dict[str, object]:
    """Up to ``cases`` cases of ``kind`` (or until ``seconds`` pass); their counts and figures.

    Raises:
        FuzzFailure: on the first case that breaks the rule (an assertion, another exception,
            :class:`CaseTimeout`), or when memory traced passes the bound.
    """
    rng = random.Random(f"{seed}-{kind}")

    def alarm(signum: int, frame: FrameType | None) -> None:
        raise CaseTimeout(f"more than {case_timeout:g} s")

    previous: Callable[..., object] | int | None = signal.signal(signal.SIGALRM, alarm)
    counts: Counter[str] = Counter()
    readers: dict[str, Counter[str]] = {}
    start = time.monotonic()
    tracemalloc.start()
    i = 0
    try:
        while i < cases and time.monotonic() - start < seconds:
            signal.setitimer(signal.ITIMER_REAL, case_timeout)
            try:
                outcome = _case(kind, rng, tmp, i)
                if isinstance(outcome, str):
                    counts[outcome] += 1
                else:
                    for reader, verdict in outcome:
                        readers.setdefault(reader, Counter())[verdict] += 1
            except Exception as e:
                raise FuzzFailure(f"{kind}, seed {seed}, case {i}: {type(e).__name__}: {e}") from e
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            i += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, previous)
    if peak >= MEMORY_BOUND:
        raise FuzzFailure(f"{kind}, seed {seed}: {peak} bytes traced, over {MEMORY_BOUND}")
    took = time.monotonic() - start
    outcomes: dict[str, object] = (
        {"readers": {r: dict(sorted(c.items())) for r, c in sorted(readers.items())}}
        if kind in CASES
        else {"ok": counts["ok"], "error": counts["error"]}
    )
    return {
        "kind": kind,
        "cases": i,
        **outcomes,
        "seconds": round(took, 1),
        "cases_per_s": round(i / took, 1) if took else None,
        "peak_traced_bytes": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS))
    parser.add_argument("--cases", type=int, default=10_000, help="per kind (default 10,000)")
    parser.add_argument("--minutes", type=float, help="per kind, at most (default: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case-timeout", type=float, default=10.0, help="seconds (a hang)")
    args = parser.parse_args()
    if args.cases < 1:
        parser.error(f"--cases must be >= 1, got {args.cases}")
    seconds = float("inf") if args.minutes is None else args.minutes * 60
    results = []
    with tempfile.TemporaryDirectory(prefix="fuzz-files-") as d:
        warm(Path(d))
        for kind in args.kinds:
            result = run(kind, args.seed, args.cases, seconds, args.case_timeout, Path(d))
            print(json.dumps(result), file=sys.stderr, flush=True)
            results.append(result)
    print(json.dumps({"benchmark": "fuzz_files", "seed": args.seed, "kinds": results}))


if __name__ == "__main__":
    main()
