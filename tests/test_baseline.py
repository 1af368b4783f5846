"""The fine-tuning baseline (TF-IDF char 1-2-grams + logistic regression) and the train/test contamination count."""

from __future__ import annotations

import numpy as np
import pytest

from tasks.finetune.baseline import baseline_metrics, contamination
from tasks.finetune.report import comparison_markdown
from tasks.finetune.threshold import search_threshold

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
    from tasks.finetune.baseline import fit_baseline

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
    from tasks.finetune import train as ft
    from tasks.finetune.config import FinetuneConfig
    from tasks.training.checkpoint import weights
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
    # the encoder alone (no stacking): training and the encoder's predictions are bit-identical, the stacked
    # classifier's test figures are new keys beside them, and the encoder's own are kept as encoder_*
    alone = ft.finetune(cfg.model_copy(update={"combine": "none"}), _featurizer(32), mc, enc)
    assert alone.train.log == with_baseline.train.log  # bit-identical training: the baseline is separate code
    assert alone.metrics["blend"] is None and "encoder_test_auc" not in alone.metrics
    assert m["encoder_test_auc"] == alone.metrics["test_auc"] and m["encoder_threshold"] == alone.metrics["threshold"]
    assert set(m["blend"]) == {"w_encoder", "w_baseline", "bias"}
    # the shipped probabilities are the blend of the two logits; the threshold is picked on its dev probabilities
    z_dev = np.zeros(len(with_baseline.dev), np.float32)
    device = next(with_baseline.train.model.parameters()).device
    ft.predict(with_baseline.train.model, with_baseline.dev, 16, device, True, z_dev)
    from tasks.finetune.baseline import run_baseline
    from tasks.inference.blend import Blend

    base = run_baseline(with_baseline.data.train, with_baseline.data.dev, with_baseline.data.test)
    blend = Blend(**m["blend"])
    assert np.array_equal(with_baseline.dev_prob, blend.prob(z_dev, base.dev_logits))
    assert m["threshold"] == search_threshold(with_baseline.dev.labels, with_baseline.dev_prob).threshold
    keep = {k: v for k, v in m.items() if k.startswith(("baseline_", "contaminated_"))}
    assert {k: alone.metrics[k] for k in keep} == keep  # the same baseline on the same rows either way
    # the shipped classifier against the baseline, on the same test rows, with its resampling interval
    vs = m["test_auc_vs_baseline"]
    assert vs["diff"] == pytest.approx(m["test_auc"] - m["baseline_test_auc"], abs=2e-6)
    assert vs["ci95"][0] <= vs["diff"] <= vs["ci95"][1] and vs["seed"] == cfg.seed
    assert alone.metrics["test_auc_vs_baseline"]["diff"] == pytest.approx(
        alone.metrics["test_auc"] - m["baseline_test_auc"], abs=2e-6)  # the encoder alone when nothing is combined


