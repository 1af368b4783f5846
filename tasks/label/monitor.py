"""Monitoring of a label run: do tonight's texts look like the bundle's dev texts, and how well is it labelling them?

Per shard the labeller keeps a sketch (``monitor-NNNNN.json``, written before the shard's part file): the counts of
every feature of :data:`tasks.inference.reference.FEATURES` on the bundle's reference grids, the predicted-label
counts, the rows near the decision, and the expected confusion matrix of the shard's labels from the bundle's
calibrated probabilities (:class:`tasks.inference.reference.ConfusionSums`). Sketches add up, so a resumed run and a
scaled-out one (each share writes its shards' sketches; the coordinator reads them) report exactly what one
uninterrupted process reports. At commit the sketches are merged into ``monitor.json`` (:func:`report`):

* **drift** per feature: the population stability index over the reference's dev deciles and the two-sample
  Kolmogorov-Smirnov distance on its dev percentiles with its asymptotic p-value; a feature drifts when the PSI is at
  least ``monitor.psi_threshold`` and the p-value below ``monitor.ks_pvalue`` (a large shift that is not chance);
* **content**: the Jensen-Shannon divergence of the texts' character frequencies, and of the lexicon words they
  match (the words the model sees), from the reference's, each against the reference's own chunk-to-chunk noise,
  with the characters and words that tell the two apart;
* **estimated accuracy and F1** of this run's labels (CBPE: the expected confusion matrix from calibrated
  probabilities), each with an interval. Accuracy, corrected for the run's mix of score x length x script cells
  (:func:`shift_correction`): 1.96 standard deviations of the run's sampling spread (Poisson-binomial) and of the
  reference's per-cell residuals, in quadrature, plus half the share of rows in cells the reference never saw, plus
  (where the texts drift, so the residuals may not carry over) the size of the correction itself.
  Without cells (F1, older references): the sampling spread (delta method for F1) and the reference figure the
  calibration was learnt from, in quadrature, widened by the calibration's out-of-fold expected calibration error.
  ``interval_terms`` lists each term. When any feature drifts (or the run is small) the estimate is marked
  unreliable;
* the share of texts **near the decision** (within ``monitor.margin`` of the threshold; K > 2 classes: top two
  probabilities within it), beside the dev share;
* **data quality**: the rows in, labelled and rejected (by reason), and the rejected share;
* K > 2 classes: a chi-square test of the **predicted-class shares** against the reference's;
* **the verdict** (:func:`rules`): an *alert* on what hurts, by default (``monitor.alert_on``): the estimated
  metric's interval wholly below its floor (``monitor.metric_floor``, else the dev value minus
  ``monitor.max_drop``), or data quality (an empty run, every row rejected, a rejected share above
  ``monitor.max_reject_share``); drift is a *warning*, the diagnosis, unless ``monitor.alert_on`` names it.

Nothing here changes a part file or a reject: the sketches and the report are files beside them.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
from datetime import datetime, timezone
from typing import Any

import fsspec
import numpy as np
from scipy.stats import chi2

from storage.urls import public_url
from tasks.inference.reference import (
    FEATURE_DOC,
    FEATURES,
    INPUT_FEATURES,
    MARGINS,
    ConfusionSums,
    Reference,
    bin_counts,
    binned_auc,
    cell_index,
    char_counts,
    char_index,
    coarse_counts,
    decisions,
    jensen_shannon,
    population_stability,
    text_surprise,
    word_lut,
)
from tasks.label.config import MonitorConfig

REPORT_FILE = "monitor.json"
REPORT_SCHEMA = "lexiflow.monitor/1"
SKETCH_SCHEMA = "lexiflow.monitor-shard/3"  # /2: the character counts (content); /3: the lexicon-word counts
DRIFT_EVENT = "lexiflow.label.drift"
LOGGER = "lexiflow.monitor"  # the run's one monitoring line (stderr and the run's logs: flows.logs)
ESTIMATOR = ("CBPE: the expected confusion matrix of this run's labels from the bundle's calibrated probabilities "
             "(cross-fitted on the reference rows); accuracy corrected per score x length x script cell, its interval "
             "1.96 sd of the run's sampling spread and of the cells' residuals, in quadrature, plus half the share "
             "of rows in cells the reference lacks, plus the correction's size where the texts drift; F1's "
             "interval: 1.96 sd of the sampling spread (delta method) and of the reference figure, in quadrature, "
             "plus the calibration's out-of-fold ECE")


def sketch_name(i: int) -> str:
    """The name of the ``i``-th shard's monitoring sketch."""
    return f"monitor-{i:05d}.json"


def _r(v: float | None, digits: int = 6) -> float | None:
    return None if v is None or v != v else round(float(v), digits)


