"""Monitoring of label runs: the calibration and the estimator on synthetic data with a known answer, drift statistics,
the report of a tiny bundle's run (two and three classes), part files and rejects byte-identical with monitoring on
or off (and on resume), the alert event reaching a real Prefect server, and ``lexiflow monitor``."""

from __future__ import annotations

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
    assert rep["alert"] and not rep["estimate"]["reliable"] and "drift in" in rep["alerts"][0]
    assert "ALERT" in rep["summary"]


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


def test_three_classes_report_macro_f1_and_the_top_two_margin(tmp_path):
    bundle = _bundle(["neg", "mid", "pos"])
    res = _label(bundle, _input(tmp_path, dev_texts(500, seed=17)), str(tmp_path / "out"))
    rep = res["monitor"]
    assert rep["estimate"]["f1_kind"] == "macro over classes" and rep["labels"]["classes"] == ["neg", "mid", "pos"]
    assert rep["estimate"]["calibration"] == "temperature" and rep["drift"] == []
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
        _label(binary, _input(tmp_path, texts, name), None, output_root=str(root))
    png = tmp_path / "trend.png"
    res = CliRunner().invoke(app, ["monitor", str(root), "--out", str(png)])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 3 and sum("ALERT" in line for line in lines[:2]) == 1
    assert "drift=none" in "".join(lines[:2]) and "no_cjk" in "".join(lines[:2])
    assert json.loads(lines[-1]) == {"runs": 2, "alerts": 1, "without_report": 0, "png": str(png)}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # one run's report edited after its commit: its row says so, the other run is still listed
    (report,) = [p for p in sorted(root.glob("*/monitor.json")) if '"alert": true' in p.read_text()]
    report.write_text(report.read_text().replace('"alert": true', '"alert": false'))
    res = CliRunner().invoke(app, ["monitor", str(root)])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 0 and len(lines) == 3, res.output
    assert json.loads(lines[-1]) == {"runs": 2, "alerts": 0, "without_report": 1, "png": None}
    assert f"(report unreadable: {report}: its sha256 does not match the manifest" in res.output
    missing = CliRunner().invoke(app, ["monitor", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and missing.output.startswith("error: ") and "nowhere" in missing.output
    bad = CliRunner().invoke(app, ["label", "--bundle", "x", "--input", "y", "--output", str(tmp_path / "z"),
                                   "--monitor-set", "psi_treshold=0.3"])
    assert bad.exit_code == 2 and bad.output.strip() == "error: psi_treshold: unknown key", bad.output


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
    res = label_flow(bundle_uri, _input(tmp_path, texts), str(out))
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
                       "--output-root", str(root), "--id-column", "id", timeout=600)
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
