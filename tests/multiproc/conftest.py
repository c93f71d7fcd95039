import pytest

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
