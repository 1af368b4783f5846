"""Dev-threshold search: hand-checked optimum, tie rule, agreement with sklearn."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import f1_score, precision_score, recall_score

from tasks.finetune.threshold import search_threshold
from tests.staging import begin


def test_known_example():
    # t <= 0.10: TP3 FP2 -> 6/8; 0.11..0.35: TP3 FP1 -> 6/7 (best); 0.36..0.40: 4/6; 0.41..0.80: 4/5
    y = [0, 0, 1, 1, 1]
    p = [0.1, 0.4, 0.35, 0.8, 0.9]
    r = search_threshold(y, p)
    assert r.threshold == 0.35  # plateau 0.11..0.35: nearest to 0.5
    assert r.f1 == pytest.approx(6 / 7)
    assert len(r.table) == 99 and r.table[0]["threshold"] == 0.01 and r.table[-1]["threshold"] == 0.99
    row = next(t for t in r.table if t["threshold"] == 0.35)
    assert (row["precision"], row["recall"]) == (pytest.approx(0.75), 1.0)


def test_plateau_containing_half_picks_half():
    assert search_threshold([0, 1], [0.2, 0.8]).threshold == 0.5


def test_tie_equally_near_half_goes_to_the_lower():
    # F1 = 2/3 on t in 0.01..0.45 (TP2 FP2) and on t in 0.55..0.90 (TP1 FN1); lower in between.
    y = [1, 1, 0, 0]
    p = [0.45, 0.9, 0.5, 0.545]
    r = search_threshold(y, p)
    assert r.f1 == pytest.approx(2 / 3)
    assert r.threshold == 0.45


def test_table_matches_sklearn():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 500)
    p = np.clip(0.3 * y + rng.random(500) * 0.7, 0, 1).astype(np.float32)
    r = search_threshold(y, p)
    for row in r.table[::7]:
        pred = p.astype(np.float64) >= row["threshold"]
        assert row["f1"] == pytest.approx(f1_score(y, pred, zero_division=0))
        assert row["precision"] == pytest.approx(precision_score(y, pred, zero_division=0))
        assert row["recall"] == pytest.approx(recall_score(y, pred, zero_division=0))
    assert r.f1 == max(t["f1"] for t in r.table)


def test_no_positives_is_all_zero_and_picks_half():
    r = search_threshold([0, 0, 0], [0.1, 0.6, 0.9])
    assert r.f1 == 0.0 and r.threshold == 0.5


def test_stage_build_rereads_dev_predictions_and_checks_agreement():
    import io
    import json
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage.artifacts import ArtifactStore
    from tasks.common.stage import StageResult
    from tasks.finetune.threshold import build

    store = ArtifactStore(f"memory://th-{uuid.uuid4().hex}")
    y, p = [0, 0, 1, 1, 1], [0.1, 0.4, 0.375, 0.8, 0.9]  # float32-exact, as fine-tuning writes them
    ft = {}
    for chosen in (0.37, 0.5):  # fine-tuning's own choice: agreeing, then not
        w = begin(store, "finetune", f"f{chosen}")
        buf = io.BytesIO()
        pq.write_table(pa.table({"label": pa.array(y, pa.int8()), "prob": pa.array(p, pa.float32())}), buf)
        w.write_bytes("dev_predictions.parquet", buf.getvalue())
        w.write_bytes("threshold.json", json.dumps({"threshold": chosen}).encode())
        ft[chosen] = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    w = begin(store, "threshold", "t1")
    res = build(w, ft[0.37])
    assert isinstance(res, StageResult) and res.publish is None
    assert res.stats == {"in": 5, "out": 5, "rejected": {}} and res.rows == {"f1_table.parquet": 99}
    assert res.metrics == {"threshold": 0.37, "dev_f1": round(6 / 7, 6)}  # plateau 0.11..0.37: nearest 0.5
    art = w.commit(code_version="t", config={}, parents=[], stats=res.stats, metrics=res.metrics, rows=res.rows)
    assert json.loads(art.read_verified("threshold.json"))["threshold"] == 0.37
    with pytest.raises(RuntimeError, match="differs"):
        build(begin(store, "threshold", "t2"), ft[0.5])
