"""NER quality: HMM vs LEBERT on two SEPARATELY pretrained encoders (adapter on / off), same data, splits, seed.

    .venv/bin/python benchmarks/eval_ner.py --config configs/demo.yaml --store .demo/store \\
        --sample .demo/inputs [--datasets pd,resume,weibo] [--steps 300] [--epochs 10]

Uses the committed ``lexicon`` (and its vocab) in ``--store`` (run ``make demo`` first). Both encoders are
pretrained here with the config's ``pretrain`` section (``--steps`` overrides its steps; only
``model.use_adapter`` differs); each dataset then trains one tagger per encoder (adapter used iff the
encoder has one) and the HMM on the same sentences. NER files: the embedded People's Daily sample
(``ner_sample.bio``, split 80/10/10) and, when ``../shared/data/ner`` exists, Resume and Weibo with
their given splits. Models are selected on dev F1, reported on test (entity level, exact span and type).
Contamination: test sentences also in the NER train split, and test sentences also in the pretraining
corpus (normalised, numbers as #NUM#); non-zero counts are printed as WARNINGs beside the row.
People's Daily is optimistic by construction: its entity labels come from the POS tags (nr/ns/nt) of the
same corpus jieba's dictionary was built from, so nearly every ORG/LOC span is a lexicon word.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "ner"
PD_NOTE = "optimistic by construction: labels from POS tags that jieba's dictionary covers"


def datasets(sample: Path, shared: Path = SHARED) -> dict[str, dict]:
    out = {"pd": {"data_uri": str(sample / "ner_sample.bio")}}
    for name in ("resume", "weibo"):
        d = shared / name
        if d.exists():
            out[name] = {f"{k}_uri": str(d / f"{k}.char.bmes") for k in ("train", "dev", "test")}
    return out


def corpus_texts(lex) -> set[str]:
    """Normalised sentences of the pretraining corpus (the lexicon shards' ``text``: #NUM# already in)."""
    from storage.parquet import iter_batches

    return {t for rel in lex.files("shards/") for b in iter_batches(lex, rel, columns=["text"])
            for t in b.column("text").to_pylist()}


def sentence_key(chars) -> str:
    from tasks.common.text import normalize_text
    from tasks.text.numbers import replace_numbers

    return replace_numbers(normalize_text("".join(chars)))


def main() -> None:
    from flows.config import PipelineConfig, load_config
    from storage.artifacts import ArtifactStore
    from tasks.evaluate.ablation import markdown, ner_rows, pretrain_variants, warn
    from tasks.ner.config import NerConfig
    from tasks.pretrain.data import max_word_num
    from tasks.pretrain.stage import lexicon_inputs, pretrain_rows
    from tasks.text.featurize import Featurizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--store", default=".demo/store")
    ap.add_argument("--sample", default=".demo/inputs")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (as the CLI's --set)")
    ap.add_argument("--datasets", default="pd,resume,weibo")
    ap.add_argument("--shared", default=str(SHARED), help="folder holding resume/ and weibo/")
    ap.add_argument("--steps", type=int, default=None, help="pretraining steps (default: the config's)")
    ap.add_argument("--max-train", type=int, default=3000)
    ap.add_argument("--max-eval", type=int, default=1000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=2)
    ap.add_argument("--crf", action="store_true", help="CRF head instead of softmax")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/eval_ner.json; make docs renders "
                    "the quality page from it)")
    args = ap.parse_args()

    cfg = load_config(PipelineConfig, args.config, args.set)
    pcfg = cfg.pretrain if args.steps is None else cfg.pretrain.model_copy(update={"steps": args.steps})
    store = ArtifactStore(args.store)
    lex = store.open("lexicon", store.versions("lexicon")[-1])
    vocab_size, wv, _ = lexicon_inputs(lex)
    rows, n_extra, _ = pretrain_rows(pcfg, lex)
    t0 = time.perf_counter()
    variants = pretrain_variants(pcfg, rows, vocab_size, wv, max_word_num(lex))
    t_pre = time.perf_counter() - t0
    feat = Featurizer.from_artifacts(lex, max_len=pcfg.model.max_len)
    corpus = corpus_texts(lex)
    budget = dict(max_train_sentences=args.max_train, max_eval_sentences=args.max_eval, max_epochs=args.epochs,
                  patience=args.patience, threads=args.threads, seed=42, lr=args.lr, use_crf=args.crf)
    lines, per_dataset = [], {}
    found = datasets(Path(args.sample), Path(args.shared))
    for name in args.datasets.split(","):
        if name not in found:
            continue
        uris = found[name]
        ncfg = NerConfig(**uris, **budget)
        t0 = time.perf_counter()
        table = ner_rows(variants, ncfg, feat, pcfg.model.max_len)
        from tasks.ner.train import load_ner_splits

        sp = load_ner_splits(ncfg)
        train_keys = {sentence_key(s["chars"]) for s in sp.train}
        test_keys = [sentence_key(s["chars"]) for s in sp.test]
        in_train = sum(k in train_keys for k in test_keys)
        in_corpus = sum(k in corpus for k in test_keys)
        note = f" ({PD_NOTE})" if name == "pd" else ""
        print(f"\n{name}: train/dev/test {len(sp.train)}/{len(sp.dev)}/{len(sp.test)} sentences, "
              f"{time.perf_counter() - t0:.0f} s{note}")
        print(markdown(table, ("model", "test_f1", "dev_f1", "best_epoch", "heldout_mlm_acc")))
        print(f"contamination: {in_train} test sentences in NER train{warn(in_train, len(test_keys), 'test')}; "
              f"{in_corpus} in the pretraining corpus{warn(in_corpus, len(test_keys), 'test (pretraining corpus)')}",
              flush=True)
        per_dataset[name] = {"sentences": {"train": len(sp.train), "dev": len(sp.dev), "test": len(sp.test)},
                             "table": table, "test_in_train": in_train, "test_in_pretraining_corpus": in_corpus}
        on, off, hmm = (r["test_f1"] for r in table)
        lines.append(f"{name}: on={on:.4f} off={off:.4f} hmm={hmm:.4f} (on - off {on - off:+.4f}, on - hmm "
                     f"{on - hmm:+.4f})")
    print(f"\npretrain: {pcfg.steps} steps x2 ({t_pre:.0f} s), {n_extra} extra rows, seed {pcfg.seed}; "
          f"NER budget {budget}")
    line = "test F1 " + "; ".join(lines)
    if args.results:
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _numerics_ab import write_results

        write_results(args.results, "eval_ner", {"budget": budget, "pretrain_steps": pcfg.steps,
                                                 "datasets": per_dataset, "last_line": line})
    print(line)


if __name__ == "__main__":
    main()
