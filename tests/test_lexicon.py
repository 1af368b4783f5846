"""tasks.text.matcher (and its numba kernels): LEBERT char-word matching, pure python vs jitted."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tasks.text.matcher import (
    PAD,
    CompiledTrie,
    build_trie,
    compile_trie,
    find_matches,
    fmm_segments,
    match_batch,
    match_words,
    slot_spans,
    text_codepoints,
    top_k_ranks,
)
from tests.lebert_reference import RefTrie

HAND_WORDS = ["长江", "长江大桥", "大桥", "江大", "南京", "南京市", "市长"]
HAND_TEXT = "南京市长江大桥"


def ref_match_words(text, words, k=3):
    """Reference per-char lists: covering words, best (first-occurrence) rank first."""
    rank = {}
    for i, w in enumerate(words):
        rank.setdefault(w, i)
    cands = [set() for _ in text]
    for start, w in RefTrie(words).matches(text):
        for p in range(start, start + len(w)):
            cands[p].add(w)
    out = []
    for c in cands:
        best = sorted(c, key=rank.__getitem__)[:k]
        out.append(best + [PAD] * (k - len(best)))
    return out


def fast_words(text, ct, k=3):
    (ranks,) = match_batch([text], ct, k)
    return [[ct.words[r] if r >= 0 else PAD for r in row] for row in ranks.tolist()]


def fast_match_set(text, ct):
    starts, lengths, ranks = find_matches(text_codepoints(text), ct)
    return {(int(s), ct.words[r]) for s, r in zip(starts.tolist(), ranks.tolist())}


# --------------------------------------------------------------------------
# hand example
# --------------------------------------------------------------------------


def test_hand_example_exact():
    trie = build_trie(HAND_WORDS)
    expected = [
        ["南京", "南京市", PAD],  # 南
        ["南京", "南京市", PAD],  # 京
        ["南京市", "市长", PAD],  # 市
        ["长江", "长江大桥", "市长"],  # 长 (rank 0, 1, 6)
        ["长江", "长江大桥", "江大"],  # 江
        ["长江大桥", "大桥", "江大"],  # 大 (rank 1, 2, 3)
        ["长江大桥", "大桥", PAD],  # 桥
    ]
    assert match_words(HAND_TEXT, trie) == expected
    ct = compile_trie(trie)
    assert fast_words(HAND_TEXT, ct) == expected
    assert ref_match_words(HAND_TEXT, HAND_WORDS) == expected


def test_hand_example_max_word_num():
    trie = build_trie(HAND_WORDS)
    ct = compile_trie(trie)
    one = match_words(HAND_TEXT, trie, max_word_num=1)
    assert one == [["南京"], ["南京"], ["南京市"], ["长江"], ["长江"], ["长江大桥"], ["长江大桥"]]
    five = match_words(HAND_TEXT, trie, max_word_num=5)
    assert all(len(row) == 5 for row in five)
    assert five[3] == ["长江", "长江大桥", "市长", PAD, PAD]
    assert fast_words(HAND_TEXT, ct, 1) == one
    assert fast_words(HAND_TEXT, ct, 5) == five


def test_hand_find_matches_sorted_and_fmm():
    ct = compile_trie(build_trie(HAND_WORDS))
    starts, lengths, ranks = find_matches(text_codepoints(HAND_TEXT), ct)
    got = list(zip(starts.tolist(), lengths.tolist(), ranks.tolist()))
    assert got == [(0, 2, 4), (0, 3, 5), (2, 2, 6), (3, 2, 0), (3, 4, 1), (4, 2, 3), (5, 2, 2)]
    assert starts.dtype == np.int64 and lengths.dtype == np.int32 and ranks.dtype == np.int32
    assert fmm_segments(len(HAND_TEXT), starts, lengths) == [(0, 3), (3, 7)]
    # min_len=1 adds nothing here (no single-char words) and keeps the order
    s1, l1, r1 = find_matches(text_codepoints(HAND_TEXT), ct, min_len=1)
    assert list(zip(s1.tolist(), l1.tolist(), r1.tolist())) == got


def test_fmm_segments_gaps_and_single_chars():
    # matches: "ab"@0, "abc"@0, "cd"@2, "d"@3 (len 1 ignored), "ef"@5
    starts = np.array([0, 0, 2, 3, 5])
    lengths = np.array([2, 3, 2, 1, 2])
    assert fmm_segments(8, starts, lengths) == [(0, 3), (5, 7)]
    assert fmm_segments(0, np.array([], np.int64), np.array([], np.int32)) == []


def test_top_k_ranks_direct():
    # position 1 is covered by ranks 7, 3, 5, 3 (dup), 9 -> [3, 5, 7]
    starts = np.array([0, 0, 1, 1, 1])
    lengths = np.array([2, 3, 2, 2, 2])
    ranks = np.array([7, 3, 5, 3, 9])
    top = top_k_ranks(4, starts, lengths, ranks, 3)
    assert top.dtype == np.int32 and top.shape == (4, 3)
    assert top.tolist() == [[3, 7, -1], [3, 5, 7], [3, 5, 9], [-1, -1, -1]]


def test_slot_spans_hand_example():
    ct = compile_trie(build_trie(HAND_WORDS))
    starts, lengths, ranks = find_matches(text_codepoints(HAND_TEXT), ct)
    top = top_k_ranks(len(HAND_TEXT), starts, lengths, ranks, 3)
    ws, we = slot_spans(top, starts, lengths, ranks)
    got = [[(ct.words[r], int(a), int(b)) for r, a, b in zip(t, s_, e_) if r >= 0] for t, s_, e_ in zip(top, ws, we)]
    for p, slots in enumerate(got):
        for w, a, b in slots:
            assert HAND_TEXT[a:b] == w and a <= p < b  # each slot: where its word sits, covering p
    assert ("长江大桥", 3, 7) in got[6] and ("市长", 2, 4) in got[2]
    assert all((a, b) == (0, 0) for t, s_, e_ in zip(top, ws, we) for r, a, b in zip(t, s_, e_) if r < 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_slot_spans_random_against_python(seed):
    """Span = the union of the slot word's occurrences covering the position (repeats overlap)."""
    rnd = random.Random(seed)
    alphabet = "甲乙丙丁"
    words = sorted({"".join(rnd.choice(alphabet) for _ in range(rnd.randint(2, 4))) for _ in range(30)})
    ct = compile_trie(build_trie(words))
    for _ in range(20):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 40)))
        starts, lengths, ranks = find_matches(text_codepoints(text), ct)
        top = top_k_ranks(len(text), starts, lengths, ranks, 2)
        ws, we = slot_spans(top, starts, lengths, ranks)
        for p in range(len(text)):
            for q in range(2):
                r = int(top[p, q])
                if r < 0:
                    assert (ws[p, q], we[p, q]) == (0, 0)
                    continue
                occ = [(i, i + len(ct.words[r])) for i in range(len(text)) if text.startswith(ct.words[r], i)]
                cover = [(a, b) for a, b in occ if a <= p < b]
                assert (ws[p, q], we[p, q]) == (min(a for a, _ in cover), max(b for _, b in cover))


