"""Reading a MediaWiki multistream dump: sequentially (one reader, start to end) against in parallel pieces (the
index splits it; one process per piece, as the clean stage's shard tasks on Dask), and WikiExtractor on the same
file (the reference: today's path made extracted text first). Reading means the clean stage's reader
(tasks/prepare/wikidump.py): XML pages -> articles' text or page rejects, wikitext parsed and rendered.

The dump is generated: ``--pages`` pages whose prose is the real zhwiki text in ../shared/data/zhwiki with wiki
markup put back (:func:`real_text_pages`; without that folder, or with ``--synthetic``, the fixture's repeated
articles, which bz2 compresses far better than a real dump), ``--per-stream`` pages per bz2 stream as Wikimedia
writes them, with its index. Figures: medians of ``--repeat`` runs; pages/s and MB/s of the bz2 file. The last line is
the ratio parallel / sequential (pages/s) and ours sequential / WikiExtractor with one process.

    .venv/bin/python benchmarks/bench_dump.py --pages 3000 --workers 2 --results docs/results/bench_dump.json
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks._numerics_ab import write_results  # noqa: E402
from tasks.prepare import wikidump  # noqa: E402
from tasks.prepare.config import CleanConfig  # noqa: E402

DUMP = "zhwiki-bench-pages-articles-multistream.xml.bz2"


SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "zhwiki")


def real_text_pages(n: int, shared: str = SHARED) -> list[dict] | None:
    """``n`` pages whose prose is real zhwiki text (../shared/data/zhwiki: extracted text, about 3 MB), split among
    the articles so that no two pages repeat (bz2 then compresses them about as it does a real dump), with wiki
    markup put back around it: an infobox, a <ref> after the first sentence, a link every 40 characters, a table,
    categories; every 10th page a redirect, every 25th a template. None when the folder is absent."""
    if not os.path.isdir(shared):
        return None
    from tasks.prepare.corpus import Doc, read_records
    from tests.dump_fixture import TEMPLATE_TEXT, page

    paras = [t for f in sorted(os.listdir(shared)) for r in read_records(os.path.join(shared, f), CleanConfig())
             if isinstance(r, Doc) for _, t in r.paragraphs for t in t.split("\n") if len(t.strip()) > 20]
    articles = [i for i in range(n) if i % 10 != 9 and i % 25 != 24]
    per = max(1, len(paras) // max(1, len(articles)))
    out, k = [], 0
    for i in range(n):
        pid = i + 1
        if i % 10 == 9:
            out.append(page(pid, f"重定向{pid}", f"#REDIRECT [[条目{pid - 1}]]", redirect=f"条目{pid - 1}"))
            continue
        if i % 25 == 24:
            out.append(page(pid, f"Template:模板{pid}", TEMPLATE_TEXT, ns=10))
            continue
        body = []
        for t in paras[k * per:(k + 1) * per] or paras[k % len(paras):k % len(paras) + 1]:
            t = "".join(f"[[{t[j:j + 2]}]]{t[j + 2:j + 40]}" for j in range(0, len(t), 40))
            body.append(t.replace("。", "。<ref>{{cite web|url=http://example.org|title=来源}}</ref>", 1))
        k += 1
        text = (f"{{{{Infobox|name=条目{pid}}}}}\n" + "\n\n".join(body)
                + "\n{| class=\"wikitable\"\n! 年份 !! 数值\n|-\n| 2020 || 1\n|}\n[[Category:条目]]\n")
        out.append(page(pid, f"条目{pid}", text))
    return out


def read_piece(uri: str, piece: dict | None) -> tuple[int, int]:
    """(pages read, peak RSS of this process in MiB)."""
    n = sum(1 for _ in wikidump.read_dump(uri, CleanConfig(), piece=piece))
    return n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def _warm(_: int = 0) -> int:
    import mwparserfromhell  # noqa: F401  (imports out of the measure)
    import mwxml  # noqa: F401

    return os.getpid()


def timed_pool(uri: str, pieces: list, workers: int) -> tuple[float, int, int]:
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_warm, range(workers)))  # workers started and imported before the clock
        t = time.perf_counter()
        res = list(pool.map(read_piece, [uri] * len(pieces), pieces))
        dt = time.perf_counter() - t
    return dt, sum(r[0] for r in res), max(r[1] for r in res)


def wikiextractor(uri: str, out: str, processes: int) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "wikiextractor.WikiExtractor", uri, "--json", "-o", out, "--processes",
                    str(processes), "-q"], check=True)
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=3000)
    ap.add_argument("--per-stream", type=int, default=100, help="pages per bz2 stream (Wikimedia: 100)")
    ap.add_argument("--streams-per-task", type=int, default=3, help="clean.dump.streams_per_task")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-wikiextractor", action="store_true")
    ap.add_argument("--synthetic", action="store_true", help="the fixture's repeated articles, not ../shared text")
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/bench_dump.json)")
    args = ap.parse_args(argv)
    from tests.dump_fixture import many_pages, multistream

    with tempfile.TemporaryDirectory() as tmp:
        pages = None if args.synthetic else real_text_pages(args.pages)
        source = "synthetic (tests/dump_fixture.py many_pages)" if pages is None else "real zhwiki text + markup"
        dump, index = multistream(pages or many_pages(args.pages), per_stream=args.per_stream)
        xml_mb = sum(len(p["text"].encode()) for p in (pages or many_pages(args.pages))) / 2**20
        uri = os.path.join(tmp, DUMP)
        with open(uri, "wb") as f:
            f.write(dump)
        with open(wikidump.standard_index_uri(uri), "wb") as f:
            f.write(index)
        pieces = wikidump.plan_pieces(wikidump.standard_index_uri(uri), args.streams_per_task)
        mb = len(dump) / 2**20
        runs: dict[str, list[tuple[float, int, int]]] = {"sequential": [], "parallel": []}
        we: list[float] = []
        for r in range(args.repeat):
            runs["sequential"].append(timed_pool(uri, [None], 1))
            runs["parallel"].append(timed_pool(uri, pieces, args.workers))
            if not args.no_wikiextractor:
                we.append(wikiextractor(uri, os.path.join(tmp, f"we{r}"), 1))
    fig: dict = {"pages": args.pages, "text": source, "bz2_mb": round(mb, 3), "wikitext_mb": round(xml_mb, 3),
                 "streams": -(-args.pages // args.per_stream),
                 "pieces": len(pieces), "workers": args.workers, "cpus": os.cpu_count()}
    for name, rs in runs.items():
        assert all(n == args.pages for _, n, _ in rs), (name, rs)
        s = statistics.median(dt for dt, _, _ in rs)
        fig[name] = {"seconds": round(s, 3), "pages_per_s": round(args.pages / s, 1), "bz2_mb_per_s": round(mb / s, 3),
                     "peak_rss_mib": max(m for _, _, m in rs)}
        fig[name]["wikitext_mb_per_s"] = round(xml_mb / s, 3)
        print(f"{name:10s}: {s:.2f} s, {args.pages / s:,.0f} pages/s, {mb / s:.2f} MB/s of bz2 "
              f"({xml_mb / s:.2f} MB/s of wikitext), "
              f"peak RSS {fig[name]['peak_rss_mib']} MiB per process")
    if we:
        s = statistics.median(we)
        fig["wikiextractor_1_process"] = {"seconds": round(s, 3), "pages_per_s": round(args.pages / s, 1),
                                          "bz2_mb_per_s": round(mb / s, 3)}
        print(f"WikiExtractor (1 process, start included): {s:.2f} s, {args.pages / s:,.0f} pages/s")
    par = fig["parallel"]["pages_per_s"] / fig["sequential"]["pages_per_s"]
    fig["ratio_parallel_over_sequential"] = round(par, 3)
    line = f"pages/s, parallel ({args.workers} workers, {len(pieces)} pieces) / sequential: {par:.2f}x"
    if we:
        ours = fig["sequential"]["pages_per_s"] / fig["wikiextractor_1_process"]["pages_per_s"]
        fig["ratio_sequential_over_wikiextractor"] = round(ours, 3)
        line += f"; ours sequential / WikiExtractor (1 process): {ours:.2f}x"
    write_results(args.results, "bench_dump", fig)
    print(line)


if __name__ == "__main__":
    main()
