"""Benchmark: Tencent embedding text -> (words, float32 matrix), reference vs tasks.prepare.tencent.

Input: a generated Tencent-format file (``N D`` header, then ``w<i> v1 ... vD`` with
``%.6f`` values from a seeded normal distribution), written into a temp dir.

Three measurements, each in a fresh ``python`` subprocess (so each has its own peak
RSS, read with ``getrusage(RUSAGE_SELF)`` at the end of the child):

* ``ref``: the seed code's parser: ``line.rstrip().split(" ")`` and
  ``np.array([float(x) for x in parts[1:]], dtype=np.float32)`` per line, then
  ``np.stack``;
* ``first``: ``read_tencent`` (first load, from the text file);
* ``reload``: ``load_embeddings`` of what ``save_embeddings`` wrote to a local dir
  (vectors memory-mapped).

Timings cover the parse/load call only: interpreter start and imports are excluded
for all three.  For ``first`` the numba kernel is loaded from numba's on-disk cache
(and the numba runtime initialised) by a warm-up call on a two-line file before the
timed call; that one-off per-process cost is printed separately (it includes
compiling the kernel, a few seconds, when numba's cache is cold).  The first
``first`` child also writes the cache (``save_embeddings``) after its timed call.
Words and vectors of ``first`` and ``reload`` must equal the reference's (exit
status 1 otherwise).  Repeats are interleaved (ref, first, reload, ref, ...).

The last line printed is ``ratio first_load=<x>x cached_reload=<y>x`` with
x = ours/ref lines per second and y = ref seconds / reload seconds (medians).

    python benchmarks/bench_tencent.py [--rows 200000] [--dim 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

# --------------------------------------------------------------------------- input


_D3 = np.array([[48 + i // 100, 48 + i // 10 % 10, 48 + i % 10] for i in range(1000)], dtype=np.uint8)
_D3_TRIM = _D3.copy()  # the same without leading zeros (0 bytes are dropped later)
_D3_TRIM[:100, 0] = 0
_D3_TRIM[:10, 1] = 0


def _digits(x: np.ndarray, width: int) -> np.ndarray:
    """Decimal digits of non-negative ints < 10**width, leading zeros as 0 bytes."""
    out = np.zeros(x.shape + (width,), dtype=np.uint8)
    for k in range(width):
        place = 10 ** (width - 1 - k)
        out[..., k] = np.where((x >= place) | (k == width - 1), 48 + (x // place) % 10, 0)
    return out


def generate(path: str, rows: int, dim: int, seed: int = 0, chunk: int = 5000) -> int:
    """Write a Tencent-format file whose values print exactly like ``"%.6f" % v``.

    Values are drawn as integer micro-units q (v = q / 1e6), so writing q's digits
    gives the text ``%.6f`` gives for v; rows are built as byte arrays with numpy."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(f"{rows} {dim}\n".encode())
        for start in range(0, rows, chunk):
            m = min(chunk, rows - start)
            q = np.rint(rng.standard_normal((m, dim)) * 0.3e6).astype(np.int32)
            np.clip(q, -999_999_999, 999_999_999, out=q)
            a = np.abs(q)
            whole, frac = np.divmod(a, 1_000_000)
            tok = np.empty((m, dim, 12), dtype=np.uint8)
            tok[..., 0] = 32
            tok[..., 1] = (q < 0) * np.uint8(45)
            tok[..., 2:5] = _D3_TRIM[whole]
            tok[..., 4] = 48 + whole % 10  # keep one integer digit: "0.123456"
            tok[..., 5] = 46
            hi, lo = np.divmod(frac, 1000)
            tok[..., 6:9] = _D3[hi]
            tok[..., 9:12] = _D3[lo]
            word = np.zeros((m, 9), dtype=np.uint8)
            word[:, 0] = ord("w")
            word[:, 1:] = _digits(np.arange(start, start + m, dtype=np.int64), 8)
            nl = np.full((m, 1), 10, dtype=np.uint8)
            row = np.concatenate([word, tok.reshape(m, dim * 12), nl], axis=1)
            f.write(row[row != 0].tobytes())
    return os.path.getsize(path)


# --------------------------------------------------------------------------- children


def reference_parse(path: str):
    words, vecs = [], []
    with open(path, encoding="utf-8") as f:
        f.readline()
        for line in f:
            parts = line.rstrip().split(" ")
            words.append(parts[0])
            vecs.append(np.array([float(x) for x in parts[1:]], dtype=np.float32))
    return words, np.stack(vecs)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _digest(words, vectors) -> str:
    import hashlib

    h = hashlib.sha256("\n".join(words).encode())
    h.update(memoryview(np.ascontiguousarray(vectors, dtype=np.float32)).cast("B"))
    return h.hexdigest()


