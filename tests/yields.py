"""A thread's looks before it sleeps (``os.sched_yield`` calls), counted: the ``yields``
fixture, which ``tests/conftest.py`` registers."""

from __future__ import annotations

import os
import threading

import pytest


class Yields:
    """The ``os.sched_yield`` calls of one thread (a lane's looks before it sleeps), counted:
    set :attr:`thread` to the thread that waits before it starts."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.count = 0
        self.looked = threading.Event()
        """Set at the thread's first look."""


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> Yields:
    counted = Yields()
    real_yield = os.sched_yield

    def counted_yield() -> None:
        if threading.current_thread() is counted.thread:
            counted.count += 1
            counted.looked.set()
        real_yield()

    monkeypatch.setattr(os, "sched_yield", counted_yield)
    return counted
