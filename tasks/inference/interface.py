"""The scorer interface labelling uses, and the one way to open a scorer: a sentiment bundle or an NER artifact.

:mod:`tasks.label` scores through the inference room only and imports no trainer (:mod:`tasks.finetune`,
:mod:`tasks.ner`, ...: forbidden contracts in ``pyproject.toml``); this module knows which scorer a kind of model
needs.
"""

from __future__ import annotations

from typing import Any, Protocol

from storage.artifacts import ArtifactRef
from tasks.inference.bundle import load_bundle
from tasks.inference.ner import NerScorer

SENTIMENT, NER = "label", "ner-label"  # the kinds of label run: a sentiment bundle, an NER artifact


class Scorer(Protocol):
    """What the labeller needs of a model: its artifact, scores for a window of texts and their output table.

    Implemented by :class:`tasks.inference.sentiment.ClassifierScorer` (sentiment and K classes) and
    :class:`tasks.inference.ner.NerScorer`."""

    ref: ArtifactRef
    positive_column: str | None  # the 0/1 (or count) column the run summary sums; None: nothing to count

    def score(self, texts: list[str]) -> tuple[list[Any], set[int]]:
        """(outputs of the scorable texts, indexes of texts empty after normalisation)."""

    def part_table(self, ids: list[str], outputs: list[Any]) -> Any:
        """The part file's Arrow table for these row ids and outputs."""

    def metrics(self) -> dict[str, Any]:
        """The model's metrics for the run summary."""


def load_scorer(kind: str, model_uri: str, batch_size: int, device: str = "cpu") -> Any:
    """The sentiment bundle (``kind="label"``, a :class:`tasks.inference.bundle.Bundle` the labeller wraps in its
    scorer) or the NER scorer (``"ner-label"``) at ``model_uri``."""
    if kind == NER:
        return NerScorer(model_uri, device, batch_size)
    if kind != SENTIMENT:
        raise ValueError(f"unknown kind of label run {kind!r}: expected {SENTIMENT!r} or {NER!r}")
    return load_bundle(model_uri, device)