def test_paired_auc_difference_interval_and_verdicts():
    from tasks.finetune.baseline import paired_auc_difference

    rng = np.random.default_rng(0)
    y = np.array([0, 1] * 100)
    good = y + rng.normal(0, 0.3, len(y))  # AUC near 1
    noise = rng.normal(0, 1, len(y))  # AUC near 0.5
    better = paired_auc_difference(y, good, noise, resamples=300, seed=3)
    assert better["diff"] > 0.3 and better["ci95"][0] > 0 and better["p_not_better"] == 0.0
    assert better["resamples"] == 300 and better == paired_auc_difference(y, good, noise, resamples=300, seed=3)
    worse = paired_auc_difference(y, noise, good, resamples=300, seed=3)
    assert worse["ci95"][1] < 0 and worse["p_not_better"] == 1.0
    same = paired_auc_difference(y, good, good, resamples=50)
    assert same["diff"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["p_not_better"] == 1.0
    a, b = y + rng.normal(0, 1, len(y)), y + rng.normal(0, 1, len(y))  # the same signal, independent noise
    tie = paired_auc_difference(y, a, b, resamples=300)
    assert tie["ci95"][0] < 0 < tie["ci95"][1] and 0 < tie["p_not_better"] < 1  # a tie: the interval holds 0
    assert paired_auc_difference(np.ones(5), np.arange(5), np.arange(5)) is None  # one class: no AUC
    assert paired_auc_difference(np.array([]), np.array([]), np.array([])) is None


def _sk_and_ours(train_texts, labels):
    from tasks.finetune.baseline import fit_baseline
    from tasks.inference.blend import BaselineModel

    sk = fit_baseline(train_texts, labels)
    return sk, BaselineModel.from_sklearn(sk)


def test_baseline_arrays_score_exactly_as_scikit_learn_and_survive_parquet():
    import io

    import pyarrow.parquet as pq

    from tasks.inference.blend import BaselineModel

    rows = _rows(300, 3)
    texts = [r["text"] for r in rows] + ["好  好", "ABC 差 abc", "  差\t\n好 "]
    sk, ours = _sk_and_ours(texts, [r["label"] for r in rows] + [1, 0, 1])
    probe = texts[:50] + ["", "   ", "完全没见过的字", "Hello  World好", "差差差差差", "好\u3000 好"]
    want = sk.decision_function(probe)
    assert np.allclose(ours.logits(probe), want, rtol=0, atol=1e-9)
    assert np.allclose(1 / (1 + np.exp(-ours.logits(probe))), sk.predict_proba(probe)[:, 1], rtol=0, atol=1e-12)
    buf = io.BytesIO()
    pq.write_table(ours.to_table(), buf)
    back = BaselineModel.from_table(pq.read_table(io.BytesIO(buf.getvalue())))
    assert np.array_equal(back.logits(probe), ours.logits(probe)) and back.intercept == ours.intercept
    with pytest.raises(ValueError, match="no intercept"):
        BaselineModel.from_table(ours.to_table().replace_schema_metadata({}))


def test_blend_is_fitted_on_dev_and_beats_either_part_when_they_disagree():
    from sklearn.metrics import roc_auc_score

    from tasks.finetune.baseline import fit_blend

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 4000)
    signal = 2.0 * y - 1.0
    z_a = signal + rng.normal(0, 1.5, y.size)  # two noisy, independent views of the same label
    z_b = 3.0 * (signal + rng.normal(0, 1.5, y.size))
    blend = fit_blend(y[:2000], z_a[:2000], z_b[:2000])
    assert blend == fit_blend(y[:2000], z_a[:2000], z_b[:2000])  # deterministic
    assert blend.w_encoder > 0 and blend.w_baseline > 0 and abs(blend.w_encoder / blend.w_baseline - 3) < 1.0
    auc = {k: roc_auc_score(y[2000:], z[2000:]) for k, z in (("a", z_a), ("b", z_b))}
    stacked = roc_auc_score(y[2000:], blend.prob(z_a[2000:], z_b[2000:]))
    assert stacked > max(auc.values()) + 0.01, (stacked, auc)
    p = blend.prob(z_a, z_b)
    assert p.dtype == np.float32 and np.all((p >= 0) & (p <= 1))


def test_comparison_markdown_with_a_blend_shows_the_encoder_alone():
    m = {"test_auc": 0.93, "encoder_test_auc": 0.89, "baseline_test_auc": 0.92, "threshold": 0.5,
         "encoder_threshold": 0.4, "baseline_threshold": 0.39, "blend": {"w_encoder": 0.7, "w_baseline": 1.1,
                                                                        "bias": -0.1}}
    md = comparison_markdown(m)
    assert "| test AUC | 0.9300 | 0.8900 | 0.9200 |" in md and "| test recall | n/a | — | — |" in md
    assert "w_encoder 0.7000, w_baseline 1.1000" in md


def test_a_stacked_bundle_labels_with_the_blend_of_both_logits(tmp_path):
    from tasks.common.text import normalize_text
    from tasks.inference.blend import Blend
    from tasks.inference.bundle import load_bundle
    from tasks.inference.sentiment import ClassifierScorer, _score_encoded, score_texts
    from tests.bundle_fixture import BLEND, make_tiny_bundle

    plain = load_bundle(make_tiny_bundle(str(tmp_path / "a")))
    stacked = load_bundle(make_tiny_bundle(str(tmp_path / "b"), blend=True))
    assert plain.blend is None and stacked.blend == Blend(**BLEND)
    texts = ["这家酒店服务很好", "隔音太差了，前台态度冷淡", "價格便宜", "ＡＢＣ失望", " \u3000 "]
    encs = stacked.featurizer.encode(texts)
    want = Blend(**BLEND).prob(_score_encoded(stacked.model, encs, 4, logits=True),
                               stacked.baseline.logits([normalize_text(t) for t in texts]))
    got = score_texts(stacked, texts, batch_size=2)
    assert np.array_equal(got, want) and not np.array_equal(got, score_texts(plain, texts))
    # the labeller's scorer: the same probabilities for the scorable rows; the last text is empty after normalisation
    probs, empty = ClassifierScorer(stacked, batch_size=3).score(texts)
    assert empty == {4} and np.array_equal(np.array(probs, np.float32), want[:4])