class Monitor:
    """One label run's monitoring against a bundle's :class:`~tasks.inference.reference.Reference`."""

    def __init__(self, reference: Reference, threshold: float | None, cfg: MonitorConfig, bundle_version: str,
                 classes: list[str] | None = None):
        self.ref, self.threshold, self.cfg, self.bundle_version = reference, threshold, cfg, bundle_version
        self.k = reference.num_classes
        self.classes = classes or reference.data.get("classes") or [str(i) for i in range(self.k)]
        self.calibration = reference.calibration
        self.margins = sorted({*MARGINS, cfg.margin})
        self.content = reference.data.get("content")  # None: a bundle built before bundle-8
        self.chars = char_index(self.content["chars"]) if self.content else None
        self.words = (self.content or {}).get("words")  # None: a bundle built before bundle-9
        self.word_lut = word_lut(self.words["ids"]) if self.words else None  # word id -> bucket, for the scorer
        self.shift = reference.data.get("shift")  # None: a bundle built before bundle-8

    def count_chars(self, texts: list[str]) -> np.ndarray | None:
        """The character counts of scored ``texts`` on the reference's characters, then the counts of their
        surprise on the reference's grid (one vector; None without a content reference); they add over a shard's
        windows."""
        if self.chars is None:
            return None
        surprise = self.content.get("surprise")
        hist = np.zeros(0, np.int64) if surprise is None else bin_counts(
            text_surprise(texts, self.chars, self.content["counts"]), surprise["fine"])
        return np.concatenate([char_counts(texts, self.chars), hist])

    # -- per shard
    def sketch(self, index: int, part_digest: str | None, outputs: Any, descriptors: np.ndarray,
               chars: np.ndarray | None = None, words: np.ndarray | None = None) -> dict[str, Any]:
        """The sketch of one shard: its scored rows' ``outputs`` (as the part file holds them), input
        ``descriptors`` ([N, len(INPUT_FEATURES)]), character counts (:meth:`count_chars`, summed) and lexicon-word
        counts (:func:`tasks.inference.reference.word_counts` on :attr:`word_lut`, summed)."""
        n = len(outputs)
        out = np.asarray(outputs, np.float32)
        if n == 0:
            out = out.reshape((0,) if self.k == 2 and self.threshold is not None else (0, self.k))
        pred, score, gap = decisions(out, self.threshold)
        desc = np.asarray(descriptors, np.float64).reshape(n, len(INPUT_FEATURES))
        values = {**{f: desc[:, i] for i, f in enumerate(INPUT_FEATURES)}, "score": score}
        sums = ConfusionSums(self.k)
        conf = np.zeros(n, np.float64)
        if n:
            q = self.calibration.apply(out)
            sums.add(q, pred)
            conf = np.asarray(q, np.float64)[np.arange(n), pred]
        cells = None
        if self.shift is not None:  # a bundle-8 reference built before the script was added: score x length only
            script = values["no_cjk"] if "no_cjk" in self.shift.get("features", ()) else None
            cells = cell_index(score, values["length"], self.ref.data["features"], script)
        return {
            "schema": SKETCH_SCHEMA, "shard": index, "part": part_digest, "bundle": self.bundle_version, "rows": n,
            "features": {f: bin_counts(values[f], self.ref.feature(f)["fine"]).tolist() for f in FEATURES},
            "labels": np.bincount(pred, minlength=self.k).tolist(),
            "near": {str(m): int((gap <= m).sum()) for m in self.margins},
            "confusion": sums.to_dict(),
            "content": None if self.chars is None else
            (np.zeros(self._content_len(), np.int64) if chars is None else np.asarray(chars, np.int64)).tolist(),
            "words": None if self.words is None else
            (np.zeros(len(self.words["counts"]), np.int64) if words is None else np.asarray(words, np.int64)).tolist(),
            "cells": None if self.shift is None else np.bincount(cells, minlength=len(self.shift["n"])).tolist(),
            # the calibrated chance of being right summed per cell: what the estimate holds for the rows in cells
            # the reference never saw, replaced by the middle of what they could be
            "cell_confidence": None if self.shift is None else np.bincount(
                cells, weights=conf, minlength=len(self.shift["n"])).tolist(),
        }

    def valid(self, sketch: Any, index: int, part_digest: str | None) -> bool:
        """Whether ``sketch`` (read back) is this monitor's sketch of shard ``index`` whose part file carries
        ``part_digest``."""
        return (isinstance(sketch, dict) and sketch.get("schema") == SKETCH_SCHEMA and sketch.get("shard") == index
                and sketch.get("part") == part_digest and sketch.get("bundle") == self.bundle_version
                and str(self.cfg.margin) in (sketch.get("near") or {})
                and set(sketch.get("features") or {}) == set(FEATURES)
                and (self.chars is None or len(sketch.get("content") or []) == self._content_len())
                and (self.words is None or len(sketch.get("words") or []) == len(self.words["counts"]))
                and (self.shift is None or len(sketch.get("cells") or []) == len(self.shift["n"])
                     == len(sketch.get("cell_confidence") or [])))

    # -- the run
    def report(self, sketches: list[dict[str, Any]], label_version: str,
               stats: dict[str, Any] | None = None,
               earlier: list[tuple[str, list[dict[str, Any]]]] | None = None) -> dict[str, Any]:
        """``monitor.json`` of the run whose shards' sketches are ``sketches`` (in shard order); ``stats``: the run's
        row counts (``in``, ``out``, ``rejected`` by reason, as the manifest holds them) for the data-quality
        rules (None: the labelled rows are all that came in); ``earlier``: (label version, sketches) of the earlier
        nights under the same output root with the same bundle, newest first (:func:`earlier_sketches`).

        A night with fewer than ``monitor.min_rows`` labelled rows is judged together with the earlier nights
        (at most ``monitor.window`` in all) until the rows reach ``min_rows``: drift, content and the estimate are
        then the window's (``window`` says which nights), the data-quality rules tonight's own."""
        own = sum(s["rows"] for s in sketches)
        cfg, ref = self.cfg, self.ref
        window = [label_version]
        if own < cfg.min_rows and earlier:
            sketches = list(sketches)
            for version, more in earlier[:max(cfg.window - 1, 0)]:
                if sum(s["rows"] for s in sketches) >= cfg.min_rows:
                    break
                sketches += more
                window.append(version)
        n = sum(s["rows"] for s in sketches)
        features = {}
        for f in FEATURES:
            cur = np.sum([s["features"][f] for s in sketches], 0) if sketches else None
            features[f] = self._drift(f, cur, n)
        drifted = [f for f in FEATURES if features[f]["drift"]]
        content = self._content(sketches, n)
        if content is not None and content["drift"]:
            drifted.append("content")
        if content is not None and self.words is not None:
            content["words"] = self._words(sketches, n)
            if content["words"]["drift"]:
                drifted.append("words")
        sums = ConfusionSums(self.k)
        for s in sketches:
            sums.merge(ConfusionSums.from_dict(s["confusion"]))
        cells = conf = None
        if sketches and self.shift is not None:
            cells = np.sum([s["cells"] for s in sketches], 0)
            conf = np.sum([s["cell_confidence"] for s in sketches], 0)
        estimate = self._estimate(sums, drifted, n, cells, conf)
        labels = np.sum([s["labels"] for s in sketches], 0) if sketches else np.zeros(self.k, np.int64)
        ref_labels = np.asarray(ref.data["labels"], np.float64)
        near = sum(s["near"][str(cfg.margin)] for s in sketches)
        ref_near = ref.data.get("margins", {}).get(str(cfg.margin))
        quality = data_quality(stats if stats is not None else {"in": own, "out": own, "rejected": {}}, cfg)
        shares = label_share_test(labels, ref_labels)
        verdict = rules(cfg, n=n, own=own, drifted=drifted, estimate=estimate, quality=quality,
                        share_test=shares if self.k > 2 else None)
        rep = {
            "schema": REPORT_SCHEMA,
            "label_version": label_version,
            "bundle_version": self.bundle_version,
            "rows": own,
            "window": {"nights": window, "rows": n},
            "config": cfg.model_dump(),
            "reference": {"split": ref.data.get("split"), "rows": ref.data.get("rows_used"),
                          "calibration": self.calibration.method},
            "features": features,
            "content": content,
            "drift": drifted,
            "labels": {"classes": self.classes, "shares": _shares(labels), "reference_shares": _shares(ref_labels),
                       "test": shares},
            "near_decision": {"margin": cfg.margin, "share": _r(near / n) if n else None,
                              "reference_share": ref_near},
            "data_quality": quality,
            "estimate": estimate,
            **verdict,
        }
        rep["summary"] = summary_line(rep)
        return rep

    def _drift(self, f: str, cur: np.ndarray | None, n: int) -> dict[str, Any]:
        grid = self.ref.feature(f)
        ref_counts = np.asarray(grid["counts"], np.float64)
        m = float(ref_counts.sum())
        if cur is None or n == 0 or m == 0:
            return {"psi": None, "ks": None, "ks_pvalue": None, "drift": False, "doc": FEATURE_DOC[f]}
        cur = np.asarray(cur, np.float64)
        a = coarse_counts(cur, grid["fine"], grid["coarse"]).astype(np.float64)
        e = coarse_counts(ref_counts, grid["fine"], grid["coarse"]).astype(np.float64)
        psi = population_stability(a, e)
        noise = psi_noise(grid, n)
        threshold = max(self.cfg.psi_threshold, noise or 0.0)
        d = float(np.max(np.abs(np.cumsum(cur)[:-1] / n - np.cumsum(ref_counts)[:-1] / m))) if len(cur) > 1 else 0.0
        p = ks_pvalue(d, n, m)
        drift = psi >= threshold and p < self.cfg.ks_pvalue
        return {"psi": _r(psi), "ks": _r(d), "ks_pvalue": _r(p, 8), "drift": bool(drift), "doc": FEATURE_DOC[f],
                "psi_threshold": _r(threshold), "reference_noise": noise,
                "mean_bin": _r(float(np.arange(len(a)) @ a / n)),
                "reference_mean_bin": _r(float(np.arange(len(e)) @ e / m))}

    def _content_len(self) -> int:
        surprise = (self.content or {}).get("surprise")
        return len(self.chars or {}) + 1 + (len(surprise["fine"]) + 1 if surprise else 0)

    def _js_threshold(self, sketch_ref: dict[str, Any], n: int) -> tuple[float | None, float]:
        """(the reference's own divergence at the chunk size nearest below ``n`` rows, the smallest when ``n`` is
        below all; the drift threshold: the larger of that and ``monitor.content_js``) for a count sketch of the
        reference (characters or words) with its ``null_js``."""
        null = {int(k): v for k, v in (sketch_ref.get("null_js") or {}).items() if v is not None}
        fits = [k for k in sorted(null) if k <= n] or sorted(null)[:1]
        noise = null[fits[-1]] if fits else None
        return noise, max(self.cfg.content_js, noise or 0.0)

    def _content(self, sketches: list[dict[str, Any]], n: int) -> dict[str, Any] | None:
        """What the texts say: the Jensen-Shannon divergence of the run's character frequencies from the
        reference's, against the larger of ``monitor.content_js`` and the largest divergence the reference's own
        chunks of a similar size show (bootstrapped when the bundle was built); the characters that tell the two
        apart most (each one's share of the divergence, and where it is more frequent); and a domain model's AUC:
        how often a run text is more surprising under the reference's character frequencies than a reference text
        is under the others' (0.5: alike; toward 1: the run's texts are not what the reference was about)."""
        if self.content is None:
            return None
        ref = np.asarray(self.content["counts"], np.float64)
        both = np.sum([s["content"] for s in sketches], 0).astype(np.float64) if sketches else \
            np.zeros(self._content_len())
        cur, hist = both[:len(ref)], both[len(ref):]
        surprise = self.content.get("surprise")
        auc = binned_auc(hist, surprise["counts"]) if surprise else None
        noise, threshold = self._js_threshold(self.content, n)
        if n == 0 or cur.sum() == 0:
            return {"js": None, "threshold": _r(threshold), "reference_noise": noise, "drift": False, "telling": [],
                    "surprise_auc": None}
        js = jensen_shannon(cur, ref)
        telling = _telling(cur, ref, js, [*self.content["chars"], "(other)"], "char")
        return {"js": _r(js), "threshold": _r(threshold), "reference_noise": noise, "drift": bool(js >= threshold),
                "telling": telling, "surprise_auc": _r(auc)}

    def _words(self, sketches: list[dict[str, Any]], n: int) -> dict[str, Any]:
        """The lexicon words the texts match: the Jensen-Shannon divergence of the run's word frequencies (a word
        counted once per character it is kept on) from the reference's, against the larger of
        ``monitor.content_js`` and the largest the reference's own chunks of a similar size show, and the words
        that tell the two apart most."""
        ref = np.asarray(self.words["counts"], np.float64)
        cur = np.sum([s["words"] for s in sketches], 0).astype(np.float64) if sketches else np.zeros(len(ref))
        noise, threshold = self._js_threshold(self.words, n)
        if n == 0 or cur.sum() == 0 or ref.sum() == 0:
            return {"js": None, "threshold": _r(threshold), "reference_noise": noise, "drift": False, "telling": []}
        js = jensen_shannon(cur, ref)
        names = [*(self.words.get("words") or [f"#{i}" for i in self.words["ids"]]), "(other)"]
        return {"js": _r(js), "threshold": _r(threshold), "reference_noise": noise, "drift": bool(js >= threshold),
                "telling": _telling(cur, ref, js, names, "word")}

    def _estimate(self, sums: ConfusionSums, drifted: list[str], n: int, cells: Any = None,
                  conf: Any = None) -> dict[str, Any]:
        cfg, cal = self.cfg, self.ref.data["calibration"]
        oof = cal.get("out_of_fold", {})
        est = sums.estimate()
        shift = None
        if cells is not None and est.get("accuracy") is not None:
            shift = shift_correction(np.asarray(cells, np.float64), self.shift,
                                     None if conf is None else np.asarray(conf, np.float64))
            est["cbpe_accuracy"], est["cbpe_accuracy_sd"] = est["accuracy"], est["accuracy_sd"]
            est["accuracy"] = min(1.0, max(0.0, est["accuracy"] + shift["bias"]))
            est["accuracy_sd"] = math.sqrt(est["accuracy_sd"] ** 2 + shift["bias_sd"] ** 2)
        ece = float(oof.get("ece") or 0.0)
        dev = {"accuracy": oof.get("true_accuracy"), "f1": oof.get("true_f1")}
        out: dict[str, Any] = {"method": ESTIMATOR, "calibration": self.calibration.method,
                               "f1_kind": "positive class" if self.k == 2 else "macro over classes"}
        terms: dict[str, dict[str, float]] = {}
        for key in ("accuracy", "f1"):
            v, sd = est.get(key), est.get(f"{key}_sd")
            out[key] = _r(v)
            if v is None:
                out[f"{key}_interval"] = None
            else:
                corrected = key == "accuracy" and shift is not None
                # Corrected: the per-cell out-of-fold residuals are the calibration's error, measured (their sd is
                # in accuracy_sd), so neither the dev figure's sd nor the ECE is added on top of them. Otherwise:
                # the calibration is learnt from a sample of dev rows (its sd, in quadrature) and is off by up to
                # its out-of-fold ECE (added).
                dev_sd = 0.0 if corrected else float(oof.get(f"sd_{key}") or 0.0)
                allowance = 0.0 if corrected else ece
                # rows in cells the reference never saw: their accuracy could be anything in [0, 1]; the estimate
                # holds them at 0.5 (half their share each side), else at the calibration's word (all of it)
                unseen = shift["unsupported_share"] / (1 if conf is None else 2) if corrected else 0.0
                # where the texts drift, the reference's per-cell residuals may not carry over to the new texts:
                # the truth may lie as far on either side of the estimate as the cells' residuals moved it (the
                # unseen rows' move to 0.5 is the unseen term's)
                moved = abs(shift["cell_bias"]) if corrected and drifted else 0.0
                half = 1.96 * math.sqrt(sd * sd + dev_sd * dev_sd) + allowance + unseen + moved
                out[f"{key}_interval"] = [_r(max(0.0, v - half)), _r(min(1.0, v + half))]
                terms[key] = {"sampling_sd": _r(sd), "calibration_sd": _r(dev_sd), "allowance": _r(allowance),
                              "unseen": _r(unseen), "shift": _r(moved), "half_width": _r(half)}
            out[f"dev_{key}"] = dev[key]
            out[f"dev_estimated_{key}"] = oof.get(f"estimated_{key}")
        out["calibration_allowance"] = _r(ece)
        out["interval_terms"] = terms
        if shift is not None:
            out["shift_correction"] = {**{k: _r(v) for k, v in shift.items()},
                                       "cbpe_accuracy": _r(est["cbpe_accuracy"]),
                                       "note": SHIFT_NOTE}
        floor = cfg.metric_floor
        if floor is None and dev[cfg.metric] is not None:
            floor = max(0.0, float(dev[cfg.metric]) - cfg.max_drop)
        out["metric"], out["floor"] = cfg.metric, _r(floor)
        upper = (out.get(f"{cfg.metric}_interval") or [None, None])[1]
        # the whole interval below the floor: a fall the run's own uncertainty cannot explain
        out["below_floor"] = bool(floor is not None and upper is not None and upper < floor)
        why = []
        if n < cfg.min_rows:
            why.append(f"{n} rows < monitor.min_rows {cfg.min_rows}")
        if drifted:
            why.append(f"drift in {', '.join(drifted)}: the dev calibration may not hold")
        if cal.get("fallback"):
            why.append("the bundle's dev split was too small to calibrate on")
        out["reliable"], out["unreliable_because"] = not why, why
        return out


