"""Binary click metrics on host numpy: ROC AUC (ties averaged) and log loss, via scikit-learn."""

from __future__ import annotations

import numpy as np
from sklearn import metrics


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Probability a random positive scores above a random negative (ties count 1/2).

    Args:
      labels: [n] 0/1 (any shape; > 0.5 is a positive). scores: [n] real scores.
    """
    labels = np.asarray(labels).reshape(-1) > 0.5
    scores = np.asarray(scores, np.float64).reshape(-1)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUC needs both classes; got {n_pos} positives, {n_neg} negatives")
    return float(metrics.roc_auc_score(labels, scores))


def log_loss(labels: np.ndarray, probs: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of click probabilities ``probs`` [n] against 0/1 ``labels``.

    Probabilities are clipped to ``[eps, 1 - eps]`` first (scikit-learn alone clips at the
    float64 machine epsilon, ~2.2e-16, which lets one saturated f32 sigmoid dominate the mean).
    """
    y = np.asarray(labels, np.float64).reshape(-1)
    p = np.clip(np.asarray(probs, np.float64).reshape(-1), eps, 1 - eps)
    return float(metrics.log_loss(y, p, labels=[0.0, 1.0]))