def test_out_of_fold_train_logits_come_from_models_that_never_saw_the_row():
    from tasks.common.text import normalize_text
    from tasks.finetune.baseline import fit_baseline, run_baseline
    from tasks.inference.blend import BaselineModel

    train, dev = _rows(60, 5), _rows(20, 6, 1000)
    run = run_baseline(train, dev, [])
    oof = run.train_logits_out_of_fold(folds=3)
    texts = [normalize_text(r["text"]) for r in train]
    y = np.array([r["label"] for r in train])
    held = np.arange(len(train)) % 3 == 1
    other = BaselineModel.from_sklearn(fit_baseline([t for t, h in zip(texts, held) if not h], y[~held]))
    assert np.array_equal(oof[held], other.logits([t for t, h in zip(texts, held) if h]))
    assert not np.allclose(oof, run.model.logits(texts))  # the full model scores its own rows more confidently


def test_residual_finetune_ships_baseline_plus_encoder():
    import tempfile
    from pathlib import Path

    import torch

    from models import LebertForPretraining
    from tasks.finetune import train as ft
    from tasks.finetune.baseline import run_baseline
    from tasks.finetune.config import FinetuneConfig
    from tasks.inference.blend import RESIDUAL
    from tasks.training.checkpoint import weights
    from tests.test_finetune import _featurizer, _model_cfg, _synthetic_csv

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "s.csv"
        _synthetic_csv(data, n=160)
        cfg = FinetuneConfig(data_uri=str(data), max_len=32, use_layers=2, dropout=0.1, batch_size=16, lr=2e-3,
                             max_epochs=2, patience=2, threads=1, device="cpu", combine="residual")
        torch.manual_seed(1)
        mc = _model_cfg()
        res = ft.finetune(cfg, _featurizer(32), mc, weights(LebertForPretraining(mc)))
    m = res.metrics
    assert m["combine"] == "residual" and m["blend"] == RESIDUAL.to_dict() and "encoder_test_auc" not in m
    base = run_baseline(res.data.train, res.data.dev, res.data.test)
    assert np.array_equal(res.dev.offset, base.dev_logits.astype(np.float32))  # dev is scored on top of the baseline
    z = np.zeros(len(res.dev), np.float32)
    device = next(res.train.model.parameters()).device
    ft.predict(res.train.model, res.dev, 16, device, True, z)
    assert np.array_equal(res.dev_prob, RESIDUAL.prob(z, base.dev_logits))
    assert m["test_auc"] > 0.9 and "baseline + residual encoder" in comparison_markdown(m)


def test_the_demo_summary_says_whether_the_difference_is_more_than_noise():
    from tasks.finetune.baseline import vs_baseline

    tie = {"diff": 0.000481, "ci95": [-0.0017, 0.0028], "p_not_better": 0.338, "resamples": 1000, "seed": 42}
    said = ("test AUC +0.0005 (95 % paired-bootstrap interval -0.0017 .. +0.0028, 1000 resamples): "
            "a tie: the interval holds 0")
    assert vs_baseline(tie) == said
    assert vs_baseline({**tie, "diff": 0.02, "ci95": [0.01, 0.03]}).endswith(": above the baseline")
    assert vs_baseline({**tie, "diff": -0.02, "ci95": [-0.03, -0.01]}).endswith(": below the baseline")
    # the Prefect report and the model card (both comparison_markdown) say the same under the table
    m = {"test_auc": 0.9111, "baseline_test_auc": 0.9106, "test_auc_vs_baseline": tie}
    assert f"\nShipped against the baseline: {said}.\n" in comparison_markdown(m)
    assert "Shipped against the baseline" not in comparison_markdown({"test_auc": 0.9111})  # older manifests


