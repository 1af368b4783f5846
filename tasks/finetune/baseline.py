"""The cheap baseline beside every fine-tuning metric (TF-IDF char 1-2-gram logistic regression), split overlap,
and the stacked classifier a bundle may ship: the encoder's logits and the baseline's, combined on dev.

The fitted baseline is kept as plain arrays (:class:`BaselineModel`: n-gram, idf, coefficient; one coefficient per
n-gram for two classes, K for K > 2), stored as Parquet in the finetune artifact and the bundle and scored without
scikit-learn at labelling time; it gives scikit-learn's own decision values (``tests/test_baseline.py`` and
``tests/test_kclass.py`` check to 1e-9). The combination is :class:`Blend` (two classes) or :class:`KBlend`
(K > 2: a multinomial logistic regression on the 2K logits, as scikit-learn's ``StackingClassifier`` stacks)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from models.rowwise import sigmoid_rows, softmax_rows
from tasks.common.text import normalize_text
from tasks.finetune.metrics import binary_metrics, class_metrics, r6, softmax_np
from tasks.finetune.threshold import search_threshold

BASELINE = "TF-IDF character 1-2-grams (sublinear tf) + logistic regression (liblinear, C=1, random_state=0)"
MULTINOMIAL = ("TF-IDF character 1-2-grams (sublinear tf) + multinomial logistic regression (lbfgs, C=1, "
               "max_iter=1000)")
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


_WHITE_SPACES = re.compile(r"\s\s+")  # scikit-learn's char analyzer collapses runs of whitespace like this


@dataclass
class BaselineModel:
    """The fitted baseline as arrays: ``ngrams[j]`` has inverse document frequency ``idf[j]`` and logistic
    regression coefficient ``coef[j]`` (a float for two classes; K floats, one per class, for K > 2);
    ``intercept`` is the regression's (a float, or K). Scores normalised texts."""

    ngrams: list[str]
    idf: np.ndarray  # float64 [V]
    coef: np.ndarray  # float64 [V] (two classes) | [V, K] (K > 2: multinomial)
    intercept: float | np.ndarray  # float | float64 [K]

    def __post_init__(self):
        self._index = {g: j for j, g in enumerate(self.ngrams)}

    @property
    def num_classes(self) -> int:
        """2 for the binary baseline (one logit), else K (one logit per class)."""
        return 2 if self.coef.ndim == 1 else int(self.coef.shape[1])

    @classmethod
    def from_sklearn(cls, pipeline) -> BaselineModel:
        """The arrays of a fitted :func:`fit_baseline` pipeline."""
        vec, lr = pipeline[0], pipeline[-1]
        ngrams = [None] * len(vec.vocabulary_)
        for g, j in vec.vocabulary_.items():
            ngrams[j] = g
        idf = np.asarray(vec.idf_, np.float64)
        if lr.coef_.shape[0] == 1:  # two classes: one decision value
            return cls(ngrams, idf, np.asarray(lr.coef_[0], np.float64), float(lr.intercept_[0]))
        return cls(ngrams, idf, np.ascontiguousarray(lr.coef_.T, np.float64), np.asarray(lr.intercept_, np.float64))

    def _grams(self, text: str) -> tuple[list[int], list[float], float]:
        """(vocabulary indices, tf-idf values, L2 norm) of one normalised text's in-vocabulary n-grams, in the order
        scikit-learn's analyzer yields them (characters, then bigrams): lowercase, whitespace runs collapsed,
        sublinear tf (1 + ln tf) times idf."""
        t = _WHITE_SPACES.sub(" ", text.lower())
        grams = Counter(t)
        grams.update(t[j : j + 2] for j in range(len(t) - 1))
        index, idf = self._index, self.idf
        js, vs, sq = [], [], 0.0
        for g, c in grams.items():
            j = index.get(g)
            if j is not None:
                v = (1.0 + math.log(c)) * idf[j]
                js.append(j)
                vs.append(v)
                sq += v * v
        return js, vs, math.sqrt(sq)

    def logits(self, texts: Sequence[str]) -> np.ndarray:
        """The regression's decision values for normalised texts, as scikit-learn computes them: float64 [N] for
        two classes, [N, K] for K > 2. Each text's sum runs over its n-grams in one fixed order (Python floats;
        for K > 2 ``np.add.accumulate``, sequential by definition), so a text's bits depend on that text alone."""
        if self.coef.ndim == 2:
            return self._logits_k(texts)
        out = np.empty(len(texts), np.float64)
        coef = self.coef
        for i, text in enumerate(texts):
            js, vs, norm = self._grams(text)
            num = 0.0
            for j, v in zip(js, vs):
                num += v * coef[j]
            out[i] = (num / norm if norm > 0 else 0.0) + self.intercept
        return out

    def _logits_k(self, texts: Sequence[str]) -> np.ndarray:
        k = self.coef.shape[1]
        out = np.empty((len(texts), k), np.float64)
        for i, text in enumerate(texts):
            js, vs, norm = self._grams(text)
            if norm > 0:
                terms = self.coef[js] * np.asarray(vs, np.float64)[:, None]  # [n, K]
                out[i] = np.add.accumulate(terms, axis=0)[-1] / norm + self.intercept
            else:
                out[i] = self.intercept
        return out

    def to_table(self):
        """The model as a Parquet-ready table (``ngram``, ``idf``, ``coef``; the intercept in the metadata)."""
        if self.coef.ndim == 1:
            meta = {b"intercept": repr(self.intercept).encode(), b"model": BASELINE.encode()}
            coef = pa.array(self.coef, pa.float64())
        else:  # K > 2: a fixed-size list of K coefficients per n-gram, the K intercepts as a JSON list
            k = self.coef.shape[1]
            meta = {b"intercept": json.dumps([repr(float(v)) for v in self.intercept]).encode(),
                    b"model": MULTINOMIAL.encode()}
            coef = pa.FixedSizeListArray.from_arrays(pa.array(self.coef.ravel(), pa.float64()), k)
        return pa.table({"ngram": pa.array(self.ngrams, pa.string()), "idf": pa.array(self.idf, pa.float64()),
                         "coef": coef}).replace_schema_metadata(meta)

    @classmethod
    def from_table(cls, table) -> BaselineModel:
        """The model :meth:`to_table` wrote."""
        meta = table.schema.metadata or {}
        if b"intercept" not in meta:
            raise ValueError("baseline table has no intercept in its schema metadata (expected a baseline.parquet "
                             "written by the finetune stage)")
        ngrams, idf = table.column("ngram").to_pylist(), table.column("idf").to_numpy().astype(np.float64)
        col = table.column("coef")
        if pa.types.is_fixed_size_list(col.type):  # K > 2
            k = col.type.list_size
            flat = col.combine_chunks().flatten().to_numpy().astype(np.float64)
            intercept = np.array([float(v) for v in json.loads(meta[b"intercept"])], np.float64)
            return cls(ngrams, idf, flat.reshape(-1, k), intercept)
        return cls(ngrams, idf, col.to_numpy().astype(np.float64), float(meta[b"intercept"]))


