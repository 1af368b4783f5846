"""The cheap baseline beside every fine-tuning metric (TF-IDF char 1-2-gram logistic regression), split overlap,
and fitting the stacked classifier a bundle may ship: the encoder's logits and the baseline's, combined on dev.

What is fitted here is scored as :mod:`tasks.inference.blend` holds it (:class:`~tasks.inference.blend.BaselineModel`,
stored as Parquet in the finetune artifact and the bundle and scored without scikit-learn at labelling time;
:class:`~tasks.inference.blend.Blend` for two classes, :class:`~tasks.inference.blend.KBlend` for K > 2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tasks.common.text import normalize_text
from tasks.finetune.metrics import binary_metrics, class_metrics, r6, softmax_np
from tasks.finetune.threshold import search_threshold
from tasks.inference.blend import BaselineModel, Blend, KBlend

SPLITS = ("train", "dev", "test")


def contamination(train: Sequence[str], other: Sequence[str]) -> int:
    """How many texts of ``other`` equal, after :func:`normalize_text`, some text of ``train``
    (so a traditional-Chinese or full-width copy of a training review counts)."""
    seen = {normalize_text(t) for t in train}
    return sum(normalize_text(t) in seen for t in other)


def fit_baseline(texts: Sequence[str], labels: Sequence[int], multinomial: bool = False):
    """The fitted baseline on normalised ``texts`` (deterministic: liblinear with a fixed random_state, or for
    ``multinomial`` (K > 2 classes) lbfgs; no torch); ``model.predict_proba(texts)`` scores normalised texts."""
    from sklearn.feature_extraction.text import TfidfVectorizer  # noqa: PLC0415 - scikit-learn is slow to import
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415 - and labelling never fits
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    lr = (LogisticRegression(C=1.0, max_iter=1000) if multinomial
          else LogisticRegression(solver="liblinear", C=1.0, random_state=0, max_iter=1000))
    model = make_pipeline(
        TfidfVectorizer(analyzer="char", ngram_range=(1, 2), sublinear_tf=True, dtype=np.float64), lr)
    return model.fit(list(texts), np.asarray(labels, np.int64))


def fit_blend(y: np.ndarray, z_encoder: np.ndarray, z_baseline: np.ndarray) -> Blend:
    """Stack the two logits with a logistic regression on (``z_encoder``, ``z_baseline``) -> ``y`` (lbfgs, C=1:
    deterministic); rounded to 12 significant digits so the stored JSON reproduces it exactly."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415 - as in fit_baseline

    X = np.column_stack([np.asarray(z_encoder, np.float64), np.asarray(z_baseline, np.float64)])
    lr = LogisticRegression(C=1.0, max_iter=1000).fit(X, np.asarray(y).astype(np.int64))
    r = lambda v: float(f"{float(v):.12g}")  # noqa: E731
    return Blend(r(lr.coef_[0][0]), r(lr.coef_[0][1]), r(lr.intercept_[0]))


def fit_kblend(y: np.ndarray, z_encoder: np.ndarray, z_baseline: np.ndarray, k: int) -> KBlend:
    """Stack K-class logits: a multinomial logistic regression on [``z_encoder``, ``z_baseline``] (N x 2K) -> ``y``
    (lbfgs, C=1: deterministic), rounded to 12 significant digits as :func:`fit_blend`. ``y`` must hold all K
    classes (ValueError otherwise: a class never seen would get no weights)."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415 - as in fit_baseline

    y = np.asarray(y).astype(np.int64)
    missing = sorted(set(range(k)) - set(np.unique(y).tolist()))
    if missing:
        raise ValueError(f"cannot stack: class index(es) {missing} have no row to fit on")
    X = np.concatenate([np.asarray(z_encoder, np.float64), np.asarray(z_baseline, np.float64)], 1)
    lr = LogisticRegression(C=1.0, max_iter=1000).fit(X, y)
    r = lambda v: float(f"{float(v):.12g}")  # noqa: E731
    return KBlend(tuple(tuple(r(v) for v in row) for row in lr.coef_), tuple(r(v) for v in lr.intercept_))


@dataclass
class BaselineRun:
    """The two-class baseline's run: the model, its dev/test logits, metrics, and the normalised texts."""

    model: BaselineModel
    dev_logits: np.ndarray  # float64 [n_dev]
    test_logits: np.ndarray  # float64 [n_test]
    metrics: dict[str, Any]
    texts: dict[str, list[str]]  # normalised texts per split
    labels: dict[str, np.ndarray]  # per split

    @property
    def test_prob(self) -> np.ndarray:
        """float64 [n_test]: the baseline's test probabilities."""
        return _sigmoid(self.test_logits)

    def unseen(self, split: str) -> np.ndarray:
        """bool [n_split]: the ``split`` rows whose normalised text does NOT occur among the training rows."""
        seen = set(self.texts["train"])
        return np.array([t not in seen for t in self.texts[split]], bool)

    def train_logits_out_of_fold(self, folds: int = 5) -> np.ndarray:
        """float64 [n_train]: each training row scored by a baseline fitted on the other folds (row i is in
        fold i % folds), so a model trained on top of these logits sees them as they are on unseen text."""
        texts, y = self.texts["train"], self.labels["train"]
        out = np.empty(len(texts), np.float64)
        fold = np.arange(len(texts)) % folds
        for f in range(folds):
            rest, held = np.flatnonzero(fold != f), np.flatnonzero(fold == f)
            model = BaselineModel.from_sklearn(fit_baseline([texts[i] for i in rest], y[rest]))
            out[held] = model.logits([texts[i] for i in held])
        return out