def test_test_rows_seen_in_training_are_scored_apart():
    """A given split may repeat training texts in test (ChnSentiCorp's standard split repeats 331 of 1,200): the
    uncontaminated test rows get their own figures for each scored model; none are recorded when all are clean."""
    from tasks.finetune.baseline import clean_test_line, clean_test_metrics, run_baseline
    from tasks.finetune.metrics import binary_metrics

    train, dev = _rows(60, 5), _rows(20, 6, 1000)
    test = _rows(20, 7, 2000) + [{**train[i], "row_id": 3000 + i} for i in (0, 3, 8)]
    run = run_baseline(train, dev, test)
    clean = run.unseen("test")
    assert clean.tolist() == [True] * 20 + [False] * 3
    assert int((~clean).sum()) == run.metrics["contaminated_test_rows"] == 3
    y = run.labels["test"]
    other = np.linspace(0.1, 0.9, len(y))
    got = clean_test_metrics(y, clean, {"": (other, 0.5), "baseline_": (run.test_prob, 0.4)})
    want = binary_metrics(y[:20], run.test_prob[:20], 0.4)
    assert got["n_clean_test"] == 20 and got["baseline_clean_test_auc"] == pytest.approx(want["auc"], abs=1e-6)
    assert got["baseline_clean_test_accuracy"] == pytest.approx(want["accuracy"], abs=1e-6)
    assert got["clean_test_auc"] == pytest.approx(binary_metrics(y[:20], other[:20], 0.5)["auc"], abs=1e-6)
    assert clean_test_metrics(y, np.ones(len(y), bool), {"": (other, 0.5)}) == {}  # nothing to set apart
    line = clean_test_line(got)
    assert line.startswith("On the 20 test rows whose text is not among the training rows: shipped AUC")
    assert "encoder alone" not in line and f"baseline AUC {got['baseline_clean_test_auc']:.4f}" in line
    assert line in comparison_markdown({"test_auc": 0.9, **got}) and clean_test_line({"test_auc": 0.9}) == ""


def test_the_stack_is_fitted_on_dev_rows_that_do_not_repeat_a_training_text(tmp_path):
    """Given splits may repeat training texts in dev (ChnSentiCorp: 338 of 1,200): the encoder has memorised those,
    so the stacking regression is fitted on the other dev rows; the threshold still uses every dev row."""
    import torch

    from models import LebertForPretraining
    from tasks.finetune import train as ft
    from tasks.finetune.baseline import fit_blend, run_baseline
    from tasks.finetune.config import FinetuneConfig
    from tasks.inference.blend import Blend
    from tasks.training.checkpoint import weights
    from tests.test_finetune import _featurizer, _model_cfg, _synthetic_csv

    for name, n, seed in (("train", 120, 0), ("dev", 40, 1), ("test", 40, 2)):
        _synthetic_csv(tmp_path / f"{name}.csv", n=n, seed=seed)
    train_lines = (tmp_path / "train.csv").read_text(encoding="utf-8").splitlines()
    with open(tmp_path / "dev.csv", "a", encoding="utf-8") as f:  # 10 training rows copied into dev
        f.write("\n".join(train_lines[1:11]) + "\n")
    cfg = FinetuneConfig(train_uri=str(tmp_path / "train.csv"), dev_uri=str(tmp_path / "dev.csv"),
                         test_uri=str(tmp_path / "test.csv"), max_len=32, use_layers=2, dropout=0.1, batch_size=16,
                         lr=2e-3, max_epochs=1, patience=1, threads=1, device="cpu")
    torch.manual_seed(1)
    mc = _model_cfg()
    res = ft.finetune(cfg, _featurizer(32), mc, weights(LebertForPretraining(mc)))
    m = res.metrics
    assert m["contaminated_dev_rows"] == 10 and m["n_dev"] == 50 and m["blend_fit_rows"] == 40
    z = np.zeros(len(res.dev), np.float32)
    ft.predict(res.train.model, res.dev, 16, next(res.train.model.parameters()).device, True, z)
    base = run_baseline(res.data.train, res.data.dev, res.data.test)
    unseen = base.unseen("dev")
    assert unseen.tolist() == [True] * 40 + [False] * 10
    want = fit_blend(res.dev.labels[unseen], z[unseen], base.dev_logits[unseen])
    assert Blend(**m["blend"]) == want and want != fit_blend(res.dev.labels, z, base.dev_logits)
    assert m["threshold"] == search_threshold(res.dev.labels, want.prob(z, base.dev_logits)).threshold
