"""Scale: ``lexiflow run prepare`` on growing Tencent files and growing corpora, time and peak RSS per stage,
the fitted growth, and projections to the full Tencent files and a full zhwiki dump.

Inputs, generated here:

* Tencent-format files (``N 200`` header, then ``word v1 ... v200`` with ``%.6f`` values) of ``--words`` sizes
  (default 250k, 500k, 1M). Words are real Chinese words: jieba's ``dict.txt`` by frequency (349,046), then
  two-word compounds of its 60,000 most frequent words (as Tencent lists phrases), distinct, seeded;
* corpora: the embedded sample (``lexiflow sample``; People's Daily, 1.84M characters) repeated ``--corpus``
  times (default 1, 4, 16) with distinct doc ids, run with ``clean.dedup=false`` so every stage sees all of it.

Two series, each run a fresh ``lexiflow run prepare`` child (configs/demo.yaml, thread runner, 2 workers) into
a fresh store, against one Prefect server started for the whole benchmark: the words series on the 1x corpus,
the corpus series with the smallest Tencent file. Per run: wall time and exact peak RSS of the child
(``RUSAGE_CHILDREN`` in a wrapper process); per stage: its wall time (staging directory created ->
``_manifest.json`` written) and the largest RSS sampled (psutil, every 0.1 s) while it ran.

Growth: per stage and in total, the log-log slope of time and of peak RSS against the input (words; corpus
characters), least squares over the sizes. Projections (written to ``--results``): each stage's time and peak
RSS at 8.8M and 12.3M words (the two Tencent releases) and at a 1.4M-article zhwiki dump (~500M characters),
from a straight-line fit (``a + b * size``) of the measured points, or from the fitted power law through the
largest size when that is higher (superlinear growth).

    .venv/bin/python benchmarks/bench_scale.py [--words 250000 500000 1000000] [--corpus 1 4 16] [--results PATH]

Wall times move with the machine's load (other jobs on shared cores); CPU seconds (user + system of the
prepare process, sampled with its RSS) much less, so the growth of time is judged on CPU seconds.

Last line: ``scale words <w>x: cpu <t>x rss <r>x; corpus <c>x: cpu <t>x rss <r>x`` (largest / smallest size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _numerics_ab import write_results  # noqa: E402
from _prepare_runs import BASE_ENV, LEXIFLOW, ROOT, WRAPPER, bench_session  # noqa: E402
from bench_prepare_memory import replicate  # noqa: E402
from bench_tencent import _D3, _D3_TRIM  # noqa: E402

STAGES = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon"]
TARGETS_WORDS = {"tencent_v0.1.0_8.8M": 8_824_330, "tencent_v0.2.0_12.3M": 12_287_936}
TARGET_CHARS = {"zhwiki_1.4M_articles_500M_chars": 500_000_000}
WORD_BYTES = 64  # a word's field in the generated rows (UTF-8, zero padded; zero bytes are dropped)


# --------------------------------------------------------------------------- inputs


def chinese_words(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct words: jieba's dictionary by descending frequency, then seeded two-word compounds."""
    import importlib.util

    spec = importlib.util.find_spec("jieba")
    if spec is None:
        raise SystemExit("jieba is not installed (pip install -e '.[sample]')")
    path = os.path.join(list(spec.submodule_search_locations)[0], "dict.txt")
    entries = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 2 and " " not in parts[0]:
                entries.append((-int(parts[1]), parts[0]))
    entries.sort()
    words = list(dict.fromkeys(w for _, w in entries))
    seen = set(words)
    out = words[:n]
    rng = np.random.default_rng(seed)
    head = words[:60_000]
    while len(out) < n:
        a = rng.integers(0, len(head), size=2 * (n - len(out)) + 1000)
        b = rng.integers(0, len(head), size=a.size)
        for i, j in zip(a.tolist(), b.tolist()):
            w = head[i] + head[j]
            if w not in seen and len(w.encode()) <= WORD_BYTES:
                seen.add(w)
                out.append(w)
                if len(out) == n:
                    break
    return out