def run_baseline(train: list[dict[str, Any]], dev: list[dict[str, Any]], test: list[dict[str, Any]]) -> BaselineRun:
    """The baseline trained on exactly the ``train`` rows ({text, label}), its threshold picked on ``dev``
    by the model's rule (:func:`tasks.finetune.threshold.search_threshold`), scored on ``test``; and the
    contamination counts: test and dev rows whose normalised text occurs in train. Metric values are rounded
    to 6 places; the test metrics are None without test rows."""
    rows = dict(zip(SPLITS, (train, dev, test)))
    texts = {s: [normalize_text(r["text"]) for r in rows[s]] for s in SPLITS}
    labels = {s: np.array([r["label"] for r in rows[s]], np.int64) for s in SPLITS}
    model = BaselineModel.from_sklearn(fit_baseline(texts["train"], labels["train"]))
    z = {s: model.logits(texts[s]) for s in ("dev", "test")}
    th = search_threshold(labels["dev"], _sigmoid(z["dev"])).threshold
    test_m = dict.fromkeys(("auc", "accuracy", "f1"))
    if texts["test"]:
        test_m = binary_metrics(labels["test"], _sigmoid(z["test"]), th)
    out: dict[str, Any] = {f"baseline_test_{k}": _r6(test_m[k]) for k in ("auc", "accuracy", "f1")}
    out["baseline_threshold"] = th
    run = BaselineRun(model, z["dev"], z["test"], out, texts, labels)
    for s in ("test", "dev"):  # as contamination() counts, on the texts normalised once above
        out[f"contaminated_{s}_rows"] = int((~run.unseen(s)).sum())
    return run


@dataclass
class KBaseline:
    """The multinomial baseline's run for K > 2 classes: the model, its metrics and its dev/test logits."""

    model: Any  # BaselineModel (multinomial: K logits per text)
    metrics: dict[str, Any]
    dev_logits: np.ndarray  # float64 [n_dev, K]
    test_logits: np.ndarray  # float64 [n_test, K]
    test_prob: np.ndarray  # [n_test, K]
    unseen_rows: dict[str, np.ndarray]  # split -> bool [n]: text not among the training rows

    def unseen(self, split: str) -> np.ndarray:
        """bool [n_split]: the ``split`` rows whose normalised text does NOT occur among the training rows."""
        return self.unseen_rows[split]


def run_kbaseline(train, dev, test, k: int) -> KBaseline:
    """The multinomial TF-IDF baseline fitted on exactly the ``train`` rows (every class must have one), as arrays
    (:class:`BaselineModel`, the form a bundle ships); its dev/test logits, test macro-F1/accuracy, and the
    contamination counts (dev/test rows whose normalised text occurs among the training rows)."""
    texts = {s: [normalize_text(r["text"]) for r in rows] for s, rows in (("train", train), ("dev", dev),
                                                                          ("test", test))}
    y = np.array([r["label"] for r in train], np.int64)
    model = BaselineModel.from_sklearn(fit_baseline(texts["train"], y, multinomial=True))
    z = {s: model.logits(texts[s]).reshape(len(texts[s]), k) for s in ("dev", "test")}
    prob = softmax_np(z["test"])
    m = class_metrics(np.array([r["label"] for r in test], np.int64), prob)
    seen = set(texts["train"])
    unseen = {s: np.array([t not in seen for t in texts[s]], bool) for s in ("dev", "test")}
    metrics = {"baseline_test_macro_f1": r6(m["macro_f1"]), "baseline_test_accuracy": r6(m["accuracy"]),
               "contaminated_test_rows": int((~unseen["test"]).sum()),
               "contaminated_dev_rows": int((~unseen["dev"]).sum())}
    return KBaseline(model, metrics, z["dev"], z["test"], prob, unseen)


