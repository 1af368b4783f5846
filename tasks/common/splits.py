"""Deterministic train/dev/test splits and seeded subsamples, shared by fine-tuning and NER."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from tasks.common.text import normalize_text


def _unit_hash(seed: int, text: str) -> float:
    h = hashlib.blake2b(f"{seed}\x00{text}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def split_key(text: str) -> str:
    """The text a row's split hash reads: :func:`normalize_text` (what the features and the contamination
    count see), so near-duplicates (traditional/simplified, full/half width, spacing) share a split."""
    return normalize_text(text)


def split_rows(rows: list[dict[str, Any]], fractions: tuple[float, float, float], seed: int) -> tuple[list, list, list]:
    """Deterministic stratified split into (train, dev, test).

    Each row gets u = hash(seed, :func:`split_key` (text)) in [0,1); within each label the rows are ordered
    by (u, file position) and cut at round(n·train) and round(n·(train+dev)). A cut never falls inside
    a run of equal u, so texts equal after normalisation with the same label always share a split (no
    train/test leakage through near-duplicates). Independent of row order and of the other rows' texts."""
    labels = np.array([r["label"] for r in rows], np.int64)
    u = np.array([_unit_hash(seed, split_key(r["text"])) for r in rows], np.float64)
    assign = np.zeros(len(rows), np.int8)
    for c in np.unique(labels):  # 0/1, or the class indices of ``classes: any``
        idx = np.flatnonzero(labels == c)
        order = idx[np.lexsort((idx, u[idx]))]
        n = len(order)
        cuts = [round(n * fractions[0]), round(n * (fractions[0] + fractions[1]))]
        for j, k in enumerate(cuts):
            while 0 < k < n and u[order[k]] == u[order[k - 1]]:
                k += 1
            cuts[j] = max(k, cuts[j - 1]) if j else k
        assign[order[cuts[0] : cuts[1]]] = 1
        assign[order[cuts[1] :]] = 2
    return tuple([r for r, a in zip(rows, assign) if a == s] for s in range(3))  # type: ignore[return-value]


def subsample(rows: list[dict[str, Any]], cap: int | None, seed: int) -> list[dict[str, Any]]:
    """At most ``cap`` rows, a seeded uniform sample kept in file order."""
    if cap is None or len(rows) <= cap:
        return rows
    keep = np.sort(np.random.default_rng(seed).permutation(len(rows))[:cap])
    return [rows[i] for i in keep]

