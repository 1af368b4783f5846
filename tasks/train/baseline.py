"""The cheap baseline beside every fine-tuning metric (TF-IDF char 1-2-gram logistic regression) and split overlap."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tasks.common.text import normalize_text
from tasks.train.threshold import search_threshold

BASELINE = "TF-IDF character 1-2-grams (sublinear tf) + logistic regression (liblinear, C=1, random_state=0)"
SPLITS = ("train", "dev", "test")


def contamination(train: Sequence[str], other: Sequence[str]) -> int:
    """How many texts of ``other`` equal, after :func:`normalize_text`, some text of ``train``
    (so a traditional-Chinese or full-width copy of a training review counts)."""
    seen = {normalize_text(t) for t in train}
    return sum(normalize_text(t) in seen for t in other)


def fit_baseline(texts: Sequence[str], labels: Sequence[int]):
    """The fitted baseline on normalised ``texts`` (deterministic: liblinear, fixed random_state, no torch);
    ``model.predict_proba(texts)[:, 1]`` scores normalised texts."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    model = make_pipeline(
        TfidfVectorizer(analyzer="char", ngram_range=(1, 2), sublinear_tf=True, dtype=np.float64),
        LogisticRegression(solver="liblinear", C=1.0, random_state=0, max_iter=1000),
    )
    return model.fit(list(texts), np.asarray(labels, np.int64))


def baseline_metrics(train: list[dict[str, Any]], dev: list[dict[str, Any]],
                     test: list[dict[str, Any]]) -> dict[str, Any]:
    """The baseline trained on exactly the ``train`` rows ({text, label}), its threshold picked on ``dev``
    by the model's rule (:func:`tasks.train.threshold.search_threshold`), scored on ``test``; and the
    contamination counts: test and dev rows whose normalised text occurs in train. Values are rounded
    to 6 places; the test metrics are None without test rows."""
    from tasks.train.finetune import binary_metrics

    rows = dict(zip(SPLITS, (train, dev, test)))
    raw = {s: [r["text"] for r in rows[s]] for s in SPLITS}
    texts = {s: [normalize_text(t) for t in raw[s]] for s in SPLITS}
    labels = {s: np.array([r["label"] for r in rows[s]], np.int64) for s in SPLITS}
    model = fit_baseline(texts["train"], labels["train"])
    th = search_threshold(labels["dev"], model.predict_proba(texts["dev"])[:, 1]).threshold
    test_m = dict.fromkeys(("auc", "accuracy", "f1"))
    if texts["test"]:
        test_m = binary_metrics(labels["test"], model.predict_proba(texts["test"])[:, 1], th)
    out: dict[str, Any] = {f"baseline_test_{k}": _r6(test_m[k]) for k in ("auc", "accuracy", "f1")}
    out["baseline_threshold"] = th
    out["contaminated_test_rows"] = contamination(raw["train"], raw["test"])
    out["contaminated_dev_rows"] = contamination(raw["train"], raw["dev"])
    return out


def _r6(v: float | None) -> float | None:
    return round(v, 6) if v is not None and v == v else None


# (label, model metric key, baseline metric key or None) for the side-by-side tables (report, model card)
COMPARED = (("test AUC", "test_auc", "baseline_test_auc"),
            ("test accuracy", "test_accuracy", "baseline_test_accuracy"),
            ("test precision", "test_precision", None), ("test recall", "test_recall", None),
            ("test F1", "test_f1", "baseline_test_f1"),
            ("threshold (picked on dev)", "threshold", "baseline_threshold"))


def comparison_markdown(m: dict[str, Any]) -> str:
    """Finetune metrics ``m`` as a markdown table, the model beside the baseline on the same rows,
    then one line with the contamination counts ("n/a" where a manifest predates them)."""
    out = "| metric | model | baseline |\n|---|---|---|\n"
    out += "".join(f"| {name} | {_fmt(m.get(k))} | {_fmt(m.get(b)) if b else '—'} |\n" for name, k, b in COMPARED)
    return (out + f"\nBaseline: {BASELINE}, trained on the same {_fmt(m.get('n_train'))} training rows, threshold "
            f"by the same rule on the same dev rows.\n\nContamination: {_fmt(m.get('contaminated_test_rows'))} of "
            f"{_fmt(m.get('n_test'))} test rows and {_fmt(m.get('contaminated_dev_rows'))} of {_fmt(m.get('n_dev'))} "
            "dev rows have a text that, normalised, also occurs among the training rows.\n")


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "n/a" if v is None else str(v)
    return f"{v:.4f}" if isinstance(v, float) else str(v)
