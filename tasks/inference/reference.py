"""What a bundle's classifier saw on rows that chose nothing, for monitoring what it labels later (``reference.json``).

The bundle stage (:func:`tasks.bundle.bundle.reference_of`) re-reads the fine-tuning TEST rows (the finetune
manifest records the files, their fingerprints and the split), leaves out those whose normalised text repeats a
training text, and records from the rest (rows that picked no epoch, learning rate, early stop, threshold or stack):

* the distribution of each **input descriptor** of the texts and of the classifier's **score**
  (:data:`FEATURES`): quantile bin edges (fine: percentiles, for a Kolmogorov-Smirnov distance; coarse: deciles,
  for the population stability index) with the counts in each bin, and the predicted-label counts;
* a **probability calibration** of the shipped classifier's probabilities, cross-fitted: each candidate
  (the probabilities as they are; two classes: isotonic and Platt scaling of the logit; K > 2 classes: Platt
  scaling per class, one-vs-rest, renormalised) is fitted on four folds and scored on the fifth (Brier score), the
  best is refitted on every row and shipped; its out-of-fold estimate of the accuracy and F1 (the estimator of
  :class:`ConfusionSums`: the in-domain validation, on held-out folds) is recorded beside the true figures, and
  the alert floor starts from the true figure.

A profile whose test split has too few such rows gets the DEV rows instead, as bundles before bundle-8 did, and the
reference says so (``split``, ``split_note``): the stacker (``combine: stack``) was fitted on dev, so for a
two-class stack that calibration is fitted on out-of-fold stacked probabilities (the stack refitted on four folds,
applied to the fifth). The probabilities are the finetune stage's own (``{split}_predictions.parquet``). No torch
runs here: a bundle's reference is a function of its parents' files.

:class:`ConfusionSums` is the performance estimator (CBPE: the expected confusion matrix from calibrated
probabilities) shared with the label runs' monitoring (:mod:`tasks.label.monitor`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.common.text import has_cjk

REFERENCE_FILE = "reference.json"
SCHEMA = "lexiflow.reference/1"
# input descriptors of a scored text, then the classifier's score (two classes: the probability; K > 2: the top
# class's probability)
INPUT_FEATURES = ("length", "unk_rate", "no_cjk", "lexicon_per_char", "num_rate")
FEATURES = (*INPUT_FEATURES, "score")
FEATURE_DOC = {
    "length": "tokens in the normalised text before truncation (a number is one #NUM# token)",
    "unk_rate": "share of the text's tokens that are [UNK] (not in the vocabulary)",
    "no_cjk": "1 when the text holds no CJK ideograph (English, emoji), else 0",
    "lexicon_per_char": "lexicon words matched per token (the adapter's input)",
    "num_rate": "share of the text's tokens that are #NUM#",
    "score": "the classifier's probability (K > 2 classes: the top class's)",
}
FINE = np.round(np.arange(1, 100) / 100, 2)  # percentiles: the KS grid
COARSE = np.round(np.arange(1, 10) / 10, 1)  # deciles: the PSI bins (a subset of the percentiles' values)
MARGINS = (0.01, 0.02, 0.05, 0.1, 0.2)  # the dev share within each margin of the decision is recorded
FOLDS = 5
SIG = 9  # significant digits of a stored calibration parameter (JSON reproduces it exactly)


def _r(v: float, sig: int = SIG) -> float:
    return float(f"{float(v):.{sig}g}")


# ============================================================================= descriptors


def describe(texts: Sequence[str], encs: Sequence[Any], full_lengths: Sequence[int], ids: Any) -> np.ndarray:
    """float64 [N, len(INPUT_FEATURES)]: each text's input descriptors from its encoding (``ids``: the vocabulary's
    special-token ids, :class:`tasks.text.vocab.TokenIds`). A text encoded to nothing ([CLS][SEP]) gets zeros."""
    out = np.zeros((len(texts), len(INPUT_FEATURES)), np.float64)
    for i, (t, e, full) in enumerate(zip(texts, encs, full_lengths)):
        tok = e.input_ids[1:-1]
        n = len(tok)
        out[i, 0] = full
        out[i, 2] = 0.0 if has_cjk(t) else 1.0
        if n:
            out[i, 1] = np.count_nonzero(tok == ids.unk) / n
            out[i, 3] = np.count_nonzero(e.word_ids[1:-1]) / n
            out[i, 4] = np.count_nonzero(tok == ids.num) / n
    return out


def class_probs(outputs: Any) -> np.ndarray:
    """float64 [N, K]: two classes' probability ``p`` (float32 [N]) as ``[1 - p, p]``; K > 2 as given."""
    p = np.asarray(outputs, np.float64)
    if p.ndim == 1:
        return np.stack([1.0 - p, p], 1)
    return p.reshape(len(p), -1)


