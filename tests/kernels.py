"""Both paths of the sparse kernels: psflow's C kernels (``psflow/sparse/_kernels.c``) and torch's
index operations, for tests that run on each (the ``path`` fixture, in ``tests/conftest.py``)."""

from __future__ import annotations

import shutil
import sysconfig

import pytest

import psflow.sparse.kernels as kernels


def need_kernels() -> None:
    """Fails where the kernels should have been built (a C compiler is here) but were not;
    skips only where the install could not build them."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if kernels.KERNELS is not None:
        return
    if shutil.which(compiler) is not None:
        pytest.fail(f"{compiler} is here, but psflow/sparse/_kernels.c was not built (setup.py)")
    pytest.skip(f"no C compiler ({compiler}): the install could not build the kernels")