def write_tencent(path: Path, words: list[str], dim: int = 200, seed: int = 0, chunk: int = 5000) -> int:
    """A Tencent-format file of ``words`` with ``%.6f`` values (normal, sd 0.3), rows built with numpy."""
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(f"{len(words)} {dim}\n".encode())
        for start in range(0, len(words), chunk):
            block = words[start: start + chunk]
            m = len(block)
            q = np.rint(rng.standard_normal((m, dim)) * 0.3e6).astype(np.int32)
            np.clip(q, -9_999_999, 9_999_999, out=q)
            whole, frac = np.divmod(np.abs(q), 1_000_000)
            tok = np.empty((m, dim, 12), dtype=np.uint8)
            tok[..., 0] = 32
            tok[..., 1] = (q < 0) * np.uint8(45)
            tok[..., 2:5] = _D3_TRIM[whole]
            tok[..., 4] = 48 + whole % 10
            tok[..., 5] = 46
            hi, lo = np.divmod(frac, 1000)
            tok[..., 6:9] = _D3[hi]
            tok[..., 9:12] = _D3[lo]
            word = np.zeros((m, WORD_BYTES), dtype=np.uint8)
            enc = [w.encode("utf-8") for w in block]
            flat = np.frombuffer(b"".join(enc), dtype=np.uint8)
            lens = np.fromiter(map(len, enc), dtype=np.int64, count=m)
            rows = np.repeat(np.arange(m), lens)
            cols = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
            word[rows, cols] = flat
            nl = np.full((m, 1), 10, dtype=np.uint8)
            row = np.concatenate([word, tok.reshape(m, dim * 12), nl], axis=1)
            f.write(row[row != 0].tobytes())
    return path.stat().st_size


# --------------------------------------------------------------------------- one run