def clean_test_metrics(y: np.ndarray, clean: np.ndarray, scored: dict[str, tuple[np.ndarray, float]]
                       ) -> dict[str, Any]:
    """AUC and accuracy on the uncontaminated test rows (``clean``, bool [n_test]) for each ``prefix: (prob,
    threshold)`` in ``scored`` (keys ``{prefix}clean_test_auc`` / ``_accuracy``), and ``n_clean_test``. Only
    when some test rows ARE contaminated (otherwise these would repeat the test metrics): else ``{}``."""
    if clean.all() or not clean.any():
        return {}
    out: dict[str, Any] = {"n_clean_test": int(clean.sum())}
    for prefix, (prob, th) in scored.items():
        m = binary_metrics(y[clean], np.asarray(prob)[clean], th)
        out.update({f"{prefix}clean_test_{k}": _r6(m[k]) for k in ("auc", "accuracy")})
    return out


def paired_auc_difference(y: np.ndarray, score_a: np.ndarray, score_b: np.ndarray, resamples: int = 1000,
                          seed: int = 0) -> dict[str, Any] | None:
    """AUC(a) - AUC(b) on the same rows, with a 95 % paired-bootstrap interval (the rows resampled together for
    both scores, ``resamples`` times from ``seed``; resamples with one class only are skipped) and the share of
    resamples in which a is not better. None when ``y`` holds one class (no AUC)."""
    from sklearn.metrics import roc_auc_score  # noqa: PLC0415 - as in fit_baseline

    y = np.asarray(y)
    if len(y) == 0 or y.min() == y.max():
        return None
    a, b = np.asarray(score_a, np.float64), np.asarray(score_b, np.float64)
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(resamples):
        i = rng.integers(0, len(y), len(y))
        if y[i].min() != y[i].max():
            diffs.append(roc_auc_score(y[i], a[i]) - roc_auc_score(y[i], b[i]))
    d = np.asarray(diffs)
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {"diff": _r6(roc_auc_score(y, a) - roc_auc_score(y, b)), "ci95": [_r6(lo), _r6(hi)],
            "p_not_better": _r6(float((d <= 0).mean())), "resamples": len(d), "seed": seed}


def baseline_metrics(train: list[dict[str, Any]], dev: list[dict[str, Any]],
                     test: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`run_baseline`'s metrics only."""
    return run_baseline(train, dev, test).metrics


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(z, np.float64)))


_r6 = r6


def vs_baseline(vs: dict[str, Any], metric: str = "test AUC") -> str:
    """The finetune metric ``test_auc_vs_baseline`` (K > 2 classes: ``test_macro_f1_vs_baseline``, ``metric``
    "test macro-F1") in words: the difference, its interval, and what it says."""
    lo, hi = vs["ci95"]
    verdict = "above the baseline" if lo > 0 else "below the baseline" if hi < 0 else "a tie: the interval holds 0"
    return (f"{metric} {vs['diff']:+.4f} (95 % paired-bootstrap interval {lo:+.4f} .. {hi:+.4f}, "
            f"{vs['resamples']} resamples): {verdict}")


def clean_test_line(m: dict[str, Any]) -> str:
    """One sentence with the metrics on the test rows whose text is not among the training rows ("" when
    every test row is clean, or the manifest predates ``n_clean_test``): AUC and accuracy, or for K > 2 classes
    macro-F1 and accuracy."""
    if not isinstance(m.get("n_clean_test"), int):
        return ""
    key, label = ("macro_f1", "macro-F1") if "clean_test_macro_f1" in m else ("auc", "AUC")
    who = [("shipped", ""), *([("encoder alone", "encoder_")] if f"encoder_clean_test_{key}" in m else []),
           ("baseline", "baseline_")]
    figs = "; ".join(f"{name} {label} {fmt(m.get(f'{p}clean_test_{key}'))}, "
                     f"accuracy {fmt(m.get(f'{p}clean_test_accuracy'))}" for name, p in who)
    return f"On the {m['n_clean_test']} test rows whose text is not among the training rows: {figs}."


def fmt(v: Any) -> str:
    """A metric as the reports print it: 4 decimals for a float, "n/a" for None."""
    if isinstance(v, bool) or v is None:
        return "n/a" if v is None else str(v)
    return f"{v:.4f}" if isinstance(v, float) else str(v)