def test_lexicon_rows_carry_spans_and_min_word_len():
    from tasks.prepare.lexicon import match_rows

    ct = compile_trie(build_trie(HAND_WORDS))
    row = {"doc_id": "d", "sent_idx": 0, "text": HAND_TEXT, "en_starts": [], "en_ends": []}
    (two,), _ = match_rows([row], ct, {}, 3, 2)
    (three,), _ = match_rows([row], ct, {}, 3, 3)
    k = 3
    for out, min_len in ((two, 2), (three, 3)):
        assert len(out["word_ranks"]) == len(out["word_starts"]) == len(out["word_ends"]) == len(HAND_TEXT) * k
        for i, (r, a, b) in enumerate(zip(out["word_ranks"], out["word_starts"], out["word_ends"])):
            if r < 0:
                assert (a, b) == (0, 0)
            else:
                assert HAND_TEXT[a:b] == ct.words[r] and a <= i // k < b and b - a >= min_len
    lens3 = {len(ct.words[r]) for r in three["word_ranks"] if r >= 0}
    assert lens3 == {3, 4}  # 南京市, 长江大桥: the two-character words are gone
    assert {len(ct.words[r]) for r in two["word_ranks"] if r >= 0} >= {2}


# --------------------------------------------------------------------------
# build_trie
# --------------------------------------------------------------------------