def _telling(cur: np.ndarray, ref: np.ndarray, js: float, names: list[str], key: str) -> list[dict[str, Any]]:
    """The ten buckets (characters or words, named ``key``) with the largest share of the Jensen-Shannon
    divergence ``js`` between the run's counts ``cur`` and the reference's ``ref``, and where each is more
    frequent."""
    p, q = cur / cur.sum(), ref / ref.sum()
    m = 0.5 * (p + q)
    with np.errstate(divide="ignore", invalid="ignore"):
        part = 0.5 * (np.where(p > 0, p * np.log2(p / m), 0.0) + np.where(q > 0, q * np.log2(q / m), 0.0))
    return [{key: names[i], "share": _r(float(p[i])), "reference_share": _r(float(q[i])),
             "of_divergence": _r(float(part[i] / js)) if js > 0 else None,
             "more_in": "run" if p[i] > q[i] else "reference"}
            for i in np.argsort(-part, kind="stable")[:10] if part[i] > 0]


SHIFT_NOTE = ("accuracy corrected for the run's mix of score x length x script cells: the reference's out-of-fold "
              "residual (right minus the calibrated chance) per cell, weighted by the run's share of each cell; rows "
              "in cells the reference lacks count as anything from wrong to right (held at 0.5, half their share "
              "added to the interval); the residuals' sd widens it too, and where the texts drift so does the "
              "residuals' correction itself (interval_terms.accuracy.shift)")


