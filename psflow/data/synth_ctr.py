"""A synthetic click-through-rate set in the Criteo layout, labelled by a planted model.

**The planted model.** Ids of column ``c`` are ranks ``1..K_c`` drawn from a Zipf law (``P(r) ~
r^-s``) over Criteo Kaggle's cardinality ``K_c``, shown as a 32-bit hash of the rank (``--ids
hashed``, the default) or as ``r - 1`` (``--ids index``, for fixed-size tables). The click
probability is ``sigmoid(bias + sum_c w_c[r_c] + sum_j beta_j * z_j)`` where ``z_j`` is the
standardised ``log1p(I_j)``, ``w_c[r] ~ N(0, sigma^2)`` for the ``signal_ids`` most frequent ranks
of each column and 0 beyond (an id seen a handful of times in a whole set could not be learned,
and the best AUC should be one a trained model can approach), and ``bias`` is calibrated to
Criteo's positive rate. Since the probabilities are known, so is the best achievable AUC: the
planted model's own AUC on the test split (:func:`auc` of the true probabilities against the
drawn labels), and its expectation over the label draws (:func:`expected_auc`).

Everything is vectorised numpy: a million examples take seconds (the encoder is
:mod:`psflow.data.encode`), and the same ``seed`` gives the same bytes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

from psflow.data import fs
from psflow.data.auc import auc, expected_auc
from psflow.data.ctr_layout import CATEGORICAL, DENSE, hex_strings, serialize_ctr, shard_name
from psflow.data.tfrecord_writer import TFRecordWriter

CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Distinct values of C1..C26 in Criteo Kaggle's ``train.txt`` (45,840,617 rows): the table sizes
of facebookresearch/dlrm's Kaggle preprocessing (``bench/dlrm_s_criteo_kaggle.sh``), also in
PyTorch's ``torch/ao/pruning/_experimental/data_sparsifier/benchmarks/dlrm_utils.py``
(``ln_emb``). 33,762,577 in all."""

CRITEO_POSITIVE_RATE = 0.2562
"""Clicks among Criteo Kaggle's training rows (about 25.6%)."""

_DENSE_LOG_MEAN = (1.0, 3.0, 1.8, 1.6, 7.5, 3.5, 1.8, 2.3, 3.8, 0.5, 1.1, 0.4, 1.9)
"""Centre of ``log1p(I_j)`` per dense column, roughly Criteo's: I5 in the thousands, I10 near 0."""
_DENSE_LOG_STD = 1.2
_CHUNK = 16384
META_FILE = "_synth_ctr.json"
"""The generator's figures beside the data; the leading ``_`` keeps it out of directory reads."""
_HASH_SALT = 0x2545F491


@dataclass(kw_only=True)
class SynthCTRConfig:
    """What :func:`write_synth_ctr` generates."""

    train_examples: int = 1_000_000
    """Examples in the training split."""
    test_examples: int = 100_000
    """Examples in the held-out split (the best AUC is computed on it)."""
    train_shards: int = 4
    """TFRecord files of the training split (contiguous ranges of examples)."""
    test_shards: int = 1
    """TFRecord files of the test split."""
    scale: float = 1.0
    """Multiplies every cardinality (at least 1 id per column): 1e-3 makes a tiny set for tests."""
    zipf: float = 1.1
    """Exponent ``s`` of the Zipf law of ids (``P(rank r) ~ r^-s``); > 1."""
    signal_ids: int = 2000
    """Most frequent ids of each column that carry a planted weight; the others weigh 0."""
    categorical_std: float = 1.2
    """Standard deviation of the categorical part of the logit (over the ids' distribution)."""
    dense_std: float = 0.5
    """Standard deviation of the dense part of the logit."""
    positive_rate: float = CRITEO_POSITIVE_RATE
    """Mean click probability the bias is calibrated to."""
    ids: str = "hashed"
    """``"hashed"``: ids are 32-bit hashes of the rank, like Criteo's; ``"index"``: rank - 1."""
    categorical: str = "int64"
    """``"int64"`` ids, or ``"hex"``: 8 lowercase hex digits (``bytes_list``), Criteo's text."""
    compression: str = ""
    """``""``, ``"GZIP"`` or ``"ZLIB"`` for the files."""
    seed: int = 0
    """Everything (the planted model, every example) follows from it."""

    def __post_init__(self) -> None:
        if self.train_examples < 1 or self.test_examples < 1:
            raise ValueError(
                f"train_examples and test_examples must be >= 1, got {self.train_examples}, "
                f"{self.test_examples}"
            )
        if self.train_shards < 1 or self.test_shards < 1:
            raise ValueError(
                f"train_shards and test_shards must be >= 1, got {self.train_shards}, "
                f"{self.test_shards}"
            )
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if not self.zipf > 1:
            raise ValueError(f"zipf must be > 1 (a Zipf law over millions of ids), got {self.zipf}")
        if self.signal_ids < 1:
            raise ValueError(f"signal_ids must be >= 1, got {self.signal_ids}")
        if self.categorical_std < 0 or self.dense_std < 0:
            raise ValueError(
                f"categorical_std and dense_std must be >= 0, got {self.categorical_std}, "
                f"{self.dense_std}"
            )
        if not 0 < self.positive_rate < 1:
            raise ValueError(f"positive_rate must be in (0, 1), got {self.positive_rate}")
        if self.ids not in ("hashed", "index"):
            raise ValueError(f"ids must be 'hashed' or 'index', got {self.ids!r}")
        if self.compression not in ("", "GZIP", "ZLIB"):
            raise ValueError(f"compression must be '', 'GZIP' or 'ZLIB', got {self.compression!r}")
        if self.categorical not in ("int64", "hex"):
            raise ValueError(f"categorical must be 'int64' or 'hex', got {self.categorical!r}")

    @property
    def cardinalities(self) -> tuple[int, ...]:
        """Ids per column: Criteo Kaggle's, times ``scale``."""
        return tuple(max(1, round(k * self.scale)) for k in CRITEO_KAGGLE_CARDINALITIES)


