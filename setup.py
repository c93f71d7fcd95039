"""The one compiled piece: psflow/sparse/_kernels.c, fused row-wise optimizer updates.

Optional: without a C compiler the install goes on without it, and the ps applies the same
updates with torch's index operations (psflow/sparse/kernels.py says which it uses).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "psflow.sparse._kernels",
            ["psflow/sparse/_kernels.c"],
            # No contraction into fused multiply-adds and no fast-math: the same roundings as
            # the torch reference; errno-free sqrt lets the loops vectorize.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        )
    ]
)
