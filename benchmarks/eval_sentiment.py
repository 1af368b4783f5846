"""Sentiment quality: LEBERT (adapter on) vs an encoder pretrained WITHOUT the lexicon vs the TF-IDF baseline,
on the same split, with the train/test contamination count.

    .venv/bin/python benchmarks/eval_sentiment.py --config configs/demo.yaml --store .demo/store \\
        [--eval-file ../shared/data/sentiment/chnsenticorp/test.tsv --eval-text-column text_a]

Uses the committed ``lexicon`` (and its vocab) in ``--store`` (run ``make demo`` first). Both encoders are
pretrained here from scratch with the config's ``pretrain`` section (same data, extra texts, seed and steps;
only ``model.use_adapter`` differs), then fine-tuned with its ``finetune`` section. ``--eval-file``: any
other evaluation file is checked for texts (normalised) that also occur in the fine-tuning or the
pretraining extra texts; a non-zero overlap is printed as a WARNING next to the metric. The budget
(steps, rows, epochs) is printed with the table.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    from flows.config import PipelineConfig, load_config
    from storage.artifacts import ArtifactStore
    from tasks.common.labelled import load_data
    from tasks.common.table import expand_inputs, read_batches
    from tasks.evaluate.ablation import markdown, overlap, pretrain_variants, sentiment_rows, warn
    from tasks.pretrain.data import max_word_num
    from tasks.pretrain.domain import train_texts
    from tasks.pretrain.stage import lexicon_inputs, pretrain_rows
    from tasks.text.featurize import Featurizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--store", default=".demo/store")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (as the CLI's --set)")
    ap.add_argument("--eval-file", default=None)
    ap.add_argument("--eval-text-column", default="review")
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/eval_sentiment.json; make docs "
                    "renders the quality page from it)")
    args = ap.parse_args()

    cfg = load_config(PipelineConfig, args.config, args.set)
    store = ArtifactStore(args.store)
    lex = store.open("lexicon", store.versions("lexicon")[-1])
    vocab_size, wv, _ = lexicon_inputs(lex)
    pcfg, fcfg = cfg.pretrain, cfg.finetune
    rows, n_extra, _ = pretrain_rows(pcfg, lex)
    t0 = time.perf_counter()
    variants = pretrain_variants(pcfg, rows, vocab_size, wv, max_word_num(lex))
    t_pre = time.perf_counter() - t0
    feat = Featurizer.from_artifacts(lex, max_len=min(fcfg.max_len, pcfg.model.max_len))
    t0 = time.perf_counter()
    table = sentiment_rows(variants, fcfg, feat)
    t_ft = time.perf_counter() - t0
    print(f"lexicon {lex.uri}; pretrain {pcfg.steps} steps x2 ({t_pre:.0f} s), {n_extra} extra rows; "
          f"fine-tune {fcfg.max_epochs} epochs max ({t_ft:.0f} s); seed {pcfg.seed}/{fcfg.seed}")
    clean = ("clean_test_auc", "clean_test_accuracy", "n_clean_test") if table[0]["n_clean_test"] else ()
    print(markdown(table, ("model", "test_auc", "test_accuracy", "test_f1", "heldout_mlm_acc", "n_train", "n_test",
                           "contaminated_test_rows", *clean)))
    n, of = table[0]["contaminated_test_rows"], table[0]["n_test"]
    print("split contamination (test rows also in train): " + (warn(n, of, "test").strip() or "0"))
    if args.eval_file:
        data = load_data(fcfg)
        seen = [r["text"] for r in data.train] + [t for ex in pcfg.extra_texts for t in train_texts(ex)]
        (src,) = expand_inputs(args.eval_file, "auto")
        texts = [t for b in read_batches(src, {"text": args.eval_text_column}, header_required=True)
                 for t in b.values["text"] if t]
        k = overlap(seen, texts)
        print(f"eval file {args.eval_file}: {k} of {len(texts)} texts also in the training data"
              + warn(k, len(texts), "evaluation-file"))
    on, off, base = (r["test_auc"] for r in table)
    line = f"test AUC adapter on={on:.4f} off={off:.4f} baseline={base:.4f}; ablation (on - off) = {on - off:+.4f}"
    if args.results:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _numerics_ab import write_results

        write_results(args.results, "eval_sentiment", {"config": args.config, "sets": args.set, "table": table,
                                                       "last_line": line})
    print(line)


if __name__ == "__main__":
    main()
