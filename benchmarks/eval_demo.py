"""Evaluation record of the demo: the shipped classifier, the encoder alone and the baseline on the same test rows,
with the contamination count, read from the bundle ``make demo`` built (its manifest holds what the fine-tuning
stage measured). Writes them as JSON for the generated quality page, so the figures there come from the run.

    make demo && .venv/bin/python benchmarks/eval_demo.py --results docs/results/eval_demo.json && make docs

Any other pipeline's store reads the same way, under another name, e.g. the ChnSentiCorp CPU run:

    .venv/bin/lexiflow run pipeline --config configs/chnsenticorp_cpu.yaml
    .venv/bin/python benchmarks/eval_demo.py --store .eval/chnsenticorp/store --name eval_chnsenticorp \
        --results docs/results/eval_chnsenticorp.json

When some test rows repeat a training text, the figures on the other rows (``clean``) are recorded too.
The last line: ``<name> test_auc shipped=<x> encoder=<y> baseline=<z> (<verdict>)``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy loads, as the CLI)

from benchmarks._numerics_ab import write_results  # noqa: E402
from storage.artifacts import ArtifactStore  # noqa: E402

KEYS = ("auc", "accuracy", "f1")


def figures(store_uri: str, version: str | None = None) -> dict:
    """The bundle's evaluation (the newest bundle when ``version`` is None) as a flat dict."""
    store = ArtifactStore(store_uri)
    version = version or store.versions("bundle")[-1]
    art = store.open("bundle", version)
    pre = next(p for p in art.manifest.parents if p.stage == "finetune")
    # the fine-tuning stage's metrics (the bundle carries the test figures, not n_clean_test / clean_test_*)
    m = {**store.open("finetune", pre.version).manifest.metrics, **art.manifest.metrics}
    rows = {
        "shipped": {k: m.get(f"test_{k}") for k in KEYS},
        "encoder alone": {k: m.get(f"encoder_test_{k}") for k in KEYS},
        "baseline (TF-IDF char 1-2-gram LR, same rows)": {k: m.get(f"baseline_test_{k}") for k in KEYS},
    }
    out = {"bundle": version, "finetune": pre.version, "threshold": m.get("threshold"), "table": rows,
           "contaminated_test_rows": m.get("contaminated_test_rows"),
           "contaminated_dev_rows": m.get("contaminated_dev_rows"), "vs_baseline": m.get("test_auc_vs_baseline")}
    if isinstance(m.get("n_clean_test"), int):  # only when some test rows repeat a training text
        out["n_test"] = m.get("n_test")
        out["clean"] = {"n_rows": m["n_clean_test"], **{
            name: {k: m.get(f"{p}clean_test_{k}") for k in ("auc", "accuracy")}
            for name, p in (("shipped", ""), ("encoder alone", "encoder_"), ("baseline", "baseline_"))}}
    return out


def verdict(f: dict) -> str:
    """Where the shipped classifier's test AUC stands against the baseline's (its 95 % interval of the difference)."""
    lo, hi = (f["vs_baseline"] or {}).get("ci95", (None, None))
    return ("n/a" if lo is None else "above the baseline" if lo > 0 else "below the baseline" if hi < 0
            else "a tie: the 95 % interval holds 0")


def record(store_uri: str, version: str | None = None, name: str = "eval_demo") -> dict:
    """:func:`figures` with the summary line (``last_line``) the results file carries."""
    f = figures(store_uri, version)
    t = f["table"]
    line = (f"{name.removeprefix('eval_')} test_auc shipped={t['shipped']['auc']:.4f} "
            f"encoder={t['encoder alone']['auc']:.4f} "
            f"baseline={t['baseline (TF-IDF char 1-2-gram LR, same rows)']['auc']:.4f} ({verdict(f)})")
    return {**f, "last_line": line}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", default=".demo/store")
    ap.add_argument("--bundle", help="a bundle version (default: the newest)")
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/eval_demo.json)")
    ap.add_argument("--name", default="eval_demo", help="the record's name (the results table's row)")
    args = ap.parse_args()
    f = record(args.store, args.bundle, args.name)
    for name, row in f["table"].items():
        print(f"{name:<48} " + "  ".join(f"{k}={v:.4f}" for k, v in row.items() if v is not None))
    print(f"contaminated test / dev rows: {f['contaminated_test_rows']} / {f['contaminated_dev_rows']}")
    write_results(args.results, args.name, f)
    print(f["last_line"])


if __name__ == "__main__":
    main()
