"""The suite's short run of ``tests/fuzz_readers.py`` (issue 36): mutated TensorFlow
checkpoints, psflow checkpoints, Criteo and text input through their readers, each case held
to the oracle (the known values, or a one-line error naming the file), seeded, in bounded
memory. ``python tests/fuzz_files.py --kinds tf_checkpoint psflow_checkpoint criteo text``
runs them as long as one likes."""

from __future__ import annotations

import random
import signal
import tracemalloc
from collections import Counter
from pathlib import Path
from types import FrameType

import pytest

from tests.fuzz_readers import CASES, warm

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

MEMORY_BOUND = 64 << 20
RUNS = {"tf_checkpoint": 40, "psflow_checkpoint": 40, "criteo": 80, "text": 150}
"""Cases per kind in the suite (a few seconds each)."""


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("fuzz-readers")
    warm(tmp)
    return tmp


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_mutated_files_end_in_the_known_values_or_a_named_refusal(kind: str, warmed: Path) -> None:
    rng = random.Random(f"suite-{kind}")
    counts: Counter[str] = Counter()

    def hang(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"{kind}: a case ran past 10 s (a reader blocked?)")

    previous = signal.signal(signal.SIGALRM, hang)
    tracemalloc.start()
    try:
        for i in range(RUNS[kind]):
            signal.setitimer(signal.ITIMER_REAL, 10)
            try:
                counts.update(f"{r}:{o}" for r, o in CASES[kind](rng, warmed, i))
            except AssertionError as e:
                raise AssertionError(f"{kind}, case {i} of seed 'suite-{kind}': {e}") from e
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        signal.signal(signal.SIGALRM, previous)
    assert peak < MEMORY_BOUND, peak
    # Both sides of the oracle were exercised: values read and checked, and refusals.
    main = {"tf_checkpoint": "tf.tensor", "psflow_checkpoint": "export"}.get(kind, kind)
    main = "text.lines" if kind == "text" else main
    assert counts[f"{main}:equal"] > 0 and counts[f"{main}:refused"] > 0, counts
