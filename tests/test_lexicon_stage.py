"""The lexicon stage's flat-array path (tasks.prepare.lexicon) against the per-row path it replaced
(tests/lexicon_reference.py): the same rows, the same shard bytes, on real Parquet and real stores."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pyarrow as pa
import pytest

from storage.artifacts import ArtifactStore
from storage.parquet import write_rows
from tasks.prepare import lexicon as lex
from tasks.prepare.numbers import SCHEMA as NUMBERS_SCHEMA
from tasks.text import match_kernels as mk
from tasks.text.matcher import build_trie, compile_trie
from tasks.text.numbers import NUM_CHAR, number_row
from tasks.text.vocab import token_ids
from tests import lexicon_reference as ref

ALPHABET = "南京市长江大桥甲乙丙丁戊1234 ab,.\U00020000"
WORDS = ["长江", "长江大桥", "大桥", "江大", "南京", "南京市", "市长", "甲乙", "甲乙丙丁", "乙丙", "\U00020000甲",
         "ab", "丙丁戊", "戊甲", "桥甲"]


def _rows(seed: int, n: int) -> list[dict]:
    """Numbers rows (real ``number_row``: #NUM# and English spans) of random text over ALPHABET."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        pieces = [rng.choice(WORDS) if rng.random() < 0.3 else rng.choice(ALPHABET) for _ in range(40)]
        text = "".join(pieces)[: rng.choice([0, 1, 3, 12, 40])]
        if rng.random() < 0.1:
            text += "##NUM#x#NUM"  # literal marks in the text: replaced left to right as str.replace does
        rows.append(number_row({"doc_id": f"d{seed}-{i // 3}", "sent_idx": i % 3, "text": text}))
    return rows


def _vocab_index(rows) -> dict[str, int]:
    chars = sorted({c for r in rows for c in r["text"]})[::2]  # half the characters: the rest are [UNK]
    return {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "#NUM#", *chars])}


@pytest.mark.parametrize("seed", range(4))
def test_match_rows_equal_the_reference(seed):
    rows = _rows(seed, 60)
    ct = compile_trie(build_trie(WORDS))
    vi = _vocab_index(rows)
    for min_len in (3, 2):
        ours, seen = lex.match_rows(rows, ct, vi, 3, min_len)
        want, want_seen = ref.match_rows(rows, ct, vi, 3, min_len)
        assert ours == want
        assert seen.dtype == want_seen.dtype and np.array_equal(seen, want_seen)  # integer ranks: exact
    assert sum(len(r["group_starts"]) for r in ours) > 50 and sum(w >= 0 for r in ours for w in r["word_ranks"]) > 200


def test_char_ids_as_token_ids():
    vi = {"[PAD]": 0, "[UNK]": 1, "#NUM#": 5, "甲": 6, "\U00020000": 7, "ab": 8}
    table = lex.char_id_table(vi)
    text = "甲乙\U00020000" + NUM_CHAR + "ab\U0010ffff"
    cps = np.array([ord(c) for c in text])
    got = np.where(cps < len(table), table[np.minimum(cps, len(table) - 1)], 1)
    assert got.tolist() == token_ids(text, vi) == [6, 1, 7, 5, 1, 1, 1]


def test_groups_fallback_for_spans_the_kernel_does_not_take():
    """English spans past the row's end or of unequal count go through ``whole_word_groups`` row by row."""
    ct = compile_trie(build_trie(WORDS))
    base = {"doc_id": "d", "sent_idx": 0, "text": "南京市长江大桥ab"}
    for en_starts, en_ends in (([7, 2], [9, 40]), ([0, 3], [2]), ([5], [3])):
        rows = [dict(base, en_starts=en_starts, en_ends=en_ends), dict(base, text="甲乙丙丁", en_starts=[], en_ends=[])]
        assert lex.match_rows(rows, ct, {}, 3)[0] == ref.match_rows(rows, ct, {}, 3)[0]


def _numbers_store(tmp_path, rows, shard_rows):
    w = ArtifactStore(str(tmp_path / "store")).attach("numbers", "t")
    rels = []
    for i in range(0, len(rows), shard_rows):
        rels.append(f"shards/part-{len(rels):05d}.parquet")
        write_rows(w, rels[-1], rows[i: i + shard_rows], NUMBERS_SCHEMA)
    return w, rels


