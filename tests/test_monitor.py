"""Monitoring of label runs: the calibration and the estimator on synthetic data with a known answer, drift statistics,
the report of a tiny bundle's run (two and three classes), part files and rejects byte-identical with monitoring on
or off (and on resume), the alert event reaching a real Prefect server, and ``lexiflow monitor``."""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tasks.inference.reference import (
    COARSE,
    FINE,
    ConfusionSums,
    bin_counts,
    coarse_counts,
    confusion_of,
    edges,
    fit_isotonic,
    fit_platt,
    fit_temperature,
    true_metrics,
)
from tasks.label.config import MonitorConfig
from tasks.label.monitor import REPORT_FILE, ks_pvalue, population_stability
from tests.bundle_fixture import dev_texts, draw_labels, make_tiny_bundle

ENGLISH = ["the room was fine", "great value, would come back", "noisy and slow service", "ok", "terrible wifi",
           "breakfast was good", "not worth the price", "friendly staff", "dirty bathroom", "nice view"]


# ----------------------------------------------------------------------------- the estimator, known answers


def _known(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shipped probabilities ``p`` (overconfident), the true P(y=1) = ``q`` (a known monotone map) and labels."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 3, n)
    p = 1 / (1 + np.exp(-z))  # what the model says
    q = 1 / (1 + np.exp(-(0.5 * z + 0.3)))  # what is true: half as sure, shifted
    y = (rng.random(n) < q).astype(np.int64)
    return p, q, y


def test_the_estimator_with_the_true_probabilities_is_the_expected_confusion_matrix():
    p, q, y = _known(5000, 0)
    pred = (p >= 0.5).astype(np.int64)
    est = confusion_of(np.stack([1 - q, q], 1), pred).estimate()
    c = np.where(pred == 1, q, 1 - q)  # each row's chance of being right
    assert est["accuracy"] == pytest.approx(c.mean(), abs=1e-12)
    tp, fp, fn = (q * pred).sum(), ((1 - q) * pred).sum(), (q * (1 - pred)).sum()
    assert est["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn), abs=1e-12)
    assert est["accuracy_sd"] == pytest.approx(np.sqrt((c * (1 - c)).sum()) / len(c), rel=1e-9)


def test_the_intervals_cover_the_realised_accuracy_and_f1():
    """Labels redrawn 300 times from the true probabilities: the 95 % normal intervals (no calibration allowance)
    cover the realised accuracy and F1 about 95 % of the time."""
    p, q, _ = _known(2000, 1)
    pred = (p >= 0.5).astype(np.int64)
    est = confusion_of(np.stack([1 - q, q], 1), pred).estimate()
    rng = np.random.default_rng(2)
    hits = {"accuracy": 0, "f1": 0}
    for _ in range(300):
        got = true_metrics(pred, (rng.random(len(q)) < q).astype(np.int64), 2)
        for k in hits:
            hits[k] += abs(got[k] - est[k]) <= 1.96 * est[f"{k}_sd"]
    assert 0.9 <= hits["accuracy"] / 300 <= 0.99 and 0.9 <= hits["f1"] / 300 <= 0.99, hits


def test_calibration_recovers_the_known_map_and_the_estimate_holds_on_new_rows():
    p, q, y = _known(4000, 3)
    p2, q2, y2 = _known(20000, 4)
    pred2 = (p2 >= 0.5).astype(np.int64)
    truth = np.where(pred2 == 1, q2, 1 - q2).mean()  # the expected accuracy on the new rows
    for cal in (fit_platt(p, y), fit_isotonic(p, y)):
        got = cal.apply(p2)[:, 1]
        assert np.abs(got - q2).mean() < 0.03, cal.method
        est = confusion_of(cal.apply(p2), pred2).estimate()
        assert abs(est["accuracy"] - truth) < 0.01, (cal.method, est["accuracy"], truth)
    platt = fit_platt(p, y)  # the true map is exactly a Platt one: a = 0.5, b = 0.3
    assert platt.params["a"] == pytest.approx(0.5, abs=0.05) and platt.params["b"] == pytest.approx(0.3, abs=0.12)
    iso = fit_isotonic(p, y)
    assert np.all(np.diff(iso.params["y"]) >= 0) and 0 < min(iso.params["y"]) and max(iso.params["y"]) < 1


def test_temperature_recovers_the_known_temperature_and_macro_f1_is_estimated():
    rng = np.random.default_rng(5)
    z = rng.normal(0, 2, (6000, 3))
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    true = np.exp(z / 2.5) / np.exp(z / 2.5).sum(1, keepdims=True)  # the truth: temperature 2.5
    y = (rng.random(6000)[:, None] > np.cumsum(true, 1)).sum(1)
    cal = fit_temperature(p, y)
    assert cal.params["t"] == pytest.approx(2.5, rel=0.1)
    pred = p.argmax(1)
    est = confusion_of(cal.apply(p), pred).estimate()
    expected = confusion_of(true, pred).estimate()
    assert abs(est["accuracy"] - expected["accuracy"]) < 0.01 and abs(est["f1"] - expected["f1"]) < 0.01


def test_confusion_sums_add_over_shards_and_round_trip_json():
    p, q, _ = _known(1000, 6)
    pred = (p >= 0.5).astype(np.int64)
    whole = confusion_of(np.stack([1 - q, q], 1), pred)
    parts = ConfusionSums(2)
    for lo in range(0, 1000, 300):
        part = confusion_of(np.stack([1 - q[lo:lo + 300], q[lo:lo + 300]], 1), pred[lo:lo + 300])
        parts.merge(ConfusionSums.from_dict(json.loads(json.dumps(part.to_dict()))))
    assert parts.estimate() == pytest.approx(whole.estimate(), rel=1e-12)


def test_k_classes_are_calibrated_one_vs_rest_where_one_temperature_cannot():
    """A model over-sure of one class and under-sure of another: the per-class (one-vs-rest) calibration beats
    the single temperature out of sample, and its estimate of the accuracy holds on new rows."""
    from tasks.inference.reference import brier, fit_ovr_platt

    def draw(n, seed):
        rng = np.random.default_rng(seed)
        z = rng.normal(0, 2, (n, 3))
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)  # what the model says
        t = np.exp(z * [2.0, 1.0, 0.4]) / np.exp(z * [2.0, 1.0, 0.4]).sum(1, keepdims=True)  # the truth
        y = (rng.random(n)[:, None] > np.cumsum(t, 1)).sum(1)
        return p, t, y

    p, _, y = draw(6000, 50)
    p2, t2, y2 = draw(20000, 51)
    ovr, temp = fit_ovr_platt(p, y), fit_temperature(p, y)
    assert ovr.method == "ovr_platt" and len(ovr.params["a"]) == 3
    q = ovr.apply(p2)
    assert np.allclose(q.sum(1), 1.0) and brier(q, y2) < brier(temp.apply(p2), y2) - 0.005
    pred = p2.argmax(1)
    assert abs(confusion_of(q, pred).estimate()["accuracy"] - confusion_of(t2, pred).estimate()["accuracy"]) < 0.01


def test_the_reference_comes_from_test_rows_that_repeat_no_training_text(binary):
    """Test rows that chose nothing, training duplicates left out; dev only where too few test rows are left."""
    from tasks.bundle.bundle import MIN_TEST_ROWS, choose_reference
    from tasks.inference.sentiment import score_texts

    texts = dev_texts(300, seed=52)
    probs = score_texts(binary, texts)
    labels = draw_labels(probs, binary.threshold, 53)
    unseen = np.arange(300) % 4 != 0  # every fourth repeats a training text
    called = []

    def dev():
        called.append(1)
        return texts[:150], labels[:150], probs[:150], None

    ref = choose_reference((texts, labels, probs, unseen), dev, binary.featurizer, binary.threshold, None)
    assert ref["split"] == "test" and ref["rows_used"] == 225 and not called
    assert ref["split_note"].startswith("test rows that repeat no training text: 225 of 300")
    assert sum(ref["features"]["score"]["counts"]) == 225
    few = np.arange(300) < MIN_TEST_ROWS - 1
    ref = choose_reference((texts, labels, probs, few), dev, binary.featurizer, binary.threshold, None)
    assert ref["split"] == "dev" and ref["rows_used"] == 150 and called == [1]
    assert f"fewer than {MIN_TEST_ROWS}" in ref["split_note"]


# ----------------------------------------------------------------------------- drift statistics


def test_psi_and_ks_see_a_shift_and_not_chance():
    rng = np.random.default_rng(7)
    ref, same, moved = rng.normal(0, 1, 3000), rng.normal(0, 1, 3000), rng.normal(0.5, 1, 3000)
    fine, coarse = edges(ref, FINE), edges(ref, COARSE)
    r = bin_counts(ref, fine)
    assert coarse_counts(r, fine, coarse).tolist() == bin_counts(ref, coarse).tolist()  # deciles from percentiles

    def stats(x):
        c = bin_counts(x, fine)
        psi = population_stability(coarse_counts(c, fine, coarse), coarse_counts(r, fine, coarse))
        d = np.max(np.abs(np.cumsum(c)[:-1] / len(x) - np.cumsum(r)[:-1] / len(ref)))
        return psi, d, ks_pvalue(d, len(x), len(ref))

    psi, _, p = stats(same)
    assert psi < 0.02 and p > 0.01
    psi, d, p = stats(moved)
    assert psi > 0.2 and p < 1e-6
    from scipy.stats import ks_2samp

    exact = ks_2samp(moved, ref, method="asymp")
    assert d == pytest.approx(exact.statistic, abs=0.011)  # the percentile grid: within a percent


def test_ks_pvalue_matches_scipys_asymptotic_distribution():
    from scipy.stats import kstwobign

    for d, n, m in ((0.02, 3000, 3000), (0.05, 1000, 800), (0.1, 200, 300), (0.01, 10**6, 3500)):
        ne = n * m / (n + m)
        lam = (np.sqrt(ne) + 0.12 + 0.11 / np.sqrt(ne)) * d
        assert ks_pvalue(d, n, m) == pytest.approx(kstwobign.sf(lam), abs=1e-6)


def test_ks_pvalue_matches_scipy_in_both_branches_of_its_series():
    """Both series are reached: lambda < 1.18 (the theta-function form) and above (the alternating sum, whose factor
    2 is the distribution's): each against scipy's Kolmogorov distribution."""
    from scipy.stats import kstwobign

    lams = []
    for d, n, m in ((0.03, 1000, 1000), (0.08, 500, 400), (0.2, 100, 100), (0.06, 3000, 2000), (0.3, 80, 90)):
        ne = n * m / (n + m)
        lam = (np.sqrt(ne) + 0.12 + 0.11 / np.sqrt(ne)) * d
        lams.append(lam)
        assert ks_pvalue(d, n, m) == pytest.approx(kstwobign.sf(lam), rel=1e-9, abs=1e-15), (d, n, m)
    assert min(lams) < 1.18 < max(lams) and sum(lam > 1.18 for lam in lams) >= 2
    assert ks_pvalue(0.0, 10, 10) == 1.0 and ks_pvalue(0.5, 0, 10) == 1.0


def test_the_ks_distance_on_the_grid_is_scipys_two_sample_statistic_on_discrete_values():
    """Integer-valued features (every value an edge of the grid): the binned distance is exactly scipy's."""
    from scipy.stats import ks_2samp

    rng = np.random.default_rng(30)
    ref = rng.integers(0, 40, 2000)
    cur = np.minimum(rng.integers(0, 40, 700) + rng.integers(0, 3, 700), 39)
    grid = np.arange(39, dtype=np.float64)  # (-inf, 0], (0, 1], ..., (38, inf): one bin per value
    r, c = bin_counts(ref, grid), bin_counts(cur, grid)
    d = float(np.max(np.abs(np.cumsum(c)[:-1] / len(cur) - np.cumsum(r)[:-1] / len(ref))))
    assert d == pytest.approx(ks_2samp(cur, ref).statistic, abs=1e-12)


def test_psi_is_the_hand_computed_sum_with_half_a_row_of_smoothing():
    a, e = np.array([10, 20, 70, 0]), np.array([30, 30, 40, 1])
    sa, se = [10.5, 20.5, 70.5, 0.5], [30.5, 30.5, 40.5, 1.5]
    ta, te = sum(sa), sum(se)  # 102 and 103
    hand = sum((x / ta - y / te) * np.log((x / ta) / (y / te)) for x, y in zip(sa, se))
    assert population_stability(a, e) == pytest.approx(hand, rel=1e-12)
    assert population_stability(e, e) == 0.0
    assert population_stability(a, e) == pytest.approx(population_stability(e, a), rel=1e-12)  # symmetric


def test_jensen_shannon_is_scipys_and_the_characters_are_counted_over_shards():
    from scipy.spatial.distance import jensenshannon

    from tasks.inference.reference import char_counts, char_index, jensen_shannon

    p, q = np.array([5, 0, 3, 2, 0]), np.array([1, 4, 3, 0, 2])
    assert jensen_shannon(p, q) == pytest.approx(jensenshannon(p, q, base=2) ** 2, rel=1e-12)
    assert jensen_shannon(p, p) == 0.0 and np.isnan(jensen_shannon(p, np.zeros(5)))
    from sklearn.metrics import roc_auc_score

    from tasks.inference.reference import binned_auc

    rng = np.random.default_rng(63)
    a, r = rng.integers(0, 30, 400), rng.integers(3, 33, 500)  # every value its own bin: the exact AUC
    grid = np.arange(40, dtype=np.float64)
    want = roc_auc_score(np.r_[np.ones(400), np.zeros(500)], np.r_[a, r])
    assert binned_auc(bin_counts(a, grid), bin_counts(r, grid)) == pytest.approx(want, rel=1e-12)
    assert binned_auc([0, 0], [1, 2]) is None
    index = char_index(["好", "差"])
    assert char_counts(["好 好差", "xy好"], index).tolist() == [3, 1, 2]
    assert (char_counts(["好 好差"], index) + char_counts(["xy好"], index)).tolist() == [3, 1, 2]


def test_content_drift_is_seen_in_what_the_texts_say_and_the_telling_characters_listed(binary, tmp_path):
    ref = binary.reference.data["content"]
    assert len(ref["chars"]) + 1 == len(ref["counts"]) and set(ref["null_js"]) == {"50", "200"}  # 400 rows
    same = _label(binary, _input(tmp_path, dev_texts(300, seed=60)), str(tmp_path / "same"))["monitor"]["content"]
    assert not same["drift"] and same["js"] < same["threshold"] and same["threshold"] >= ref["null_js"]["200"]
    assert abs(same["surprise_auc"] - 0.5) < 0.1
    # the same lengths, other characters: a topic change the length features cannot see
    rng = np.random.default_rng(61)
    texts = dev_texts(300, seed=62)
    hot = ref["chars"][-3:]  # three of the reference's rarest characters, now half of every text
    moved = ["".join(rng.choice(hot) if rng.random() < 0.5 else c for c in t) for t in texts]
    rep = _label(binary, _input(tmp_path, moved, "moved.csv"), str(tmp_path / "moved"))["monitor"]
    content = rep["content"]
    assert content["drift"] and "content" in rep["drift"] and content["js"] > 3 * content["threshold"]
    assert content["surprise_auc"] > 0.9  # the run's texts are far more surprising than the reference's own
    assert content["telling"][0]["char"] in hot and content["telling"][0]["more_in"] == "run"
    assert any(w.startswith("drift in") and "content" in w for w in rep["warnings"]) and not rep["features"][
        "length"]["drift"]
    from tasks.label.monitor import report_markdown

    assert f"`{content['telling'][0]['char']}` (more often)" in report_markdown(rep)


def test_lexicon_words_are_counted_over_shards_and_named_from_the_word_vocabulary():
    from types import SimpleNamespace

    from tasks.inference.reference import name_words, word_counts, word_lut, words_reference

    def enc(*rows):  # an encoding's word slots: [CLS], one row of word ids per character, [SEP]
        return SimpleNamespace(word_ids=np.array([[0, 0], *rows, [0, 0]], np.int64))

    encs = [enc([3, 0], [3, 5]), enc([5, 0]), enc([7, 3], [0, 0])]
    ref = words_reference(encs)
    assert ref["ids"] == [3, 5, 7] and ref["counts"] == [3, 2, 1, 0]  # most frequent first, then by id
    lut = word_lut([5, 3])
    assert word_counts(encs, lut).tolist() == [2, 3, 1]  # 5, 3, then any other word (7)
    assert (word_counts(encs[:1], lut) + word_counts(encs[1:], lut)).tolist() == [2, 3, 1]
    assert word_counts([enc([40, 0])], lut).tolist() == [0, 0, 1]  # an id past the table: the other bucket
    named = name_words({"content": {"words": dict(ref)}}, ["[PAD]", "[UNK]", "x", "酒店", "y", "服务"])
    assert named["content"]["words"]["words"] == ["酒店", "服务", "#7"]


def test_lexicon_word_drift_sees_words_where_the_characters_are_the_same(binary, tmp_path):
    """Two nights with the same characters in the same numbers: in one, 干 and 净 stand apart; in the other they
    form the lexicon word 干净 (one of the reference's). Only the words tell them apart."""
    ref = binary.reference.data["content"]["words"]
    assert ref["words"] is not None and len(ref["ids"]) + 1 == len(ref["counts"])
    texts = dev_texts(300, seed=64)
    apart = [f"干{t}净" for t in texts]
    together = [f"干净{t}" for t in texts]
    a = _label(binary, _input(tmp_path, apart, "apart.csv"), str(tmp_path / "apart"))["monitor"]
    b = _label(binary, _input(tmp_path, together, "together.csv"), str(tmp_path / "together"))["monitor"]
    assert a["content"]["js"] == pytest.approx(b["content"]["js"], abs=1e-9)  # the same characters
    words = b["content"]["words"]
    assert "words" in b["drift"] and words["js"] > words["threshold"] > 0
    assert words["telling"][0]["word"] == "干净" and words["telling"][0]["more_in"] == "run"
    assert a["content"]["words"]["js"] < words["js"] / 3 and "words" not in a["drift"]
    from tasks.label.monitor import report_markdown

    assert "`干净` (more often)" in report_markdown(b)


def test_psi_thresholds_come_from_the_references_own_chunks_where_it_has_them(binary, tmp_path):
    """The reference records the largest PSI its bootstrapped chunks show (no shift at all); a feature's threshold
    is the larger of that and monitor.psi_threshold, at the chunk size nearest below the run's rows."""
    from tasks.inference.reference import bin_counts as counts
    from tasks.inference.reference import null_psi
    from tasks.label.monitor import psi_noise

    rng = np.random.default_rng(80)
    values = rng.normal(0, 1, 2500)
    coarse = edges(values, COARSE)
    null = null_psi(values, coarse)
    assert set(null) == {"50", "200", "1000"} and null["50"] > null["200"] > null["1000"] > 0
    chunk = values[np.random.default_rng(0).integers(0, 2500, 50)]  # the first draw, as null_psi draws it
    assert null["50"] >= population_stability(counts(chunk, coarse), counts(values, coarse))
    grid = {"null_psi": null}
    assert psi_noise(grid, 30) == null["50"] and psi_noise(grid, 199) == null["50"]
    assert psi_noise(grid, 200) == null["200"] and psi_noise(grid, 10**6) == null["1000"] and psi_noise({}, 5) is None
    rep = _label(binary, _input(tmp_path, dev_texts(60, seed=81)), str(tmp_path / "out"))["monitor"]
    f = rep["features"]["length"]
    assert f["reference_noise"] == binary.reference.data["features"]["length"]["null_psi"]["50"]
    assert f["psi_threshold"] == pytest.approx(max(0.2, f["reference_noise"]))


# ----------------------------------------------------------------------------- every rule, pinned one by one


def _synthetic_monitor(cfg: MonitorConfig, k: int = 2, dev_accuracy: float = 0.9):
    """A :class:`Monitor` on a hand-made reference: every input feature uniform on the integers 0..99 (1,000 rows),
    the score 0.125 or 0.875 (K > 2: 0.875, the top class's; both exact in float32), as :func:`_night`'s; the
    shipped probabilities as they are (identity calibration)."""
    from tasks.inference.reference import FEATURES, Reference
    from tasks.label.monitor import Monitor

    values = {f: np.arange(1000) % 100 for f in FEATURES}
    values["score"] = np.where(np.arange(1000) % 2, 0.875, 0.125) if k == 2 else np.full(1000, 0.875)
    feats = {}
    for f, v in values.items():
        fine = edges(v, FINE)
        feats[f] = {"fine": fine, "coarse": edges(v, COARSE), "counts": bin_counts(v, fine).tolist()}
    data = {"schema": "lexiflow.reference/1", "split": "dev", "rows": 1000, "rows_used": 1000,
            "classes": None, "num_classes": k, "threshold": 0.5 if k == 2 else None, "features": feats,
            "labels": [1000 // k] * k, "margins": {"0.05": 0.1},
            "calibration": {"method": "identity", "out_of_fold": {"true_accuracy": dev_accuracy,
                                                                   "true_f1": dev_accuracy, "ece": 0.0,
                                                                   "sd_accuracy": 0.0, "sd_f1": 0.0}}}
    return Monitor(Reference(data), 0.5 if k == 2 else None, cfg, "b0")


def _night(mon, n: int, shift: int = 0, sure: float = 0.875, seed: int = 32, feature: int = 0):
    """A sketch of ``n`` rows: input features as the reference's, ``feature`` moved up by ``shift``; probabilities
    ``sure`` or ``1 - sure`` (the estimated accuracy is ``sure``)."""
    rng = np.random.default_rng(seed)
    desc = np.tile((np.arange(n) % 100)[:, None], (1, 5)).astype(np.float64)
    desc[:, feature] = np.minimum(desc[:, feature] + shift, 99)
    probs = np.where(rng.random(n) < 0.5, sure, 1 - sure).astype(np.float32)
    return mon.sketch(0, None, probs, desc)


def _stats_of(mon, sketch):
    """(PSI, p-value) of the length feature computed here from the counts, independently of the report."""
    from scipy.stats import kstwobign

    grid = mon.ref.feature("length")
    cur, ref = np.asarray(sketch["features"]["length"], float), np.asarray(grid["counts"], float)
    psi = population_stability(coarse_counts(cur, grid["fine"], grid["coarse"]),
                               coarse_counts(ref, grid["fine"], grid["coarse"]))
    d = np.max(np.abs(np.cumsum(cur)[:-1] / cur.sum() - np.cumsum(ref)[:-1] / ref.sum()))
    ne = cur.sum() * ref.sum() / (cur.sum() + ref.sum())
    return psi, kstwobign.sf((np.sqrt(ne) + 0.12 + 0.11 / np.sqrt(ne)) * d)


def test_a_feature_drifts_only_when_both_its_psi_and_its_ks_pvalue_say_so():
    base = _synthetic_monitor(MonitorConfig())
    sk = _night(base, 400, shift=12)
    psi, p = _stats_of(base, sk)
    assert 0.05 < psi < 5 and 1e-12 < p < 0.5, (psi, p)
    cases = {  # (psi_threshold, ks_pvalue) -> drift
        (psi * 0.999, p * 1.001): True,  # both conditions hold
        (psi * 1.001, p * 1.001): False,  # the PSI is under its threshold
        (psi * 0.999, p * 0.999): False,  # the p-value is not below its threshold
        (psi * 1.001, p * 0.999): False,  # neither
        (psi * 0.999, min(p * 1e3, 0.99)): True,
    }
    for (thr, pv), want in cases.items():
        mon = _synthetic_monitor(MonitorConfig(psi_threshold=thr, ks_pvalue=pv, alert_on=["drift"]))
        rep = mon.report([sk], "v")
        f = rep["features"]["length"]
        assert f["psi"] == pytest.approx(psi, rel=1e-5) and f["ks_pvalue"] == pytest.approx(p, rel=1e-5)
        assert f["drift"] is want and (rep["drift"] == ["length"]) is want, (thr, pv)
        assert rep["alert"] is want  # drift is in alert_on here


def test_drift_alone_is_a_warning_unless_alert_on_names_it():
    sk = _night(_synthetic_monitor(MonitorConfig()), 2000, shift=40)
    rep = _synthetic_monitor(MonitorConfig()).report([sk], "v")
    assert rep["drift"] == ["length"] and not rep["alert"] and rep["alerts"] == []
    assert rep["warnings"] == ["drift in length"] and "ok (warning: drift in length)" in rep["summary"]
    rep = _synthetic_monitor(MonitorConfig(alert_on=["drift"])).report([sk], "v")
    assert rep["alert"] and rep["alerts"] == ["drift in length"] and rep["warnings"] == []


def test_the_metric_alerts_only_when_its_whole_interval_lies_below_the_floor():
    mon = _synthetic_monitor(MonitorConfig())
    sk = _night(mon, 1000, sure=0.8)
    est = mon.report([sk], "v")["estimate"]
    lo, hi = est["accuracy_interval"]
    assert est["accuracy"] == pytest.approx(0.8, abs=1e-6) and lo < 0.8 < hi
    for floor, want in ((hi + 1e-4, True), (hi - 1e-4, False), (0.8 + 1e-4, False), (lo, False)):
        rep = _synthetic_monitor(MonitorConfig(metric_floor=floor)).report([sk], "v")
        assert rep["estimate"]["below_floor"] is want and rep["alert"] is want, (floor, rep["estimate"])
        assert want == any(a.startswith("estimated accuracy 0.800") for a in rep["alerts"])
    # no metric_floor: the dev value minus max_drop (0.9 - 0.05 = 0.85 > hi)
    rep = _synthetic_monitor(MonitorConfig()).report([sk], "v")
    assert rep["estimate"]["floor"] == pytest.approx(0.85) and rep["alert"]
    rep = _synthetic_monitor(MonitorConfig(max_drop=0.2)).report([sk], "v")
    assert rep["estimate"]["floor"] == pytest.approx(0.7) and not rep["alert"]
    rep = _synthetic_monitor(MonitorConfig(alert_on=["data_quality"])).report([sk], "v")  # metric not asked for
    assert not rep["alert"] and rep["warnings"][0].startswith("estimated accuracy 0.800")
    rep = _synthetic_monitor(MonitorConfig(metric="f1")).report([sk], "v")  # the floor applies to f1 now
    assert rep["estimate"]["metric"] == "f1" and rep["estimate"]["floor"] == pytest.approx(0.85)


def test_data_quality_alerts_on_rejects_and_empty_runs_whatever_the_size():
    mon = _synthetic_monitor(MonitorConfig())
    sk = _night(mon, 300)
    ok = mon.report([sk], "v", {"in": 375, "out": 300, "rejected": {"empty_text": 75}})
    assert ok["data_quality"]["reject_share"] == 0.2 and not ok["alert"]  # 20 % is not above 20 %
    bad = mon.report([sk], "v", {"in": 376, "out": 300, "rejected": {"empty_text": 76}})
    assert bad["alert"] and bad["alerts"] == ["20.2% of the rows rejected > monitor.max_reject_share 20.0%"]
    empty = _night(mon, 0)
    every = mon.report([empty], "v", {"in": 50, "out": 0, "rejected": {"empty_text": 40, "missing_id": 10}})
    assert every["alert"] and every["alerts"] == ["every row rejected (50 of 50: empty_text 40, missing_id 10)"]
    assert "est. accuracy n/a" in every["summary"] and "ALERT" in every["summary"]
    nothing = mon.report([], "v", {"in": 0, "out": 0, "rejected": {}})
    assert nothing["alert"] and nothing["alerts"] == ["empty run: no input rows"]
    off = _synthetic_monitor(MonitorConfig(alert_on=["metric"])).report([empty], "v", {"in": 5, "out": 0,
                                                                                       "rejected": {"x": 5}})
    assert not off["alert"] and off["warnings"] == ["every row rejected (5 of 5: x 5)"]


def test_the_unseen_share_alerts_above_its_limit_as_data_quality_and_small_nights_hold_it_back():
    """Each condition of the unseen-rows rule, one at a time, on the rule itself."""
    from tasks.label.monitor import rules

    quality = {"in": 500, "out": 500, "rejected": 0, "rejected_by_reason": {}, "reject_share": 0.0}

    def verdict(share, n=500, **cfg):
        est = {"shift_correction": {"unsupported_share": share}, "below_floor": False}
        return rules(MonitorConfig(**cfg), n=n, drifted=[], estimate=est, quality=quality)

    assert not verdict(0.2)["alert"] and verdict(0.2)["warnings"] == []  # 20 % is not above 20 %
    above = verdict(0.201)
    assert above["alert"] and above["alerts"] == [
        "20.1% of the rows are unlike any reference row (score x length x script cells it has none in) > "
        "monitor.max_unseen_share 20.0%: the estimate cannot vouch for them"]
    assert not verdict(0.3, max_unseen_share=0.3)["alert"] and verdict(0.31, max_unseen_share=0.3)["alert"]
    off = verdict(0.5, alert_on=["metric"])  # data quality not asked for: a warning
    assert not off["alert"] and off["warnings"][0].startswith("50.0% of the rows are unlike")
    small = verdict(0.5, n=99)  # below min_rows a few odd texts are a large share: held back
    assert not small["alert"] and small["warnings"][1].startswith("50.0% of the rows are unlike")
    assert not rules(MonitorConfig(), n=500, drifted=[], estimate={"below_floor": False}, quality=quality)["alert"]


def test_a_small_run_holds_back_metric_and_drift_alerts_but_not_data_quality_ones():
    cfg = MonitorConfig(min_rows=100, alert_on=["metric", "data_quality", "drift"], metric_floor=0.99)
    mon = _synthetic_monitor(cfg)
    small = _night(mon, 99, shift=60, sure=0.6)
    rep = mon.report([small], "v", {"in": 99, "out": 99, "rejected": {}})
    assert not rep["alert"] and rep["warnings"][0] == "99 rows < monitor.min_rows 100: metric and drift raise no alert"
    assert rep["estimate"]["below_floor"] and rep["warnings"][2].startswith("drift in length")
    rep = mon.report([small], "v", {"in": 200, "out": 99, "rejected": {"empty_text": 101}})
    assert rep["alert"] and rep["alerts"] == ["50.5% of the rows rejected > monitor.max_reject_share 20.0%"]
    big = _night(mon, 100, shift=60, sure=0.6)
    rep = mon.report([big], "v")
    assert rep["alert"] and len(rep["alerts"]) == 2 and rep["alerts"][1].startswith("drift in length")


def test_the_estimate_is_corrected_for_the_runs_mix_and_its_interval_widens_with_the_shift():
    """A reference whose calibration overstates the accuracy by 0.2 on long texts: a run of long texts gets the
    correction (importance weights over score x length cells), a wider interval, and the share of its rows in
    cells the reference never saw added to the interval."""
    from tasks.inference.reference import cell_index

    mon = _synthetic_monitor(MonitorConfig())
    feats = mon.ref.data["features"]
    ref_len = np.arange(1000) % 100
    ref_score = np.where(np.arange(1000) % 2, 0.875, 0.125)
    idx = cell_index(ref_score, ref_len, feats)
    cells = (len(feats["score"]["coarse"]) + 1) * (len(feats["length"]["coarse"]) + 1)
    long = (ref_len >= 50).astype(float)
    n = np.bincount(idx, minlength=cells).astype(float)
    n_long = np.bincount(idx, weights=long, minlength=cells)
    n[cell_index(np.array([0.125, 0.875]), np.array([95.0, 95.0]), feats)] = 0  # over 89: no reference row
    mon.ref.data["shift"] = mon.shift = {"features": ["score", "length"], "n": n.tolist(),
                                         "residual": (-0.2 * n_long * (n > 0)).tolist(),
                                         "residual_sq": (0.04 * n_long * (n > 0)).tolist()}
    home_rep = mon.report([_night(mon, 1000)], "v")
    home = home_rep["estimate"]
    away_sketch = _night(mon, 1000, shift=50)
    away_rep = mon.report([away_sketch], "v")
    away = away_rep["estimate"]
    length = np.minimum(np.arange(1000) % 100 + 50, 99)
    u = float(np.mean(length > 89))
    corr = away["shift_correction"]
    assert corr["unsupported_share"] == pytest.approx(u) and corr["cbpe_accuracy"] == pytest.approx(0.875)
    # the unseen rows: held at 0.5 instead of the calibrated 0.875
    assert corr["bias"] == pytest.approx(-0.2 * (1 - u) + (0.5 - 0.875) * u, abs=1e-6)
    assert away["accuracy"] == pytest.approx(0.875 - 0.2 * (1 - u) + (0.5 - 0.875) * u, abs=1e-6)
    # at home 40 % of the rows are long and seen (50..89), 10 % long and unseen (90..99)
    assert home["shift_correction"]["bias"] == pytest.approx(-0.2 * 0.4 + (0.5 - 0.875) * 0.1, abs=1e-6)
    assert home["shift_correction"]["unsupported_share"] == pytest.approx(0.1)
    assert corr["effective_rows"] < home["shift_correction"]["effective_rows"]  # the weights concentrate
    below = {k: e["accuracy"] - e["accuracy_interval"][0] for k, e in (("home", home), ("away", away))}
    assert below["away"] >= below["home"] + (u - 0.1) / 2 - 1e-5  # the unseen share widens it (half each side)
    # corrected per cell, the measured residuals replace the dev figure's sd and the ECE allowance: not added twice
    terms = away["interval_terms"]["accuracy"]
    assert terms["calibration_sd"] == 0 and terms["allowance"] == 0 and terms["unseen"] == pytest.approx(u / 2)
    # the away night's lengths drift: the residuals may not carry over, so the correction's size is added too
    assert corr["cell_bias"] == pytest.approx(-0.2 * (1 - u), abs=1e-6)  # the residuals' part of the correction
    assert "length" in away_rep["drift"] and terms["shift"] == pytest.approx(0.2 * (1 - u), abs=1e-6)
    assert terms["half_width"] == pytest.approx(1.96 * terms["sampling_sd"] + u / 2 + 0.2 * (1 - u), abs=1e-5)
    assert home_rep["drift"] == [] and home["interval_terms"]["accuracy"]["shift"] == 0  # no drift: not added
    f1 = away["interval_terms"]["f1"]  # F1 has no cell correction: the dev sd and the ECE stay
    assert f1["allowance"] == away["calibration_allowance"] and f1["unseen"] == 0


def test_rows_in_another_script_widen_the_interval_and_move_the_estimate_to_the_truth():
    """A reference of CJK texts only, honestly calibrated; a night where every second text is in another script and
    the classifier, as sure as ever, is right on only 30 % of those: the script cells the reference never saw
    take the foreign rows out of the calibration's word, so the interval covers the true accuracy (score x length
    cells alone would keep the confident 0.875 and miss it)."""
    from tasks.inference.reference import shift_cells

    mon = _synthetic_monitor(MonitorConfig())
    rng = np.random.default_rng(5)
    feats = mon.ref.data["features"]
    m = 4000
    ref_probs = np.where(np.arange(m) % 2, 0.875, 0.125)
    ref_pred = (ref_probs > 0.5).astype(np.int64)
    ref_y = np.where(rng.random(m) < 0.875, ref_pred, 1 - ref_pred)  # the calibration holds at home
    values = {"score": ref_probs, "length": (np.arange(m) % 100).astype(float), "no_cjk": np.zeros(m)}
    mon.ref.data["shift"] = mon.shift = shift_cells(values, feats, ref_pred, ref_y, {"method": "identity"},
                                                    ref_probs)
    n = 2000
    desc = np.tile((np.arange(n) % 100)[:, None], (1, 5)).astype(np.float64)
    foreign = np.arange(n) % 2 == 1
    desc[:, 2] = foreign  # no_cjk
    probs = np.where(rng.random(n) < 0.5, 0.875, 0.125).astype(np.float32)
    right = rng.random(n) < np.where(foreign, 0.3, 0.875)
    truth = float(right.mean())
    est = mon.report([mon.sketch(0, None, probs, desc)], "v")["estimate"]
    lo, hi = est["accuracy_interval"]
    assert truth < 0.65 and lo <= truth <= hi
    assert est["shift_correction"]["unsupported_share"] == pytest.approx(0.5)
    assert abs(est["accuracy"] - truth) < abs(est["shift_correction"]["cbpe_accuracy"] - truth)
    assert hi - lo <= 0.5 + 0.1  # half the night unknown: no wider than that plus the sampling error


def test_k_classes_test_their_predicted_shares_against_the_reference():
    from scipy.stats import chisquare

    mon = _synthetic_monitor(MonitorConfig(alert_on=["drift"]), k=3)
    desc = np.tile((np.arange(600) % 100)[:, None], (1, 5)).astype(np.float64)
    even = np.eye(3)[np.arange(600) % 3] * 0.75 + 0.125  # predicted shares 1/3 each, as the reference's
    rep = mon.report([mon.sketch(0, None, even.astype(np.float32), desc)], "v")
    assert rep["labels"]["test"]["pvalue"] > 0.5 and not rep["alert"]
    skewed = np.eye(3)[(np.arange(600) % 5).clip(0, 2)] * 0.75 + 0.125  # shares 0.2, 0.2, 0.6
    rep = mon.report([mon.sketch(0, None, skewed.astype(np.float32), desc)], "v")
    test = rep["labels"]["test"]
    ref = chisquare([120, 120, 360], [200, 200, 200])  # the reference's 1000 rows are 333 each: near-equal shares
    assert test["dof"] == 2 and test["chi2"] == pytest.approx(ref.statistic, rel=1e-3)
    assert test["pvalue"] < 1e-6 and rep["alert"] and rep["alerts"][0].startswith("predicted-class shares moved")


# ----------------------------------------------------------------------------- a label run's report


def _bundle(classes=None):
    from tasks.inference.bundle import load_bundle

    return load_bundle(make_tiny_bundle(f"memory://mon-{uuid.uuid4().hex}", reference=True, classes=classes))


def _input(tmp_path: Path, texts: list[str], name: str = "in.csv") -> str:
    path = tmp_path / name
    pd.DataFrame({"id": [f"r{i}" for i in range(len(texts))], "review": texts}).to_csv(path, index=False)
    return str(path)


def _label(bundle, inp: str, out: str, monitor: MonitorConfig | None = None, **kw):
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream

    opts = LabelOptions(id_column="id", shard_rows=kw.pop("shard_rows", 150), threads=1)
    return label_stream(bundle, inp, out, opts, progress=False, monitor=monitor, **kw)


@pytest.fixture(scope="module")
def binary():
    return _bundle()


def test_in_domain_run_reports_no_drift_and_an_estimate_near_the_truth(binary, tmp_path):
    texts = dev_texts(600, seed=11)  # new texts from the dev distribution, labels from the fixture's known truth
    res = _label(binary, _input(tmp_path, texts + ["   "]), str(tmp_path / "out"))
    rep = res["monitor"]
    out = tmp_path / "out"
    manifest = json.loads((out / "_manifest.json").read_text())
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    assert REPORT_FILE in listed and json.loads((out / REPORT_FILE).read_text()) == rep  # committed with the output
    assert {"monitor-00000.json", "monitor-00003.json"} <= set(listed)  # one sketch per shard
    assert manifest["metrics"]["monitor"]["alert"] is False
    assert rep["rows"] == 600 and rep["drift"] == [] and not rep["alert"] and rep["estimate"]["reliable"]
    assert set(rep["features"]) == {"length", "unk_rate", "no_cjk", "lexicon_per_char", "num_rate", "score"}
    parts = pd.concat([pd.read_parquet(p) for p in sorted(out.glob("part-*.parquet"))])
    y = draw_labels(parts["prob"].to_numpy(), binary.threshold, 12)
    actual = (parts["label"].to_numpy() == y).mean()
    lo, hi = rep["estimate"]["accuracy_interval"]
    assert lo <= actual <= hi and abs(rep["estimate"]["accuracy"] - actual) < 0.06, (rep["estimate"], actual)
    near = (np.abs(parts["prob"].to_numpy().astype(np.float64) - binary.threshold) <= 0.05).mean()
    assert rep["near_decision"]["share"] == pytest.approx(near, abs=1e-6)
    assert rep["summary"].startswith(f"monitor {res['version']}: 600 rows") and rep["summary"].endswith("; ok")


def test_half_english_input_is_flagged_and_the_run_still_commits(binary, tmp_path):
    texts = dev_texts(400, seed=13)
    texts[::2] = [ENGLISH[i % len(ENGLISH)] + f" #{i}" for i in range(200)]
    res = _label(binary, _input(tmp_path, texts), str(tmp_path / "out"))
    rep = res["monitor"]
    assert (tmp_path / "out" / "_manifest.json").exists() and res["stats"]["out"] == 400
    assert "no_cjk" in rep["drift"] and rep["features"]["no_cjk"]["psi"] > 1
    assert not rep["estimate"]["reliable"] and any(w.startswith("drift in") for w in rep["warnings"])
    # half the rows in script cells the reference has none in: a data-quality alert; drift stays a warning
    assert rep["estimate"]["shift_correction"]["unsupported_share"] == pytest.approx(0.5, abs=0.02)
    assert rep["alert"] and rep["alerts"][0].startswith("50.") and "unlike any reference row" in rep["alerts"][0]
    assert not any(a.startswith("drift in") for a in rep["alerts"])
    tolerant = _label(binary, _input(tmp_path, texts), str(tmp_path / "out1"), MonitorConfig(max_unseen_share=0.6))
    assert tolerant["monitor"]["alert"] is tolerant["monitor"]["estimate"]["below_floor"]  # only the metric is left
    drift_too = _label(binary, _input(tmp_path, texts), str(tmp_path / "out2"),
                       MonitorConfig(alert_on=["metric", "data_quality", "drift"]))["monitor"]
    assert drift_too["alert"] and any(a.startswith("drift in") for a in drift_too["alerts"])
    assert "ALERT" in drift_too["summary"]


def test_monitoring_on_or_off_writes_the_same_part_files_rejects_and_version(binary, tmp_path):
    texts = dev_texts(300, seed=14) + ["", "hello", "  "]
    inp = _input(tmp_path, texts)
    on = _label(binary, inp, str(tmp_path / "on"))
    off = _label(binary, inp, str(tmp_path / "off"), MonitorConfig(enabled=False))
    tuned = _label(binary, inp, str(tmp_path / "tuned"), MonitorConfig(margin=0.2, psi_threshold=0.05))
    assert on["version"] == off["version"] == tuned["version"]
    assert off["monitor"] is None and not list((tmp_path / "off").glob("monitor*"))
    data = {d: sorted(p.name for p in (tmp_path / d).glob("*.parquet")) for d in ("on", "off", "tuned")}
    assert data["on"] == data["off"] == data["tuned"] and any(n.startswith("rejected-") for n in data["on"])
    for name in data["on"]:
        assert (tmp_path / "on" / name).read_bytes() == (tmp_path / "off" / name).read_bytes() == \
            (tmp_path / "tuned" / name).read_bytes(), name


def test_a_resumed_run_scores_again_the_shards_written_without_monitoring(binary, tmp_path):
    inp = _input(tmp_path, dev_texts(300, seed=15))
    out = tmp_path / "out"
    _label(binary, inp, str(out), MonitorConfig(enabled=False))
    parts = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")}
    (out / "_manifest.json").unlink()  # an unfinished run whose shards have no sketches
    res = _label(binary, inp, str(out))
    assert res["skipped_shards"] == 0 and res["monitor"]["rows"] == 300  # every shard scored again...
    assert {p.name: p.read_bytes() for p in out.glob("part-*.parquet")} == parts  # ...to the same bytes
    (out / "_manifest.json").unlink()
    again = _label(binary, inp, str(out))  # now every shard has its sketch: resumed, the same report
    assert again["skipped_shards"] == 2 and again["monitor"] == res["monitor"]
    cached = _label(binary, inp, str(out))
    assert cached["cached"] and cached["monitor"] == res["monitor"]


def test_shares_write_their_shards_sketches_and_the_coordinator_reports_what_one_process_does(binary, tmp_path):
    from tasks.label.config import LabelOptions
    from tasks.label.scale import label_scaled

    inp = _input(tmp_path, dev_texts(200, seed=22) + ["   "])
    one = _label(binary, inp, str(tmp_path / "one"), shard_rows=50)
    opts = LabelOptions(id_column="id", shard_rows=50, threads=1)
    many = label_scaled("label", binary.uri, inp, str(tmp_path / "many"), opts, shares=3, threads=1, scorer=binary,
                        monitor=MonitorConfig())
    assert many["skipped_shards"] == 5 and many["monitor"] == one["monitor"]  # shards by the shares, sketches read
    names = sorted(p.name for p in (tmp_path / "one").iterdir() if p.name != "_manifest.json")
    assert names == sorted(p.name for p in (tmp_path / "many").iterdir() if p.name != "_manifest.json")
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "many" / name).read_bytes(), name


def test_values_do_not_depend_on_the_bundle_carrying_a_reference(binary, tmp_path):
    """The reference changes what a bundle holds, not how it scores: the same weights label the same values."""
    from tasks.inference.bundle import load_bundle

    plain = load_bundle(make_tiny_bundle(f"memory://plain-{uuid.uuid4().hex}"))
    assert plain.reference is None
    inp = _input(tmp_path, dev_texts(100, seed=16))
    with_ref, without = _label(binary, inp, str(tmp_path / "a")), _label(plain, inp, str(tmp_path / "b"))
    assert without["monitor"] is None  # a bundle built before bundle-7: labelled, no report
    cols = ["row_id", "prob", "label", "threshold", "no_cjk", "truncated_at"]
    a = pd.read_parquet(tmp_path / "a" / "part-00000.parquet")[cols]
    b = pd.read_parquet(tmp_path / "b" / "part-00000.parquet")[cols]
    pd.testing.assert_frame_equal(a, b)
    assert with_ref["monitor"] is not None


def test_a_reference_built_before_bundle_8_still_monitors(binary):
    """A bundle-7 reference (dev rows, no content sketch, no shift cells, no chunk noise, a temperature for K > 2):
    the report has no content and no correction, and fixed thresholds."""
    import copy

    from tasks.inference.reference import Calibration, Reference
    from tasks.label.monitor import Monitor

    old = copy.deepcopy(binary.reference.data)
    for key in ("content", "shift", "split_note"):
        old.pop(key)
    for grid in old["features"].values():
        grid.pop("null_psi")
    mon = Monitor(Reference(old), binary.threshold, MonitorConfig(), "b7")
    texts = dev_texts(200, seed=90)
    from tasks.inference.sentiment import score_texts

    probs = np.asarray(score_texts(binary, texts), np.float32)
    desc = np.tile((np.arange(200) % 20)[:, None], (1, 5)).astype(np.float64)
    sk = mon.sketch(0, None, probs, desc, mon.count_chars(texts))
    assert sk["content"] is None and sk["cells"] is None and mon.valid(sk, 0, None)
    rep = mon.report([sk], "v")
    assert rep["content"] is None and "shift_correction" not in rep["estimate"]
    assert all(f["psi_threshold"] == 0.2 and f["reference_noise"] is None for f in rep["features"].values())
    temp = Calibration.from_dict({"method": "temperature", "t": 2.0})
    assert np.allclose(temp.apply(np.array([[0.7, 0.2, 0.1]])).sum(1), 1.0)


def test_three_classes_report_macro_f1_and_the_top_two_margin(tmp_path):
    bundle = _bundle(["neg", "mid", "pos"])
    res = _label(bundle, _input(tmp_path, dev_texts(500, seed=17)), str(tmp_path / "out"))
    rep = res["monitor"]
    assert rep["estimate"]["f1_kind"] == "macro over classes" and rep["labels"]["classes"] == ["neg", "mid", "pos"]
    assert rep["estimate"]["calibration"] in ("ovr_platt", "identity") and rep["drift"] == []
    parts = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "out").glob("part-*.parquet"))])
    probs = parts[[f"prob_{c}" for c in ("neg", "mid", "pos")]].to_numpy()
    y = draw_labels(probs, None, 18)
    pred = probs.argmax(1)
    actual = true_metrics(pred, y, 3)
    for key in ("accuracy", "f1"):
        lo, hi = rep["estimate"][f"{key}_interval"]
        assert lo <= actual[key] <= hi, (key, rep["estimate"], actual)
    top2 = np.sort(probs.astype(np.float64), 1)[:, -2:]
    assert rep["near_decision"]["share"] == pytest.approx(((top2[:, 1] - top2[:, 0]) <= 0.05).mean(), abs=1e-6)


