"""Both paths of psflow's compiled modules, for tests that run on each (the ``path`` fixture, in
``tests/conftest.py``): the native one (``psflow/sparse/_kernels.c``, the row kernels;
``psflow/data/_native.c``, hashing and Example parsing) and the fallback (torch's index
operations; numpy and Python)."""

from __future__ import annotations

import importlib
import shutil
import sysconfig
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import pytest

from psflow import env as envvars

T = TypeVar("T")

COMPILED = {
    "psflow.sparse.kernels": ("KERNELS", "psflow/sparse/_kernels.c"),
    "psflow.data.native": ("NATIVE", "psflow/data/_native.c"),
}
"""Each wrapper module, the attribute that holds its compiled module (``None`` where it is
missing: the fallback), and the C source it is built from."""


def wrappers() -> list[tuple[ModuleType, str]]:
    """Each wrapper module with the name of its compiled module's attribute."""
    return [(importlib.import_module(name), attr) for name, (attr, _) in COMPILED.items()]


def need_kernels() -> None:
    """Fails where the compiled modules should have been built (a C compiler is here) but were
    not; skips only where the install could not build them, or ``PSFLOW_KERNELS=0`` turned
    them off (a run of the fallback alone)."""
    if not envvars.flag(envvars.PSFLOW_KERNELS, True):
        pytest.skip(f"{envvars.PSFLOW_KERNELS}=0: the compiled modules are off")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    missing = [
        src for name, (attr, src) in COMPILED.items()
        if getattr(importlib.import_module(name), attr) is None
    ]  # fmt: skip
    if not missing:
        return
    if shutil.which(compiler) is not None:
        pytest.fail(f"{compiler} is here, but {', '.join(missing)} was not built (setup.py)")
    pytest.skip(f"no C compiler ({compiler}): the install could not build {', '.join(missing)}")


def kernels_then_torch(run: Callable[[], T]) -> tuple[T, T]:
    """``run()`` with the sparse tables' row kernels, then again with torch's ops in their place
    (in one test, to compare the two)."""
    from psflow.sparse import kernels

    results = []
    for use in (kernels.KERNELS, None):
        saved, kernels.KERNELS = kernels.KERNELS, use
        try:
            results.append(run())
        finally:
            kernels.KERNELS = saved
    return results[0], results[1]
