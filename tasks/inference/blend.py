"""The stacked classifier a bundle may ship, as labelling scores it: the fitted TF-IDF baseline kept as plain arrays
(:class:`BaselineModel`: n-gram, idf, coefficient; one coefficient per n-gram for two classes, K for K > 2), scored
without scikit-learn, and the combination of the encoder's logits with the baseline's (:class:`Blend` for two
classes, :class:`KBlend` for K > 2: a multinomial logistic regression on the 2K logits, as scikit-learn's
``StackingClassifier`` stacks). Fitting them is fine-tuning's (:mod:`tasks.finetune.baseline`); the baseline gives
scikit-learn's own decision values (``tests/test_baseline.py`` and ``tests/test_kclass.py`` check to 1e-9)."""

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

BASELINE = "TF-IDF character 1-2-grams (sublinear tf) + logistic regression (liblinear, C=1, random_state=0)"
MULTINOMIAL = ("TF-IDF character 1-2-grams (sublinear tf) + multinomial logistic regression (lbfgs, C=1, "
               "max_iter=1000)")
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