def _digests(w, n):
    out = []
    for i in range(n):
        with w.fs.open(w.file_path(f"shards/part-{i:05d}.parquet"), "rb") as f:
            out.append(hashlib.sha256(f.read()).hexdigest())
    return out


def test_final_shards_byte_identical_to_the_reference(tmp_path):
    rows = _rows(7, 500)
    src, rels = _numbers_store(tmp_path, rows, 150)  # 4 shards, the last one short
    ct = compile_trie(build_trie(WORDS))
    vi = _vocab_index(rows)
    old = ArtifactStore(str(tmp_path / "out")).attach("lexicon", "ref")
    res = ref.run_shards(src, rels, ct, vi, 3, old)

    new = ArtifactStore(str(tmp_path / "out")).attach("lexicon", "new")
    scans = [lex.shard_ranks(src, r, ct, 2, new, f"_work/{i:05d}.npz") for i, r in enumerate(rels)]
    ranks = np.unique(np.concatenate([s["ranks"] for s in scans]))
    assert np.array_equal(ranks, res["ranks"]) and sum(s["rows"] for s in scans) == len(rows)  # integer ranks
    table = lex.char_id_table(vi)
    done = [lex.finalize_shard(src, r, ct, table, 3, new, f"shards/part-{i:05d}.parquet", ranks, 2,
                               f"_work/{i:05d}.npz") for i, r in enumerate(rels)]
    assert not new.fs.exists(new.file_path("_work/00000.npz"))  # each kept file is removed once used
    assert _digests(new, len(rels)) == _digests(old, len(rels))
    assert [d["rows"] for d in done] == res["out"]
    assert [(d["tokens"], d["covered"]) for d in done] == [(m["tokens"], m["covered"]) for m in res["matched"]]

    # a retried step 2 (its kept matches already removed) walks again: the same bytes
    again = ArtifactStore(str(tmp_path / "out")).attach("lexicon", "again")
    lex.finalize_shard(src, rels[1], ct, table, 3, again, "shards/part-00001.parquet", ranks, 2, "_work/00001.npz")
    with again.fs.open(again.file_path("shards/part-00001.parquet"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == _digests(old, 2)[1]


def test_a_rank_missing_from_the_union_is_refused():
    ct = compile_trie(build_trie(WORDS))
    table = pa.Table.from_pylist([number_row({"doc_id": "d", "sent_idx": 0, "text": "南京市长江大桥"})],
                                 schema=lex.NUMBERS_SCHEMA)
    with pytest.raises(ValueError, match="not in the union"):
        lex.match_table(table, ct, lex.char_id_table({}), 3, 2, np.asarray([0], np.int64))


def test_codepoints_are_strict_utf8_like_python(monkeypatch):
    """Random byte strings: the kernel yields Python's decoding (``#NUM#`` -> U+E000) or names the bad row."""
    rng = random.Random(3)
    pieces = [b"a", b"#NUM#", b"#", "南".encode(), "\U00020000".encode(), b"\xff", b"\xc0\x80", b"\xed\xa0\x80",
              b"\xf4\x90\x80\x80", b"\xe4\xb8", b"\x80", "é".encode(), b"\x00"]
    for _ in range(300):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
        arr = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(np.array([0, 1, 1 + len(data)], np.int32)),
                                                     pa.py_buffer(b"z" + data)])
        try:
            want = ("z\x00" + data.decode("utf-8").replace("#NUM#", NUM_CHAR))
        except UnicodeDecodeError:
            with pytest.raises(ValueError, match="row 1 .* not valid UTF-8"):
                lex.token_codepoints(arr)
            continue
        cps, start, length = lex.token_codepoints(arr)
        assert "".join(map(chr, cps.tolist())) == want and start.tolist() == [0, 2] and length[0] == 1