@dataclass(frozen=True)
class Blend:
    """The shipped classifier's logit: ``w_encoder * encoder logit + w_baseline * baseline logit + bias``,
    a logistic regression on the two logits fitted on the dev rows (never test)."""

    w_encoder: float
    w_baseline: float
    bias: float

    def logits(self, z_encoder: np.ndarray, z_baseline: np.ndarray) -> np.ndarray:
        """float64 [N]: the shipped logits."""
        return self.w_encoder * np.asarray(z_encoder, np.float64) + self.w_baseline * z_baseline + self.bias

    def prob(self, z_encoder: np.ndarray, z_baseline: np.ndarray) -> np.ndarray:
        """float32 probabilities (the stored precision of every probability). The sigmoid is torch's, under the
        pinned CPU kernels and padded (:func:`models.rowwise.sigmoid_rows`): NumPy's ``exp`` takes an AVX-512 path
        on some CPUs, so its bits would follow the machine, and a row's bits would follow its batch."""
        z = torch.from_numpy(np.ascontiguousarray(self.logits(z_encoder, z_baseline), np.float64))
        return sigmoid_rows(z).numpy().astype(np.float32)

    def to_dict(self) -> dict[str, float]:
        """The weights as ``blend.json`` holds them."""
        return {"w_encoder": self.w_encoder, "w_baseline": self.w_baseline, "bias": self.bias}