def _stage_spans(store: Path, t_start: float, first_seen: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Per stage (start, end) in perf_counter seconds: when its directory was first seen, when its manifest was
    written."""
    wall0 = time.time() - (time.perf_counter() - t_start)  # wall clock at t_start
    out = {}
    for stage in STAGES:
        for m in (store / stage).glob("*/_manifest.json"):
            end = m.stat().st_mtime - wall0 + t_start
            out[stage] = (first_seen.get(stage, end), end)
    return out


def run_once(api: str, home: Path, store: Path, corpus: str, embeddings: str, sets: list[str]) -> dict:
    cmd = [LEXIFLOW, "run", "prepare", "--config", str(ROOT / "configs" / "demo.yaml")]
    for s in [f"store_uri={store}", f"prepare.corpus_uri={corpus}", f"prepare.embeddings_uri={embeddings}",
              "progress=false", "prepare.clean.dedup=false", *sets]:
        cmd += ["--set", s]
    env = {**os.environ, **BASE_ENV, "PREFECT_HOME": str(home), "PREFECT_API_URL": api}
    log, rss_path = store.with_suffix(".log"), store.with_suffix(".maxrss")
    samples: list[tuple[float, int, float]] = []  # (time, RSS bytes, CPU seconds) of the prepare process
    first_seen: dict[str, float] = {}
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", WRAPPER, str(rss_path), *cmd], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
        done = threading.Event()

        def sample():
            import psutil

            wrapper = psutil.Process(proc.pid)
            while not done.is_set():
                try:
                    kids = wrapper.children(recursive=True)
                    rss = sum(c.memory_info().rss for c in kids)
                    cpu = sum(sum(c.cpu_times()[:2]) for c in kids)
                    samples.append((time.perf_counter(), rss, cpu))
                except psutil.Error:
                    pass
                now = time.perf_counter()
                for stage in STAGES:
                    if stage not in first_seen and (store / stage).is_dir() and any((store / stage).iterdir()):
                        first_seen[stage] = now
                time.sleep(0.1)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        rc = proc.wait()
        wall = time.perf_counter() - t0
        done.set()
        th.join()
    if rc != 0:
        raise RuntimeError(f"prepare failed (rc={rc}):\n{log.read_text(errors='replace')[-3000:]}")
    spans = _stage_spans(store, t0, first_seen)
    stages = {}
    for stage, (a, b) in spans.items():
        inside = [r for t, r, _ in samples if a <= t <= b]
        cpu_a = max([c for t, _, c in samples if t <= a], default=0.0)
        cpu_b = max([c for t, _, c in samples if t <= b], default=0.0)
        stages[stage] = {"wall_s": round(b - a, 2), "cpu_s": round(cpu_b - cpu_a, 2),
                         "peak_rss_mb": round(max(inside, default=0) / 2**20, 1)}
    cpu = max((c for _, _, c in samples), default=0.0)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mb": round(int(rss_path.read_text()) / 1024, 1),
            "stages": stages, "load1": os.getloadavg()[0]}


# --------------------------------------------------------------------------- growth


def slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.maximum(np.asarray(y, float), 1e-9))
    return float(np.polyfit(lx, ly, 1)[0]) if len(x) > 1 else float("nan")


def project(x: list[float], y: list[float], target: float) -> float:
    """The larger of a straight-line fit (``a + b * size``) and the fitted power law (the log-log slope over all
    sizes, through the largest size) at ``target``."""
    if len(x) < 2:
        return float("nan")
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    power = y[-1] * (target / x[-1]) ** slope(x, y)
    return float(max(a + b * target, power))


def growth(series: list[dict], key: str, targets: dict[str, int]) -> dict:
    xs = [s[key] for s in series]
    out = {"total": {}, "stages": {}}
    for name, get in [("total", lambda s: s)] + [(st, lambda s, st=st: s["stages"].get(st, {})) for st in STAGES]:
        t = [get(s).get("wall_s", 0.0) for s in series]
        c = [get(s).get("cpu_s", 0.0) for s in series]
        r = [get(s).get("peak_rss_mb", 0.0) for s in series]
        rec = {"time_slope": round(slope(xs, t), 3), "cpu_slope": round(slope(xs, c), 3),
               "rss_slope": round(slope(xs, r), 3),
               "projection": {k: {"wall_s": round(project(xs, t, v), 1), "cpu_s": round(project(xs, c, v), 1),
                                  "peak_rss_mb": round(project(xs, r, v), 1)} for k, v in targets.items()}}
        if name == "total":
            out["total"] = rec
        else:
            out["stages"][name] = rec
    for k, p in out["total"]["projection"].items():  # the process's peak is at least its largest stage's
        stage_peaks = [st["projection"][k]["peak_rss_mb"] for st in out["stages"].values()]
        p["peak_rss_mb"] = max([p["peak_rss_mb"], *stage_peaks])
    return out


def table(series: list[dict], key: str, label: str) -> None:
    print(f"\n{label:>12} {'wall s':>8} {'peak RSS MiB':>12}   " + "  ".join(f"{s:>16}" for s in STAGES)
          + "   (per stage: CPU seconds, peak RSS)")
    for s in series:
        st_of = [s["stages"].get(st, {}) for st in STAGES]
        per = "  ".join(f"{v.get('cpu_s', 0):6.1f}s {v.get('peak_rss_mb', 0):6.0f}M" for v in st_of)
        print(f"{s[key]:>12,} {s['wall_s']:>8.1f} {s['peak_rss_mb']:>12.1f}   {per}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--words", type=int, nargs="+", default=[250_000, 500_000, 1_000_000])
    ap.add_argument("--corpus", type=int, nargs="+", default=[1, 4, 16], help="copies of the sample corpus")
    ap.add_argument("--sample", type=Path, help="existing `lexiflow sample` output dir (default: build one)")
    ap.add_argument("--api-url", help="use this Prefect API instead of starting a server")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (stores, logs, generated inputs)")
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/bench_scale.json)")
    args = ap.parse_args()
    args.repeats, args.warmup = 1, 0
    words_sizes, corpus_sizes = sorted(args.words), sorted(args.corpus)

    t_start = time.perf_counter()
    with bench_session(args, "bench_scale_") as (work, sample, home, api):
        t0 = time.perf_counter()
        all_words = chinese_words(words_sizes[-1])
        tencent = {}
        for n in words_sizes:
            p = work / f"tencent_{n}.txt"
            size = write_tencent(p, all_words[:n])
            tencent[n] = p
            print(f"generated {p.name}: {n:,} words x 200, {size / 2**20:,.0f} MiB", flush=True)
        del all_words
        corpora, chars = {}, {}
        base_chars = sum(len(json.loads(line)["text"]) for f in sorted((sample / "corpus").glob("*.jsonl"))
                         for line in open(f, encoding="utf-8") if line.strip())
        for c in corpus_sizes:
            corpora[c] = (str(sample / "corpus" / "*.jsonl") if c == 1
                          else replicate(sample / "corpus", work / f"corpus_{c}x", c))
            chars[c] = c * base_chars
        print(f"inputs ready in {time.perf_counter() - t0:.0f} s; corpus 1x = {base_chars:,} characters", flush=True)
        sets = ["runner.kind=thread", "runner.max_workers=2"]

        def one(name: str, corpus_x: int, n_words: int) -> dict:
            store = work / f"store_{name}"
            res = run_once(api, home, store, corpora[corpus_x], str(tencent[n_words]), sets)
            res.update(words=n_words, corpus_x=corpus_x, corpus_chars=chars[corpus_x])
            per = ", ".join(f"{k} {v['wall_s']:.1f}s/{v['cpu_s']:.1f}s CPU/{v['peak_rss_mb']:.0f}M"
                            for k, v in res["stages"].items())
            print(f"  {name}: wall {res['wall_s']:.1f} s, CPU {res['cpu_s']:.1f} s, peak RSS {res['peak_rss_mb']:.0f} "
                  f"MiB (load {res['load1']:.1f}); {per}", flush=True)
            if not args.keep:
                shutil.rmtree(store, ignore_errors=True)
            return res

        c0, w0 = corpus_sizes[0], words_sizes[0]
        first = one(f"w{w0}_c{c0}", c0, w0)
        by_words = [first] + [one(f"w{n}_c{c0}", c0, n) for n in words_sizes[1:]]
        by_corpus = [first] + [one(f"w{w0}_c{c}", c, w0) for c in corpus_sizes[1:]]

    table(by_words, "words", "words")
    table(by_corpus, "corpus_chars", "corpus chars")
    g_words = growth(by_words, "words", TARGETS_WORDS)
    g_corpus = growth(by_corpus, "corpus_chars", TARGET_CHARS)
    for label, g in (("words", g_words), ("corpus", g_corpus)):
        print(f"\ngrowth against {label} (log-log slope: 1 = linear): total wall {g['total']['time_slope']}, "
              f"CPU {g['total']['cpu_slope']}, peak RSS {g['total']['rss_slope']}")
        for st, rec in list(g["stages"].items()) + [("total", g["total"])]:
            proj = "; ".join(f"{k}: {v['wall_s']:,.0f} s wall, {v['cpu_s']:,.0f} s CPU, "
                             f"{v['peak_rss_mb'] / 1024:,.1f} GiB" for k, v in rec["projection"].items())
            print(f"  {st:<10} wall {rec['time_slope']:>6}  CPU {rec['cpu_slope']:>6}  peak RSS {rec['rss_slope']:>6}  "
                  f"projected: {proj}")
    print(f"(total {time.perf_counter() - t_start:.0f} s)")
    write_results(args.results, "bench_scale", {
        "words_series": by_words, "corpus_series": by_corpus, "growth_words": g_words, "growth_corpus": g_corpus,
        "corpus_1x_chars": by_corpus[0]["corpus_chars"],
    })
    rw = (by_words[-1]["words"] / by_words[0]["words"], by_words[-1]["cpu_s"] / by_words[0]["cpu_s"],
          by_words[-1]["peak_rss_mb"] / by_words[0]["peak_rss_mb"])
    rc = (by_corpus[-1]["corpus_chars"] / by_corpus[0]["corpus_chars"],
          by_corpus[-1]["cpu_s"] / by_corpus[0]["cpu_s"], by_corpus[-1]["peak_rss_mb"] / by_corpus[0]["peak_rss_mb"])
    print(f"scale words {rw[0]:.1f}x: cpu {rw[1]:.2f}x rss {rw[2]:.2f}x; "
          f"corpus {rc[0]:.1f}x: cpu {rc[1]:.2f}x rss {rc[2]:.2f}x")


if __name__ == "__main__":
    main()
