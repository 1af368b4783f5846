"""Explain one text with a bundle (the backend of ``lexiflow explain`` and ``lexiflow.explain``): the labeller's
probability beside the pictures of :mod:`tasks.inference.explain`.

The probability is the labeller's (:class:`tasks.inference.sentiment.ClassifierScorer`, the bundle's own featurizer,
the same threads), so ``lexiflow explain`` says exactly what ``lexiflow label`` wrote. The pictures come from a second,
plain fp32 forward pass of the same encoder with autograd on (the labeller scores a row-invariant copy under
inference mode, whose float sums run in another order): its probability, ``prob_forward``, agrees with the
labelled one to about 1e-6 and is reported beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from models.numerics import numerics_record
from tasks.common.config import THREADS
from tasks.inference import explain as model_explain
from tasks.inference.explain import Explanation, bundle_words
from tasks.inference.sentiment import ClassifierScorer


def labelled_prob(bundle, text: str) -> float | np.ndarray:
    """The probability ``lexiflow label`` writes for ``text`` (its scorer, its threads; K > 2 classes: float32 [K],
    every class's); ValueError when the text is empty after normalisation (the labeller rejects it)."""
    probs, empty = ClassifierScorer(bundle, 1, threads=THREADS).score([text])
    if empty:
        raise ValueError(f"text {text[:40]!r} is empty after normalisation: the labeller rejects it; nothing to "
                         "explain")
    return probs[0] if np.ndim(probs[0]) else float(probs[0])


def explain_text(bundle, text: str, words: Sequence[str], prob: float | None = None) -> Explanation:
    """Explain ``text`` with ``bundle`` (a :class:`tasks.inference.bundle.Bundle`, or anything with its ``featurizer``,
    ``model``, ``threshold``, ``classes``, ``version``, ``baseline``, ``blend``); ``words``: word id -> word.
    ``prob``: the labelled probability when the caller has it (else computed with the labeller's scorer; K > 2
    classes: the [K] probabilities)."""
    if not isinstance(text, str):
        raise ValueError(f"expected a text (str), got {type(text).__name__}")
    if prob is None:
        prob = labelled_prob(bundle, text)
    return model_explain.explain_text(bundle, text, words, prob)


def explain(bundle, text: str, words: Sequence[str] | None = None) -> Explanation:
    """What ``bundle`` (a :class:`tasks.inference.bundle.Bundle`) looks at for ``text`` (``words``: the bundle's word
    list, read from it when not given).

    Refuses a process whose torch computed before the CPU kernels were pinned, as scoring does."""
    numerics_record()
    return explain_text(bundle, text, bundle_words(bundle.uri) if words is None else words)