def test_lexiflow_monitor_prints_one_row_per_run_and_draws_the_trend(binary, tmp_path):
    from typer.testing import CliRunner

    from lexiflow.cli import app

    root = tmp_path / "nightly"
    good = dev_texts(200, seed=19)
    bad = list(good)
    bad[::2] = ENGLISH * 10
    for texts, name in ((good, "a.csv"), (bad, "b.csv")):
        _label(binary, _input(tmp_path, texts, name), None, MonitorConfig(alert_on=["drift"]), output_root=str(root))
    png = tmp_path / "trend.png"
    res = CliRunner().invoke(app, ["monitor", str(root), "--out", str(png)])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 3 and sum("ALERT" in line for line in lines[:2]) == 1
    assert "drift=none" in "".join(lines[:2]) and "no_cjk" in "".join(lines[:2])
    newest = "ALERT" in lines[1]  # oldest first (two runs in one second: by version)
    assert json.loads(lines[-1]) == {"runs": 2, "alerts": 1, "without_report": 0, "newest_alert": newest,
                                     "png": str(png)}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    failing = CliRunner().invoke(app, ["monitor", str(root), "--fail-on-alert"])
    assert failing.exit_code == (3 if newest else 0)
    # one run's report edited after its commit: its row says so, the other run is still listed
    (report,) = [p for p in sorted(root.glob("*/monitor.json")) if '"alert": true' in p.read_text()]
    report.write_text(report.read_text().replace('"alert": true', '"alert": false'))
    res = CliRunner().invoke(app, ["monitor", str(root)])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 0 and len(lines) == 3, res.output
    assert json.loads(lines[-1]) == {"runs": 2, "alerts": 0, "without_report": 1, "newest_alert": False,
                                     "png": None}
    assert CliRunner().invoke(app, ["monitor", str(root), "--fail-on-alert"]).exit_code == 0
    assert f"(report unreadable: {report}: its sha256 does not match the manifest" in res.output
    missing = CliRunner().invoke(app, ["monitor", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and missing.output.startswith("error: ") and "nowhere" in missing.output
    bad = CliRunner().invoke(app, ["label", "--bundle", "x", "--input", "y", "--output", str(tmp_path / "z"),
                                   "--monitor-set", "psi_treshold=0.3"])
    assert bad.exit_code == 2 and bad.output.strip() == "error: psi_treshold: unknown key", bad.output


def test_small_nights_are_judged_together_with_the_earlier_nights_of_the_same_bundle(binary, tmp_path):
    root = tmp_path / "nightly"
    cfg = MonitorConfig(min_rows=100, alert_on=["drift"])
    nights = []
    for i in range(3):
        texts = dev_texts(60, seed=70 + i)
        texts[::2] = [ENGLISH[(i + j) % len(ENGLISH)] + f" {i}.{j}" for j in range(30)]
        nights.append(_label(binary, _input(tmp_path, texts, f"n{i}.csv"), None, cfg, output_root=str(root)))
    first, second, third = (n["monitor"] for n in nights)
    assert first["window"] == {"nights": [nights[0]["version"]], "rows": 60} and not first["alert"]
    assert first["warnings"][0] == "60 rows < monitor.min_rows 100: metric and drift raise no alert"
    # the second night alone is small; with the first it reaches min_rows: judged, and its drift alerts
    assert second["window"] == {"nights": [nights[1]["version"], nights[0]["version"]], "rows": 120}
    assert second["rows"] == 60 and second["alert"] and "no_cjk" in second["drift"]
    assert "with 1 earlier nights (120 rows)" in second["summary"]
    # newest first by commit time (two nights in one second tie): one earlier night is enough
    assert len(third["window"]["nights"]) == 2 and third["window"]["nights"][0] == nights[2]["version"]
    alone = _label(binary, _input(tmp_path, dev_texts(50, seed=79), "n9.csv"), None,
                   cfg.model_copy(update={"window": 1}), output_root=str(root))["monitor"]
    assert alone["window"]["rows"] == 50 and not alone["alert"]


def test_a_run_whose_text_column_is_empty_everywhere_alerts_and_fails_with_fail_on_alert(binary, tmp_path):
    from typer.testing import CliRunner

    from lexiflow.cli import app
    from lexiflow.cli.base import ALERT_EXIT

    inp = _input(tmp_path, [""] * 120)  # a renamed column upstream: every text empty
    res = _label(binary, inp, str(tmp_path / "out"))
    rep = res["monitor"]
    assert res["stats"]["out"] == 0 and rep["rows"] == 0 and rep["alert"]
    assert rep["alerts"] == ["every row rejected (120 of 120: empty_text 120)"]
    assert rep["data_quality"]["reject_share"] == 1.0 and "est. accuracy n/a" in rep["summary"]
    cli = CliRunner().invoke(app, ["label", "--bundle", binary.uri, "--input", inp, "--output",
                                   str(tmp_path / "cli"), "--id-column", "id", "--fail-on-alert"])
    assert cli.exit_code == ALERT_EXIT == 3, cli.output
    summary = [json.loads(line) for line in cli.output.splitlines() if line.startswith('{"uri"')]
    assert summary[-1]["stats"]["out"] == 0  # committed and summarised first
    again = CliRunner().invoke(app, ["label", "--bundle", binary.uri, "--input", inp, "--output",
                                     str(tmp_path / "cli"), "--id-column", "id"])
    assert again.exit_code == 0, again.output  # without the flag an alert is no failure
    ok = CliRunner().invoke(app, ["label", "--bundle", binary.uri, "--input", _input(tmp_path, dev_texts(150, 40),
                                                                                     "ok.csv"),
                                  "--output", str(tmp_path / "ok"), "--id-column", "id", "--fail-on-alert"])
    assert ok.exit_code == 0, ok.output


def test_the_table_artifact_gives_the_estimate_columns_of_its_own():
    from tasks.label.monitor import report_table

    mon = _synthetic_monitor(MonitorConfig())
    rep = mon.report([_night(mon, 400, sure=0.8)], "v", {"in": 500, "out": 400, "rejected": {"empty_text": 100}})
    rows = {r["what"]: r for r in report_table(rep)}
    assert all(set(r) == set(rows["length"]) for r in rows.values())  # one set of columns
    acc = rows["estimated accuracy"]
    assert (acc["estimate"], [acc["lower"], acc["upper"]]) == (rep["estimate"]["accuracy"],
                                                               rep["estimate"]["accuracy_interval"])
    assert acc["psi"] is acc["ks"] is acc["ks_pvalue"] is None and acc["reference"] == 0.9
    assert acc["flag"].startswith("BELOW FLOOR") and rows["length"]["estimate"] is None
    assert rows["rejected share"]["estimate"] == 0.2 and rows["rejected share"]["flag"] == ""


def test_a_cached_rerun_republishes_marked_cached_and_sends_no_second_event(binary, tmp_path, monkeypatch):
    import flows.label as fl
    from tasks.common.context import Runtime
    from tests.reporting import Recording

    sent = []
    monkeypatch.setattr(fl, "emit_drift", lambda res, uri: sent.append(res["version"]) or f"ev{len(sent)}")
    inp = _input(tmp_path, [""] * 10 + dev_texts(100, seed=41))  # 10 of 110 rejected...
    cfg = MonitorConfig(max_reject_share=0.05)  # ...above 5 %: a data-quality alert
    first, rt1 = _label(binary, inp, str(tmp_path / "out"), cfg), Runtime(reporter=Recording())
    assert first["monitor"]["alert"] and fl.publish_label(rt1, first, binary.uri) == "ev1"
    second, rt2 = _label(binary, inp, str(tmp_path / "out"), cfg), Runtime(reporter=Recording())
    assert second["cached"] and fl.publish_label(rt2, second, binary.uri) is None and sent == [first["version"]]
    descs = [a["description"] for a in rt2.reporter.artifacts if a["key"].startswith("label-monitor")]
    assert descs and all("(cached: committed by an earlier run)" in d for d in descs)
    assert not any("cached" in a["description"] for a in rt1.reporter.artifacts if a["key"] == "label-monitor")


def test_the_final_state_is_completed_and_says_whether_monitoring_alerted():
    from flows.label import final_state

    res = {"version": "abc", "monitor": {"alert": True, "alerts": ["every row rejected (3 of 3: empty_text 3)"]}}
    state = final_state(res)
    assert state.is_completed() and state.message == \
        "labelled abc; monitoring ALERT: every row rejected (3 of 3: empty_text 3)"
    assert final_state({"version": "abc", "monitor": {"alert": False}}).message == "labelled abc; monitoring ok"
    assert final_state({"version": "abc", "monitor": None}).message == "labelled abc"


def test_the_trend_marks_where_the_bundle_changed():
    from tasks.label.monitor import bundle_changes, trend_png

    rows = [{"created_at": f"2026-11-0{d}T03:00:00Z", "bundle": b, "estimate": 0.9, "interval": [0.88, 0.92],
             "alert": False, "drift": [], "max_psi": 0.1, "psi_threshold": 0.2, "metric": "accuracy"}
            for d, b in ((1, "aaa"), (2, "aaa"), (5, "bbb"), (6, "bbb"), (7, "aaa"))]
    assert bundle_changes(rows, list(range(5))) == [(2, "bbb"), (4, "aaa")]
    assert trend_png(rows)[:8] == b"\x89PNG\r\n\x1a\n"


def test_late_labels_give_the_realized_accuracy_beside_the_estimate(binary, tmp_path):
    """``lexiflow monitor --labels``: ids from an id column, or by position for the file the run labelled; the
    realized accuracy is the accuracy of the part files' labels against the file's; committed and checked."""
    from typer.testing import CliRunner

    from lexiflow.cli import app
    from tasks.label.realized import read_realized

    texts = dev_texts(300, seed=42) + ["   "]
    inp = _input(tmp_path, texts)
    out = tmp_path / "out"
    _label(binary, inp, str(out))
    parts = pd.concat([pd.read_parquet(p) for p in sorted(out.glob("part-*.parquet"))])
    y = draw_labels(parts["prob"].to_numpy(), binary.threshold, 43)
    truth = pd.DataFrame({"id": parts["row_id"].to_numpy()[::-1], "sentiment": y[::-1]})  # any order
    truth.iloc[:50].to_json(tmp_path / "late.jsonl", orient="records", lines=True)  # 50 labels arrived
    want = float((parts["label"].to_numpy()[-50:] == y[-50:]).mean())
    res = CliRunner().invoke(app, ["monitor", str(out), "--labels", str(tmp_path / "late.jsonl"),
                                   "--label-column", "sentiment", "--labels-id-column", "id"])
    assert res.exit_code == 0, res.output
    line = res.output.splitlines()[1]  # after "labels joined to <version>"
    assert line.startswith(f"realized accuracy {want:.4f} on 50 of 300 labelled rows; estimated "), line
    rep = read_realized(str(out))
    assert rep["accuracy"] == pytest.approx(want) and rep["rows_joined"] == 50
    assert f"realized_accuracy={want:.3f}" in res.output
    # ids by position (a run without --id-column): the labelled file itself with a label column added (the blank
    # row 300 is rejected, unmatched)
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream

    root = tmp_path / "nightly"  # a root: the labels go to its newest run
    out = Path(label_stream(binary, inp, None, LabelOptions(shard_rows=150, threads=1), progress=False,
                            output_root=str(root))["uri"])
    frame = pd.read_csv(inp)
    frame["label"] = list(draw_labels(parts["prob"].to_numpy(), binary.threshold, 44)) + [1]
    frame.to_csv(inp, index=False)
    res = CliRunner().invoke(app, ["monitor", str(root), "--labels", inp])
    assert f"labels joined to {out.name}" in res.output, res.output
    whole = float((parts["label"].to_numpy() == frame["label"].to_numpy()[:300]).mean())
    assert res.exit_code == 0 and f"realized accuracy {whole:.4f} on 300 of 300" in res.output, res.output
    edited = (out / "realized.json").read_text().replace('"rows_joined": 300', '"rows_joined": 1')
    (out / "realized.json").write_text(edited)
    with pytest.raises(ValueError, match="sha256 does not match"):
        read_realized(str(out))
    none = CliRunner().invoke(app, ["monitor", str(out), "--labels", str(tmp_path / "late.jsonl"), "--label-column",
                                    "sentiment"])  # ids by position: late.jsonl:0.. name no row of this run
    assert none.exit_code == 2 and "no label matches" in none.output, none.output


# ----------------------------------------------------------------------------- the alert reaches the server


@pytest.mark.flow
def test_an_alerting_label_flow_emits_the_drift_event_to_the_server(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    from flows.label import label_flow
    from storage.artifacts import canonical_store

    bundle_uri = make_tiny_bundle(str(tmp_path / "store"), reference=True)
    texts = dev_texts(300, seed=20)
    texts[::2] = ENGLISH * 15
    out = tmp_path / "out"
    res = label_flow(bundle_uri, _input(tmp_path, texts), str(out), monitor=MonitorConfig(alert_on=["drift"]))
    assert res["monitor"]["alert"] and (out / "_manifest.json").exists()
    EventsWorker.drain_all(timeout=30)
    import anyio

    async def events() -> list[dict]:
        async with get_client() as client:
            body = {"filter": {"event": {"name": ["lexiflow.label.drift"]},
                               "any_resource": {"id": [f"lexiflow.labelled.{canonical_store(str(out))}"]}},
                    "limit": 10}
            r = await client._client.post("/events/filter", json=body)
            r.raise_for_status()
            return r.json()["events"]

    import time

    deadline = time.monotonic() + 30
    while not (got := anyio.run(events)):
        assert time.monotonic() < deadline, "the drift event never reached the server"
        time.sleep(0.5)
    [event] = got
    assert event["payload"]["label_version"] == res["version"] and "no_cjk" in event["payload"]["drift"]
    related = {r["prefect.resource.role"]: r for r in event["related"]}
    assert related["bundle"]["lexiflow.bundle"] == canonical_store(bundle_uri)

    # what the drift-alert deployment runs with the event's fields (prefect.yaml's trigger templates them)
    from flows.label import drift_alert_flow

    done = drift_alert_flow(event["payload"]["output"], event["payload"]["label_version"], event_id=event["id"])
    assert done["alert"] and done["label_version"] == res["version"]
    with pytest.raises(ValueError, match="holds label version"):
        drift_alert_flow(event["payload"]["output"], "0" * 16)
    report = out / REPORT_FILE  # edited after its commit: the answer refuses it, as `lexiflow monitor` does
    report.write_text(report.read_text().replace('"alert": true', '"alert": false'))
    with pytest.raises(ValueError, match="sha256 does not match the manifest"):
        drift_alert_flow(event["payload"]["output"], event["payload"]["label_version"])
    with pytest.raises(ValueError, match="sha256 does not match the manifest"):  # nor does a cached rerun
        label_flow(bundle_uri, _input(tmp_path, texts), str(out), monitor=MonitorConfig(alert_on=["drift"]))
    state = label_flow(bundle_uri, _input(tmp_path, texts), str(tmp_path / "out2"),
                       monitor=MonitorConfig(alert_on=["drift"]), return_state=True)
    assert state.is_completed() and "monitoring ALERT: drift in" in state.message, state


@pytest.mark.flow
@pytest.mark.heavy  # a real `prefect server start`, `prefect deploy` and a worker: minutes on 2 cores
def test_the_drift_alert_deployment_answers_an_alerting_cli_label_run(tmp_path):
    """prefect.yaml's drift-alert deployment, deployed as is (its match pointed at this test's output root): a CLI
    label run against the server alerts, its event triggers a drift-alert run, a worker runs it, the run publishes
    the report as the drift-alert artifact."""
    import os

    import yaml

    from tests.prefect_server import BIN, REPO, deployed, run_ok, triggered_runs

    store = str(tmp_path / "store")
    bundle_uri = make_tiny_bundle(store, reference=True)
    texts = dev_texts(300, seed=21)
    texts[::2] = ENGLISH * 15
    inp = _input(tmp_path, texts)
    root = tmp_path / "labelled"
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    [dep] = [d for d in spec["deployments"] if d["name"] == "drift-alert"]
    dep["triggers"][0]["match"]["prefect.resource.id"] = f"lexiflow.labelled.{os.path.realpath(root)}/*"
    spec["deployments"] = [dep]
    with deployed(tmp_path, spec) as env:
        labelled = run_ok(env, str(BIN / "lexiflow"), "label", "--bundle", bundle_uri, "--input", inp,
                       "--output-root", str(root), "--id-column", "id", "--monitor-set", "alert_on=[drift]",
                       timeout=600)
        assert "ALERT" in labelled.stderr
        version = json.loads(labelled.stdout.strip().splitlines()[-1])["version"]

        from prefect.client.orchestration import SyncPrefectClient

        runs = triggered_runs(env["PREFECT_API_URL"], "drift-alert")
        assert runs[0].parameters["label_version"] == version
        run_ok(env, str(BIN / "prefect"), "worker", "start", "--pool", "lexiflow-process", "--run-once", timeout=600)
        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            [done] = triggered_runs(env["PREFECT_API_URL"], "drift-alert")
            assert done.state.is_completed(), done.state
            md = next(a.data for a in client.read_artifacts() if a.key == "drift-alert")
            assert version in md and "no_cjk" in md and "data:image/png;base64," in md


def _eval_record(false_alarms: float, err: float, half: float, covered: bool, alert: bool, truth: float) -> dict:
    case = {"rows": 100, "true_accuracy": truth, "estimated_accuracy": 0.8, "accuracy_interval": [0.78, 0.82],
            "error_points": round(100 * (0.8 - truth), 2), "half_width_points": 2.0, "covered": covered,
            "alert": alert, "below_floor": alert, "floor": 0.75, "truth_below_floor": truth < 0.75,
            "contaminated_rows": 0}
    return {"demo": {"bundle": "b", "heldout_rows": 500, "heldout_repeating_training": 3,
                     "unshifted_nights": {"nights": 200, "rows_per_night": 300, "false_alarm_rate": false_alarms,
                                          "alerts": int(200 * false_alarms), "alerts_if_drift_alerted": 9,
                                          "false_alarm_rate_if_drift_alerted": 0.045, "drift_warnings_by_feature": {},
                                          "mean_abs_error_points": 1.0, "mean_half_width_points": 4.0,
                                          "coverage": 0.96},
                     "in_domain": {"rows": 500, "error_points": err, "mean_half_width_points": half,
                                   "fold_rows": [100] * 5, "true_accuracy": 0.8, "estimated_accuracy": 0.8,
                                   "max_fold_error_points": 1.0, "covered_folds": 5, "contaminated_rows": 0},
                     "folds": [{"alert": False}] * 5, "cases": {"waimai": case}},
            "chnsenticorp": {"evaluated": False, "why": "not run"}}


def _module(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_monitoring_evaluation_targets_can_fail_and_render(tmp_path):
    """Every target of ``benchmarks/eval_monitor.py`` is met by good figures and missed by a bad one (no target
    passes whenever drift is flagged), and the quality page renders the record with its command and revision."""
    ev, gen = (_module(name, rel) for name, rel in (("eval_monitor", "benchmarks/eval_monitor.py"),
                                                     ("lexiflow_docs_gen", "docs/gen.py")))
    good = ev.targets(_eval_record(0.02, 1.5, 2.5, True, False, 0.8))
    assert [t["met"] for t in good] == [True] * 5 and all(t["bundle"] == "demo" for t in good)
    assert [t["met"] for t in ev.targets(_eval_record(0.06, 1.5, 2.5, True, False, 0.8))][0] is False
    assert [t["met"] for t in ev.targets(_eval_record(0.02, -2.1, 2.5, True, False, 0.8))][1] is False
    assert [t["met"] for t in ev.targets(_eval_record(0.02, 1.5, 3.1, True, False, 0.8))][2] is False
    assert [t["met"] for t in ev.targets(_eval_record(0.02, 1.5, 2.5, False, False, 0.8))][3] is False
    fell = ev.targets(_eval_record(0.02, 1.5, 2.5, True, False, 0.7))  # the truth fell below the floor: no alert
    assert "an alert" in fell[4]["target"] and fell[4]["met"] is False
    assert ev.targets(_eval_record(0.02, 1.5, 2.5, True, True, 0.7))[4]["met"] is True
    assert ev.targets(_eval_record(0.02, 1.5, 2.5, True, True, 0.8))[4]["met"] is False  # a metric alert, no fall
    quality = _eval_record(0.02, 1.5, 2.5, True, True, 0.8)  # a data-quality alert, no fall: a false alarm too
    quality["demo"]["cases"]["waimai"].update(below_floor=False, alerts=["30.0% of the rows are unlike x: y"])
    assert ev.targets(quality)[4]["met"] is False
    assert ev.targets(quality)[4]["figure"] == "alert: 30.0% of the rows are unlike x"
    path = tmp_path / "eval_monitor.json"
    path.write_text(json.dumps({"bundles": _eval_record(0.06, 1.5, 2.5, True, False, 0.8), "git": "abc1234",
                                "command": "python benchmarks/eval_monitor.py --results x.json",
                                "targets": ev.targets(_eval_record(0.06, 1.5, 2.5, True, False, 0.8))}))
    page = gen.render_monitor(path)
    assert "Targets (4 of 5 met)" in page and "**not met**: demo, false-alarm rate" in page
    assert "revision `abc1234` by `python benchmarks/eval_monitor.py --results x.json`" in page
    assert "chnsenticorp: not run" in page
