from collections.abc import Iterator

import pytest

from psflow.cluster.spec import ClusterSpec

from .support import local_cluster, start_ps, stop

DEFAULT_TIMEOUT = 120
"""Seconds a multiproc test may take unless it (or its module) declares its own timeout."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "multiproc" in str(item.fspath):
            item.add_marker(pytest.mark.multiproc)
            # A test's own timeout (its marker or its module's pytestmark) stands: added last,
            # this default would override it.
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT))


@pytest.fixture
def two_ps() -> Iterator[ClusterSpec]:
    """A cluster of 2 ps and 1 worker, its ps tasks running (stopped after the test)."""
    cluster = local_cluster(2, 1)
    procs = [start_ps(cluster, i) for i in range(2)]
    yield cluster
    for p in procs:
        stop(p, timeout=5)
