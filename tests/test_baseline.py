"""The fine-tuning baseline (TF-IDF char 1-2-grams + logistic regression) and the train/test contamination count."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.train.baseline import baseline_metrics, comparison_markdown, contamination
from tasks.train.threshold import search_threshold

FILLER = list("我们今天去吃饭店里的东西还可以服务一般真")


def _rows(n: int, seed: int, start: int = 0) -> list[dict]:
    """Separable synthetic reviews: label 1 contains 好, label 0 contains 差, the rest is random filler."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        y = i % 2
        chars = list(rng.choice(FILLER, size=int(rng.integers(4, 14))))
        chars.insert(int(rng.integers(0, len(chars) + 1)), "好" if y else "差")
        rows.append({"row_id": start + i, "text": "".join(chars), "label": y})
    return rows


def test_baseline_beats_chance_on_separable_text_and_is_deterministic():
    train, dev, test = _rows(200, 0), _rows(40, 1, 1000), _rows(40, 2, 2000)
    m = baseline_metrics(train, dev, test)
    assert m["baseline_test_auc"] > 0.95 and m["baseline_test_accuracy"] > 0.9 and m["baseline_test_f1"] > 0.9, m
    assert round(m["baseline_threshold"] * 100) in range(1, 100)
    assert baseline_metrics(train, dev, test) == m  # fixed solver and random_state: the same numbers every run


def test_baseline_uses_train_rows_and_the_dev_threshold_rule():
    train, dev, test = _rows(200, 0), _rows(40, 1, 1000), _rows(40, 2, 2000)
    m = baseline_metrics(train, dev, test)
    # test labels never reach the fit or the threshold: flipping them mirrors the test metrics only
    flipped = [{**r, "label": 1 - r["label"]} for r in test]
    f = baseline_metrics(train, dev, flipped)
    assert f["baseline_threshold"] == m["baseline_threshold"]
    assert f["baseline_test_auc"] == pytest.approx(1 - m["baseline_test_auc"], abs=1e-6)
    # the threshold is the model's rule applied to the baseline's dev probabilities
    from tasks.common.text import normalize_text
    from tasks.train.baseline import fit_baseline

    model = fit_baseline([normalize_text(r["text"]) for r in train], [r["label"] for r in train])
    prob = model.predict_proba([normalize_text(r["text"]) for r in dev])[:, 1]
    assert m["baseline_threshold"] == search_threshold([r["label"] for r in dev], prob).threshold
    # no test rows: the test metrics are None, the threshold is still picked on dev
    empty = baseline_metrics(train, dev, [])
    assert (empty["baseline_test_auc"], empty["baseline_test_f1"], empty["contaminated_test_rows"]) == (None, None, 0)
    assert empty["baseline_threshold"] == m["baseline_threshold"]


def test_contamination_counts_duplicates_after_normalisation():
    train = ["这家酒店服务很好", "房间干净ABC123", "早餐 不错", "位置方便"]
    others = [
        "這家酒店服務很好",  # traditional Chinese of a train text
        "房间干净ＡＢＣ１２３",  # full-width letters and digits
        "  早餐\u3000不错 ",  # ideographic space and padding
        "位置方便",  # exact copy
        "位置很方便",  # a near-duplicate is not a duplicate
        "隔音太差",
    ]
    assert contamination(train, others) == 4
    assert contamination(train, []) == 0 and contamination([], others) == 0

    def rows(texts: list[str], start: int) -> list[dict]:
        return [{"row_id": start + i, "text": t, "label": i % 2} for i, t in enumerate(texts)]

    train_rows = rows(train + [f"{t}，还会再来" for t in train] + ["隔壁很吵", "价格便宜"], 0)
    m = baseline_metrics(train_rows, rows(others[:2] + ["非常满意", "失望"], 100), rows(others, 200))
    assert (m["contaminated_test_rows"], m["contaminated_dev_rows"]) == (4, 2)


def test_comparison_markdown_puts_model_beside_baseline():
    m = {"test_auc": 0.81, "baseline_test_auc": 0.9, "test_accuracy": 0.7, "baseline_test_accuracy": 0.8,
         "test_precision": 0.6, "test_recall": 0.5, "test_f1": 0.55, "baseline_test_f1": 0.85, "threshold": 0.42,
         "baseline_threshold": 0.5, "n_train": 256, "n_dev": 30, "n_test": 30, "contaminated_test_rows": 3,
         "contaminated_dev_rows": 1}
    md = comparison_markdown(m)
    assert "| test AUC | 0.8100 | 0.9000 |" in md and "| test F1 | 0.5500 | 0.8500 |" in md
    assert "| test recall | 0.5000 | — |" in md and "| threshold (picked on dev) | 0.4200 | 0.5000 |" in md
    assert "3 of 30 test rows and 1 of 30 dev rows" in md and "same 256 training rows" in md
    old = comparison_markdown({"test_auc": 0.8})  # a finetune-2 manifest: no baseline recorded
    assert "| test AUC | 0.8000 | n/a |" in old and "Contamination: n/a of n/a" in old


def test_finetune_reports_the_baseline_without_changing_the_model(tmp_path, monkeypatch):
    import torch

    from models import LebertForPretraining
    from tasks.common.config import FinetuneConfig
    from tasks.train import finetune as ft
    from tasks.train.checkpoint import weights
    from tests.test_finetune import _featurizer, _model_cfg, _synthetic_csv

    data = tmp_path / "s.csv"
    _synthetic_csv(data, n=160)
    cfg = FinetuneConfig(data_uri=str(data), max_len=32, use_layers=2, dropout=0.1, batch_size=16, lr=2e-3,
                         max_epochs=2, patience=2, threads=1, device="cpu")
    torch.manual_seed(1)
    mc = _model_cfg()
    enc = weights(LebertForPretraining(mc))
    with_baseline = ft.finetune(cfg, _featurizer(32), mc, enc)
    m = with_baseline.metrics
    assert m["baseline_test_auc"] > 0.9 and 0 < m["baseline_threshold"] < 1
    assert m["contaminated_test_rows"] == contamination([r["text"] for r in with_baseline.data.train],
                                                        [r["text"] for r in with_baseline.data.test])
    monkeypatch.setattr(ft, "baseline_metrics", lambda *a: {})
    without = ft.finetune(cfg, _featurizer(32), mc, enc)
    assert without.train.log == with_baseline.train.log  # bit-identical training: the baseline is separate code
    assert np.array_equal(without.test_prob, with_baseline.test_prob)
    keep = {k: v for k, v in m.items() if not k.startswith(("baseline_", "contaminated_")) and k != "wall_s"}
    assert {k: v for k, v in without.metrics.items() if k != "wall_s"} == keep
