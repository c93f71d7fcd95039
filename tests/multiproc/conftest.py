import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "multiproc" in str(item.fspath):
            item.add_marker(pytest.mark.multiproc)
            item.add_marker(pytest.mark.timeout(120))
