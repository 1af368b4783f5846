"""NER quality: HMM baseline vs LEBERT (lexicon adapter on / off) on the same data, splits and seed.

    .venv/bin/python benchmarks/eval_ner.py --store .demo/store --sample .demo/inputs [--datasets pd,resume,weibo]

Uses the committed ``pretrain`` and ``lexicon`` artifacts in ``--store`` (run ``make demo`` first)
and the NER files: the embedded People's Daily sample (``ner_sample.bio``, split 80/10/10) and,
when ``../shared/data/ner`` exists, Resume and Weibo with their given train/dev/test splits.
Models are selected on dev F1 and reported on test (entity-level, exact span and type).
The CPU budget (caps, epochs) is printed with the table; the last line is the ablation delta.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "ner"


def datasets(sample: Path) -> dict[str, dict]:
    out = {"pd": {"data_uri": str(sample / "ner_sample.bio")}}
    for name in ("resume", "weibo"):
        d = SHARED / name
        if d.exists():
            out[name] = {f"{k}_uri": str(d / f"{k}.char.bmes") for k in ("train", "dev", "test")}
    return out


def main() -> None:
    from storage.artifacts import ArtifactStore
    from tasks.common.config import NerConfig
    from tasks.ner.train import load_ner_splits, run_hmm_eval, run_ner_stage

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", default=".demo/store")
    ap.add_argument("--sample", default=".demo/inputs")
    ap.add_argument("--datasets", default="pd,resume,weibo")
    ap.add_argument("--max-train", type=int, default=3000)
    ap.add_argument("--max-eval", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    store = ArtifactStore(args.store)
    pre = store.open("pretrain", store.versions("pretrain")[-1])
    lex = next(p for p in pre.manifest.parents if p.stage == "lexicon")
    scratch = ArtifactStore(f"memory://eval-ner-{uuid.uuid4().hex}")
    budget = dict(max_train_sentences=args.max_train, max_eval_sentences=args.max_eval, max_epochs=args.epochs,
                  patience=2, threads=args.threads, seed=42)
    rows, deltas = [], []
    for name, uris in datasets(Path(args.sample)).items():
        if name not in args.datasets.split(","):
            continue
        base = NerConfig(**uris, **budget)
        sp = load_ner_splits(base)
        hmm = run_hmm_eval(sp.train, sp.dev, sp.test)
        sizes = f"{len(sp.train)}/{len(sp.dev)}/{len(sp.test)}"
        row = {"dataset": name, "train/dev/test": sizes, "hmm": hmm["test_f1"]}
        for adapter in (True, False):
            cfg = base.model_copy(update={"use_adapter": adapter})
            t0 = time.perf_counter()
            res = run_ner_stage(scratch.begin("ner", uuid.uuid4().hex[:16]), cfg, pre.uri, lex.uri, progress=False)
            key = "lebert" if adapter else "no_adapter"
            row[key] = res.metrics["test_f1"]
            row[f"{key}_s"] = round(time.perf_counter() - t0)
            row[f"{key}_epoch"] = res.metrics["best_epoch"]
        deltas.append(row["lebert"] - row["no_adapter"])
        rows.append(row)
        print(row, flush=True)
    print(f"\npretrain {pre.uri} ({pre.manifest.metrics.get('steps')} steps); budget {budget}")
    print("| dataset | train/dev/test | HMM F1 | LEBERT F1 (adapter on) | adapter off | best epoch on/off |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dataset']} | {r['train/dev/test']} | {r['hmm']:.4f} | {r['lebert']:.4f} | {r['no_adapter']:.4f} "
              f"| {r['lebert_epoch']}/{r['no_adapter_epoch']} |")
    deltas_txt = ", ".join(f"{r['dataset']}={d:+.4f}" for r, d in zip(rows, deltas))
    print("ablation mean test F1 delta (adapter on - off) = " + deltas_txt)


if __name__ == "__main__":
    main()
