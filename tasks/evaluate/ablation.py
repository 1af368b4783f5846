"""Honest lexicon ablation: two SEPARATELY pretrained encoders (adapter on / off, same data, seed and steps),
each fine-tuned the same way, beside the cheap baseline and the contamination count.

Turning the adapter off on an encoder pretrained with it measures a lexicon-trained encoder with its
lexicon removed, not the value of the lexicon; here each variant is pretrained from scratch.
Pure functions over in-memory rows and configs: ``benchmarks/eval_sentiment.py`` and
``benchmarks/eval_ner.py`` feed them the committed artifacts, the test feeds them tiny real data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tasks.finetune.baseline import contamination
from tasks.finetune.config import FinetuneConfig
from tasks.finetune.train import finetune
from tasks.ner.config import NerConfig
from tasks.ner.train import run_hmm_eval, train_ner
from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.stage import train
from tasks.training.checkpoint import weights

VARIANTS = (("adapter on", True), ("adapter off", False))


def pretrain_variants(cfg: PretrainConfig, rows_factory: Callable[[int, int], Iterable[dict]], vocab_size: int,
                      word_vectors: np.ndarray, W: int) -> dict[str, dict[str, Any]]:
    """Pretrain both variants of ``cfg`` (only ``model.use_adapter`` differs) on the same row stream.
    Returns per variant {model_cfg, state (weights), heldout_mlm_acc, last_mlm_loss}."""
    out = {}
    for name, adapter in VARIANTS:
        c = cfg.model_copy(update={"model": cfg.model.model_copy(update={"use_adapter": adapter})})
        model, log = train(c, rows_factory, vocab_size, word_vectors, W, progress=False)
        out[name] = {"model_cfg": model.cfg, "state": weights(model),
                     "heldout_mlm_acc": log[-1].get("heldout_mlm_acc"), "last_mlm_loss": log[-1]["mlm_loss"]}
    return out


def sentiment_rows(variants: dict[str, dict[str, Any]], cfg: FinetuneConfig, featurizer) -> list[dict[str, Any]]:
    """Fine-tune every variant on the same split; one row per variant, then the baseline's row (same rows)."""
    rows, m = [], {}
    cfg = cfg.model_copy(update={"combine": "none"})  # the encoders compared alone, not stacked
    for name, v in variants.items():
        m = finetune(cfg, featurizer, v["model_cfg"], v["state"]).metrics
        rows.append({"model": f"LEBERT, {name}", **_scores(m, ""), "heldout_mlm_acc": v["heldout_mlm_acc"],
                     **_counts(m)})
    rows.append({"model": "baseline (TF-IDF char 1-2-gram LR)", **_scores(m, "baseline_"), "heldout_mlm_acc": None,
                 **_counts(m)})
    return rows


def _scores(m: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Test AUC / accuracy / F1, and on the uncontaminated test rows (None when every test row is clean)."""
    return {**{f"test_{k}": m[f"{prefix}test_{k}"] for k in ("auc", "accuracy", "f1")},
            **{f"clean_test_{k}": m.get(f"{prefix}clean_test_{k}") for k in ("auc", "accuracy")}}


def _counts(m: dict[str, Any]) -> dict[str, Any]:
    """The contamination and row counts of a fine-tuning's metrics."""
    return {k: m.get(k) for k in ("contaminated_test_rows", "n_train", "n_test", "n_clean_test")}


def ner_rows(variants: dict[str, dict[str, Any]], cfg: NerConfig, featurizer, max_len: int) -> list[dict[str, Any]]:
    """Train the tagger on every variant (the adapter used iff the encoder has one); one row each, then the
    HMM's on the same sentences. ``test_f1`` is entity-level, exact span and type."""
    rows, res = [], None
    for name, v in variants.items():
        c = cfg.model_copy(update={"use_adapter": v["model_cfg"].use_adapter})
        res = train_ner(c, featurizer, v["model_cfg"], v["state"], max_len)
        rows.append({"model": f"LEBERT, {name}", "test_f1": res.metrics["test_f1"], "dev_f1": res.metrics["dev_f1"],
                     "heldout_mlm_acc": v["heldout_mlm_acc"], "best_epoch": res.metrics["best_epoch"]})
    sp = res.splits
    hmm = run_hmm_eval(sp.train, sp.dev, sp.test)
    rows.append({"model": "HMM", "test_f1": hmm["test_f1"], "dev_f1": hmm["dev_f1"], "heldout_mlm_acc": None,
                 "best_epoch": None})
    return rows


def overlap(train: Iterable[str], other: Iterable[str]) -> int:
    """Rows of ``other`` whose normalised text occurs among ``train`` (see ``contamination``)."""
    return contamination(list(train), list(other))


def warn(n: int, of: int, what: str) -> str:
    """The warning printed next to a metric when an evaluation file overlaps the training data ('' when clean)."""
    return f"  WARNING: {n} of {of} {what} rows also occur in the training data" if n else ""


def markdown(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    """A markdown table of ``rows`` (floats to 4 places, None as n/a)."""
    def cell(v: Any) -> str:
        return "n/a" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(cell(r.get(c)) for c in columns) + " |\n" for r in rows)