class Sample(NamedTuple):
    """Examples drawn from a :class:`PlantedCTR`, as arrays."""

    dense: np.ndarray
    """``[n, 13]`` int64 counts (``I1..I13``)."""
    ranks: np.ndarray
    """``[n, 26]`` int64 Zipf ranks, 1 the most frequent id of its column."""
    ids: np.ndarray
    """``[n, 26]`` int64 ids as written (``C1..C26``)."""
    prob: np.ndarray
    """``[n]`` float64 true click probabilities."""
    label: np.ndarray
    """``[n]`` int64 labels drawn from ``prob``."""


def _fmix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's finaliser: a bijection of 32-bit integers (distinct ranks, distinct ids)."""
    x = x.astype(np.uint64) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    return x.astype(np.int64)


class _Zipf:
    """Zipf ranks ``1..k``: inverse CDF for small columns, rejection for large ones."""

    _TABLE_MAX = 1 << 20

    def __init__(self, k: int, s: float):
        self.k = k
        self.s = s
        self.cdf: np.ndarray | None = None
        if k <= self._TABLE_MAX:
            cdf = np.cumsum(np.arange(1, k + 1, dtype=np.float64) ** -s)
            self.cdf = cdf / cdf[-1]

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.cdf is not None:
            ranks = np.searchsorted(self.cdf, rng.random(n), side="right") + 1
            return np.minimum(ranks, self.k).astype(np.int64)
        out = rng.zipf(self.s, n)
        bad = out > self.k
        while bad.any():  # truncation: about 20% redrawn at s = 1.1 for k in the millions
            out[bad] = rng.zipf(self.s, int(bad.sum()))
            bad = out > self.k
        return out.astype(np.int64)