def shift_correction(cells: np.ndarray, ref: dict[str, Any], confidence: np.ndarray | None = None
                     ) -> dict[str, float]:
    """The estimated accuracy's correction for the run's mix of cells (importance weights: the run's share of a
    cell over the reference's, so the reference's per-cell residuals are averaged as the run is mixed): ``bias``
    (added to the CBPE accuracy; ``cell_bias``: the part of it from the supported cells' residuals), ``bias_sd``
    (the sampling sd of that weighted mean of residuals: it grows as the run concentrates in few reference cells),
    ``unsupported_share`` (run rows in cells with no reference row: the
    interval widens by half of it, nothing is known there) and ``effective_rows`` (the reference rows the weighting
    leaves in effect). Given ``confidence`` (the run's calibrated chance of being right summed per cell), ``bias``
    also replaces what the calibration claims for the unsupported rows by 0.5, the middle of [0, 1]."""
    r_n = np.asarray(ref["n"], np.float64)
    resid, resid_sq = np.asarray(ref["residual"], np.float64), np.asarray(ref["residual_sq"], np.float64)
    total = float(cells.sum())
    if total <= 0:
        return {"bias": 0.0, "cell_bias": 0.0, "bias_sd": 0.0, "unsupported_share": 0.0,
                "effective_rows": float(r_n.sum())}
    seen = r_n > 0
    u = float(cells[~seen].sum() / total)
    share = np.where(seen, cells, 0.0) / total  # the run's share of each supported cell
    mean = np.divide(resid, r_n, out=np.zeros_like(resid), where=seen)
    var = np.divide(resid_sq, r_n * r_n, out=np.zeros_like(resid), where=seen)  # the cell mean's variance
    w = np.divide(share, r_n / r_n.sum(), out=np.zeros_like(share), where=seen)  # importance weight per row
    eff = float((w * r_n).sum() ** 2 / max((w * w * r_n).sum(), 1e-12))
    unseen = 0.0 if confidence is None else 0.5 * u - float(confidence[~seen].sum() / total)
    cell_bias = float(share @ mean)
    return {"bias": cell_bias + unseen, "cell_bias": cell_bias, "bias_sd": float(math.sqrt(share * share @ var)),
            "unsupported_share": u, "effective_rows": eff}


def data_quality(stats: dict[str, Any], cfg: MonitorConfig) -> dict[str, Any]:
    """The run's rows in, labelled and rejected (by reason), and the rejected share against
    ``monitor.max_reject_share``."""
    n_in = int(stats.get("in") or 0)
    rejected = {str(k): int(v) for k, v in sorted((stats.get("rejected") or {}).items())}
    total = sum(rejected.values())
    return {"in": n_in, "out": int(stats.get("out") or 0), "rejected": total, "rejected_by_reason": rejected,
            "reject_share": _r(total / n_in) if n_in else None, "max_reject_share": cfg.max_reject_share}


