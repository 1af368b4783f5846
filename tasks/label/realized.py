"""Realized performance of a committed label run: late labels joined to its rows by row id, beside the estimate.

A label run's monitoring report (``monitor.json``) estimates accuracy and F1 without labels. When the true labels
arrive later (a file with an id column and a label column, in any format ``label`` reads), :func:`realized_report`
joins them to the run's labelled rows by row id (the run's ``--id-column`` values, or ``{file name}:{record}`` when
the labels file is the labelled file itself, read with ids by position) and computes the realized accuracy and F1
(two classes: the positive class's; K > 2: macro) beside the estimate. :func:`commit_realized` writes it beside
the output as a second report with its own commit record: ``realized.json`` and then ``_realized.json`` (what was
joined, when, and the report's sha256), which every reader checks (:func:`read_realized`). The run's own files and
manifest are not touched.
"""

from __future__ import annotations

import hashlib
import io
import json
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from storage.artifacts import open_artifact
from storage.urls import public_url
from tasks.common.table import expand_inputs, read_batches
from tasks.inference.reference import true_metrics
from tasks.label.monitor import REPORT_FILE, verified_report
from tasks.label.output import OutputDir
from tasks.label.run import id_string

REALIZED_FILE = "realized.json"
RECORD_FILE = "_realized.json"  # the commit record of realized.json: written after it
SCHEMA = "lexiflow.realized/1"


def _class_index(value: Any, classes: list[str]) -> int | None:
    """A label value as a class index: its name among ``classes``, or an integer index (``1``, ``"1"``,
    ``1.0``); None when it is neither."""
    if value is None:
        return None
    text = str(value).strip()
    if text in classes:
        return classes.index(text)
    try:
        f = float(text)
    except ValueError:
        return None
    return int(f) if f.is_integer() and 0 <= f < len(classes) else None


def read_labels(labels_uri: str, label_column: str, id_column: str | None) -> dict[str, Any]:
    """{row id: label value} of a labels file (any format ``label`` reads); ids from ``id_column``, or
    ``{file name}:{record}`` as a run without an id column names its rows. A repeated id keeps its first label."""
    out: dict[str, Any] = {}
    for src in expand_inputs(labels_uri):
        for batch in read_batches(src, {"id": id_column, "label": label_column}, as_strings=True):
            for j in range(len(batch)):
                if batch.bad[j] is not None:
                    continue
                rid = id_string(batch.values["id"][j]) if id_column else f"{src.name}:{batch.start + j}"
                if rid is not None:
                    out.setdefault(rid, batch.values["label"][j])
    return out


def realized_report(output_uri: str, labels_uri: str, label_column: str = "label",
                    id_column: str | None = None) -> dict[str, Any]:
    """The realized accuracy and F1 of the committed label run at ``output_uri`` on the labels of ``labels_uri``
    (``id_column``: the labels file's id column, None: ids by position), beside the run's estimate. ValueError
    when the run has no monitoring report or no labelled row matches a label."""
    art = open_artifact(output_uri)
    m = art.manifest
    if m.stage != "label":
        raise ValueError(f"{public_url(output_uri)} is a {m.stage} artifact, not a label output")
    listed = {f.path: f for f in m.files}
    if REPORT_FILE not in listed:
        raise ValueError(f"{public_url(output_uri)}: no {REPORT_FILE} (labelled without monitoring)")
    out = OutputDir(output_uri, m.version)
    rep = verified_report(out.fs, out.file_path(REPORT_FILE), listed[REPORT_FILE].sha256,
                          public_url(f"{output_uri.rstrip('/')}/{REPORT_FILE}"))
    classes = [str(c) for c in rep["labels"]["classes"]]
    labels = read_labels(labels_uri, label_column, id_column)
    pred, truth, unmatched_label, labelled = [], [], 0, 0
    for rel in sorted(p for p in listed if p.startswith("part-")):
        table = pq.read_table(io.BytesIO(art.read_verified(rel)), columns=["row_id", "label"])
        for rid, lab in zip(table.column("row_id").to_pylist(), table.column("label").to_pylist()):
            labelled += 1
            if rid not in labels:
                continue
            y = _class_index(labels[rid], classes)
            if y is None:
                unmatched_label += 1
                continue
            pred.append(_class_index(lab, classes))
            truth.append(y)
    if not truth:
        raise ValueError(f"{public_url(labels_uri)}: no label matches a labelled row of {public_url(output_uri)} "
                         f"(ids {'from ' + repr(id_column) if id_column else 'by position, file:row'})")
    got = true_metrics(np.asarray(pred), np.asarray(truth), len(classes))
    est = rep["estimate"]
    return {
        "schema": SCHEMA, "label_version": m.version, "bundle_version": rep.get("bundle_version"),
        "labels": public_url(labels_uri), "label_column": label_column, "id_column": id_column,
        "rows_labelled": labelled, "rows_joined": len(truth), "labels_read": len(labels),
        "labels_not_a_class": unmatched_label,
        "accuracy": round(got["accuracy"], 6), "f1": round(got["f1"], 6), "f1_kind": est.get("f1_kind"),
        "estimate": {k: est.get(k) for k in ("accuracy", "accuracy_interval", "f1", "f1_interval", "metric")},
        "covered": {k: (None if est.get(f"{k}_interval") is None else
                        bool(est[f"{k}_interval"][0] <= got[k] <= est[f"{k}_interval"][1]))
                    for k in ("accuracy", "f1")},
    }


def commit_realized(output_uri: str, report: dict[str, Any]) -> dict[str, Any]:
    """Write ``realized.json`` beside the label output, then its commit record ``_realized.json`` (the report's
    sha256, when, which labels); returns the record. A later join replaces both."""
    out = OutputDir(output_uri, report["label_version"])
    data = json.dumps(report, indent=1, sort_keys=True, ensure_ascii=False).encode()
    out.write_bytes(REALIZED_FILE, data)
    record = {"schema": SCHEMA, "file": REALIZED_FILE, "sha256": hashlib.sha256(data).hexdigest(),
              "label_version": report["label_version"], "labels": report["labels"],
              "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    out.write_bytes(RECORD_FILE, json.dumps(record, indent=1, sort_keys=True).encode())
    return record


def read_realized(output_uri: str) -> dict[str, Any] | None:
    """The committed ``realized.json`` of a label output, checked against its record's sha256; None when no labels
    were joined yet; ValueError when the bytes do not match."""
    out = OutputDir(output_uri, "")
    record = out.read_json(RECORD_FILE)
    if not isinstance(record, dict):
        return None
    with out.fs.open(out.file_path(REALIZED_FILE), "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise ValueError(f"{public_url(output_uri.rstrip('/') + '/' + REALIZED_FILE)}: its sha256 does not match "
                         f"{RECORD_FILE} (modified after the commit)")
    return json.loads(data)
