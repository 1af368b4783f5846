"""Dask with 2 workers on >= 8 shards beats 1 worker, for ``lexiflow run prepare``.

Uses the embedded sample corpus (built in a temp dir, or ``--sample DIR``) re-split into
``--files`` (default 8) input files of contiguous documents, with ``clean.shard_rows`` small
enough (default 4096) for >= 8 clean shards. Runs ``prepare`` with the thread runner (the default path,
for reference) and with ``runner.kind=dask``, ``runner.dask_threads_per_worker=1`` and
``runner.dask_workers`` = 1 and 2, each in a fresh subprocess and a fresh store (nothing is a cache hit),
``--repeats`` times rotating the order, and checks that every run wrote the same data bytes. One Prefect
server is started for the whole benchmark (or pass ``--api-url``); the timed figures are spans recorded by
that server: the flow run's start->end (neither server nor interpreter start-up counts; the LocalCluster
start-up does) and each stage task's start->end. "data" is the sum of the stages that map over shards
(clean, numbers, vocab, lexicon). The child's own wall time is printed too.

    .venv/bin/python benchmarks/bench_dask.py [--sample DIR] [--repeats 3] [--results docs/results/bench_dask.json]

Takes ~6 min on 2 cores. Needs an otherwise idle machine: with 2 cores, a second worker only
helps when both are free (each run prints the 1-minute load average).

Last line: ``ratio dask_2w/1w speedup=<x>x`` (median 1w / median 2w time of the data stages; target > 1),
followed on the same line by the whole flow's ratio.
"""

from __future__ import annotations

import argparse
import hashlib
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
from _numerics_ab import write_results  # noqa: E402
from _prepare_runs import add_common_args, bench_session, run_prepare, warm_up  # noqa: E402

STAGES = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon"]  # the stage tasks' names
DATA_STAGES = ["clean", "numbers", "vocab", "lexicon"]  # the ones that map over shards


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
    """(flow run seconds, {stage: its stage task's start -> end}) for the run that wrote ``store``."""
    runs = _post(api, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 20})
    run = next(r for r in runs if (r.get("parameters") or {}).get("config", {}).get("store_uri") == str(store))
    stages: dict[str, list[float]] = defaultdict(list)
    for _ in range(20):  # task-run end times arrive through the server's event pipeline
        tasks = _post(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}, "limit": 200})
        if tasks and all(t.get("end_time") for t in tasks):
            break
        time.sleep(0.5)
    for t in tasks:
        if t["name"] in STAGES and t.get("start_time") and t.get("end_time"):
            stages[t["name"]] += [_ts(t["start_time"]), _ts(t["end_time"])]
    spans = {s: max(v) - min(v) for s, v in stages.items()}
    spans["data"] = sum(spans.get(s, 0.0) for s in DATA_STAGES)
    return _ts(run["end_time"]) - _ts(run["start_time"]), spans


def data_digest(store: Path) -> str:
    """One sha256 over every committed data file of the store (manifests aside: they carry created_at)."""
    h = hashlib.sha256()
    for f in sorted(p for p in store.rglob("*") if p.is_file() and p.name != "_manifest.json"
                    and p.parts[len(store.parts)] in STAGES):
        h.update(str(f.relative_to(store)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(ap, repeats=3)
    ap.add_argument("--files", type=int, default=8, help="input files (clean maps over files)")
    ap.add_argument("--shard-rows", type=int, default=4096)
    ap.add_argument("--results", help="also write the figures as JSON here (e.g. docs/results/bench_dask.json)")
    args = ap.parse_args()

    t_start = time.perf_counter()
    with bench_session(args, "bench_dask_") as (work, sample, home, api):
        corpus = split_corpus(sample / "corpus", work / "corpus", args.files)
        embeddings = str(sample / "tencent_sample.txt")
        settings = {"thread": None, "1w": 1, "2w": 2}
        flow_s: dict[str, list[float]] = defaultdict(list)
        child_s: dict[str, list[float]] = defaultdict(list)
        stage_s: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        n_shards = None
        base = [f"prepare.clean.shard_rows={args.shard_rows}"]
        dask = ["runner.kind=dask", "runner.dask_threads_per_worker=1"]

        def sets(name: str) -> list[str]:
            return base if settings[name] is None else [*base, *dask, f"runner.dask_workers={settings[name]}"]

        warm_up(args, api, home, work, corpus, embeddings, sets("1w"))
        digests: dict[str, set[str]] = defaultdict(set)
        for r in range(args.repeats):
            names = list(settings)
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                store = work / f"store_{name}_{r}"
                wall, rss, _ = run_prepare(api, home, store, corpus, embeddings, sets(name))
                digests[name].add(data_digest(store))
                fs, spans = flow_timings(api, store)
                if n_shards is None:
                    n_shards = len(list(store.glob("clean/*/shards/*.parquet")))
                flow_s[name].append(fs)
                child_s[name].append(wall)
                for k, v in spans.items():
                    stage_s[name][k].append(v)
                print(
                    f"  run {r} {name:>6}: flow {fs:6.1f} s  data {spans['data']:6.1f} s  child wall {wall:6.1f} s  "
                    f"peak RSS (largest process) {rss / 2**20:6.0f} MiB  load1 {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                if not args.keep:
                    shutil.rmtree(store, ignore_errors=True)
        stages = [*STAGES, "data"]
        same = len(set().union(*digests.values())) == 1
        print(
            f"\n{args.files} input files, {n_shards} clean shards (shard_rows={args.shard_rows}), "
            f"repeats={args.repeats}, {os.cpu_count()} CPUs; medians in seconds; "
            "stage = its task's start -> end"
        )
        print(f"{'setting':>8} {'flow':>6} {'child':>6} " + " ".join(f"{s:>10}" for s in stages))
        for name in settings:
            cells = " ".join(
                f"{statistics.median(stage_s[name][s]) if stage_s[name][s] else float('nan'):>10.1f}" for s in stages
            )
            flow_med, child_med = statistics.median(flow_s[name]), statistics.median(child_s[name])
            print(f"{name:>8} {flow_med:>6.1f} {child_med:>6.1f} {cells}")
        print(f"same data bytes in every run: {same}")
        print(f"(total {time.perf_counter() - t_start:.0f} s, work dir {work})")
        med = {n: {s: statistics.median(v) for s, v in stage_s[n].items()} for n in settings}
        flow_med = {n: statistics.median(flow_s[n]) for n in settings}
        speedup = med["1w"]["data"] / med["2w"]["data"]
        flow_speedup = flow_med["1w"] / flow_med["2w"]
        write_results(args.results, "bench_dask", {
            "files": args.files, "clean_shards": n_shards, "shard_rows": args.shard_rows, "repeats": args.repeats,
            "load1_at_end": os.getloadavg()[0], "same_bytes": same,
            "median_flow_s": flow_med, "median_stage_s": med,
            "runs_flow_s": dict(flow_s), "runs_data_s": {n: stage_s[n]["data"] for n in settings},
            "speedup_2w_over_1w_data": speedup, "speedup_2w_over_1w_flow": flow_speedup,
            "dask_2w_over_thread_data": med["thread"]["data"] / med["2w"]["data"],
        })
        if not same:
            seen = {k: sorted(v) for k, v in digests.items()}
            raise SystemExit(f"the runs wrote different data bytes: {json.dumps(seen)}")
        print(f"ratio dask_2w/1w speedup={speedup:.2f}x (data stages; whole flow {flow_speedup:.2f}x)")


if __name__ == "__main__":
    main()