def label_share_test(counts: Any, reference: Any) -> dict[str, Any]:
    """Pearson's chi-square test of the run's predicted-label ``counts`` against the reference's predicted-label
    shares (``reference``: its counts): statistic, degrees of freedom, p-value (None without rows on either side;
    a class the reference never predicted is smoothed by half a row)."""
    obs = np.asarray(counts, np.float64)
    ref = np.asarray(reference, np.float64)
    n, m = float(obs.sum()), float(ref.sum())
    if n == 0 or m == 0 or len(obs) < 2:
        return {"chi2": None, "dof": max(len(obs) - 1, 0), "pvalue": None}
    expected = n * (ref + 0.5) / (m + 0.5 * len(ref))
    stat = float(np.sum((obs - expected) ** 2 / expected))
    return {"chi2": _r(stat), "dof": len(obs) - 1, "pvalue": _r(float(chi2.sf(stat, len(obs) - 1)), 8)}


def rules(cfg: MonitorConfig, *, n: int, drifted: list[str], estimate: dict[str, Any], quality: dict[str, Any],
          share_test: dict[str, Any] | None = None, own: int | None = None) -> dict[str, Any]:
    """The verdict: ``alert`` (bool), ``alerts`` (what raised it) and ``warnings`` (what was seen and raises none).

    * data quality (``data_quality`` in ``monitor.alert_on``): no input rows; every row rejected; a rejected share
      above ``monitor.max_reject_share`` (never held back by ``min_rows``: an empty night is the worst night); a
      share of rows in cells the reference has no row in above ``monitor.max_unseen_share`` (held back below
      ``min_rows``, where a few odd texts are a large share).
    * metric (``metric``): the estimated metric's interval lies wholly below its floor.
    * drift (``drift``): a feature drifted; K > 2 classes: the predicted-class shares differ from the reference's
      (chi-square p-value below ``monitor.ks_pvalue``).
    Fewer than ``monitor.min_rows`` labelled rows (``n``: tonight's, or the rolling window's; ``own``: tonight's
    alone): metric and drift findings are warnings only. A finding whose kind is not in ``monitor.alert_on`` is a
    warning."""
    own = n if own is None else own
    found: list[tuple[str, str]] = []  # (kind, text)
    n_in, rejected, share = quality["in"], quality["rejected"], quality["reject_share"]
    if n_in == 0:
        found.append(("data_quality", "empty run: no input rows"))
    elif own == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in quality["rejected_by_reason"].items())
        found.append(("data_quality", f"every row rejected ({rejected} of {n_in}: {reasons})"))
    elif share is not None and share > cfg.max_reject_share:
        found.append(("data_quality", f"{share:.1%} of the rows rejected > monitor.max_reject_share "
                                      f"{cfg.max_reject_share:.1%}"))
    small = 0 < n < cfg.min_rows
    unseen = (estimate.get("shift_correction") or {}).get("unsupported_share")
    if unseen is not None and unseen > cfg.max_unseen_share:
        found.append(("unseen", f"{unseen:.1%} of the rows are unlike any reference row (score x length x script "
                                f"cells it has none in) > monitor.max_unseen_share {cfg.max_unseen_share:.1%}: "
                                "the estimate cannot vouch for them"))
    if estimate.get("below_floor"):
        lo_hi = estimate[f"{cfg.metric}_interval"]
        found.append(("metric", f"estimated {cfg.metric} {estimate[cfg.metric]:.3f} (interval up to {lo_hi[1]:.3f}) "
                                f"below the floor {estimate['floor']:.3f}"))
    if drifted:
        found.append(("drift", f"drift in {', '.join(drifted)}"))
    if share_test is not None and share_test["pvalue"] is not None and share_test["pvalue"] < cfg.ks_pvalue:
        found.append(("drift", f"predicted-class shares moved (chi-square p {share_test['pvalue']:.2g})"))
    alerts, warnings = [], []
    for kind, text in found:
        held = small and kind != "data_quality"
        kind = "data_quality" if kind == "unseen" else kind  # a data-quality finding that small nights hold back
        (alerts if kind in cfg.alert_on and not held else warnings).append(text)
    if small:
        warnings.insert(0, f"{n} rows < monitor.min_rows {cfg.min_rows}: metric and drift raise no alert")
    return {"alert": bool(alerts), "alerts": alerts, "warnings": warnings}


def _shares(counts: np.ndarray) -> list[float | None]:
    total = float(np.sum(counts))
    return [_r(c / total) if total else None for c in np.asarray(counts, np.float64)]


def psi_noise(grid: dict[str, Any], n: int) -> float | None:
    """The largest PSI the reference's own bootstrapped chunks showed at the largest chunk size up to ``n`` rows
    (the smallest size for a smaller run); None for a reference without them (before bundle-8)."""
    null = {int(k): v for k, v in (grid.get("null_psi") or {}).items()}
    if not null:
        return None
    fits = [k for k in sorted(null) if k <= n] or sorted(null)[:1]
    return null[fits[-1]]


def ks_pvalue(d: float, n: float, m: float) -> float:
    """The asymptotic two-sample Kolmogorov-Smirnov p-value of distance ``d`` between samples of ``n`` and ``m``
    rows (Stephens' small-sample correction). On binned or discrete data the distance is a lower bound: the test
    is conservative."""
    if d <= 0 or n <= 0 or m <= 0:
        return 1.0
    ne = n * m / (n + m)
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    if lam < 1.18:  # the series in exp(-(2j-1)^2 pi^2 / (8 lam^2)) converges fast here
        s = sum(math.exp(-((2 * j - 1) ** 2) * math.pi**2 / (8 * lam * lam)) for j in range(1, 50))
        return float(min(1.0, max(0.0, 1.0 - math.sqrt(2 * math.pi) / lam * s)))
    s = sum((-1) ** (j - 1) * math.exp(-2 * j * j * lam * lam) for j in range(1, 100))
    return float(min(1.0, max(0.0, 2 * s)))


