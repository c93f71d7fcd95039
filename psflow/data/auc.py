"""ROC AUC: of scores against labels (:func:`auc`), and expected over drawn labels
(:func:`expected_auc`, the best AUC a model can expect where the click probabilities are known).
"""

from __future__ import annotations

import numpy as np


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC (Mann-Whitney, ties counted half), as sklearn's ``roc_auc_score``."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1).astype(bool)
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        raise ValueError(f"AUC needs both classes, got {pos} positives and {neg} negatives")
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    first = np.r_[True, s[1:] != s[:-1]]
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    sizes = np.diff(np.r_[starts, len(s)])
    avg_rank = starts + (sizes + 1) / 2.0  # 1-based average rank of each tie group
    rank_sum = avg_rank[group][labels[order]].sum()
    return float((rank_sum - pos * (pos + 1) / 2.0) / (pos * neg))


def expected_auc(prob: np.ndarray) -> float:
    """The AUC of the scores ``prob`` expected over labels drawn as ``Bernoulli(prob)``.

    The ratio of expectations ``sum_{i != j} p_i (1 - p_j) [p_i > p_j] (+1/2 for ties) /
    sum_{i != j} p_i (1 - p_j)``, exact in O(n log n): the best AUC a model can expect on these
    features, whatever labels fell.
    """
    p = np.sort(np.asarray(prob, dtype=np.float64).reshape(-1))
    first = np.r_[True, p[1:] != p[:-1]]
    group = np.cumsum(first) - 1
    gp = np.bincount(group, weights=p)
    gq = np.bincount(group, weights=1 - p)
    gself = np.bincount(group, weights=p * (1 - p))
    below_q = np.r_[0.0, np.cumsum(gq)[:-1]]
    num = float((gp * below_q).sum() + 0.5 * (gp * gq - gself).sum())
    den = float(p.sum() * (1 - p).sum() - (p * (1 - p)).sum())
    return num / den
