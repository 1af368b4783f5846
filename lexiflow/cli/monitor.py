"""``lexiflow monitor``: the monitoring trend of label runs (one row per run, and the trend picture)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from lexiflow.cli.base import ALERT_EXIT, StorageOptions, storage_options


def monitor(
    uri: Annotated[str, typer.Argument(help="a label output root (one directory per label version), a store (its "
                                       "labelled/ outputs) or one label output")],
    out: Annotated[Optional[Path], typer.Option("--out", help="write the trend picture (PNG) here")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line, the rows of the text")] = False,
    fail_on_alert: Annotated[bool, typer.Option("--fail-on-alert", help=f"exit {ALERT_EXIT} when the newest run's "
                                                "report alerts (after printing everything)")] = False,
    labels: Annotated[Optional[str], typer.Option("--labels", help="late true labels for one label run (URI: that "
                                                  "output, or a root: its newest run): any format `label` reads; "
                                                  "joined by row id, the realized accuracy and F1 are committed "
                                                  "beside it (realized.json)")] = None,
    label_column: Annotated[str, typer.Option("--label-column", help="with --labels: the column of the true "
                                              "label (a class name or index)")] = "label",
    labels_id_column: Annotated[Optional[str], typer.Option(
        "--labels-id-column", help="with --labels: its row-id column (the run's --id-column values); default: ids by "
        "position, file:row, for the file the run labelled")] = None,
    storage_opts: StorageOptions = None,
) -> None:
    """Monitoring over label runs: one row per run (drift, estimated metric, alert), and the trend picture.

    Oldest first: date, label version, bundle, rows, drifted features, the estimated metric with its interval,
    and ALERT or ok (from each run's monitor.json, checked against the sha256 its manifest records). --out draws the
    trend against the date: the estimated metric per run with its interval, the largest drift (PSI), and a line
    where the bundle changed. The last stdout line is a JSON summary: runs, alerts, runs without a report, whether
    the newest run alerts, the picture. With --fail-on-alert the command exits 3 when the newest run alerts.
    With --labels (URI: one label output, or a root: its newest run) the true labels that arrived later are joined
    to its rows by row id; the
    realized accuracy and F1 are printed beside the estimate and committed beside the output (realized.json and its
    record), and the trend shows them."""
    storage_options(storage_opts)
    from tasks.label.monitor import render_trend_row, trend_png, trend_rows  # noqa: PLC0415  (numpy: this command)

    if labels is not None:
        from tasks.label.realized import commit_realized, realized_report  # noqa: PLC0415  (pyarrow: this option)

        runs = [r for r in trend_rows(uri) if r["state"] == "labelled"]  # a missing root: FileNotFoundError, exit 2
        if not runs:
            raise ValueError(f"{uri}: no committed label run to join the labels to")
        target = runs[-1]["uri"]  # the output itself, or the newest run under a root
        got = realized_report(target, labels, label_column, labels_id_column)  # ValueError: one `error:` line, exit 2
        commit_realized(target, got)
        typer.echo(f"labels joined to {got['label_version']}")
        est = got["estimate"]
        for key in ("accuracy", "f1"):
            iv = est.get(f"{key}_interval") or [float("nan")] * 2
            typer.echo(f"realized {key} {got[key]:.4f} on {got['rows_joined']} of {got['rows_labelled']} labelled "
                       f"rows; estimated {est.get(key) or float('nan'):.4f} [{iv[0]:.4f}, {iv[1]:.4f}]"
                       + ("" if got["covered"][key] else " (outside the interval)"))
    rows = trend_rows(uri)  # a missing root: FileNotFoundError, one `error:` line, exit 2
    for row in rows:
        typer.echo(json.dumps(row, ensure_ascii=False, default=str) if as_json else render_trend_row(row))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(trend_png([r for r in rows if r["state"] == "labelled"]))
    sys.stdout.flush()
    dated = [r for r in rows if r.get("created_at")]  # an unfinished run has no date and is no verdict
    newest = dated[-1]["alert"] if dated else False
    typer.echo(json.dumps({"runs": len(rows), "alerts": sum(bool(r["alert"]) for r in rows),
                           "without_report": sum(r["state"] != "labelled" for r in rows),
                           "newest_alert": bool(newest), "png": str(out) if out is not None else None}))
    if fail_on_alert and newest:
        raise typer.Exit(ALERT_EXIT)