@pytest.mark.parametrize("seed", range(2))
def test_new_kernels_python_and_numba_paths_agree(seed, monkeypatch):
    rows = _rows(seed, 400)
    small = mk.SMALL
    ct = compile_trie(build_trie(WORDS))
    table = pa.Table.from_pylist(rows, schema=lex.NUMBERS_SCHEMA)
    ranks = np.arange(len(WORDS), dtype=np.int64)
    jitted, _, _ = lex.match_table(table, ct, lex.char_id_table(_vocab_index(rows)), 3, 2, ranks)
    assert all(k._jit is not None for k in (mk.utf8_token_codepoints, mk.word_groups, mk.shard_slots))
    monkeypatch.setattr(mk, "SMALL", 10**9)
    python, _, _ = lex.match_table(table, ct, lex.char_id_table(_vocab_index(rows)), 3, 2, ranks)
    assert jitted.equals(python)
    assert sum(jitted.column("n_tokens").to_pylist()) > small  # so the first call did run numba


# --------------------------------------------------------------------------
# the trie stage at scale: compiled from the word list, pickle streamed, collector paused
# --------------------------------------------------------------------------


def test_trie_files_equal_the_trie_path(tmp_path):
    import gc
    import pickle

    from tasks.prepare.trie import TRIE_FILE, write_trie_files
    from tasks.text.matcher import COMPILED_FILE, compile_words

    rng = random.Random(5)
    words = ["".join(rng.choice("甲乙丙丁戊\U00020000a") for _ in range(rng.randint(0, 6))) for _ in range(3000)]
    words += ["有\x00零", "数" + NUM_CHAR, "甲乙"]  # unusable, and a duplicate
    trie = build_trie(words)
    assert compile_words(words).to_bytes() == compile_trie(trie).to_bytes()
    w = ArtifactStore(str(tmp_path)).attach("trie", "t")
    gc.enable()
    info = write_trie_files(w, words, 2500)
    assert gc.isenabled()
    with w.fs.open(w.file_path(TRIE_FILE), "rb") as f:
        assert f.read() == pickle.dumps(build_trie(words[:2500]), protocol=4)
    with w.fs.open(w.file_path(COMPILED_FILE), "rb") as f:
        assert f.read() == compile_trie(build_trie(words[:2500])).to_bytes()
    assert info["stats"]["in"] == 2500 and info["stats"]["out"] == len(build_trie(words[:2500])) < 2500


def test_embedding_words_without_the_vectors():
    import fsspec

    from tasks.prepare.tencent import TencentEmbeddings
    from tasks.text.embedding_files import load_embedding_words, load_embeddings, save_embeddings

    fs = fsspec.filesystem("memory")
    emb = TencentEmbeddings(words=["长江", "大桥", "南京"], vectors=np.arange(6, dtype=np.float32).reshape(3, 2))
    save_embeddings(emb, fs, "/lexstage/e")
    assert load_embedding_words(fs, "/lexstage/e") == load_embeddings(fs, "/lexstage/e")[0] == emb.words
    fs.pipe("/lexstage/e/words.txt", "长江\n大桥\n".encode())
    with pytest.raises(ValueError, match="2 words but vectors of shape"):
        load_embedding_words(fs, "/lexstage/e")
    fs.rm("/lexstage", recursive=True)


def test_vector_rows_read_only_the_indexed_rows(tmp_path):
    import fsspec

    from tasks.prepare.tencent import TencentEmbeddings
    from tasks.text.embedding_files import VectorRows, save_embeddings

    vec = np.random.default_rng(0).standard_normal((50, 7)).astype(np.float32)
    emb = TencentEmbeddings(words=[f"w{i}" for i in range(50)], vectors=vec)
    idx = np.array([0, 3, 4, 5, 17, 18, 40, 49])
    mem = fsspec.filesystem("memory")
    save_embeddings(emb, mem, "/lexstage/v")
    save_embeddings(emb, fsspec.filesystem("file"), str(tmp_path))
    for rows in (VectorRows(mem, "/lexstage/v", window_bytes=3 * 7 * 4), VectorRows(mem, "/lexstage/v"),
                 VectorRows(fsspec.filesystem("file"), str(tmp_path))):
        assert len(rows) == 50 and rows.shape == (50, 7)
        assert np.array_equal(rows[idx], vec[idx]) and rows[idx[:0]].shape == (0, 7)
        with pytest.raises(IndexError, match="ascending"):
            rows[idx[::-1]]
    mem.rm("/lexstage", recursive=True)
