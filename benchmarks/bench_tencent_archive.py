"""Tencent embeddings as distributed: time and peak RSS of reading the same vectors from the plain text file (memory
mapped), from ``.txt.gz``, from the v0.2.0 ``.tar.gz`` through ``tar://<member>::<archive>`` in one streamed pass
(ours, tasks/prepare/tencent_source.py ``open_tar_member``), and through fsspec's own ``tar://`` file system (the
reference: it indexes the archive first, decompressing all of it, then decompresses again from the start to reach
the member). Each read runs in a fresh process (peak RSS: VmHWM; imports and the parser's compile are done before
the clock, on a 2-word file). The archive is generated (``--words`` words, d=200, six decimals, as the files are).
The last line: reference / ours (seconds), and ours' peak RSS over the plain file's.

    .venv/bin/python benchmarks/bench_tencent_archive.py --results docs/results/bench_tencent_archive.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

NAME = "tencent-ailab-embedding-zh-d200-v0.2.0"
MEMBER = f"{NAME}/{NAME}.txt"
MODES = ("plain", "gzip", "tar_ours", "tar_fsspec")


def hwm_mib() -> int:
    """This process's peak RSS (VmHWM, MiB). Not ``getrusage``'s ``ru_maxrss``: Linux carries it over ``exec`` from
    the forked parent, so a child would report the parent's size."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM:"))


def child(mode: str, uri: str) -> None:
    from tasks.prepare import tencent, tencent_source

    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as tiny:  # imports and the parser's compile, on 2 words
        tiny.write(("2 200\n" + "".join(f"词{i} " + " ".join(["0.100000"] * 200) + "\n" for i in range(2))).encode())
        tiny.flush()
        tencent.read_tencent(tiny.name, progress=False)
    if mode == "tar_fsspec":
        tencent_source.tar_member = lambda _uri: None  # read_tencent then opens the chain with fsspec.open
    base = hwm_mib()
    t = time.perf_counter()
    emb = tencent.read_tencent(uri, progress=False)
    dt = time.perf_counter() - t
    peak = hwm_mib()
    print(json.dumps({"seconds": dt, "peak_rss_mib": peak, "before_mib": base, "words": len(emb.words),
                      "vectors_mib": round(emb.vectors.nbytes / 2**20, 2)}))


def make_inputs(d: str, words: int) -> dict[str, str]:
    import numpy as np

    from tests.test_embeddings_archive import write_archive

    rng = np.random.default_rng(0)
    lines = [f"{words} 200"]
    for i in range(words):
        lines.append(f"词{i} " + " ".join(f"{v:.6f}" for v in rng.uniform(-1, 1, 200)))
    text = ("\n".join(lines) + "\n").encode()
    plain = os.path.join(d, f"{NAME}.txt")
    with open(plain, "wb") as f:
        f.write(text)
    with open(plain + ".gz", "wb") as f:
        f.write(gzip.compress(text, 6))
    archive = os.path.join(d, f"{NAME}.tar.gz")
    write_archive(archive, text)
    return {"plain": plain, "gzip": plain + ".gz", "tar_ours": f"tar://{MEMBER}::{archive}",
            "tar_fsspec": f"tar://{MEMBER}::{archive}", "_text_mib": len(text) / 2**20,
            "_archive_mib": os.path.getsize(archive) / 2**20}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--words", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/bench_tencent_archive.json)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "URI"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(*args.child)
    fig: dict = {"words": args.words, "dim": 200}
    with tempfile.TemporaryDirectory() as d:
        inputs = make_inputs(d, args.words)
        fig["member_mib"], fig["archive_mib"] = round(inputs["_text_mib"], 2), round(inputs["_archive_mib"], 2)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.repeat):
            for m in MODES:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", m, inputs[m]],
                                     capture_output=True, text=True, check=True).stdout
                runs[m].append(json.loads(out.strip().splitlines()[-1]))
    for m, rs in runs.items():
        assert all(r["words"] == args.words for r in rs), (m, rs)
        fig[m] = {"seconds": round(statistics.median(r["seconds"] for r in rs), 3),
                  "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
                  "rss_before_read_mib": max(r["before_mib"] for r in rs), "vectors_mib": rs[0]["vectors_mib"]}
        print(f"{m:10s}: {fig[m]['seconds']:.2f} s, peak RSS {fig[m]['peak_rss_mib']} MiB "
              f"(before the read {fig[m]['rss_before_read_mib']} MiB; vectors {fig[m]['vectors_mib']} MiB)")
    fig["ratio_seconds_fsspec_tar_over_ours"] = round(fig["tar_fsspec"]["seconds"] / fig["tar_ours"]["seconds"], 3)
    fig["ratio_rss_ours_tar_over_plain"] = round(fig["tar_ours"]["peak_rss_mib"] / fig["plain"]["peak_rss_mib"], 3)
    from benchmarks._numerics_ab import write_results

    write_results(args.results, "bench_tencent_archive", fig)
    print(f"member {fig['member_mib']} MiB in a {fig['archive_mib']} MiB .tar.gz: seconds, fsspec tar:// / ours: "
          f"{fig['ratio_seconds_fsspec_tar_over_ours']:.2f}x; peak RSS, ours tar / plain file: "
          f"{fig['ratio_rss_ours_tar_over_plain']:.2f}x")


if __name__ == "__main__":
    main()