def summary_line(rep: dict[str, Any]) -> str:
    """The report in one line (the run's log line)."""
    est, feats = rep["estimate"], rep["features"]
    worst = max((f for f in FEATURES if feats[f]["psi"] is not None), key=lambda f: feats[f]["psi"], default=None)
    drift = (f"drift in {', '.join(rep['drift'])}" if rep["drift"] else
             f"no drift (max PSI {feats[worst]['psi']:.3f} {worst})" if worst else "no drift measured")
    metric = est["metric"]
    if est.get(metric) is not None:
        lo, hi = est[f"{metric}_interval"]
        dev = est.get(f"dev_{metric}")
        ref_txt = f" (reference {dev:.3f})" if dev is not None else ""
        est_txt = (f"est. {metric} {est[metric]:.3f} [{lo:.3f}, {hi:.3f}]{ref_txt}"
                   + ("" if est["reliable"] else " unreliable"))
    else:
        est_txt = f"est. {metric} n/a"
    near = rep["near_decision"]
    near_txt = "" if near["share"] is None else f"; {near['share']:.1%} within {near['margin']} of the decision"
    verdict = "ALERT: " + "; ".join(rep["alerts"]) if rep["alert"] else "ok"
    if rep.get("warnings"):
        verdict += " (warning: " + "; ".join(rep["warnings"]) + ")"
    win = rep.get("window") or {}
    if len(win.get("nights") or []) > 1:
        drift = f"with {len(win['nights']) - 1} earlier nights ({win['rows']} rows): {drift}"
    return (f"monitor {rep['label_version']}: {rep['rows']} rows, bundle {rep['bundle_version']}; {drift}; {est_txt}"
            f"{near_txt}; {verdict}")


