"""Benchmark: a pretraining step with the adapter's word table at 10k and at 1M rows, sparse against dense.

``pretrain.model.word_table: sparse`` updates only the rows a batch touched (:mod:`tasks.training.row_adam`), so a
step should cost the same whatever the table's size; ``dense`` (the CPU default) clears, clips and AdamW-updates
every row on every step. Timed: one whole training step as the stage makes it (forward, backward, the global
clipping norm, AdamW; :func:`tasks.training.loop.optimizer_step`), one process, at the demo profile's model and
batch (``configs/demo.yaml``: 2 x 128, batch 32 x 64 tokens, 3 word slots per character, 64-dim word vectors).

The batches are synthetic and demo-like: about half the word slots hold a word, drawn by a Zipf law over the
table's own words (so the 1M-row table's batches touch more distinct rows, as a bigger lexicon matches rarer words),
placed at random rows. Eight batches are cycled. After a warm-up, the four set-ups take turns step by step for
``--rounds`` rounds, in a new random order each round (a busy host slows them alike, and no set-up always follows
the dense 1M-row one, whose freed gigabyte the next step may pay for), and each set-up's figure is the median of its
step times: wall
time (the headline) and the process's CPU time (all its threads; less moved by other processes on the host).

    python benchmarks/bench_word_table.py [--rounds 16] [--results docs/results/bench_word_table.json]

The last line: ``bench_word_table sparse_1m_vs_10k=<x>x dense_1m_vs_10k=<x>x sparse_1m_vs_10k_cpu=<x>x`` (target:
sparse_1m_vs_10k <= 1.15x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy and torch load, as the CLI)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks._numerics_ab import write_results  # noqa: E402
from flows.config import PipelineConfig, load_config  # noqa: E402
from tasks.pretrain.train import build_model, sparse_rows  # noqa: E402
from tasks.training.loop import make_adamw, optimizer_step  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"10k": 10_000, "1m": 1_000_000}
V = 4_200  # about the demo's character vocabulary
WORD_DIM = 64  # the demo's word vectors (the sample's gensim vectors)
SLOT_FILL = 0.5  # share of word slots that hold a word
ZIPF = 1.1
N_BATCHES = 8
TARGET = 1.15


def batches(rows: int, B: int, T: int, W: int, max_pred: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``N_BATCHES`` demo-like batches over a table of ``rows`` rows (row 0 the [PAD] word)."""
    rng = np.random.default_rng(seed)
    where = rng.permutation(rows - 1) + 1  # word rank -> table row: the batch's words scattered over the table
    out = []
    for _ in range(N_BATCHES):
        ranks = rng.zipf(ZIPF, size=B * T * W * 3)
        ranks = ranks[ranks < rows][: B * T * W]  # the table's own words: Zipf truncated to its size
        words = where[ranks - 1] * (rng.random(B * T * W) < SLOT_FILL)
        n_pred = min(max_pred, round(0.15 * (T - 3)))
        pos = np.concatenate([b * T + 1 + rng.choice(T - 2, n_pred, replace=False) for b in range(B)])
        out.append({
            "input_ids": torch.from_numpy(rng.integers(6, V, size=(B, T))),
            "segment_ids": torch.from_numpy((np.arange(T) >= T // 2).astype(np.int64)).expand(B, T).contiguous(),
            "attention_mask": torch.ones(B, T, dtype=torch.bool),
            "word_ids": torch.from_numpy(words.reshape(B, T, W).astype(np.int64)),
            "mlm_positions": torch.from_numpy(pos.astype(np.int64)),
            "mlm_labels": torch.from_numpy(rng.integers(6, V, size=pos.size)),
            "nsp_labels": torch.from_numpy(rng.integers(0, 2, size=B)),
        })
    return out


class Setup:
    """A model, its optimizer(s) and its batches: one of the four set-ups."""

    def __init__(self, cfg, kind: str, rows: int, W: int):
        torch.manual_seed(cfg.seed)
        vectors = np.random.default_rng(1).uniform(-0.1, 0.1, size=(rows, WORD_DIM)).astype(np.float32)
        vectors[0] = 0
        self.cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"word_table": kind})})
        self.model = build_model(self.cfg, V, vectors, W)
        self.model.train()
        self.opt = make_adamw(self.model, cfg.lr, cfg.weight_decay, cfg.betas)
        self.rows = sparse_rows(self.cfg, self.model)
        d = cfg.data
        self.batches = batches(rows, d.batch_size, d.max_seq_len, W, d.max_predictions_per_seq, seed=rows)
        self.distinct = statistics.mean(int(torch.unique(b["word_ids"]).numel()) - 1 for b in self.batches)
        self.k = 0

    def step(self) -> tuple[float, float]:
        """One training step, as the stage makes it: its (wall, CPU) seconds."""
        b = self.batches[self.k % N_BATCHES]
        self.k += 1
        t, c = time.perf_counter(), time.process_time()
        words, extra = b["word_ids"], {}
        if self.rows is not None:
            words, extra["word_rows"] = self.rows.gather(words)
        out = self.model(b["input_ids"], b["segment_ids"], b["attention_mask"], words, b["mlm_positions"],
                         b["mlm_labels"], b["nsp_labels"], **extra)
        optimizer_step(self.opt, out.loss, self.model.parameters(), self.cfg.grad_clip, self.rows)
        return time.perf_counter() - t, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=16, help="timed steps per set-up, the set-ups taking turns")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per set-up first")
    ap.add_argument("--results", help="write the figures as JSON here (e.g. docs/results/bench_word_table.json)")
    args = ap.parse_args()

    cfg = load_config(PipelineConfig, os.path.join(ROOT, "configs", "demo.yaml"), []).pretrain
    W = load_config(PipelineConfig, os.path.join(ROOT, "configs", "demo.yaml"), []).prepare.lexicon.max_word_num
    torch.set_num_threads(cfg.threads)
    m, d = cfg.model, cfg.data
    print(f"model {m.num_layers} x {m.hidden_size} (ffn {m.ffn_size}), batch {d.batch_size} x {d.max_seq_len} "
          f"tokens, W={W}, word vectors {WORD_DIM}-dim; torch {torch.__version__}, {cfg.threads} threads")
    setups = {f"{kind}_{size}": Setup(cfg, kind, rows, W) for size, rows in SIZES.items()
              for kind in ("sparse", "dense")}
    for name, s in setups.items():
        for _ in range(args.warmup):
            s.step()
        print(f"{name}: {s.distinct:,.0f} distinct words per batch (mean)")
    times: dict[str, list[float]] = {name: [] for name in setups}
    cpu: dict[str, list[float]] = {name: [] for name in setups}
    order = np.random.default_rng(0)
    for r in range(args.rounds):
        for i in order.permutation(len(setups)):
            name, s = list(setups.items())[i]
            wall, c = s.step()
            times[name].append(wall)
            cpu[name].append(c)
        if (r + 1) % 4 == 0 or r + 1 == args.rounds:
            print(f"step {r + 1}/{args.rounds}: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.0f} ms"
                                                           for n, t in times.items()))
    med = {name: statistics.median(t) for name, t in times.items()}
    med_cpu = {name: statistics.median(t) for name, t in cpu.items()}
    sparse_ratio = med["sparse_1m"] / med["sparse_10k"]
    dense_ratio = med["dense_1m"] / med["dense_10k"]
    sparse_cpu_ratio = med_cpu["sparse_1m"] / med_cpu["sparse_10k"]
    for name in setups:
        print(f"{name:11s} median step {med[name] * 1e3:7.1f} ms wall (min {min(times[name]) * 1e3:.1f}, "
              f"max {max(times[name]) * 1e3:.1f}), {med_cpu[name] * 1e3:7.1f} ms CPU")
    write_results(args.results, "bench_word_table", {
        "torch": torch.__version__, "threads": cfg.threads,
        "model": {"hidden_size": m.hidden_size, "num_layers": m.num_layers, "ffn_size": m.ffn_size,
                  "batch_size": d.batch_size, "max_seq_len": d.max_seq_len, "max_word_num": W,
                  "word_dim": WORD_DIM, "vocab": V},
        "table_rows": SIZES, "slot_fill": SLOT_FILL, "zipf": ZIPF, "rounds": args.rounds, "warmup": args.warmup,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "distinct_words_per_batch": {n: round(s.distinct) for n, s in setups.items()},
        "median_step_ms": {n: round(v * 1e3, 2) for n, v in med.items()},
        "median_step_cpu_ms": {n: round(v * 1e3, 2) for n, v in med_cpu.items()},
        "step_ms": {n: [round(x * 1e3, 2) for x in t] for n, t in times.items()},
        "sparse_1m_vs_10k_cpu": round(sparse_cpu_ratio, 3),
        "sparse_1m_vs_10k": round(sparse_ratio, 3), "dense_1m_vs_10k": round(dense_ratio, 3),
        "dense_1m_vs_sparse_1m": round(med["dense_1m"] / med["sparse_1m"], 2), "target": TARGET,
        "met": sparse_ratio <= TARGET})
    print(f"bench_word_table sparse_1m_vs_10k={sparse_ratio:.2f}x dense_1m_vs_10k={dense_ratio:.2f}x "
          f"sparse_1m_vs_10k_cpu={sparse_cpu_ratio:.2f}x")


if __name__ == "__main__":
    main()
