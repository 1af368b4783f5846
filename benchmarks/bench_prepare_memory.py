"""Peak memory of ``lexiflow run prepare`` does not grow with corpus size.

Builds the embedded sample (or reuses ``--sample DIR``), then runs the ``prepare`` flow
(configs/demo.yaml, thread runner, ``clean.shard_rows`` fixed) in a fresh subprocess and a
fresh store on two corpora:

* 1x: the sample's 4 corpus files;
* 8x: the sample replicated 8 times as 32 files (every doc ``id`` made distinct with a
  ``-r{k}`` suffix, text identical, so clean reads 8x the input and dedup drops 7/8 of it).

Peak RSS is exact: a tiny wrapper process runs each child and reports its ``RUSAGE_CHILDREN``
``ru_maxrss`` (the thread runner runs every task inside that one process). One Prefect server
is started for the whole benchmark (or pass ``--api-url``) so server start-up is not measured;
one unmeasured 1x warm-up run comes first (``--warmup``). Takes ~1.5 min on 2 cores.

Note: since the replicas' text is identical, numbers/vocab/lexicon see the same data at 1x
and 8x; only clean (readers, per-file parts, the dedup reduce) scales with the input.

    .venv/bin/python benchmarks/bench_prepare_memory.py [--sample DIR] [--repeats 1]

Last line: ``ratio peak_rss 8x/1x=<r>x`` (target <= 1.3).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _prepare_runs import add_common_args, bench_session, run_prepare, warm_up  # noqa: E402


def replicate(sample_corpus: Path, dest: Path, times: int) -> str:
    """``times`` copies of every sample file; copy k > 0 gets ``-r{k}`` appended to each doc id."""
    dest.mkdir(parents=True, exist_ok=True)
    files = sorted(sample_corpus.glob("*.jsonl"))
    for k in range(times):
        for f in files:
            target = dest / f"r{k:02d}_{f.name}"
            if k == 0:
                shutil.copyfile(f, target)
                continue
            with open(f, encoding="utf-8") as src, open(target, "w", encoding="utf-8") as dst:
                for line in src:
                    if line.strip():
                        obj = json.loads(line)
                        obj["id"] = f"{obj['id']}-r{k}"
                        dst.write(json.dumps(obj, ensure_ascii=False) + "\n")
    return str(dest / "*.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, repeats=1)
    ap.add_argument("--factor", type=int, default=8, help="replication factor of the large corpus")
    ap.add_argument("--shard-rows", type=int, default=8192)
    args = ap.parse_args()

    t_start = time.perf_counter()
    with bench_session(args, "bench_mem_") as (work, sample, home, api):
        embeddings = str(sample / "tencent_sample.txt")
        corpora = {
            "1x": str(sample / "corpus" / "*.jsonl"),
            f"{args.factor}x": replicate(sample / "corpus", work / f"corpus_{args.factor}x", args.factor),
        }
        sets = [f"prepare.clean.shard_rows={args.shard_rows}", "runner.kind=thread", "runner.max_workers=2"]
        results: dict[str, list[tuple[float, int]]] = {k: [] for k in corpora}
        warm_up(args, api, home, work, corpora["1x"], embeddings, sets)  # on the 1x corpus
        for r in range(args.repeats):
            for name in list(corpora)[:: 1 if r % 2 == 0 else -1]:
                glob = corpora[name]
                wall, rss, _ = run_prepare(api, home, work / f"store_{name}_{r}", glob, embeddings, sets)
                results[name].append((wall, rss))
                print(
                    f"  run {r} {name:>3}: wall {wall:7.1f} s  peak RSS {rss / 2**20:7.1f} MiB  "
                    f"load1 {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
                    flush=True,
                )
                if not args.keep:
                    shutil.rmtree(work / f"store_{name}_{r}", ignore_errors=True)
        n_files = {k: len(list(Path(g).parent.glob("*.jsonl"))) for k, g in corpora.items()}
        in_mib = {k: sum(p.stat().st_size for p in Path(g).parent.glob("*.jsonl")) / 2**20 for k, g in corpora.items()}
        print(f"\n{'corpus':>6} {'files':>5} {'input MiB':>9} {'median wall s':>13} {'median peak RSS MiB':>19}")
        med = {}
        for k, runs in results.items():
            med[k] = statistics.median(rss for _, rss in runs)
            wall = statistics.median(w for w, _ in runs)
            print(f"{k:>6} {n_files[k]:>5} {in_mib[k]:>9.1f} {wall:>13.1f} {med[k] / 2**20:>19.1f}")
        total = time.perf_counter() - t_start
        print(f"(repeats={args.repeats}, shard_rows={args.shard_rows}, total {total:.0f} s, work dir {work})")
        big = f"{args.factor}x"
        print(f"ratio peak_rss {big}/1x={med[big] / med['1x']:.2f}x")


if __name__ == "__main__":
    main()
