"""Entity-level precision / recall / F1 of BIO tag sequences (conlleval-style, exact match).

An entity counts as correct only when its type, start and end all match a gold entity; a
partial overlap or a wrong type is one false positive *and* one false negative. Tags may be in
any scheme :func:`tasks.inference.tags.to_bio` reads (a stray ``I-X`` starts an entity, as in
conlleval). ``precision = tp / predicted``, ``recall = tp / support`` (gold entities),
``f1 = 2pr / (p + r)``; each is 0.0 when its denominator is 0 (no division error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tasks.inference.tags import spans

__all__ = ["entity_prf", "prf"]


def prf(tp: int, n_pred: int, n_gold: int) -> dict[str, Any]:
    """Precision, recall and F1 from true positives, predicted and gold counts (0 where undefined)."""
    p = tp / n_pred if n_pred else 0.0
    r = tp / n_gold if n_gold else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return {"precision": p, "recall": r, "f1": f, "support": n_gold, "predicted": n_pred, "tp": tp}


def entity_prf(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Micro-averaged (``overall``) and per-type entity scores over a list of sentences.

    Returns ``{"overall": {...}, "per_type": {type: {...}}}`` where each ``{...}`` has
    ``precision``, ``recall``, ``f1``, ``support`` (gold entities), plus ``predicted`` and
    ``tp``. ``per_type`` holds every type seen in gold or pred, sorted by name. Raises
    ValueError when the sentence counts or a sentence's lengths differ."""
    if len(gold) != len(pred):
        raise ValueError(f"{len(gold)} gold sentences but {len(pred)} predicted")
    tp: dict[str, int] = {}
    n_gold: dict[str, int] = {}
    n_pred: dict[str, int] = {}
    for i, (g, p) in enumerate(zip(gold, pred)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold tags but {len(p)} predicted")
        gs, ps = set(spans(g)), set(spans(p))
        for kind, _, _ in gs:
            n_gold[kind] = n_gold.get(kind, 0) + 1
        for kind, _, _ in ps:
            n_pred[kind] = n_pred.get(kind, 0) + 1
        for kind, _, _ in gs & ps:
            tp[kind] = tp.get(kind, 0) + 1
    types = sorted(set(n_gold) | set(n_pred))
    per_type = {k: prf(tp.get(k, 0), n_pred.get(k, 0), n_gold.get(k, 0)) for k in types}
    overall = prf(sum(tp.values()), sum(n_pred.values()), sum(n_gold.values()))
    return {"overall": overall, "per_type": per_type}
