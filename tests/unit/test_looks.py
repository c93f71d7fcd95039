"""Whether a side of a lane looks before it sleeps (:class:`psflow.transport.looks.Looks`)."""

from __future__ import annotations

import doctest

import pytest

import psflow.transport.looks as looks_module
from psflow.transport.looks import Looks

pytestmark = pytest.mark.unit


def test_the_odds_follow_the_last_waits() -> None:
    looks = Looks()
    looks.waited(0.002, spin=0.002)  # within the spin time, to the end
    assert looks.odds == 1.0
    misses = 0
    while looks.worth():
        looks.waited(0.0021, spin=0.002)
        misses += 1
    assert misses == 6  # about the last eight count: one slow phase does not stop the looks
    for _ in range(20):
        looks.waited(1.0, spin=0.002)
    looks.waited(0.0, spin=0.002)
    assert not looks.worth()  # after a long slow run, one quick reply does not start them
    hits = 1
    while not looks.worth():
        looks.waited(0.0, spin=0.002)
        hits += 1
    assert hits == 5


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(looks_module).failed == 0
