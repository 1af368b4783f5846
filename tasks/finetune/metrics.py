"""The figures fine-tuning reports: AUC and thresholded metrics for two classes, macro-F1, accuracy, the paired
bootstrap and the confusion matrix for K > 2; plain NumPy and scikit-learn, shared by the trainer and the baseline."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

BOOTSTRAP_CHUNK = 50  # resamples counted at once: memory is [chunk, n_test] per array, whatever the test size


def r6(v: float | None) -> float | None:
    """``v`` rounded to 6 places; None for None or nan (a metric with no rows)."""
    return round(v, 6) if v is not None and v == v else None


def auc(y: np.ndarray, p: np.ndarray) -> float:
    """ROC AUC of scores ``p`` against 0/1 labels ``y``; nan when ``y`` holds one class."""
    from sklearn.metrics import roc_auc_score  # noqa: PLC0415 - scikit-learn adds seconds to the CLI's start

    return float(roc_auc_score(y, p)) if len(np.unique(y)) == 2 else float("nan")


def binary_metrics(y: np.ndarray, prob: np.ndarray, threshold: float) -> dict[str, float]:
    """AUC, accuracy, precision, recall, F1 of ``prob >= threshold`` (sklearn, zero_division=0)."""
    from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score  # noqa: PLC0415 - as auc

    y = np.asarray(y).astype(np.int64)
    pred = (np.asarray(prob, np.float64) >= threshold).astype(np.int64)
    return {
        "auc": auc(y, prob),
        "accuracy": float(accuracy_score(y, pred)),
        "precision": float(precision_score(y, pred, zero_division=0)),
        "recall": float(recall_score(y, pred, zero_division=0)),
        "f1": float(f1_score(y, pred, zero_division=0)),
    }


def macro_f1(y: np.ndarray, pred: np.ndarray, k: int | None = None) -> float:
    """Macro-F1 over the classes present in ``y`` (a class absent from ``y`` has no F1 to average; sklearn,
    zero_division=0); nan without rows."""
    from sklearn.metrics import f1_score  # noqa: PLC0415 - as auc

    if len(y) == 0:
        return float("nan")
    return float(f1_score(y, pred, labels=np.unique(y), average="macro", zero_division=0))


def class_metrics(y: np.ndarray, prob: np.ndarray) -> dict[str, float | None]:
    """macro_f1 and accuracy of the arg-max of ``prob`` [N, K] against ``y`` [N]."""
    if len(y) == 0:
        return {"macro_f1": None, "accuracy": None}
    pred = np.asarray(prob).argmax(1)
    return {"macro_f1": macro_f1(y, pred), "accuracy": float((pred == y).mean())}


def paired_macro_f1_difference(y: np.ndarray, pred_a: np.ndarray, pred_b: np.ndarray, k: int,
                               resamples: int = 1000, seed: int = 0) -> dict[str, Any] | None:
    """macro-F1(a) - macro-F1(b) on the same rows (class predictions ``pred_a``, ``pred_b`` against ``y``), with a
    95 % paired-bootstrap interval (rows resampled together for both, ``resamples`` times from ``seed``; each
    resample's macro-F1 averages over the classes present in it, as :func:`macro_f1`) and the share of resamples in
    which a is not better: the K-class twin of :func:`tasks.finetune.baseline.paired_auc_difference`. None without
    rows. Counted with ``np.bincount``, :data:`BOOTSTRAP_CHUNK` resamples at a time."""
    y = np.asarray(y, np.int64)
    if len(y) == 0:
        return None
    n = len(y)
    pred_a, pred_b = np.asarray(pred_a, np.int64), np.asarray(pred_b, np.int64)
    rng = np.random.default_rng(seed)
    d = np.concatenate([_f1_difference(rng.integers(0, n, (r, n)), y, pred_a, pred_b, k)  # [r, n] rows each
                        for r in np.diff(np.r_[0:resamples:BOOTSTRAP_CHUNK, resamples])])
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {"diff": r6(macro_f1(y, np.asarray(pred_a)) - macro_f1(y, np.asarray(pred_b))),
            "ci95": [r6(lo), r6(hi)], "p_not_better": r6(float((d <= 0).mean())), "resamples": resamples,
            "seed": seed}


def _f1_difference(rows: np.ndarray, y: np.ndarray, pred_a: np.ndarray, pred_b: np.ndarray, k: int) -> np.ndarray:
    """macro-F1(a) - macro-F1(b) for each resample (``rows`` [R, n] row indices), from per-class counts."""
    r = len(rows)
    base = np.arange(r)[:, None] * k  # [R, 1]
    yy = y[rows]
    true = np.bincount((base + yy).ravel(), minlength=r * k).reshape(r, k)
    present = true > 0

    def f1s(pred: np.ndarray) -> np.ndarray:  # [R] macro-F1 over the classes present in each resample
        pp = pred[rows]
        predicted = np.bincount((base + pp).ravel(), minlength=r * k).reshape(r, k)
        tp = np.bincount((base + yy).ravel(), weights=(pp == yy).ravel(), minlength=r * k).reshape(r, k)
        denom = predicted + true
        f1 = np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
        return (f1 * present).sum(1) / present.sum(1)

    return f1s(pred_a) - f1s(pred_b)


def confusion(y: np.ndarray, pred: np.ndarray, k: int) -> list[list[int]]:
    """counts [K, K]: row = true class, column = predicted class."""
    m = np.zeros((k, k), np.int64)
    np.add.at(m, (np.asarray(y, np.int64), np.asarray(pred, np.int64)), 1)
    return m.tolist()


def softmax_np(z: np.ndarray) -> np.ndarray:
    """float32 [N, K] probabilities of logits [N, K] (training-time metrics only; labelling uses
    :func:`models.rowwise.softmax_rows`)."""
    return torch.softmax(torch.from_numpy(np.ascontiguousarray(z, np.float32)), dim=-1).numpy()