def child(mode: str, path: str, cache: str, tiny: str) -> dict:
    out: dict = {"mode": mode}
    if mode == "ref":
        c, t = _cpu_s(), time.perf_counter()
        words, vectors = reference_parse(path)
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, _cpu_s() - c
        out["peak_rss_mb"] = _peak_rss_mb()
    elif mode in ("first", "first+save"):
        t = time.perf_counter()
        from tasks.prepare import tencent as E

        out["import_s"] = time.perf_counter() - t
        t = time.perf_counter()
        E.read_tencent(tiny, progress=False)  # numba runtime init + kernel cache load
        out["jit_s"] = time.perf_counter() - t
        c, t = _cpu_s(), time.perf_counter()
        emb = E.read_tencent(path, progress=False)
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, _cpu_s() - c
        out["peak_rss_mb"] = _peak_rss_mb()
        words, vectors = emb.words, emb.vectors
        out["rejected"] = sum(emb.stats["rejected"].values())
        if mode == "first+save":  # untimed: the cache the reload children read
            import fsspec

            from tasks.text.embedding_files import save_embeddings

            save_embeddings(emb, fsspec.filesystem("file"), cache)
    elif mode == "reload":
        import fsspec

        from tasks.text.embedding_files import load_embeddings

        fs = fsspec.filesystem("file")
        c, t = _cpu_s(), time.perf_counter()
        words, vectors = load_embeddings(fs, cache)
        out["seconds"], out["cpu_s"] = time.perf_counter() - t, _cpu_s() - c
        out["peak_rss_mb"] = _peak_rss_mb()
        t = time.perf_counter()
        float(np.asarray(vectors).sum(dtype=np.float64))  # page every vector in once
        out["touch_s"] = time.perf_counter() - t
    else:
        raise SystemExit(f"unknown mode {mode}")
    out["lines"] = len(words)
    out["shape"] = list(vectors.shape)
    out["digest"] = _digest(words, vectors)  # after the peak RSS reading: hashing pages in the mmap
    return out


def run_child(mode: str, path: str, cache: str, tiny: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--file", path, "--cache", cache, "--tiny", tiny]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        sys.stderr.write(res.stdout + res.stderr)
        raise SystemExit(f"child {mode} failed with status {res.returncode}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.file, args.cache, args.tiny)))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench_tencent_") as tmp:
        path = os.path.join(tmp, "tencent.txt")
        tiny = os.path.join(tmp, "tiny.txt")
        cache = os.path.join(tmp, "cache")
        with open(tiny, "w") as f:
            f.write("2 2\na 0.5 -1e-05\nb 1 2\n")
        t = time.perf_counter()
        size = generate(path, args.rows, args.dim, args.seed)
        print(
            f"input: {args.rows:,} x {args.dim} ({size / 2**20:,.1f} MiB) generated in {time.perf_counter() - t:.2f} s"
        )
        print(
            f"cpus: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.2f}, "
            f"python {sys.version.split()[0]}, numpy {np.__version__}"
        )

        results: dict[str, list[dict]] = {"ref": [], "first": [], "reload": []}
        for r in range(args.repeats):
            for mode in results:
                res = run_child("first+save" if (mode, r) == ("first", 0) else mode, path, cache, tiny)
                results[mode].append(res)
                extra = ""
                if mode == "first":
                    extra = (
                        f"  (import {res['import_s']:.2f} s, numba init + kernel load {res['jit_s']:.2f} s, untimed)"
                    )
                elif mode == "reload":
                    extra = f"  (then paging all vectors in: {res['touch_s']:.3f} s)"
                print(
                    f"  repeat {r + 1} {mode:6s}: {res['seconds']:8.3f} s (cpu {res['cpu_s']:6.3f} s)"
                    f"  peak RSS {res['peak_rss_mb']:7.1f} MB{extra}"
                )

        ref_digest = results["ref"][0]["digest"]
        ok = all(res["digest"] == ref_digest and res["lines"] == args.rows for rs in results.values() for res in rs)
        ok = ok and all(res["rejected"] == 0 for res in results["first"])
        if not ok:
            print("MISMATCH: words/vectors differ from the reference parse")
            return 1

        med = {m: statistics.median(r["seconds"] for r in rs) for m, rs in results.items()}
        rss = {m: statistics.median(r["peak_rss_mb"] for r in rs) for m, rs in results.items()}
        names = {"ref": "reference parse", "first": "read_tencent (first load)", "reload": "load_embeddings (cached)"}
        cpu = {m: statistics.median(r["cpu_s"] for r in rs) for m, rs in results.items()}
        jit = statistics.median(r["jit_s"] for r in results["first"])
        load = os.getloadavg()[0]
        print(f"medians over {args.repeats} repeats ({args.rows:,} lines, identical output; load average {load:.2f}):")
        for m in results:
            print(
                f"  {names[m]:27s} {med[m]:8.3f} s  {args.rows / med[m]:14,.0f} lines/s"
                f"  cpu {cpu[m]:7.3f} s  peak RSS {rss[m]:7.1f} MB"
            )
        first = med["ref"] / med["first"]
        reload = med["ref"] / med["reload"]
        print(
            f"(first load counting the one-off numba init of a fresh process too: "
            f"{med['ref'] / (med['first'] + jit):.1f}x; cpu-time ratio: {cpu['ref'] / cpu['first']:.1f}x)"
        )
        print(f"ratio first_load={first:.1f}x cached_reload={reload:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
