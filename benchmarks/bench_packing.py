"""Benchmark: how full the pretraining batches are: packed rows (``pretrain.data.packing: pairs``) against one pair
a row, on the same pairs.

The full profile's sequence length (512) on the demo store's matched shards (``make demo``; else synthetic rows
with the demo's sentence lengths: the source is printed and written). One epoch of batches is built by each loader
and ``fill`` = real tokens / token positions is counted over all of them:

* ``packed``: rows of 512 tokens holding whole pairs (best-fit-decreasing, ``--pairs-per-row`` slots a row),
  ``--rows`` rows a batch: one static shape (the number of distinct batch shapes is reported);
* ``buckets``: one pair a row padded to one of 4 lengths up to 512 (what ``compile: true`` ran before packing);
* ``eager``: one pair a row padded to the batch's longest pair, pairs sorted by length in pools (no static shape);
* ``fixed``: one pair a row padded to 512 (a single static shape without packing).

Also the milliseconds a loader worker spends building one packed batch (with the sparse word table's renumbering),
which the training thread no longer spends. The last line: ``packing fill=<packed> buckets=<..> eager=<..>
fixed=<..> shapes=<n>``.

    python benchmarks/bench_packing.py [--lexicon URI] [--results docs/results/bench_packing.json]
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

from benchmarks._numerics_ab import repo_relative, write_results  # noqa: E402
from benchmarks.bench_loader import demo_rows  # noqa: E402
from tasks.pretrain.config import PretrainDataConfig  # noqa: E402
from tasks.pretrain.packed import PackedBatches, pack_rows  # noqa: E402
from tasks.pretrain.pairpack import PairRows, with_word_rows  # noqa: E402
from tasks.pretrain.shapes import BucketedBatches  # noqa: E402


def fill_of(data, per_epoch: int) -> tuple[float, int, int]:
    """(real tokens / positions, distinct batch shapes, batches) over one epoch of ``data``."""
    real = positions = 0
    shapes = set()
    for k in range(per_epoch):
        b = data[0, k]
        real += b.n_real_tokens
        positions += b.seq_positions()
        shapes.add(dict(b.layout)["input_ids"])
    return real / positions, len(shapes), per_epoch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lexicon", help="a lexicon artifact URI (default: the newest under .demo/store)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128, help="pairs a batch, one pair a row")
    ap.add_argument("--rows", type=int, default=32, help="rows a packed batch")
    ap.add_argument("--pairs-per-row", type=int, default=16)
    ap.add_argument("--results", help="write the figures as JSON here (e.g. docs/results/bench_packing.json)")
    args = ap.parse_args()

    rows, W, V, source = demo_rows(args.lexicon)
    print(f"rows: {len(rows):,} from {source}")
    base = PretrainDataConfig(max_seq_len=args.seq_len, batch_size=args.batch)
    pack = pack_rows(rows, base, W)
    lengths = pack.lengths
    print(f"pairs: {len(pack):,}; tokens a pair: median {np.median(lengths):.0f}, "
          f"p90 {np.percentile(lengths, 90):.0f}, mean {lengths.mean():.1f}")
    plain = PackedBatches(pack, base, V)
    eager, _, n_eager = fill_of(plain, plain.per_epoch())
    bucketed = BucketedBatches(plain, 4)
    buckets, n_bucket_shapes, _ = fill_of(bucketed, bucketed.per_epoch())
    fixed = float(lengths.sum()) / (len(lengths) * args.seq_len)
    cfg = PretrainDataConfig(max_seq_len=args.seq_len, batch_size=args.rows, packing="pairs",
                             pairs_per_row=args.pairs_per_row)
    packed = PairRows(pack, cfg, V)
    ours, n_shapes, n_packed = fill_of(packed, packed.per_epoch())
    times = []
    for k in range(min(20, n_packed)):
        t = time.perf_counter()
        with_word_rows(packed[0, k], fixed=True)
        times.append(time.perf_counter() - t)
    build_ms = 1e3 * statistics.median(times)
    print(f"fill, one epoch at T={args.seq_len}: packed {ours:.3f} ({n_packed} batches of {args.rows} rows, "
          f"{n_shapes} shape), compile buckets {buckets:.3f} ({n_bucket_shapes} shapes), eager {eager:.3f} "
          f"({n_eager} batches of {args.batch} pairs), fixed {fixed:.3f}")
    print(f"a packed batch built in a loader worker (masking, layout, word-table renumbering): {build_ms:.1f} ms")
    write_results(args.results, "bench_packing", {
        "rows": len(rows), "source": repo_relative(source), "pairs": len(pack), "W": W, "max_seq_len": args.seq_len,
        "pair_tokens": {"median": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
                        "mean": round(float(lengths.mean()), 1)},
        "packed": {"fill": round(ours, 4), "shapes": n_shapes, "batches": n_packed, "rows": args.rows,
                   "pairs_per_row": args.pairs_per_row, "worker_ms_per_batch": round(build_ms, 2)},
        "fill": {"packed": round(ours, 4), "buckets": round(buckets, 4), "eager": round(eager, 4),
                 "fixed": round(fixed, 4)},
        "ratio": round(ours / buckets, 2)})
    print(f"packing fill={ours:.3f} buckets={buckets:.3f} eager={eager:.3f} fixed={fixed:.3f} shapes={n_shapes}")


if __name__ == "__main__":
    main()
