"""Benchmark: the pretraining input pipeline, today's packed loader against the per-example reference path.

Same rows, the full profile's shape (``configs/full.yaml``: 512-token pairs, batch 128, W words per character,
whole-word masking without answer leaks, NSP):

* ``ref``: ``tests/pretrain_reference.py``'s ``iter_batches``: pairing, masking and collation per example, in Python,
  in the consuming process (what the trainer read before the packed loader);
* ``packed``: ``tasks.pretrain.packed``: the rows packed once (timed apart, reported as pairs/s), then batches built
  by vectorised gathers and masking. Measured three ways: built inline in this process (the work itself); delivered
  by one background loader thread (the trainer's default, what the training loop receives: the headline figure);
  delivered by one torch DataLoader worker process (``pretrain.data.loader: process``).

Tokens are real tokens ([CLS], [SEP] and characters; no padding). Each rate is the median of ``--repeats`` passes
over the same rows. ``h100_need`` is the rate an H100 at 40 % MFU consumes when training the seed-size model
(6 x 384, FFN 1536, the lexicon adapter on) at 512 tokens: 0.4 x 989e12 / flops_per_token, the model's own formula
(checked against torch's FLOP counter in tests/test_gpu_paths.py).

Rows: the demo store's matched shards when ``make demo`` has run (``--lexicon URI`` picks another lexicon
artifact), else synthetic rows with the demo's sentence-length and word statistics.

    python benchmarks/bench_loader.py [--lexicon .demo/store/lexicon/<version>] [--repeats 3] [--results FILE]

The last line: ``loader tokens_per_s=<packed, delivered by the thread> ref=<ref> h100_need=<N> ratio=<packed/ref>x``.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy and torch load, as the CLI)

import numpy as np  # noqa: E402

from benchmarks._numerics_ab import write_results  # noqa: E402
from flows.config import PipelineConfig, load_config  # noqa: E402
from tasks.pretrain.data import iter_rows, max_word_num  # noqa: E402
from tests import pretrain_reference as ref  # noqa: E402
from tasks.pretrain.packed import PackedBatches, Schedule, loader, pack_rows  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_BF16, MFU = 989e12, 0.4


def demo_rows(uri: str | None) -> tuple[list[dict], int, int, str]:
    """(rows, W, vocab size, where they came from)."""
    from storage.artifacts import open_artifact
    from tasks.text.vocab import parse_vocab

    found = [uri] if uri else sorted(glob.glob(os.path.join(ROOT, ".demo", "store", "lexicon", "*[0-9a-f]")))
    if found:
        lex = open_artifact(found[-1])
        vocab = next(p for p in lex.manifest.parents if p.stage == "vocab")
        V = len(parse_vocab(open_artifact(vocab.uri).read_verified("vocab.txt")))
        return list(iter_rows(lex)), max_word_num(lex), V, lex.uri
    return synthetic_rows(), 3, 21128, "synthetic (run `make demo` for the demo's matched shards)"


def synthetic_rows(n_docs: int = 4000, seed: int = 0, W: int = 3, V: int = 21128,
                   word_vocab: int = 50000) -> list[dict]:
    """Rows shaped like the demo's: 2-20 sentences a document, 10-80 characters, whole words of 2-4 characters
    on about 60 % of the characters, up to W lexicon words per character; character ids within V (after the six
    specials of a counted vocabulary), word ids within word_vocab."""
    rng = np.random.default_rng(seed)
    rows = []
    for d in range(n_docs):
        for _ in range(int(rng.integers(2, 21))):
            n = int(rng.integers(10, 81))
            starts, ends, p = [], [], 0
            while p < n:
                g = int(rng.integers(2, 5))
                if rng.random() < 0.4 and p + g <= n:
                    starts.append(p)
                    ends.append(p + g)
                    p += g
                else:
                    p += 1
            ws = np.repeat(np.arange(n, dtype=np.int32), W)
            rows.append({"doc_id": f"d{d}", "n_tokens": n, "char_ids": rng.integers(6, V, n).astype(np.int32),
                         "word_ids": rng.integers(0, word_vocab, n * W).astype(np.int32), "word_starts": ws,
                         "word_ends": ws + 1, "group_starts": np.array(starts, np.int32),
                         "group_ends": np.array(ends, np.int32)})
    return rows


def seed_flops_per_token(V: int, W: int, seq_len: int, mask_prob: float) -> float:
    from models import LebertForPretraining, ModelConfig

    m = load_config(PipelineConfig, os.path.join(ROOT, "configs", "full.yaml")).pretrain.model
    mc = ModelConfig(vocab_size=V, word_vocab_size=1000, word_dim=200, max_word_num=W,
                     **m.model_dump(exclude=m.TRAINING_ONLY))
    return LebertForPretraining(mc).flops_per_token(seq_len, mask_prob)


def rate(fn, repeats: int) -> tuple[float, list[float]]:
    """Median tokens/s of ``fn()`` over ``repeats`` passes; ``fn`` returns the tokens it produced, or (tokens,
    seconds) when it times itself."""
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        got = fn()
        n, dt = got if isinstance(got, tuple) else (got, time.perf_counter() - t)
        rates.append(n / dt)
    return statistics.median(rates), rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lexicon", help="a lexicon artifact URI (default: the newest under .demo/store)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", help="write the figures as JSON here (e.g. docs/results/bench_loader.json)")
    args = ap.parse_args()

    full = load_config(PipelineConfig, os.path.join(ROOT, "configs", "full.yaml")).pretrain.data
    cfg = full.model_copy(update={"heldout_frac": 0.0})
    rows, W, V, source = demo_rows(args.lexicon)
    print(f"rows: {len(rows):,} sentences, {sum(r['n_tokens'] for r in rows):,} characters, W={W}, vocab {V}: "
          f"{source}")
    print(f"shape: max_seq_len {cfg.max_seq_len}, batch {cfg.batch_size}, whole-word masking, NSP")

    def reference() -> int:
        return sum(b.n_real_tokens for b in ref.iter_batches(rows, cfg, V, W, 0))

    ref_rate, ref_all = rate(reference, args.repeats)
    print(f"ref     (per example, in the consuming process): {ref_rate:,.0f} tokens/s  {[round(r) for r in ref_all]}")

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        pack = pack_rows(rows, cfg, W, tmp)
        pack_s = time.perf_counter() - t
        print(f"pack    (once): {len(pack):,} pairs, {pack.meta['tokens']:,} tokens in {pack_s:.1f} s "
              f"({len(pack) / pack_s:,.0f} pairs/s)")
        data = PackedBatches(tmp, cfg, V)
        n_batches = data.per_epoch()

        def inline() -> int:
            return sum(data[0, k].n_real_tokens for k in range(n_batches))

        starts: list[float] = []
        kind = "thread"

        def delivered() -> tuple[int, float]:
            """Tokens and seconds from the first batch's arrival to the last's (the worker's start-up, once a run,
            is timed apart)."""
            t = time.perf_counter()
            it = iter(loader(data, Schedule(0, 0, n_batches, n_batches), 1, 4, False, kind))
            next(it)
            t0 = time.perf_counter()
            starts.append(t0 - t)
            return sum(b.to("cpu").n_real_tokens for _, b in it), time.perf_counter() - t0

        inline_rate, inline_all = rate(inline, args.repeats)
        print(f"packed  (built inline, one process): {inline_rate:,.0f} tokens/s  {[round(r) for r in inline_all]}")
        new_rate, new_all = rate(delivered, args.repeats)
        print(f"packed  (delivered by 1 loader thread, the default): {new_rate:,.0f} tokens/s  "
              f"{[round(r) for r in new_all]}")
        kind = "process"
        proc_rate, proc_all = rate(delivered, args.repeats)
        print(f"packed  (delivered by 1 DataLoader worker process): {proc_rate:,.0f} tokens/s  "
              f"{[round(r) for r in proc_all]}; start-up {statistics.median(starts[args.repeats:]):.2f} s (once a run)")

    fpt = seed_flops_per_token(V, W, cfg.max_seq_len, cfg.mask_prob)
    need = MFU * H100_BF16 / fpt
    print(f"seed model at {cfg.max_seq_len} tokens: {fpt / 1e6:.1f} MFLOP/token; an H100 at 40 % MFU consumes "
          f"{need:,.0f} tokens/s")
    write_results(args.results, "bench_loader", {
        "rows": len(rows), "source": source, "W": W, "vocab": V, "max_seq_len": cfg.max_seq_len,
        "batch_size": cfg.batch_size, "ref_tokens_per_s": round(ref_rate), "pack_s": round(pack_s, 2),
        "pack_pairs_per_s": round(len(pack) / pack_s), "inline_tokens_per_s": round(inline_rate),
        "delivered_tokens_per_s": round(new_rate), "process_worker_tokens_per_s": round(proc_rate),
        "process_worker_startup_s": round(statistics.median(starts[args.repeats:]), 2),
        "flops_per_token": round(fpt), "h100_need_tokens_per_s": round(need), "ratio": round(new_rate / ref_rate, 2)})
    ratio = new_rate / ref_rate
    print(f"loader tokens_per_s={new_rate:.0f} ref={ref_rate:.0f} h100_need={need:.0f} ratio={ratio:.2f}x")


if __name__ == "__main__":
    main()
