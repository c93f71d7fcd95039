"""Click-through-rate data in the Criteo layout: a synthetic set from a planted model, and a reader.

This module is the one place to import them from; each role has a module of its own:

- ``ctr_layout.py``: the layout (``label``, ``I1`` .. ``I13``, ``C1`` .. ``C26``, one value each),
  :func:`serialize_ctr`, Criteo's hex ids (:func:`hex_strings`, :func:`parse_hex`) and the
  files' names (:func:`shard_name`)
- ``synth_ctr.py``: :class:`SynthCTRConfig`, :class:`PlantedCTR` and :func:`write_synth_ctr`: a
  set labelled by a planted model, so that its best achievable AUC is known (:data:`META_FILE`)
- ``ctr_reader.py``: :func:`ctr_batches` (tensors for a CTR model, this worker's share), the
  layout of the files found from their first records (:func:`detect_layout`)
- ``auc.py``: :func:`auc`, :func:`expected_auc`
"""

from __future__ import annotations

from psflow.data.auc import auc, expected_auc
from psflow.data.ctr_layout import (
    CATEGORICAL,
    DENSE,
    HEX_DIGIT,
    LABEL,
    hex_strings,
    parse_hex,
    serialize_ctr,
    shard_name,
)
from psflow.data.ctr_reader import (
    TF_MODELS_CATEGORICAL,
    TF_MODELS_DENSE,
    CTRBatch,
    CTRLayout,
    ctr_arrays,
    ctr_batches,
    ctr_spec,
    detect_layout,
)
from psflow.data.synth_ctr import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_POSITIVE_RATE,
    META_FILE,
    PlantedCTR,
    Sample,
    SynthCTRConfig,
    write_synth_ctr,
)

__all__ = [
    "CATEGORICAL",
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_POSITIVE_RATE",
    "DENSE",
    "HEX_DIGIT",
    "LABEL",
    "META_FILE",
    "TF_MODELS_CATEGORICAL",
    "TF_MODELS_DENSE",
    "CTRBatch",
    "CTRLayout",
    "PlantedCTR",
    "Sample",
    "SynthCTRConfig",
    "auc",
    "ctr_arrays",
    "ctr_batches",
    "ctr_spec",
    "detect_layout",
    "expected_auc",
    "hex_strings",
    "parse_hex",
    "serialize_ctr",
    "shard_name",
    "write_synth_ctr",
]