def test_build_trie_first_occurrence_wins_and_skips_empty():
    trie = build_trie(["ab", "", "cd", "ab", "ef", "cd"])
    assert dict(trie.items()) == {"ab": 0, "cd": 2, "ef": 4}
    ct = compile_trie(trie)
    assert ct.words[0] == "ab" and ct.words[2] == "cd" and ct.words[4] == "ef"
    assert match_words("abcd", trie, 2) == [["ab", PAD], ["ab", PAD], ["cd", PAD], ["cd", PAD]]


def test_duplicate_occurrences_listed_once():
    # "aa" occurs at 0 and 1 in "aaa"; char 1 is covered by both occurrences
    words = ["aa", "aaa", "b"]
    trie = build_trie(words)
    ct = compile_trie(trie)
    expected = [["aa", "aaa", PAD]] * 3
    assert match_words("aaa", trie) == expected
    assert fast_words("aaa", ct) == expected
    assert ref_match_words("aaa", words) == expected


# --------------------------------------------------------------------------
# random equivalence: match_words == fast path == LEBERT reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_random_equivalence(seed):
    rng = random.Random(seed)
    alphabet = "甲乙丙丁戊己"[: rng.randint(2, 6)]
    words = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 60))]
    if seed % 2:
        words += words[: len(words) // 3]  # duplicates at worse ranks
    trie = build_trie(words)
    ct = compile_trie(trie)
    ref = RefTrie(words)
    texts = ["".join(rng.choice(alphabet + "x") for _ in range(rng.randint(0, 40))) for _ in range(25)]
    k = rng.randint(1, 5)
    batch = match_batch(texts, ct, k)
    assert len(batch) == len(texts)
    for text, ranks in zip(texts, batch):
        assert ranks.shape == (len(text), k) and ranks.dtype == np.int32
        fast = [[ct.words[r] if r >= 0 else PAD for r in row] for row in ranks.tolist()]
        assert match_words(text, trie, k) == fast == ref_match_words(text, words, k)
        assert fast_match_set(text, ct) == ref.matches(text)


def test_long_words_beyond_python_window():
    # words longer than match_words' initial 32-char window
    w_long = "甲" * 40 + "乙"
    words = ["甲甲", w_long, "甲" * 70]
    trie = build_trie(words)
    ct = compile_trie(trie)
    text = "丙" + "甲" * 80 + "乙"
    assert match_words(text, trie) == fast_words(text, ct) == ref_match_words(text, words)
    assert fast_match_set(text, ct) == RefTrie(words).matches(text)


# --------------------------------------------------------------------------
# special characters
# --------------------------------------------------------------------------


def test_astral_characters():
    a, b, c = "\U00020000", "\U0002a6d6", "\U0001f600"  # CJK ext B x2, emoji
    words = [a + b, "中" + a, b + c + "文", c + c, "中文"]
    trie = build_trie(words)
    ct = compile_trie(trie)
    # astral first chars use the CSR fallback; the dense table ends at 中
    assert ct.root.shape[0] == ord("中") + 1
    text = "中" + a + b + c + "文" + c + c + "中文"
    assert len(text_codepoints(text)) == len(text)
    ref = ref_match_words(text, words)
    assert match_words(text, trie) == ref == fast_words(text, ct)
    assert fast_match_set(text, ct) == RefTrie(words).matches(text)
    assert {w for _, w in fast_match_set(text, ct)} == set(words)


def test_num_placeholder_never_matches():
    num = "\ue000"
    words = ["1" + num, num + num, num + "年", "年份", num]
    trie = build_trie(words)
    assert dict(trie.items()) == {"年份": 3}
    ct = compile_trie(trie)
    text = "1" + num + num + "年份"
    expected = [[PAD] * 3] * 3 + [["年份", PAD, PAD]] * 2
    assert match_words(text, trie) == expected == fast_words(text, ct)
    # even a hand-built trie holding such words never matches them
    import pygtrie

    raw = pygtrie.CharTrie({num + "年": 0, "年份": 1})
    assert match_words(num + "年份", raw)[0] == [PAD] * 3
    ct_raw = compile_trie(raw)
    assert fast_words(num + "年份", ct_raw)[0] == [PAD] * 3


def test_separator_never_spans_texts():
    words = ["ab", "bc", "abc"]
    ct = compile_trie(build_trie(words))
    texts = ["a", "bc", "ab", "c", "", "abc"]
    out = match_batch(texts, ct, 2)
    got = [[[ct.words[r] if r >= 0 else PAD for r in row] for row in a.tolist()] for a in out]
    assert got == [
        [[PAD, PAD]],
        [["bc", PAD], ["bc", PAD]],
        [["ab", PAD], ["ab", PAD]],
        [[PAD, PAD]],
        [],
        [["ab", "abc"], ["ab", "bc"], ["bc", "abc"]],
    ]


def test_empty_inputs():
    trie = build_trie(HAND_WORDS)
    ct = compile_trie(trie)
    assert match_words("", trie) == []
    assert match_batch([], ct) == []
    (empty,) = match_batch([""], ct)
    assert empty.shape == (0, 3)
    s, n, r = find_matches(np.zeros(0, np.uint32), ct)
    assert s.size == n.size == r.size == 0
    assert top_k_ranks(0, s, n, r, 3).shape == (0, 3)
    assert fmm_segments(0, s, n) == []
    # empty lexicon
    ct0 = compile_trie(build_trie([]))
    assert match_batch(["abc"], ct0)[0].tolist() == [[-1] * 3] * 3
    back0 = CompiledTrie.from_bytes(ct0.to_bytes())
    assert back0.max_depth == 0 and back0.words == ()
    assert match_batch(["abc"], back0)[0].tolist() == [[-1] * 3] * 3


# --------------------------------------------------------------------------
# compile_trie determinism + serialisation
# --------------------------------------------------------------------------


def test_compile_deterministic_and_round_trip():
    rng = random.Random(1234)
    words = ["".join(rng.choice("abcdeé中\U00020000") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    t1 = build_trie(words)
    # same word -> rank items inserted in another order
    t2 = build_trie([])
    items = list(t1.items())
    rng.shuffle(items)
    for w, r in items:
        t2[w] = r
    c1, c2 = compile_trie(t1), compile_trie(t2)
    for name in ("root", "start", "ch", "child", "term"):
        a, b = getattr(c1, name), getattr(c2, name)
        assert a.dtype == np.int32 and np.array_equal(a, b), name
    b1 = c1.to_bytes()
    assert b1 == c2.to_bytes() == compile_trie(t1).to_bytes()
    back = CompiledTrie.from_bytes(b1)
    for name in ("root", "start", "ch", "child", "term"):
        assert np.array_equal(getattr(back, name), getattr(c1, name)), name
    assert back.max_depth == c1.max_depth == max(len(w) for w in words)
    assert back.words == c1.words
    assert back.to_bytes() == b1
    text = "".join(rng.choice("abcdeé中\U00020000x") for _ in range(200))
    assert np.array_equal(match_batch([text], back)[0], match_batch([text], c1)[0])
    # without the words lookup
    nw = CompiledTrie(c1.root, c1.start, c1.ch, c1.child, c1.term, c1.max_depth, None)
    assert CompiledTrie.from_bytes(nw.to_bytes()).words is None


def test_pickle_round_trip_drops_walk_cache():
    import pickle

    ct = compile_trie(build_trie(HAND_WORDS))
    before = match_batch([HAND_TEXT], ct)[0]
    back = pickle.loads(pickle.dumps(ct))
    assert "_walk_cache" not in back.__dict__
    assert np.array_equal(match_batch([HAND_TEXT], back)[0], before)


def test_compiled_structure_invariants():
    ct = compile_trie(build_trie(HAND_WORDS + ["\U00020000\U00020001"]))
    n = ct.term.shape[0]
    assert ct.start.shape == (n + 1,) and ct.start[0] == 0 and ct.start[-1] == ct.ch.shape[0]
    assert ct.child.shape == ct.ch.shape
    for v in range(n):
        kids = ct.ch[ct.start[v] : ct.start[v + 1]]
        assert np.all(np.diff(kids) > 0)  # sorted, unique
    assert sorted(int(r) for r in ct.term if r >= 0) == list(range(len(HAND_WORDS) + 1))
    assert ct.max_depth == 4
    for cp in (ord("南"), ord("长")):
        assert ct.root[cp] >= 0
    assert ct.root[0] == -1 and ct.root[ord("桥")] == -1


def test_hand_built_csr_any_numbering():
    """find_matches accepts CompiledTrie arrays in any node numbering (pre-order here)."""
    # words "ab" (rank 0), "ac" (1), "b" (2): nodes 0 root, 1 a, 2 ab, 3 ac, 4 b
    ct = CompiledTrie(
        root=np.array([-1] * 97 + [1, 4], np.int32),
        start=np.array([0, 2, 4, 4, 4, 4], np.int32),
        ch=np.array([97, 98, 98, 99], np.int32),
        child=np.array([1, 4, 2, 3], np.int32),
        term=np.array([-1, -1, 0, 1, 2], np.int32),
        max_depth=2,
        words=("ab", "ac", "b"),
    )
    s, n, r = find_matches(text_codepoints("abacb"), ct, min_len=1)
    assert list(zip(s.tolist(), n.tolist(), r.tolist())) == [(0, 2, 0), (1, 1, 2), (2, 2, 1), (4, 1, 2)]


# --------------------------------------------------------------------------
# the kernels' two paths: Python for small calls, numba for large ones
# --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_kernels_python_and_numba_paths_agree(seed, monkeypatch):
    from tasks.text import match_kernels as mk

    rng = random.Random(seed)
    alphabet = "甲乙丙丁戊己"
    words = sorted({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(80)})
    ct = compile_trie(build_trie(words))
    text = "".join(rng.choice(alphabet + "x") for _ in range(3000))  # above SMALL: numba by default
    cps = text_codepoints(text)

    def run_all():
        starts, lengths, ranks = find_matches(cps, ct)
        top = top_k_ranks(len(cps), starts, lengths, ranks, 3)
        spans = slot_spans(top, starts, lengths, ranks)
        return [starts, lengths, ranks, top, *spans, np.array(fmm_segments(len(cps), starts, lengths))]

    jitted = run_all()
    assert all(k._jit is not None for k in (mk.walk, mk.top_k, mk.top_k_spans, mk.fmm_spans))
    monkeypatch.setattr(mk, "SMALL", 10**9)  # every call now runs the kernels' Python code
    python = run_all()
    assert len(jitted[0]) > 500  # many matches, so every branch of the walk runs
    for a, b in zip(jitted, python, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_small_label_call_never_imports_numba():
    import subprocess
    import sys

    code = ("import sys\nfrom tasks.text.matcher import build_trie, compile_trie, match_batch\n"
            "ct = compile_trie(build_trie(['长江', '大桥', '长江大桥']))\n"
            "r = match_batch(['南京市长江大桥'], ct, 3)[0]\n"
            "assert r.shape == (7, 3) and (r >= 0).sum() == 8, r\n"
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
