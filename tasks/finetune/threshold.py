"""Decision threshold for a binary classifier: the F1-maximising cut on dev probabilities, and its stage."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage.artifacts import ArtifactRef, open_artifact
from storage.parquet import write_table
from tasks.common.context import StageContext
from tasks.common.stage import Stage, StageResult

ARGMAX_RULE = "arg-max over the K classes' probabilities (no threshold: the threshold stage applies to K = 2 only)"
RULE = "max F1 over t in 0.01..0.99 (step 0.01), predict 1 when prob >= t; ties -> t nearest 0.5, then the lower t"


@dataclass
class ThresholdResult:
    """The chosen threshold, its dev F1 and the F1 table it was picked from."""

    threshold: float
    f1: float
    table: list[dict[str, float]] = field(default_factory=list)  # one row per candidate t


def search_threshold(y_true: Any, prob: Any) -> ThresholdResult:
    """Pick the threshold t in {0.01, 0.02, …, 0.99} that maximises F1 of ``prob >= t`` vs ``y_true``.

    Rule: predict 1 when prob >= t. F1 = 2TP / (2TP + FP + FN), 0 when that denominator is 0
    (sklearn's ``zero_division=0``); precision and recall are 0 on a zero denominator likewise.
    The candidate with the highest F1 wins; exact ties go to the t nearest 0.5, and if two are
    equally near (0.5 - d and 0.5 + d), to the lower one. F1 is one correctly rounded division of
    integers, so mathematically equal F1 values compare equal and ties are exact.

    Vectorised: O(N log N) via sorting, no [thresholds x N] matrix.
    """
    y = np.asarray(y_true).astype(bool).ravel()
    p = np.asarray(prob, dtype=np.float64).ravel()
    if y.shape != p.shape:
        raise ValueError(f"y_true has {y.size} values, prob has {p.size}")
    cents = np.arange(1, 100)  # integer cents: exact distances to 50
    thresholds = np.round(cents / 100, 2)
    pos = np.sort(p[y])
    neg = np.sort(p[~y])
    tp = pos.size - np.searchsorted(pos, thresholds, side="left")  # positives with p >= t
    fp = neg.size - np.searchsorted(neg, thresholds, side="left")
    fn = pos.size - tp
    f1 = _safe_div(2 * tp, 2 * tp + fp + fn)
    precision = _safe_div(tp, tp + fp)
    recall = _safe_div(tp, tp + fn)
    best = int(np.lexsort((cents, np.abs(cents - 50), -f1))[0])  # primary key last: -f1, |t-0.5|, t
    table = [
        {"threshold": float(t), "precision": float(pr), "recall": float(rc), "f1": float(f)}
        for t, pr, rc, f in zip(thresholds, precision, recall, f1)
    ]
    return ThresholdResult(threshold=float(thresholds[best]), f1=float(f1[best]), table=table)


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num, den = num.astype(np.float64), den.astype(np.float64)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


# ----------------------------------------------------------------------------- stage

CODE_VERSION = "threshold-1"


def build(writer, finetune_art) -> StageResult:
    """The threshold artifact: the search re-run on the best epoch's dev predictions. For a K > 2 class
    finetune the stage is skipped: ``threshold.json`` says ``threshold: null`` and the arg-max rule.

    Writes ``threshold.json`` (threshold, dev F1, rule) and ``f1_table.parquet`` (precision,
    recall and F1 for every candidate)."""
    has_config = "model_config.json" in finetune_art.files()
    classes = json.loads(finetune_art.read_verified("model_config.json")).get("classes") if has_config else None
    if classes is not None and len(classes) > 2:  # K classes: the label is the arg-max; nothing to pick
        info = {"threshold": None, "rule": ARGMAX_RULE, "classes": classes}
        writer.write_bytes("threshold.json", json.dumps(info, indent=1, ensure_ascii=False).encode())
        n = finetune_art.manifest.metrics.get("n_dev", 0)
        return StageResult({"in": n, "out": n, "rejected": {}}, {"threshold": None, "skipped": "K > 2 classes"}, {})
    dev = pq.read_table(io.BytesIO(finetune_art.read_verified("dev_predictions.parquet")))
    y, p = dev.column("label").to_numpy(), dev.column("prob").to_numpy()
    res = search_threshold(y, p)
    chosen = json.loads(finetune_art.read_verified("threshold.json"))
    if abs(chosen["threshold"] - res.threshold) > 1e-9:  # same predictions, same rule: must agree
        raise RuntimeError(f"threshold {res.threshold} differs from the one fine-tuning chose ({chosen['threshold']})")
    info = {"threshold": res.threshold, "dev_f1": res.f1, "rule": RULE}
    writer.write_bytes("threshold.json", json.dumps(info, indent=1).encode())
    write_table(writer, "f1_table.parquet", pa.Table.from_pylist(res.table))
    n = len(y)
    return StageResult({"in": n, "out": n, "rejected": {}}, {"threshold": res.threshold, "dev_f1": round(res.f1, 6)},
                       {"f1_table.parquet": len(res.table)})


def _build(ctx: StageContext, finetune_ref: ArtifactRef) -> StageResult:
    return build(ctx.writer, open_artifact(finetune_ref))


# no config section: the threshold is a function of the classifier's dev predictions alone
STAGE = Stage("threshold", CODE_VERSION, None, parents=("finetune_ref",), build=_build)
