"""What the clean stage keeps from a MediaWiki dump, read directly (tasks/prepare/wikidump.py: mwxml +
mwparserfromhell), against WikiExtractor's text of the same dump cleaned by the same stage (the reference: how the
wiki2019zh / WikiExtractor inputs were made until now).

Both texts go through the same cleaning (OpenCC t2s, sentence split, min_chars, CJK ratio; no cross-page dedup,
so that each page is compared with itself). Counts are over the pages both keep as articles (WikiExtractor keeps
disambiguation pages; we reject them), plus the totals. The last line is the ratio of characters kept, ours over
WikiExtractor's.

    .venv/bin/pip install wikiextractor==3.1.0      # or: pip install -e '.[bench]'
    .venv/bin/python benchmarks/eval_dump_clean.py --results docs/results/eval_dump_clean.json
    .venv/bin/python benchmarks/eval_dump_clean.py --dump /data/zhwiki/zhwiki-latest-pages-articles1.xml-p1p187712.bz2
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks._numerics_ab import write_results  # noqa: E402
from tasks.prepare.clean import clean_records  # noqa: E402
from tasks.prepare.config import CleanConfig  # noqa: E402
from tasks.prepare.corpus import Doc, read_records  # noqa: E402


def kept_by_page(records, cfg: CleanConfig) -> tuple[dict[str, list[str]], int]:
    """doc_id -> kept sentences (a page with none kept: an empty list), and how many records were articles."""
    recs = list(records)
    pages: dict[str, list[str]] = defaultdict(list)
    for r in recs:
        if isinstance(r, Doc):
            pages[r.doc_id]
    for kind, row in clean_records(recs, cfg):
        if kind == "keep":
            pages[row["doc_id"]].append(row["text"])
    return dict(pages), sum(isinstance(r, Doc) for r in recs)


def wikiextractor(dump: str, out: str) -> tuple[list[str], float]:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "wikiextractor.WikiExtractor", dump, "--json", "-o", out, "--processes", "1",
                    "-q"], check=True)
    return sorted(glob.glob(os.path.join(out, "*", "wiki_*"))), time.perf_counter() - t


def totals(pages: dict[str, list[str]], ids) -> dict[str, int]:
    sents = [s for i in ids for s in pages.get(i, [])]
    return {"pages": len(ids), "sentences": len(sents), "chars": sum(map(len, sents))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="a MediaWiki XML dump (.xml or .xml.bz2); default: the test fixture's pages")
    ap.add_argument("--results", help="write the figures as JSON here (docs/results/eval_dump_clean.json)")
    args = ap.parse_args(argv)
    cfg = CleanConfig()
    with tempfile.TemporaryDirectory() as tmp:
        dump = args.dump
        if dump is None:
            from tests.dump_fixture import dump_xml, eval_pages

            dump = os.path.join(tmp, "zhwiki-sample-pages-articles.xml")
            with open(dump, "wb") as f:
                f.write(dump_xml(eval_pages()))
        t = time.perf_counter()
        ours, our_articles = kept_by_page(read_records(dump, cfg), cfg)
        our_s = time.perf_counter() - t
        files, we_s = wikiextractor(dump, os.path.join(tmp, "we"))
        ref: dict[str, list[str]] = {}
        ref_articles = 0
        for f in files:
            pages, n = kept_by_page(read_records(f, CleanConfig(input_format="jsonl")), cfg)
            ref.update(pages)
            ref_articles += n
    common = sorted(set(ours) & set(ref), key=lambda x: int(x) if x.isdigit() else x)
    a, b = totals(ours, common), totals(ref, common)
    shared = sum(len(set(ours[i]) & set(ref[i])) for i in common)
    only_ref = sorted(set(ref) - set(ours))
    fig = {
        "dump": os.path.basename(args.dump) if args.dump else "tests/dump_fixture.py eval_pages()",
        "articles": {"ours": our_articles, "wikiextractor": ref_articles, "common": len(common),
                     "only_wikiextractor": len(only_ref)},
        "common_pages": {"ours": a, "wikiextractor": b, "sentences_in_both": shared},
        "all_pages": {"ours": totals(ours, list(ours)), "wikiextractor": totals(ref, list(ref))},
        "seconds": {"ours": round(our_s, 3), "wikiextractor": round(we_s, 3)},
        "ratio_chars_ours_over_wikiextractor": round(a["chars"] / max(b["chars"], 1), 4),
        "ratio_sentences_ours_over_wikiextractor": round(a["sentences"] / max(b["sentences"], 1), 4),
    }
    print(f"articles: ours {our_articles}, WikiExtractor {ref_articles} (common {len(common)}; WikiExtractor only "
          f"{len(only_ref)}: disambiguation pages it keeps)")
    print(f"common pages: sentences kept ours {a['sentences']} / WikiExtractor {b['sentences']} "
          f"({shared} identical), characters kept ours {a['chars']} / WikiExtractor {b['chars']}")
    print(f"time: ours {our_s:.2f} s, WikiExtractor {we_s:.2f} s (its process start included)")
    write_results(args.results, "eval_dump_clean", fig)
    print(f"characters kept, ours / WikiExtractor (common pages): {fig['ratio_chars_ours_over_wikiextractor']}x; "
          f"sentences {fig['ratio_sentences_ours_over_wikiextractor']}x")


if __name__ == "__main__":
    main()