@dataclass
class PlantedCTR:
    """The model that labels a synthetic set: per-id weights, a dense linear part and a bias."""

    config: SynthCTRConfig
    weights: list[np.ndarray] = field(default_factory=list)
    """Per column, the weights of ranks ``1..len(w)`` (ranks beyond weigh 0)."""
    beta: np.ndarray = field(default_factory=lambda: np.zeros(len(DENSE)))
    bias: float = 0.0
    _zipf: list[_Zipf] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, config: SynthCTRConfig) -> PlantedCTR:
        """Draws the weights from ``config.seed`` and calibrates the bias on a sample."""
        model = cls(config)
        model._zipf = [_Zipf(k, config.zipf) for k in config.cardinalities]
        calib = np.random.default_rng([config.seed, 0])
        dense, ranks = model._features(calib, 200_000)
        heads = [min(k, config.signal_ids) for k in config.cardinalities]
        hit = sum(float(np.mean(ranks[:, c] <= h)) for c, h in enumerate(heads))
        sigma = config.categorical_std / np.sqrt(max(hit, 1e-12))
        wrng = np.random.default_rng([config.seed, 1])
        model.weights = [wrng.standard_normal(h) * sigma for h in heads]
        model.beta = wrng.standard_normal(len(DENSE)) * config.dense_std / np.sqrt(len(DENSE))
        logit = model.logit(dense, ranks)
        lo, hi = -20.0, 20.0
        for _ in range(60):  # bisection: the mean probability is increasing in the bias
            mid = (lo + hi) / 2
            if np.mean(_sigmoid(logit + mid)) < config.positive_rate:
                lo = mid
            else:
                hi = mid
        model.bias = (lo + hi) / 2
        return model

    def _features(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        g = rng.standard_normal((n, len(DENSE))) * _DENSE_LOG_STD + np.asarray(_DENSE_LOG_MEAN)
        dense = np.maximum(np.floor(np.expm1(g)), 0).astype(np.int64)
        ranks = np.stack([z.draw(rng, n) for z in self._zipf], axis=1)
        return dense, ranks

    def logit(self, dense: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """The planted logit without the bias, from counts and ranks."""
        z = (np.log1p(dense) - np.asarray(_DENSE_LOG_MEAN)) / _DENSE_LOG_STD
        out = z @ self.beta
        for c, w in enumerate(self.weights):
            r = ranks[:, c]
            head = r <= len(w)
            out[head] += w[r[head] - 1]
        return out

    def probability(self, dense: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        return _sigmoid(self.logit(dense, ranks) + self.bias)

    def ids(self, ranks: np.ndarray) -> np.ndarray:
        """Ranks as the ids written to the files."""
        if self.config.ids == "index":
            return ranks - 1
        salt = np.arange(1, len(CATEGORICAL) + 1, dtype=np.int64) * _HASH_SALT
        return _fmix32((ranks ^ salt[None, :]) & 0xFFFFFFFF)

    def sample(self, split: str, chunk: int, n: int) -> Sample:
        """``n`` examples of chunk ``chunk`` of a split, from its own random stream."""
        rng = np.random.default_rng([self.config.seed, 2 + ("train", "test").index(split), chunk])
        dense, ranks = self._features(rng, n)
        prob = self.probability(dense, ranks)
        label = (rng.random(n) < prob).astype(np.int64)
        return Sample(dense, ranks, self.ids(ranks), prob, label)

    def encode(self, s: Sample) -> tuple[bytes, np.ndarray]:
        """The examples serialized in the Criteo layout, by :func:`serialize_ctr`: ``(data,
        offsets)``."""
        hex_ids = self.config.categorical == "hex"
        return serialize_ctr(s.label, s.dense, s.ids, categorical=hex_strings if hex_ids else None)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(0.5 * (1.0 + np.tanh(0.5 * x)))


def write_synth_ctr(out_dir: str, config: SynthCTRConfig, *, log: Any = None) -> dict[str, Any]:
    """Writes the train and test splits and :data:`META_FILE` (the model's figures) to ``out_dir``.

    Args:
        out_dir: a directory (local or fsspec URL), created if missing.
        config: what to generate.
        log: a callable taking one line of progress (e.g. ``print``), or None.

    Returns:
        What :data:`META_FILE` holds: the config, cardinalities, positive rates, ``best_auc``
        (the planted model's AUC on the test split) and ``expected_best_auc``, files, seconds.
    """
    start = time.perf_counter()
    model = PlantedCTR.build(config)
    files: dict[str, list[str]] = {}
    summary: dict[str, Any] = {}
    test_prob: list[np.ndarray] = []
    test_label: list[np.ndarray] = []
    for split, total, shards in (
        ("train", config.train_examples, config.train_shards),
        ("test", config.test_examples, config.test_shards),
    ):
        names = [shard_name(split, i, shards, config.compression) for i in range(shards)]
        files[split] = names
        bounds = [total * i // shards for i in range(shards + 1)]
        positives = 0
        done = 0
        shard = 0
        writer = TFRecordWriter(fs.join(out_dir, names[0]), compression=config.compression)
        try:
            for chunk, lo in enumerate(range(0, total, _CHUNK)):
                s = model.sample(split, chunk, min(_CHUNK, total - lo))
                positives += int(s.label.sum())
                if split == "test":
                    test_prob.append(s.prob)
                    test_label.append(s.label)
                data, offsets = model.encode(s)
                view = memoryview(data)
                for i in range(len(s.label)):
                    while done >= bounds[shard + 1]:
                        writer.close()
                        shard += 1
                        path = fs.join(out_dir, names[shard])
                        writer = TFRecordWriter(path, compression=config.compression)
                    writer.write(view[offsets[i] : offsets[i + 1]])
                    done += 1
            while shard + 1 < shards:  # more shards than examples: empty files
                writer.close()
                shard += 1
                writer = TFRecordWriter(
                    fs.join(out_dir, names[shard]), compression=config.compression
                )
        finally:
            writer.close()
        summary[f"{split}_positive_rate"] = round(positives / total, 5)
        if log is not None:
            log(f"{split}: {total:,} examples in {shards} files, {positives / total:.2%} positive")
    prob = np.concatenate(test_prob)
    label = np.concatenate(test_label)
    result: dict[str, Any] = {
        "layout": {
            "label": "int64",
            "dense": {"names": list(DENSE), "dtype": "int64", "transform": "log1p"},
            "categorical": {
                "names": list(CATEGORICAL),
                "dtype": "int64" if config.categorical == "int64" else "bytes (8 hex digits)",
                "ids": config.ids,
            },
        },
        "config": asdict(config),
        "cardinalities": list(config.cardinalities),
        "bias": model.bias,
        **summary,
        "best_auc": round(auc(prob, label), 5) if 0 < label.sum() < len(label) else None,
        "expected_best_auc": round(expected_auc(prob), 5),
        "files": files,
        "seconds": round(time.perf_counter() - start, 2),
    }
    with fs.open_write(fs.join(out_dir, META_FILE)) as f:
        f.write((json.dumps(result, indent=2) + "\n").encode())
    return result
