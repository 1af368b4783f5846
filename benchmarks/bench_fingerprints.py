"""Input hashing of a fully cached re-run: today's full sha256 read against the fingerprint cache.

Writes a ``--size-mb`` (default 1024) file of random bytes, waits until it is older than the cache's racy
window, then times, ``--repeats`` times each and alternating:

- reference: :func:`storage.artifacts.fingerprint_uri` (what every run did: read and hash the whole file);
- ours, cached: :class:`storage.fingerprints.FingerprintCache` of a store whose entry for the file exists
  (what every re-run now does: one ``stat`` and one small JSON read).

The first (uncached) fingerprint through the cache, which hashes and writes the entry, is timed once. The
cached result must equal the reference's digest. The page cache is warm for the reference (the file was
just written and read), so the reference figure is a lower bound: a cold 1 GB read costs more.

    .venv/bin/python benchmarks/bench_fingerprints.py [--size-mb 1024] [--repeats 5] [--dir /tmp] \\
        [--results docs/results/bench_fingerprints.json]

Last line: ``ratio reference/cached speedup=<x>x`` (median reference time / median cached time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _numerics_ab import write_results  # noqa: E402

from storage.artifacts import fingerprint_uri  # noqa: E402
from storage.fingerprints import RACY_S, FingerprintCache  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temp dir)")
    ap.add_argument("--results", help="also write the figures as JSON here (e.g. docs/results/bench_fingerprints.json)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench_fp_", dir=args.dir))
    try:
        path = work / "corpus.bin"
        block = os.urandom(1 << 20)
        with open(path, "wb") as f:
            for _ in range(args.size_mb):
                f.write(block)
        time.sleep(RACY_S + 0.1)  # an entry hashed right after a change is not trusted (storage.fingerprints)
        store = str(work / "store")

        t0 = time.perf_counter()
        first = FingerprintCache(store)
        want = first.fingerprint(str(path))
        first_s = time.perf_counter() - t0
        assert first.stats.hashed == 1, first.stats

        ref_s, cached_s = [], []
        for r in range(args.repeats):
            for which in (("ref", "cached") if r % 2 == 0 else ("cached", "ref")):
                t0 = time.perf_counter()
                if which == "ref":
                    got = fingerprint_uri(str(path))
                    ref_s.append(time.perf_counter() - t0)
                else:
                    cache = FingerprintCache(store)  # a new run: a fresh cache object, entries on disk
                    got = cache.fingerprint(str(path))
                    cached_s.append(time.perf_counter() - t0)
                    assert (cache.stats.hits, cache.stats.hashed) == (1, 0), cache.stats
                assert got == want, (got, want)
        ref, cached = statistics.median(ref_s), statistics.median(cached_s)
        print(f"{args.size_mb} MiB file, repeats={args.repeats}, {os.cpu_count()} CPUs, load1 {os.getloadavg()[0]:.1f}")
        print(f"reference (read + sha256 every run): median {ref:8.3f} s  ({args.size_mb / ref:.0f} MiB/s)")
        print(f"first run through the cache (hash + write the entry): {first_s:8.3f} s")
        print(f"cached re-run (stat + entry read): median {cached * 1e3:8.3f} ms")
        write_results(args.results, "bench_fingerprints", {
            "size_mb": args.size_mb, "repeats": args.repeats, "reference_s": ref_s, "cached_s": cached_s,
            "first_through_cache_s": first_s, "median_reference_s": ref, "median_cached_s": cached,
            "speedup": ref / cached, "load1_at_end": os.getloadavg()[0],
        })
        print(f"ratio reference/cached speedup={ref / cached:.0f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
