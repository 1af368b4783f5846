"""Dask with 2 workers on >= 8 shards beats 1 worker, for ``lexiflow run prepare``.

Uses the embedded sample corpus (built in a temp dir, or ``--sample DIR``) re-split into
``--files`` (default 8) input files of contiguous documents, with ``clean.shard_rows`` small
enough (default 4096) for >= 8 clean shards. Runs ``prepare`` with ``runner.kind=dask``,
``runner.dask_threads_per_worker=1`` and ``runner.dask_workers`` = 1 and 2, each in a fresh
subprocess and a fresh store (nothing is a cache hit), ``--repeats`` times alternating the
order. One Prefect server is started for the whole benchmark (or pass ``--api-url``); the
timed figure is the flow run's start->end as recorded by that server (so neither server
start-up nor interpreter start-up counts; the LocalCluster start-up does). The child's own
wall time and a per-stage breakdown (task-run spans from the API) are printed too.

    .venv/bin/python benchmarks/bench_dask.py [--sample DIR] [--repeats 3]

Takes ~3 min on 2 cores. Needs an otherwise idle machine: with 2 cores, a second worker only
helps when both are free (each run prints the 1-minute load average).

Last line: ``ratio dask_2w/1w speedup=<x>x`` (median 1w time / median 2w time; target > 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import urllib.request
from collections import defaultdict
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _prepare_runs import add_common_args, bench_session, run_prepare, warm_up  # noqa: E402

STAGE_OF = {
    "clean-file": "clean",
    "clean-dedup": "clean",
    "numbers-shard": "numbers",
    "vocab-count": "vocab",
    "embeddings": "embeddings",
    "trie": "trie",
    "lexicon-match": "lexicon",
    "lexicon-finalize": "lexicon",
}


def split_corpus(sample_corpus: Path, dest: Path, n_files: int) -> str:
    """Every document of the sample, in order, re-split into ``n_files`` contiguous blocks."""
    lines = [
        ln
        for f in sorted(sample_corpus.glob("*.jsonl"))
        for ln in f.read_text(encoding="utf-8").splitlines()
        if ln.strip()
    ]
    dest.mkdir(parents=True, exist_ok=True)
    step, extra = divmod(len(lines), n_files)
    start = 0
    for i in range(n_files):
        end = start + step + (i < extra)
        (dest / f"wiki_{i:02d}.jsonl").write_text("\n".join(lines[start:end]) + "\n", encoding="utf-8")
        start = end
    return str(dest / "*.jsonl")


def _post(api: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        api + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def flow_timings(api: str, store: Path) -> tuple[float, dict[str, float]]:
    """(flow run seconds, {stage: first task start -> last task end}) for the run that wrote ``store``."""
    runs = _post(api, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 20})
    run = next(r for r in runs if (r.get("parameters") or {}).get("config", {}).get("store_uri") == str(store))
    stages: dict[str, list[float]] = defaultdict(list)
    for _ in range(20):  # task-run end times arrive through the server's event pipeline
        tasks = _post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}, "limit": 200})
        if tasks and all(t.get("end_time") for t in tasks):
            break
        time.sleep(0.5)
    for t in tasks:
        stage = STAGE_OF.get(t["name"].rsplit("-", 1)[0], STAGE_OF.get(t["name"], "other"))
        if t.get("start_time") and t.get("end_time"):
            stages[stage] += [_ts(t["start_time"]), _ts(t["end_time"])]
    spans = {s: max(v) - min(v) for s, v in stages.items()}
    return _ts(run["end_time"]) - _ts(run["start_time"]), spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, repeats=3)
    ap.add_argument("--files", type=int, default=8, help="input files (clean maps over files)")
    ap.add_argument("--shard-rows", type=int, default=4096)
    args = ap.parse_args()

    t_start = time.perf_counter()
    with bench_session(args, "bench_dask_") as (work, sample, home, api):
        corpus = split_corpus(sample / "corpus", work / "corpus", args.files)
        embeddings = str(sample / "tencent_sample.txt")
        settings = {"1w": 1, "2w": 2}
        flow_s: dict[str, list[float]] = defaultdict(list)
        child_s: dict[str, list[float]] = defaultdict(list)
        stage_s: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        n_shards = None
        base = ["runner.kind=dask", "runner.dask_threads_per_worker=1", f"clean.shard_rows={args.shard_rows}"]
        warm_up(args, api, home, work, corpus, embeddings, base)
        for r in range(args.repeats):
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for name in order:
                store = work / f"store_{name}_{r}"
                wall, rss, _ = run_prepare(
                    api, home, store, corpus, embeddings, [*base, f"runner.dask_workers={settings[name]}"]
                )
                fs, spans = flow_timings(api, store)
                if n_shards is None:
                    n_shards = len(list(store.glob("clean/*/shards/*.parquet")))
                flow_s[name].append(fs)
                child_s[name].append(wall)
                for k, v in spans.items():
                    stage_s[name][k].append(v)
                print(
                    f"  run {r} dask {name}: flow {fs:6.1f} s  child wall {wall:6.1f} s  "
                    f"peak RSS (largest process) {rss / 2**20:6.0f} MiB  load1 {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                if not args.keep:
                    shutil.rmtree(store, ignore_errors=True)
        stages = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon"]
        print(
            f"\n{args.files} input files, {n_shards} clean shards (shard_rows={args.shard_rows}), "
            f"repeats={args.repeats}, {os.cpu_count()} CPUs; medians in seconds; "
            "stage = first task start -> last task end"
        )
        print(f"{'setting':>8} {'flow':>6} {'child':>6} " + " ".join(f"{s:>10}" for s in stages))
        for name in settings:
            cells = " ".join(
                f"{statistics.median(stage_s[name][s]) if stage_s[name][s] else float('nan'):>10.1f}" for s in stages
            )
            flow_med, child_med = statistics.median(flow_s[name]), statistics.median(child_s[name])
            print(f"{'dask ' + name:>8} {flow_med:>6.1f} {child_med:>6.1f} {cells}")
        print(f"(total {time.perf_counter() - t_start:.0f} s, work dir {work})")
        print(f"ratio dask_2w/1w speedup={statistics.median(flow_s['1w']) / statistics.median(flow_s['2w']):.2f}x")


if __name__ == "__main__":
    main()
