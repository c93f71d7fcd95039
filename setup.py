"""psflow's compiled modules, one a concern, each optional: without a C compiler the install goes
on without them, and psflow does the same work in Python (each wrapper says which path it takes).

- ``psflow.sparse._kernels`` (``psflow/sparse/_kernels.c`` binding ``_rows.c``, ``_ids.c``,
  ``_init.c``, ``_sketch.c`` and ``_evict.c``): row kernels, the ps's fused row-wise updates, row
  gathers, the partition of ids to shards, a hashed table's id map, admission counts and
  eviction order, the hashes of new rows' initial values; without it,
  torch's operations (``psflow/sparse/kernels.py``, ``psflow/sparse/init.py``).
- ``psflow.data._native`` (``psflow/data/_native.c`` binding ``_farmhash.c``, ``_example.c`` and
  ``_tfrecord.c``): TensorFlow's string hash, the Example parser's fast path, TFRecord's framing
  and checksums, records packed into one buffer; without it, numpy and Python
  (``psflow/data/native.py``).

Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "psflow.sparse._kernels",
            [
                "psflow/sparse/_kernels.c",
                "psflow/sparse/_rows.c",
                "psflow/sparse/_ids.c",
                "psflow/sparse/_init.c",
                "psflow/sparse/_sketch.c",
                "psflow/sparse/_evict.c",
            ],
            depends=["psflow/sparse/_kernels.h"],
            # No contraction into fused multiply-adds and no fast-math: the same roundings as
            # the torch reference; errno-free sqrt lets the loops vectorize.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno"],
            optional=True,
        ),
        Extension(
            "psflow.data._native",
            [
                "psflow/data/_native.c",
                "psflow/data/_farmhash.c",
                "psflow/data/_example.c",
                "psflow/data/_tfrecord.c",
            ],
            depends=["psflow/data/_native.h"],  # a change rebuilds it, and the sdist carries it
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