RESIDUAL = Blend(1.0, 1.0, 0.0)  # combine: residual: the encoder's logit is a correction added to the baseline's


def fit_blend(y: np.ndarray, z_encoder: np.ndarray, z_baseline: np.ndarray) -> Blend:
    """Stack the two logits with a logistic regression on (``z_encoder``, ``z_baseline``) -> ``y`` (lbfgs, C=1:
    deterministic); rounded to 12 significant digits so the stored JSON reproduces it exactly."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415 - as in fit_baseline

    X = np.column_stack([np.asarray(z_encoder, np.float64), np.asarray(z_baseline, np.float64)])
    lr = LogisticRegression(C=1.0, max_iter=1000).fit(X, np.asarray(y).astype(np.int64))
    r = lambda v: float(f"{float(v):.12g}")  # noqa: E731
    return Blend(r(lr.coef_[0][0]), r(lr.coef_[0][1]), r(lr.intercept_[0]))


@dataclass(frozen=True)
class KBlend:
    """K > 2 classes: the shipped logits ``bias + weights @ [encoder logits (K), baseline logits (K)]``, a
    multinomial logistic regression on the 2K logits fitted on the dev rows (never test); ``weights`` [K][2K],
    ``bias`` [K]. Probabilities are the softmax of these logits."""

    weights: tuple[tuple[float, ...], ...]
    bias: tuple[float, ...]

    @property
    def num_classes(self) -> int:
        """K."""
        return len(self.bias)

    def logits(self, z_encoder: np.ndarray, z_baseline: np.ndarray) -> np.ndarray:
        """float64 [N, K]. The 2K products are added one input at a time in a fixed order (elementwise NumPy, no
        BLAS), so a row's bits depend on that row alone."""
        x = np.concatenate([np.asarray(z_encoder, np.float64), np.asarray(z_baseline, np.float64)], 1)  # [N, 2K]
        w = np.asarray(self.weights, np.float64)  # [K, 2K]
        out = np.repeat(np.asarray(self.bias, np.float64)[None, :], len(x), 0)  # [N, K]
        for i in range(w.shape[1]):
            out += x[:, i : i + 1] * w[:, i]
        return out

    def prob(self, z_encoder: np.ndarray, z_baseline: np.ndarray) -> np.ndarray:
        """float32 [N, K] probabilities: torch's softmax under the pinned CPU kernels, padded
        (:func:`models.rowwise.softmax_rows`), as :meth:`Blend.prob`'s sigmoid."""
        z = torch.from_numpy(np.ascontiguousarray(self.logits(z_encoder, z_baseline), np.float64))
        return softmax_rows(z).numpy().astype(np.float32)

    def encoder_weights(self, c: int) -> np.ndarray:
        """float64 [K]: d(shipped logit of class ``c``) / d(encoder logits), what the encoder's part of it is."""
        return np.asarray(self.weights[c][: self.num_classes], np.float64)

    def to_dict(self) -> dict[str, Any]:
        """The weights as ``blend.json`` holds them."""
        return {"weights": [list(r) for r in self.weights], "bias": list(self.bias)}


def blend_from_dict(d: dict[str, Any]) -> Blend | KBlend:
    """The combination a ``blend.json`` holds: :class:`Blend` (two classes) or :class:`KBlend` (``weights``)."""
    if "weights" in d:
        return KBlend(tuple(tuple(float(v) for v in r) for r in d["weights"]), tuple(float(v) for v in d["bias"]))
    return Blend(**d)


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