def decisions(outputs: Any, threshold: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(predicted class index int64 [N], score float64 [N], distance to the decision float64 [N]) as the part
    files label: two classes ``prob >= threshold`` (the stored float32 value, compared in float64), distance
    ``|prob - threshold|``; K > 2 the arg-max (ties to the first), distance top-1 minus top-2 probability."""
    p = np.asarray(outputs)
    if p.ndim == 1:
        p64 = p.astype(np.float32).astype(np.float64)
        pred = (p64 >= float(threshold)).astype(np.int64)
        return pred, p64, np.abs(p64 - float(threshold))
    p64 = p.astype(np.float32).astype(np.float64).reshape(len(p), -1)
    if not len(p64):
        z = np.zeros(0)
        return z.astype(np.int64), z, z
    pred = p64.argmax(1)
    top2 = np.sort(p64, 1)[:, -2:]
    return pred, top2[:, 1], top2[:, 1] - top2[:, 0]


# ============================================================================= bins


def edges(values: np.ndarray, qs: np.ndarray) -> list[float]:
    """Unique observed values at the quantiles ``qs`` (bins: (-inf, e0], (e0, e1], ..., (e_last, inf))."""
    if not len(values):
        return []
    return [float(v) for v in np.unique(np.quantile(values, qs, method="inverted_cdf"))]


def bin_counts(values: np.ndarray, grid: Sequence[float]) -> np.ndarray:
    """int64 [len(grid) + 1]: how many ``values`` fall in each bin of ``grid`` (right-closed)."""
    idx = np.searchsorted(np.asarray(grid, np.float64), np.asarray(values, np.float64), side="left")
    return np.bincount(idx, minlength=len(grid) + 1).astype(np.int64)


def coarse_counts(fine_counts: Sequence[int], fine: Sequence[float], coarse: Sequence[float]) -> np.ndarray:
    """Counts on the ``coarse`` grid from counts on the ``fine`` grid (every coarse edge is a fine edge)."""
    f = np.asarray(fine, np.float64)
    upper = np.append(f, np.inf)  # each fine bin's upper edge
    idx = np.searchsorted(np.asarray(coarse, np.float64), upper, side="left")
    return np.bincount(idx, weights=np.asarray(fine_counts, np.float64), minlength=len(coarse) + 1).astype(np.int64)


# ============================================================================= calibration


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, np.float64), 1e-7, 1 - 1e-7)
    return np.log(p) - np.log1p(-p)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, np.float64)))


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(1, keepdims=True)


def _pava(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Pool-adjacent-violators: the non-decreasing fit of ``y`` (weights ``w``), one value per input."""
    vals, wts, sizes = [], [], []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        wts.append(wi)
        sizes.append(1)
        while len(vals) > 1 and vals[-2] >= vals[-1]:
            v2, w2, s2 = vals.pop(), wts.pop(), sizes.pop()
            wsum = wts[-1] + w2
            vals[-1] = (vals[-1] * wts[-1] + v2 * w2) / wsum
            wts[-1], sizes[-1] = wsum, sizes[-1] + s2
    return np.repeat(np.asarray(vals, np.float64), sizes)


@dataclass(frozen=True)
class Calibration:
    """A fitted map from the shipped probabilities to calibrated class probabilities.

    ``isotonic``: ``x``/``y`` breakpoints (linear between them, flat outside) on the positive class's probability;
    ``platt``: ``sigmoid(a * logit(p) + b)``; ``ovr_platt`` (K > 2): per class ``sigmoid(a_k * logit(p_k) + b_k)``,
    renormalised; ``temperature`` (bundles before bundle-8): ``softmax(log(p) / t)`` over K classes;
    ``identity``: as shipped (the best out of fold, or too few dev rows to fit on)."""

    method: str
    params: dict[str, Any]

    def apply(self, outputs: Any) -> np.ndarray:
        """float64 [N, K] calibrated class probabilities of the shipped ``outputs`` ([N] or [N, K])."""
        p = np.asarray(outputs, np.float64)
        if self.method == "isotonic":
            q = np.interp(p, self.params["x"], self.params["y"])
            return np.stack([1.0 - q, q], 1)
        if self.method == "platt":
            q = _sigmoid(self.params["a"] * _logit(p) + self.params["b"])
            return np.stack([1.0 - q, q], 1)
        if self.method == "temperature":  # bundles built before bundle-8
            return _softmax(np.log(np.clip(p, 1e-12, 1.0)) / self.params["t"])
        if self.method == "ovr_platt":
            q = _sigmoid(np.asarray(self.params["a"]) * _logit(p.reshape(len(p), -1)) + np.asarray(self.params["b"]))
            return q / q.sum(1, keepdims=True)
        return class_probs(p)

    def to_dict(self) -> dict[str, Any]:
        """The calibration as ``reference.json`` holds it."""
        return {"method": self.method, **self.params}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """The calibration :meth:`to_dict` wrote."""
        return cls(d["method"], {k: v for k, v in d.items() if k not in ("method", "candidates", "out_of_fold",
                                                                         "folds")})


def fit_isotonic(p: np.ndarray, y: np.ndarray) -> Calibration:
    """Isotonic regression of the 0/1 ``y`` on the probability ``p`` (ties pooled), kept away from exact 0 and 1
    (``1 / (n + 2)``: a few dev rows cannot say a class is certain)."""
    p = np.asarray(p, np.float64)
    xs, inv = np.unique(p, return_inverse=True)
    w = np.bincount(inv, minlength=len(xs)).astype(np.float64)
    ys = np.bincount(inv, weights=np.asarray(y, np.float64), minlength=len(xs)) / w
    fit = _pava(ys, w)
    eps = 1.0 / (len(p) + 2)
    fit = np.clip(fit, eps, 1 - eps)
    keep = np.ones(len(xs), bool)  # a flat run only needs its two ends
    keep[1:-1] = ~((fit[1:-1] == fit[:-2]) & (fit[1:-1] == fit[2:]))
    return Calibration("isotonic", {"x": [_r(v) for v in xs[keep]], "y": [_r(v) for v in fit[keep]]})


def fit_platt(p: np.ndarray, y: np.ndarray, ridge: float = 1e-6) -> Calibration:
    """Logistic regression of ``y`` on ``logit(p)`` (Newton's method, a tiny ridge for separable dev rows)."""
    x = _logit(p)
    y = np.asarray(y, np.float64)
    a, b = 1.0, 0.0
    for _ in range(50):
        q = _sigmoid(a * x + b)
        w = q * (1 - q)
        g = np.array([np.sum((q - y) * x) + ridge * a, np.sum(q - y)])
        h = np.array([[np.sum(w * x * x) + ridge, np.sum(w * x)], [np.sum(w * x), np.sum(w) + ridge]])
        step = np.linalg.solve(h + 1e-12 * np.eye(2), g)
        a, b = a - step[0], b - step[1]
        if abs(step).max() < 1e-10:
            break
    return Calibration("platt", {"a": _r(a), "b": _r(b)})


def fit_temperature(p: np.ndarray, y: np.ndarray) -> Calibration:
    """The temperature ``t`` minimising the log loss of ``softmax(log(p) / t)`` (golden-section on log t)."""
    z = np.log(np.clip(np.asarray(p, np.float64), 1e-12, 1.0))
    y = np.asarray(y, np.int64)

    def nll(log_t: float) -> float:
        q = _softmax(z / math.exp(log_t))
        return float(-np.mean(np.log(np.clip(q[np.arange(len(y)), y], 1e-12, 1.0))))

    lo, hi = math.log(0.05), math.log(20.0)
    g = (math.sqrt(5) - 1) / 2
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    fc, fd = nll(c), nll(d)
    for _ in range(80):
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - g * (hi - lo)
            fc = nll(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + g * (hi - lo)
            fd = nll(d)
    return Calibration("temperature", {"t": _r(math.exp((lo + hi) / 2))})


def fit_ovr_platt(p: np.ndarray, y: np.ndarray) -> Calibration:
    """K > 2 classes, one-vs-rest: per class ``k`` a Platt scaling of ``logit(p[:, k])`` against ``y == k``; the
    K calibrated probabilities are renormalised to sum to 1. Each class gets its own slope and offset (one
    temperature cannot fix a model over-sure of one class and under-sure of another)."""
    p = np.asarray(p, np.float64)
    y = np.asarray(y, np.int64)
    fits = [fit_platt(p[:, k], (y == k).astype(np.float64)) for k in range(p.shape[1])]
    return Calibration("ovr_platt", {"a": [f.params["a"] for f in fits], "b": [f.params["b"] for f in fits]})


FITTERS = {"isotonic": fit_isotonic, "platt": fit_platt, "temperature": fit_temperature,
           "ovr_platt": fit_ovr_platt, "identity": lambda p, y: Calibration("identity", {})}


def log_loss(q: np.ndarray, y: np.ndarray) -> float:
    """Mean negative log-likelihood of the true class under ``q`` ([N, K])."""
    return float(-np.mean(np.log(np.clip(q[np.arange(len(y)), np.asarray(y, np.int64)], 1e-12, 1.0))))


def brier(q: np.ndarray, y: np.ndarray) -> float:
    """The Brier score: mean squared distance of ``q`` ([N, K]) from the one-hot true class (K = 2: twice the
    usual binary score). Proper and bounded: a few rows near 0 or 1 do not decide it, as they can the log loss."""
    onehot = np.eye(q.shape[1])[np.asarray(y, np.int64)]
    return float(np.mean(np.sum((q - onehot) ** 2, 1)))


def out_of_fold(method: str, p: np.ndarray, y: np.ndarray, folds: int = FOLDS) -> np.ndarray:
    """float64 [N, K]: each dev row's calibrated probabilities from ``method`` fitted on the other folds (row i is in
    fold ``i % folds``)."""
    fold = np.arange(len(y)) % folds
    out = np.zeros((len(y), 2 if np.asarray(p).ndim == 1 else np.asarray(p).shape[1]))
    for f in range(folds):
        rest, held = fold != f, fold == f
        if held.any():
            out[held] = FITTERS[method](p[rest], y[rest]).apply(p[held])
    return out


def ece(q: np.ndarray, pred: np.ndarray, y: np.ndarray, bins: int = 10) -> float:
    """Expected calibration error of the confidence in the predicted class (equal-width bins)."""
    conf = q[np.arange(len(pred)), pred]
    correct = (pred == np.asarray(y, np.int64)).astype(np.float64)
    idx = np.minimum((conf * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        m = idx == b
        if m.any():
            total += abs(correct[m].mean() - conf[m].mean()) * m.sum()
    return total / max(len(pred), 1)


# ============================================================================= the estimator (CBPE)


class ConfusionSums:
    """The expected confusion matrix of labelled rows from their calibrated class probabilities, as sums that add
    over shards: per predicted class ``j``, ``n[j]`` rows, ``s[j]`` the sum of their probability vectors (row ``j``
    of the expected confusion matrix) and ``m[j]`` the sum of their outer products (for the variance: each row's
    true class is one draw from its calibrated probabilities, rows independent)."""

    def __init__(self, k: int):
        self.k = k
        self.n = np.zeros(k, np.int64)
        self.s = np.zeros((k, k), np.float64)
        self.m = np.zeros((k, k, k), np.float64)

    def add(self, q: np.ndarray, pred: np.ndarray) -> None:
        """Add rows with calibrated probabilities ``q`` [N, K] predicted as ``pred`` [N]."""
        for j in range(self.k):
            rows = q[pred == j]
            if len(rows):
                self.n[j] += len(rows)
                self.s[j] += rows.sum(0)
                self.m[j] += np.einsum("ni,nj->ij", rows, rows)  # no BLAS: the same sum on any CPU

    def merge(self, other: ConfusionSums) -> None:
        """Add another shard's sums."""
        self.n += other.n
        self.s += other.s
        self.m += other.m

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (floats exactly as computed: JSON round-trips them)."""
        return {"k": self.k, "n": self.n.tolist(), "s": self.s.tolist(), "m": self.m.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConfusionSums:
        """The sums :meth:`to_dict` wrote."""
        out = cls(int(d["k"]))
        out.n = np.asarray(d["n"], np.int64).reshape(out.k)
        out.s = np.asarray(d["s"], np.float64).reshape(out.k, out.k)
        out.m = np.asarray(d["m"], np.float64).reshape(out.k, out.k, out.k)
        return out

    def _covariances(self) -> np.ndarray:
        """[K, K, K]: the covariance of row ``j`` of the confusion matrix, per predicted class ``j``."""
        return np.stack([np.diag(self.s[j]) - self.m[j] for j in range(self.k)])

    def estimate(self, z: float = 1.96) -> dict[str, Any]:
        """Estimated accuracy and F1 (two classes: the positive class's F1; K > 2: macro-F1), each with a normal
        interval ``± z`` standard deviations (delta method over the confusion matrix's cells)."""
        n = int(self.n.sum())
        if n == 0:
            return {"rows": 0, "accuracy": None, "accuracy_sd": None, "f1": None, "f1_sd": None}
        cov = self._covariances()
        acc = float(np.trace(self.s) / n)
        acc_var = float(sum(cov[j, j, j] for j in range(self.k))) / n / n
        f1, grad = self._f1_and_grad()
        f1_var = float(sum(grad[j] @ cov[j] @ grad[j] for j in range(self.k)))
        return {"rows": n, "accuracy": acc, "accuracy_sd": math.sqrt(max(acc_var, 0.0)),
                "f1": f1, "f1_sd": math.sqrt(max(f1_var, 0.0)), "z": z}

    def _f1_and_grad(self) -> tuple[float, np.ndarray]:
        """F1 (K = 2: class 1's; K > 2: the mean over classes) of the expected confusion matrix, and its gradient
        with respect to the cells ([K, K]: row = predicted class, column = true class)."""
        c = self.s  # [pred, true]
        predicted = self.n.astype(np.float64)  # row sums (fixed)
        actual = c.sum(0)  # column sums: expected rows of each true class
        classes = [1] if self.k == 2 else list(range(self.k))
        grad = np.zeros((self.k, self.k))
        total = 0.0
        for cls in classes:
            den = predicted[cls] + actual[cls]
            if den <= 0:
                continue
            f = 2 * c[cls, cls] / den
            total += f
            grad[:, cls] -= 2 * c[cls, cls] / den**2  # every cell of the true class's column adds to `actual`
            grad[cls, cls] += 2 / den
        return total / len(classes), grad / len(classes)


def confusion_of(q: np.ndarray, pred: np.ndarray) -> ConfusionSums:
    """:class:`ConfusionSums` of rows with calibrated probabilities ``q`` [N, K] and predictions ``pred``."""
    sums = ConfusionSums(q.shape[1])
    sums.add(q, pred)
    return sums


def true_metrics(pred: np.ndarray, y: np.ndarray, k: int) -> dict[str, float]:
    """The actual accuracy and F1 (two classes: class 1's; K > 2: macro) of ``pred`` against ``y``."""
    pred, y = np.asarray(pred, np.int64), np.asarray(y, np.int64)
    acc = float((pred == y).mean()) if len(y) else float("nan")
    f1s = []
    for cls in [1] if k == 2 else range(k):
        tp = float(((pred == cls) & (y == cls)).sum())
        den = float((pred == cls).sum() + (y == cls).sum())
        f1s.append(2 * tp / den if den else 0.0)
    return {"accuracy": acc, "f1": float(np.mean(f1s))}


NULL_CHUNKS = (50, 200, 1000)  # rows per bootstrapped chunk of the reference, for its own chunk-to-chunk variability
NULL_DRAWS = 40


def population_stability(actual: np.ndarray, expected: np.ndarray) -> float:
    """PSI = sum (a - e) ln(a / e) over bins, each share smoothed by half a row (no empty bin is infinite)."""
    b = len(actual)
    a = (np.asarray(actual, np.float64) + 0.5) / (np.sum(actual) + 0.5 * b)
    e = (np.asarray(expected, np.float64) + 0.5) / (np.sum(expected) + 0.5 * b)
    return float(np.sum((a - e) * np.log(a / e)))


def null_psi(values: np.ndarray, coarse: Sequence[float], seed: int = 0) -> dict[str, float]:
    """The reference's own chunk-to-chunk variability of one feature: for chunks of :data:`NULL_CHUNKS` rows (at
    most half the rows) drawn with replacement :data:`NULL_DRAWS` times, the largest PSI of a chunk against the
    whole (what a night of that size shows with no shift at all)."""
    rng = np.random.default_rng(seed)
    whole = bin_counts(values, coarse)
    out = {}
    for size in NULL_CHUNKS:
        if size * 2 > len(values):
            break
        psi = [population_stability(bin_counts(values[rng.integers(0, len(values), size)], coarse), whole)
               for _ in range(NULL_DRAWS)]
        out[str(size)] = round(float(np.max(psi)), 6)
    return out


# ============================================================================= content: character frequencies

TOP_CHARS = 2000  # the reference's most frequent characters; every other character counts in one last bucket


def char_index(chars: Sequence[str]) -> dict[str, int]:
    """{character: bucket} for a reference's character list (any other character: bucket ``len(chars)``)."""
    return {c: i for i, c in enumerate(chars)}


def char_counts(texts: Sequence[str], index: dict[str, int]) -> np.ndarray:
    """int64 [len(index) + 1]: how often each reference character (then any other) occurs in ``texts``
    (whitespace not counted). Counts add over shards."""
    other = len(index)
    idx = [index.get(c, other) for t in texts for c in t if not c.isspace()]
    return np.bincount(np.asarray(idx, np.int64), minlength=other + 1).astype(np.int64)


def jensen_shannon(p: Any, q: Any) -> float:
    """The Jensen-Shannon divergence (base 2, in [0, 1]) between two count vectors (each normalised)."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    if p.sum() <= 0 or q.sum() <= 0:
        return float("nan")
    p, q = p / p.sum(), q / q.sum()
    m = 0.5 * (p + q)

    def kl(a: np.ndarray) -> float:
        nz = a > 0
        return float(np.sum(a[nz] * np.log2(a[nz] / m[nz])))

    return max(0.0, 0.5 * kl(p) + 0.5 * kl(q))


def chunk_noise(per_text: Sequence[np.ndarray], total: np.ndarray, seed: int = 0) -> dict[str, float | None]:
    """A count sketch's own chunk-to-chunk variability: for chunks of :data:`NULL_CHUNKS` rows (at most half the
    rows) drawn with replacement :data:`NULL_DRAWS` times, the largest Jensen-Shannon divergence of a chunk from
    the whole ``total`` (``per_text``: each row's counts); None where every chunk drawn was empty."""
    rng = np.random.default_rng(seed)
    null: dict[str, float | None] = {}
    for size in NULL_CHUNKS:
        if size * 2 > len(per_text):
            break
        js = [jensen_shannon(np.sum([per_text[i] for i in rng.integers(0, len(per_text), size)], 0), total)
              for _ in range(NULL_DRAWS)]
        null[str(size)] = None if np.all(np.isnan(js)) else round(float(np.nanmax(js)), 6)
    return null


def content_reference(texts: Sequence[str], seed: int = 0) -> dict[str, Any]:
    """The reference's character sketch: its :data:`TOP_CHARS` most frequent characters (ties by code point), their
    counts and the rest's, and its own variability: for chunks of :data:`NULL_CHUNKS` rows (at most half the rows)
    drawn with replacement :data:`NULL_DRAWS` times, the largest Jensen-Shannon divergence of a chunk from the whole
    (what a night of that size shows with no shift at all)."""
    from collections import Counter  # noqa: PLC0415 - only when a bundle is built

    freq = Counter(c for t in texts for c in t if not c.isspace())
    chars = [c for c, _ in sorted(freq.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_CHARS]]
    index = char_index(chars)
    per_text = [char_counts([t], index) for t in texts]
    total = np.sum(per_text, 0) if per_text else np.zeros(len(chars) + 1, np.int64)
    null = chunk_noise(per_text, total, seed)
    # each text's surprise under the others' character frequencies (leave-one-out: a text does not vouch for itself)
    buckets, mass = len(chars) + 1, float(total.sum())
    own = np.asarray(per_text, np.float64).reshape(len(texts), buckets)
    lens = own.sum(1)
    loo = np.log2((total[None, :] - own + 0.5) / (mass - lens[:, None] + 0.5 * buckets))
    surprise = -(own * loo).sum(1)[lens > 0] / lens[lens > 0]
    fine = [_r(v) for v in edges(surprise, FINE)]
    return {"chars": chars, "counts": total.tolist(), "null_js": null, "rows": len(texts),
            "surprise": {"fine": fine, "counts": bin_counts(surprise, fine).tolist()}}


# ============================================================================= content: lexicon words

TOP_WORDS = 1000  # the reference's most frequent lexicon words; every other matched word counts in one last bucket


def word_lut(ids: Sequence[int]) -> np.ndarray:
    """int64 [max(ids) + 2]: word id -> bucket, the reference's words in order (ids past the table, and those not
    among ``ids``: bucket ``len(ids)``)."""
    lut = np.full(max(ids, default=0) + 2, len(ids), np.int64)
    lut[np.asarray(ids, np.int64)] = np.arange(len(ids), dtype=np.int64)
    return lut


def word_counts(encs: Sequence[Any], lut: np.ndarray) -> np.ndarray:
    """int64 [lut buckets]: how often each reference word (then any other) is kept on a character of the encoded
    texts ``encs`` (a word counts once per character it is kept on, as the model sees it). Counts add over
    shards."""
    other = int(lut[-1])
    slots = [e.word_ids[1:-1].ravel() for e in encs]
    ids = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    ids = ids[ids > 0]
    buckets = lut[np.minimum(ids, len(lut) - 1)]
    return np.bincount(buckets, minlength=other + 1).astype(np.int64)


def words_reference(encs: Sequence[Any], seed: int = 0) -> dict[str, Any]:
    """The reference's lexicon-word sketch: the ids of its :data:`TOP_WORDS` most frequent words (ties by id),
    their counts and the rest's, and its own chunk-to-chunk variability (as :func:`content_reference`). The word
    strings are added by :func:`name_words` (the featurizer holds ids only)."""
    all_ids = [e.word_ids[1:-1].ravel() for e in encs]
    flat = np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64)
    freq = np.bincount(flat[flat > 0]) if np.any(flat > 0) else np.zeros(0, np.int64)
    order = np.lexsort((np.arange(len(freq)), -freq))  # most frequent first, ties by id
    ids = [int(i) for i in order[: TOP_WORDS] if freq[i] > 0]
    lut = word_lut(ids)
    per_text = [word_counts([e], lut) for e in encs]
    total = np.sum(per_text, 0) if per_text else np.zeros(len(ids) + 1, np.int64)
    return {"ids": ids, "words": None, "counts": total.tolist(), "null_js": chunk_noise(per_text, total, seed)}


def name_words(ref: dict[str, Any], vocabulary: Sequence[str]) -> dict[str, Any]:
    """``ref`` with its word sketch's strings filled in from the word ``vocabulary`` (line i = word id i: the
    bundle's ``words.txt``)."""
    words = (ref.get("content") or {}).get("words")
    if words is not None:
        words["words"] = [vocabulary[i] if 0 <= i < len(vocabulary) else f"#{i}" for i in words["ids"]]
    return ref


def text_surprise(texts: Sequence[str], index: dict[str, int], counts: Sequence[int]) -> np.ndarray:
    """float64 [N]: each text's mean surprise (bits per character) under the reference's character frequencies
    ``counts`` (half a count of smoothing); texts with no character are left out."""
    total = np.asarray(counts, np.float64)
    logp = np.log2((total + 0.5) / (total.sum() + 0.5 * len(total)))
    out = []
    for t in texts:
        c = char_counts([t], index)
        if c.sum():
            out.append(-float(c @ logp) / float(c.sum()))
    return np.asarray(out, np.float64)


def binned_auc(run: Sequence[float], reference: Sequence[float]) -> float | None:
    """P(a run row scores above a reference row) from two histograms on one grid (ties in a bin count half): the
    Mann-Whitney AUC of the binned scores; 0.5 when the two are alike. None when either side is empty."""
    a, r = np.asarray(run, np.float64), np.asarray(reference, np.float64)
    if a.sum() <= 0 or r.sum() <= 0:
        return None
    below = np.concatenate([[0.0], np.cumsum(r)[:-1]])
    return float(np.sum(a * (below + 0.5 * r)) / (a.sum() * r.sum()))


# ============================================================================= the reference


def build_reference(texts: Sequence[str], labels: np.ndarray, outputs: np.ndarray, featurizer: Any,
                    threshold: float | None, classes: Sequence[str] | None,
                    calibration_outputs: np.ndarray | None = None, calibration_note: str | None = None,
                    split: str = "dev", split_note: str | None = None) -> dict[str, Any]:
    """``reference.json`` from the reference ``texts`` (the ``split`` they come from: ``test`` for bundles since
    bundle-8, with ``split_note`` saying which rows), their true ``labels`` (class indices) and the shipped
    classifier's ``outputs`` on them ([N] probabilities, or [N, K]); ``calibration_outputs``: what the calibration is
    fitted on instead (out-of-fold stacked probabilities), with a note saying so. Rows that encode to nothing
    ([CLS][SEP]: labelling rejects them) are left out."""
    lengths: list[int] = []
    encs = featurizer.encode(list(texts), lengths)
    keep = np.array([len(e.input_ids) > 2 for e in encs], bool)
    texts = [t for t, k in zip(texts, keep) if k]
    desc = describe(texts, [e for e, k in zip(encs, keep) if k], [n for n, k in zip(lengths, keep) if k],
                    featurizer.ids)
    outputs = np.asarray(outputs)[keep]
    fit_on = outputs if calibration_outputs is None else np.asarray(calibration_outputs)[keep]
    y = np.asarray(labels, np.int64)[keep]
    pred, score, gap = decisions(outputs, threshold)
    values = {**{f: desc[:, i] for i, f in enumerate(INPUT_FEATURES)}, "score": score}
    features = {}
    for name in FEATURES:
        fine = edges(values[name], FINE)
        coarse = [_r(v) for v in edges(values[name], COARSE)]
        features[name] = {"fine": [_r(v) for v in fine], "coarse": coarse,
                          "counts": bin_counts(values[name], [_r(v) for v in fine]).tolist(),
                          "null_psi": null_psi(values[name], coarse)}
    k = 2 if outputs.ndim == 1 else outputs.shape[1]
    calibration = calibrate(fit_on, y, pred, k)
    return {
        "schema": SCHEMA,
        "split": split,
        "split_note": split_note,
        "rows": int(keep.size),
        "rows_used": int(keep.sum()),
        "classes": list(classes) if classes is not None else None,
        "num_classes": k,
        "threshold": threshold,
        "features": features,
        "labels": np.bincount(pred, minlength=k).tolist(),
        "content": {**content_reference(texts), "words": words_reference([e for e, k in zip(encs, keep) if k])},
        "margins": {str(m): round(float((gap <= m).mean()), 6) if len(gap) else None for m in MARGINS},
        "calibration": {**calibration,
                        "fitted_on": calibration_note or f"the shipped classifier's {split} probabilities"},
        "shift": shift_cells(values, features, pred, y, calibration, fit_on),
    }


SHIFT_FEATURES = ("score", "length", "no_cjk")  # the cells of the shift correction: score and length deciles
# crossed with the text's script (CJK or not: 10 x 10 x 2); bundle-8 references built before the script was added
# hold the first two only, and are read as they are


def cell_count(features: dict[str, Any], names: Sequence[str] = SHIFT_FEATURES) -> int:
    """The number of shift cells over the feature ``names`` (the score and length deciles, times 2 for the script)."""
    n = (len(features["score"]["coarse"]) + 1) * (len(features["length"]["coarse"]) + 1)
    return n * 2 if "no_cjk" in names else n


def cell_index(score: np.ndarray, length: np.ndarray, features: dict[str, Any],
               no_cjk: np.ndarray | None = None) -> np.ndarray:
    """int64 [N]: each row's cell, its score decile crossed with its length decile (the reference's coarse grids;
    bins right-closed as :func:`bin_counts`), then, given ``no_cjk`` (the descriptor: 1 for a text with no CJK
    ideograph), crossed with the script, so that texts in another script fall in cells of their own."""
    s_grid, l_grid = (np.asarray(features[f]["coarse"], np.float64) for f in SHIFT_FEATURES[:2])
    s = np.searchsorted(s_grid, np.asarray(score, np.float64), side="left")
    ln = np.searchsorted(l_grid, np.asarray(length, np.float64), side="left")
    idx = s * (len(l_grid) + 1) + ln
    if no_cjk is None:
        return idx
    return idx * 2 + (np.asarray(no_cjk, np.float64) > 0.5).astype(np.int64)


def shift_cells(values: dict[str, np.ndarray], features: dict[str, Any], pred: np.ndarray, y: np.ndarray,
                calibration: dict[str, Any], fit_on: np.ndarray) -> dict[str, Any]:
    """Per cell (:func:`cell_index`, with the script) of the reference: its rows, and the sum (and sum of squares)
    of each row's residual: right or wrong minus the out-of-fold calibrated chance of being right. A run
    concentrated in cells where the calibration over- or under-states the accuracy gets its estimate corrected by
    them (importance weights: the run's share of each cell over the reference's)."""
    cells = cell_count(features)
    if calibration.get("folds"):
        q = out_of_fold(calibration["method"], np.asarray(fit_on, np.float64), y)
    else:
        q = class_probs(fit_on)
    resid = (pred == y).astype(np.float64) - q[np.arange(len(pred)), pred]
    idx = cell_index(values["score"], values["length"], features, values["no_cjk"])
    return {"features": list(SHIFT_FEATURES), "n": np.bincount(idx, minlength=cells).tolist(),
            "residual": [_r(v) for v in np.bincount(idx, weights=resid, minlength=cells)],
            "residual_sq": [_r(v) for v in np.bincount(idx, weights=resid * resid, minlength=cells)]}


def calibrate(outputs: np.ndarray, y: np.ndarray, pred: np.ndarray, k: int) -> dict[str, Any]:
    """The cross-fitted calibration record: candidates' out-of-fold log loss, the chosen one refitted on every dev
    row, and its out-of-fold estimate of the dev accuracy and F1 beside the true ones."""
    p = np.asarray(outputs, np.float64)
    truth = {f"true_{k_}": round(v, 6) for k_, v in true_metrics(pred, y, k).items()}
    if len(y) < 2 * FOLDS or len(np.unique(y)) < 2:
        return {"method": "identity", "folds": 0, "candidates": {}, "out_of_fold": truth, "fallback": True,
                "note": "too few dev rows (or one class) to fit a calibration: the shipped probabilities are used"}
    # the probabilities as they are compete too: a stack fitted on dev by log loss is often calibrated already
    methods = ("identity", "isotonic", "platt") if p.ndim == 1 else ("identity", "ovr_platt")
    oof = {m: out_of_fold(m, p, y) for m in methods}
    scores = {m: brier(oof[m], y) for m in methods}
    best = min(methods, key=lambda m: (scores[m], m))
    est = confusion_of(oof[best], pred).estimate()
    shipped = class_probs(p)
    # how uncertain the dev figures themselves are (the calibration is learnt from these rows): the sampling sd of
    # the dev accuracy, and a seeded bootstrap sd of the dev F1
    rng = np.random.default_rng(0)
    boot = [true_metrics(pred[i], y[i], k)["f1"] for i in (rng.integers(0, len(y), len(y)) for _ in range(200))]
    acc = float((pred == y).mean())
    record = FITTERS[best](p, y).to_dict()
    record["folds"] = FOLDS
    record["candidates"] = {m: {"brier": round(scores[m], 6), "log_loss": round(log_loss(oof[m], y), 6)}
                            for m in methods}
    record["out_of_fold"] = {
        **truth,
        "estimated_accuracy": round(est["accuracy"], 6), "estimated_f1": round(est["f1"], 6),
        "ece": round(ece(oof[best], pred, y), 6), "ece_uncalibrated": round(ece(shipped, pred, y), 6),
        "sd_accuracy": round(math.sqrt(acc * (1 - acc) / len(y)), 6), "sd_f1": round(float(np.std(boot)), 6),
    }
    return record


@dataclass
class Reference:
    """An opened ``reference.json``: the dev distributions and the calibration (see :func:`build_reference`)."""

    data: dict[str, Any]

    @property
    def calibration(self) -> Calibration:
        """The shipped calibration."""
        return Calibration.from_dict(self.data["calibration"])

    @property
    def num_classes(self) -> int:
        """K (2 for a binary bundle)."""
        return int(self.data["num_classes"])

    def feature(self, name: str) -> dict[str, Any]:
        """One feature's grids and dev counts."""
        return self.data["features"][name]

    @classmethod
    def from_bytes(cls, data: bytes) -> Reference:
        """Parse ``reference.json``; ValueError for another schema."""
        d = json.loads(data)
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ValueError(f"{REFERENCE_FILE}: schema {d.get('schema') if isinstance(d, dict) else None!r}, "
                             f"expected {SCHEMA!r}")
        return cls(d)


def reference_bytes(ref: dict[str, Any]) -> bytes:
    """The file's bytes: sorted keys, one space indent (deterministic)."""
    return json.dumps(ref, indent=1, sort_keys=True, ensure_ascii=False).encode()