def report_table(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """The report as rows, the UI's table: each feature's drift (PSI, KS, p-value), then the estimates (value,
    interval, the reference's value), the share near the decision and the rejected share, each figure in a column of
    its own kind (every row has every column; n/a as None)."""
    blank = {"what": None, "psi": None, "ks": None, "ks_pvalue": None, "estimate": None, "lower": None,
             "upper": None, "reference": None, "flag": ""}
    rows = [{**blank, "what": f, "psi": v["psi"], "ks": v["ks"], "ks_pvalue": v["ks_pvalue"],
             "flag": "DRIFT" if v["drift"] else ""} for f, v in rep["features"].items()]
    est = rep["estimate"]
    for key in ("accuracy", "f1"):
        lo_hi = est.get(f"{key}_interval") or [None, None]
        rows.append({**blank, "what": f"estimated {key}", "estimate": est.get(key), "lower": lo_hi[0],
                     "upper": lo_hi[1], "reference": est.get(f"dev_{key}"),
                     "flag": (("BELOW FLOOR" if key == est["metric"] and est["below_floor"] else "")
                              + ("" if est["reliable"] else " unreliable")).strip()})
    content = rep.get("content")
    if content:
        rows.append({**blank, "what": "content (character JS divergence)", "estimate": content["js"],
                     "upper": content["threshold"], "flag": "DRIFT" if content["drift"] else ""})
    near = rep["near_decision"]
    rows.append({**blank, "what": f"within {near['margin']} of the decision", "estimate": near["share"],
                 "reference": near["reference_share"]})
    quality = rep.get("data_quality")
    if quality:
        over = quality["reject_share"] is not None and quality["reject_share"] > quality["max_reject_share"]
        rows.append({**blank, "what": "rejected share", "estimate": quality["reject_share"],
                     "upper": quality["max_reject_share"], "flag": "TOO MANY REJECTS" if over else ""})
    return rows


def report_markdown(rep: dict[str, Any]) -> str:
    """The report as markdown (the UI's markdown artifact, before the picture)."""
    est = rep["estimate"]
    lines = [f"**monitoring** label `{rep['label_version']}`, bundle `{rep['bundle_version']}`, {rep['rows']} rows",
             "", f"**{'ALERT' if rep['alert'] else 'ok'}**" + (f": {'; '.join(rep['alerts'])}" if rep["alerts"]
                                                                else "")]
    if rep.get("warnings"):
        lines += ["", "Warnings (no alert): " + "; ".join(rep["warnings"])]
    quality = rep.get("data_quality")
    if quality:
        lines += ["", f"Rows in {quality['in']}, labelled {quality['out']}, rejected {quality['rejected']} "
                      f"(share {_fmt(quality['reject_share'])}, alert above {_fmt(quality['max_reject_share'])})."]
    lines += ["", "| feature | PSI | KS | KS p-value | drift |", "|---|---|---|---|---|"]
    for f, v in rep["features"].items():
        lines.append(f"| {f} | {_fmt(v['psi'])} | {_fmt(v['ks'])} | {_fmt(v['ks_pvalue'])} | "
                     f"{'**yes**' if v['drift'] else 'no'} |")
    content = rep.get("content")
    if content and content["js"] is not None:
        tell = _told(content["telling"], "char")
        lines += ["", f"Content: character Jensen-Shannon divergence {_fmt(content['js'])} against the reference "
                      f"(drift at {_fmt(content['threshold'])}: {'**yes**' if content['drift'] else 'no'}); the "
                      f"characters that tell tonight apart: {tell or 'none'}. Domain AUC (surprise under the "
                      f"reference's character frequencies): {_fmt(content.get('surprise_auc'))}."]
        words = content.get("words")
        if words and words["js"] is not None:
            lines += ["", f"Lexicon words: Jensen-Shannon divergence {_fmt(words['js'])} (drift at "
                          f"{_fmt(words['threshold'])}: {'**yes**' if words['drift'] else 'no'}); the words that "
                          f"tell tonight apart: {_told(words['telling'], 'word') or 'none'}."]
    lines += ["", "| estimate | value | interval | reference (true) | reference (estimated, out-of-fold) |",
              "|---|---|---|---|---|"]
    for key in ("accuracy", "f1"):
        iv = est.get(f"{key}_interval") or [None, None]
        lines.append(f"| {key} | {_fmt(est.get(key))} | {_fmt(iv[0])} .. {_fmt(iv[1])} | {_fmt(est.get(f'dev_{key}'))} "
                     f"| {_fmt(est.get(f'dev_estimated_{key}'))} |")
    corr = est.get("shift_correction")
    if corr:
        lines += ["", f"Accuracy shift-corrected: {_fmt(corr['cbpe_accuracy'])} {corr['bias']:+.4f} for the run's mix "
                      f"(effective reference rows {_fmt(corr['effective_rows'])}; rows where the reference has none: "
                      f"{_fmt(corr['unsupported_share'])}, added to the interval)."]
    lines += ["", f"Estimate {'reliable' if est['reliable'] else 'unreliable: ' + '; '.join(est['unreliable_because'])}"
              f" (calibration: {est['calibration']}). Near the decision: {_fmt(rep['near_decision']['share'])} "
              f"(reference {_fmt(rep['near_decision']['reference_share'])})."]
    return "\n".join(lines)


def _told(telling: list[dict[str, Any]], key: str) -> str:
    """The first eight telling characters or words (``key``) as markdown, each with where it is more frequent."""
    return ", ".join(f"{md_char(t[key])} ({'more' if t['more_in'] == 'run' else 'less'} often)" for t in telling[:8])


def md_char(c: str) -> str:
    """A character as literal markdown text (code span; a backtick shown by name)."""
    if c == "`":
        return "(backtick)"
    return f"`` {c} ``" if "`" in c else f"`{c}`"


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ============================================================================= pictures


def report_png(rep: dict[str, Any]) -> bytes:
    """PNG: each feature's PSI against the threshold, and the estimated metrics with their intervals beside dev."""
    from tasks.common.plots import subplots, to_png  # noqa: PLC0415 - matplotlib only when drawing

    fig, (ax1, ax2) = subplots(2, figsize=(10, 3.6))
    names = list(rep["features"])
    psi = [rep["features"][f]["psi"] or 0.0 for f in names]
    colors = ["tab:red" if rep["features"][f]["drift"] else "tab:blue" for f in names]
    ax1.barh(names, psi, color=colors)
    ax1.axvline(rep["config"]["psi_threshold"], color="grey", ls="--", lw=1, label="psi threshold")
    ax1.set_xlabel("PSI against the reference (red: drift)")
    ax1.legend()
    est = rep["estimate"]
    keys = [k for k in ("accuracy", "f1") if est.get(k) is not None]
    for i, key in enumerate(keys):
        lo, hi = est[f"{key}_interval"]
        ax2.errorbar([i], [est[key]], yerr=[[est[key] - lo], [hi - est[key]]], fmt="o", capsize=6,
                     color="tab:red" if not est["reliable"] else "tab:blue", label="estimated" if i == 0 else None)
        if est.get(f"dev_{key}") is not None:
            ax2.plot([i], [est[f"dev_{key}"]], "k_", ms=20, label="reference (true)" if i == 0 else None)
    if est.get("floor") is not None:
        ax2.axhline(est["floor"], color="grey", ls="--", lw=1, label=f"{est['metric']} floor")
    ax2.set_xticks(range(len(keys)), keys)
    ax2.set_xlim(-0.6, len(keys) - 0.4)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    title = f"label {rep['label_version']}: {rep['rows']} rows" + ("  ALERT" if rep["alert"] else "")
    return to_png(fig, title)


def trend_png(rows: list[dict[str, Any]]) -> bytes:
    """PNG against the date: per label run the estimated metric with its interval (red: alert) and the largest PSI;
    a dashed line where the bundle changed (labelled with the new bundle's version). Missed nights are gaps."""
    from tasks.common.plots import subplots, to_png  # noqa: PLC0415 - matplotlib only when drawing

    fig, (ax1, ax2) = subplots(2, figsize=(11, 3.8))
    rows = [r for r in rows if _when(r.get("created_at")) != float("inf")]
    xs = [datetime.fromtimestamp(_when(r["created_at"]), timezone.utc) for r in rows]
    for x, r in zip(xs, rows):
        if r.get("estimate") is None:
            continue
        lo, hi = r["interval"]
        ax1.errorbar([x], [r["estimate"]], yerr=[[r["estimate"] - lo], [hi - r["estimate"]]], fmt="o", capsize=4,
                     color="tab:red" if r["alert"] else "tab:blue")
    real = [(x, r["realized"]) for x, r in zip(xs, rows) if r.get("realized") is not None]
    if real:
        ax1.plot(*zip(*real), "kx", ms=8, label="realized (late labels)")
        ax1.legend(fontsize=7)
    ax1.set_ylabel(f"estimated {rows[0]['metric'] if rows and rows[0].get('metric') else 'metric'}")
    ax2.plot(xs, [r.get("max_psi") or 0.0 for r in rows], "-", color="lightgrey", lw=1)
    ax2.scatter(xs, [r.get("max_psi") or 0.0 for r in rows], color=["tab:red" if r["drift"] else "tab:blue"
                                                                      for r in rows], zorder=3)
    thr = next((r["psi_threshold"] for r in rows if r.get("psi_threshold") is not None), None)
    if thr is not None:
        ax2.axhline(thr, color="grey", ls="--", lw=1, label="psi threshold")
        ax2.legend()
    ax2.set_ylabel("largest PSI")
    for x, bundle in bundle_changes(rows, xs):
        for ax in (ax1, ax2):
            ax.axvline(x, color="tab:green", ls="--", lw=1)
        ax1.annotate(f"bundle {str(bundle)[:8]}", (x, 1), xycoords=("data", "axes fraction"), fontsize=7,
                     rotation=90, va="top", ha="right", color="tab:green")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax2.tick_params(axis="x", rotation=30, labelsize=7)
    return to_png(fig, f"label runs: {len(rows)} (red: alert / drift; green: bundle changed)")


def bundle_changes(rows: list[dict[str, Any]], xs: list[Any]) -> list[tuple[Any, str | None]]:
    """``(x, new bundle)`` for every run (in order) whose bundle differs from the run before it."""
    return [(x, r.get("bundle")) for i, (x, r) in enumerate(zip(xs, rows))
            if i and r.get("bundle") != rows[i - 1].get("bundle")]


# ============================================================================= trends over runs


def label_outputs(uri: str) -> list[str]:
    """The label output directories ``uri`` names: itself when it is one (a label ``_manifest.json`` or
    ``_run.json``), else its ``labelled/`` directory's children when it is a store, else its children (an output
    root). FileNotFoundError when ``uri`` does not exist."""
    fs, path = fsspec.core.url_to_fs(uri)
    path = path.rstrip("/")
    if not fs.exists(path):
        raise FileNotFoundError(2, "No such output root or store", uri)
    if _is_output(fs, path):
        return [uri.rstrip("/")]
    base = path + "/labelled" if fs.isdir(path + "/labelled") else path
    prefix = uri.rstrip("/") + (base[len(path):] if base != path else "")
    out = []
    for entry in sorted(fs.ls(base, detail=True), key=lambda e: e["name"]):
        name = entry["name"].rstrip("/")
        if entry.get("type") == "directory" and _is_output(fs, name):
            out.append(f"{prefix}/{posixpath.basename(name)}")
    return out


def _is_output(fs, path: str) -> bool:
    for rel in ("_manifest.json", "_run.json"):
        try:
            with fs.open(f"{path}/{rel}", "rb") as f:
                data = json.loads(f.read())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("stage") == "label":
            return True
    return False


def trend_rows(uri: str) -> list[dict[str, Any]]:
    """One row per committed label run under ``uri`` (:func:`label_outputs`), oldest first: when, the bundle, rows,
    drifted features, the estimated metric with its interval, the alert; runs without a report say so."""
    rows = []
    for out in label_outputs(uri):
        fs, path = fsspec.core.url_to_fs(out)
        try:
            with fs.open(f"{path.rstrip('/')}/_manifest.json", "rb") as f:
                manifest = json.loads(f.read())
        except (OSError, ValueError):
            rows.append({"uri": out, "version": posixpath.basename(out.rstrip("/")), "state": "incomplete",
                         "created_at": None, "bundle": None, "rows": None, "drift": [], "estimate": None,
                         "interval": None, "metric": None, "alert": False, "max_psi": None, "reliable": None,
                         "realized": None})
            continue
        bundle = next((p.get("version") for p in manifest.get("parents") or [] if p.get("stage") == "bundle"), None)
        row = {"uri": out, "version": manifest.get("version"), "state": "labelled",
               "created_at": manifest.get("created_at"), "bundle": bundle,
               "rows": (manifest.get("stats") or {}).get("out"),
               "drift": [], "estimate": None, "interval": None, "metric": None, "alert": False, "max_psi": None,
               "reliable": None, "psi_threshold": None, "realized": None}
        listed = {f.get("path"): f for f in manifest.get("files") or [] if isinstance(f, dict)}
        if REPORT_FILE in listed:
            try:
                rep = verified_report(fs, f"{path.rstrip('/')}/{REPORT_FILE}", listed[REPORT_FILE].get("sha256"),
                                       public_url(f"{out.rstrip('/')}/{REPORT_FILE}"))
            except (OSError, ValueError) as e:  # one damaged run does not hide the others: its row says why
                row["state"] = f"report unreadable: {e}"
                rows.append(row)
                continue
            est = rep.get("estimate") or {}
            metric = est.get("metric", "accuracy")
            psis = [v.get("psi") for v in (rep.get("features") or {}).values() if v.get("psi") is not None]
            row.update(drift=rep.get("drift") or [], estimate=est.get(metric), interval=est.get(f"{metric}_interval"),
                       metric=metric, alert=bool(rep.get("alert")), max_psi=max(psis) if psis else None,
                       reliable=est.get("reliable"), psi_threshold=(rep.get("config") or {}).get("psi_threshold"))
            try:  # late labels joined to this run (lexiflow monitor --labels): the realized metric beside it
                realized = read_realized_metric(out, metric, row["version"])
            except (OSError, ValueError) as e:  # the estimate still stands; the row says why no realized figure
                realized = None
                row["realized_error"] = str(e)
            row["realized"] = realized
        else:
            row["state"] = "no report"
        rows.append(row)
    rows.sort(key=lambda r: (_when(r.get("created_at")), r["version"] or ""))
    return rows


def read_realized_metric(out: str, metric: str, version: str | None) -> float | None:
    """The realized ``metric`` committed beside the label output ``out`` (``realized.json``, checked against its
    record), or None when no labels were joined to label version ``version`` (an overwritten output's are not)."""
    fs, path = fsspec.core.url_to_fs(out)
    path = path.rstrip("/")
    try:
        with fs.open(f"{path}/_realized.json", "rb") as f:
            record = json.loads(f.read())
    except FileNotFoundError:
        return None
    if not isinstance(record, dict) or record.get("label_version") != version:
        return None
    with fs.open(f"{path}/realized.json", "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise ValueError(f"{public_url(out.rstrip('/') + '/realized.json')}: its sha256 does not match its record")
    return json.loads(data).get(metric)


def earlier_sketches(root: str, bundle_version: str, exclude: str, limit: int) -> list[tuple[str, list[dict]]]:
    """(label version, its shards' sketches) of up to ``limit`` committed label runs under the output ``root``
    labelled with ``bundle_version`` (not ``exclude``, tonight's), newest first; each sketch checked against its
    manifest's sha256 (a run whose sketches do not check out is skipped, never half-read)."""
    out = []
    try:
        outputs = label_outputs(root)
    except FileNotFoundError:
        return []
    runs = []
    for uri in outputs:
        fs, path = fsspec.core.url_to_fs(uri)
        try:
            with fs.open(f"{path.rstrip('/')}/_manifest.json", "rb") as f:
                manifest = json.loads(f.read())
        except (OSError, ValueError):
            continue
        bundle = next((p.get("version") for p in manifest.get("parents") or [] if p.get("stage") == "bundle"), None)
        if bundle == bundle_version and manifest.get("version") != exclude:
            runs.append((_when(manifest.get("created_at")), uri, manifest))
    for _, uri, manifest in sorted(runs, key=lambda r: r[0], reverse=True):
        if len(out) >= limit:
            break
        fs, path = fsspec.core.url_to_fs(uri)
        sketches = []
        try:
            for f in sorted((f for f in manifest.get("files") or [] if str(f.get("path", "")).startswith("monitor-")),
                            key=lambda f: f["path"]):
                with fs.open(f"{path.rstrip('/')}/{f['path']}", "rb") as fh:
                    data = fh.read()
                if hashlib.sha256(data).hexdigest() != f.get("sha256"):
                    raise ValueError(f"{f['path']}: sha256 does not match")
                sk = json.loads(data)
                if sk.get("schema") != SKETCH_SCHEMA or sk.get("bundle") != bundle_version:
                    raise ValueError(f"{f['path']}: another sketch schema or bundle")
                sketches.append(sk)
        except (OSError, ValueError):
            continue
        if sketches:
            out.append((manifest.get("version"), sketches))
    return out


def verified_report(fs, path: str, sha256: str | None, uri: str) -> dict[str, Any]:
    """A run's ``monitor.json`` at ``path``, refused (ValueError naming it as ``uri``) unless its bytes match the
    manifest's sha256 and hold a JSON object with the report's parts."""
    with fs.open(path, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{uri}: its sha256 does not match the manifest (modified after the commit)")
    try:
        rep = json.loads(data)
    except ValueError as e:
        raise ValueError(f"{uri}: not valid JSON ({e})") from e
    if not isinstance(rep, dict) or not isinstance(rep.get("estimate", {}), dict) or \
            not isinstance(rep.get("features", {}), dict):
        raise ValueError(f"{uri}: not a monitoring report")
    return rep


def _when(created_at: str | None) -> float:
    if not created_at:
        return float("inf")
    try:
        return datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("inf")


def render_trend_row(row: dict[str, Any]) -> str:
    """One text line of ``lexiflow monitor``."""
    when = (row.get("created_at") or row["state"])[:19]
    parts = [f"{when:<20}", f"{row['version']}", f"bundle={row.get('bundle')}", f"rows={row.get('rows')}"]
    if row["state"] != "labelled":
        parts.append(f"({row['state']})")
        return "  ".join(parts)
    parts.append("drift=" + (",".join(row["drift"]) if row["drift"] else "none"))
    if row.get("estimate") is not None:
        lo, hi = row["interval"]
        parts.append(f"est_{row['metric']}={row['estimate']:.3f} [{lo:.3f},{hi:.3f}]"
                     + ("" if row.get("reliable") else " unreliable"))
    if row.get("realized") is not None:
        parts.append(f"realized_{row['metric']}={row['realized']:.3f}")
    elif row.get("realized_error"):
        parts.append(f"(realized unreadable: {row['realized_error']})")
    parts.append("ALERT" if row["alert"] else "ok")
    return "  ".join(parts)
