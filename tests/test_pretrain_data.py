"""Pretraining data pipeline on synthetic rows: NSP pairing, whole-word MLM, bucketing, determinism.

Every sentence gets its own token-id range (token = 6 + sid * 1000 + position) so the sentence
behind A and B can be recovered from the ids. Word slots mimic the lexicon stage: each whole-word
group is a word (slot 0, span = the group) and a word bridging a group's last token and the next
token sits in slot 1, with ids derived from the token ids (unique per occurrence), so alignment
after truncation and the removal of words overlapping masked positions can be checked.
"""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest
import torch

from storage.artifacts import ArtifactStore
from storage.parquet import write_table
from tasks.pretrain.config import PretrainDataConfig
from tasks.pretrain.data import Batch, _truncate, iter_rows, max_word_num
from tasks.pretrain.packed import PackedBatches, pack_rows
from tasks.text.vocab import CLS, MASK, SEP
from tests.pretrain_reference import iter_batches, iter_examples, shuffle_buffer, skip
from tests.staging import begin

W = 3
VOCAB = 10**6
STRIDE = 1000


def word_slots(toks: np.ndarray, starts: list[int], ends: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(word ids, span starts, span ends), each int32 [n, W]: a group word in slot 0, a bridge word in slot 1."""
    n = len(toks)
    wid, ws, we = (np.zeros((n, W), np.int32) for _ in range(3))
    for s, e in zip(starts, ends):
        wid[s:e, 0], ws[s:e, 0], we[s:e, 0] = toks[s] * 4 + 1, s, e
        if e < n:
            wid[e - 1 : e + 1, 1], ws[e - 1 : e + 1, 1], we[e - 1 : e + 1, 1] = toks[e - 1] * 4 + 2, e - 1, e + 1
    return wid, ws, we


def make_rows(n_docs: int = 60, seed: int = 0, min_len: int = 5, max_len: int = 70) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows, sid = [], 0
    for d in range(n_docs):
        for k in range(int(rng.integers(1, 9))):
            n = int(rng.integers(min_len, max_len + 1))
            toks = 6 + sid * STRIDE + np.arange(n)
            starts, ends, p = [], [], 0
            while p < n:
                if rng.random() < 0.3 and p + 2 <= n:
                    g = int(rng.integers(2, 5))
                    g = min(g, n - p)
                    starts.append(p)
                    ends.append(p + g)
                    p += g
                else:
                    p += 1
            wid, ws, we = word_slots(toks, starts, ends)
            rows.append({
                "doc_id": f"doc{d}", "sent_idx": k, "n_tokens": n,
                "char_ids": toks.astype(np.int32),
                "word_ids": wid.reshape(-1), "word_starts": ws.reshape(-1), "word_ends": we.reshape(-1),
                "group_starts": np.array(starts, np.int32), "group_ends": np.array(ends, np.int32),
            })
            sid += 1
    return rows


ROWS = make_rows()
SENT = {(int(r["char_ids"][0]) - 6) // STRIDE: r for r in ROWS}  # sid -> row


def cfg(**kw) -> PretrainDataConfig:
    base = dict(batch_size=8, shuffle_buffer=64, bucket_batches=4)
    base.update(kw)
    return PretrainDataConfig(**base)


def unpack(batch: Batch) -> list[dict]:
    """Per example: ids as fed, original ids (labels restored), masked positions, lengths."""
    B, T = batch.input_ids.shape
    pos, lab = batch.mlm_positions.numpy(), batch.mlm_labels.numpy()
    out = []
    for i in range(B):
        L = int(batch.attention_mask[i].sum())
        sel = (pos >= i * T) & (pos < (i + 1) * T)
        p = pos[sel] - i * T
        ids = batch.input_ids[i, :L].numpy()
        orig = ids.copy()
        orig[p] = lab[sel]
        sep = int(np.flatnonzero(orig == SEP)[0])
        out.append({"ids": ids, "orig": orig, "pos": p, "labels": lab[sel], "L": L, "sep": sep,
                    "seg": batch.segment_ids[i].numpy(), "words": batch.word_ids[i].numpy(),
                    "nsp": int(batch.nsp_labels[i]), "T": T})
    return out


def batches(c: PretrainDataConfig, loader: str = "reference", epoch: int = 0, rows=ROWS) -> list[Batch]:
    """Every batch of one epoch, from the reference per-example stream or the packed loader."""
    if loader == "reference":
        return list(iter_batches(rows, c, VOCAB, W, epoch))
    return PackedBatches(pack_rows(rows, c, W), c, VOCAB).epoch(epoch)


def all_examples(c: PretrainDataConfig, epoch: int = 0, loader: str = "reference") -> list[dict]:
    return [e for b in batches(c, loader, epoch) for e in unpack(b)]


def sid_of(tokens: np.ndarray) -> int:
    s = set(((tokens - 6) // STRIDE).tolist())
    assert len(s) == 1, s
    return s.pop()


def expected_words(e: dict) -> tuple[np.ndarray, set[int]]:
    """The example's word slots as the rows hold them (after truncation), with every word whose span
    (clipped to the kept tokens) holds a masked position zeroed everywhere; and the removed ids."""
    orig, sep, L, masked = e["orig"], e["sep"], e["L"], set(e["pos"].tolist())
    exp, hit = np.zeros((L, W), np.int64), set()
    for off, end in ((1, sep), (sep + 1, L - 1)):
        row, n = SENT[sid_of(orig[off:end])], end - off
        wid, ws, we = (np.asarray(row[k]).reshape(-1, W)[:n] for k in ("word_ids", "word_starts", "word_ends"))
        exp[off:end] = wid
        for i in range(n):
            for j in range(W):
                if wid[i, j] and any(off + p in masked for p in range(ws[i, j], min(we[i, j], n))):
                    hit.add(int(wid[i, j]))
    exp[np.isin(exp, list(hit))] = 0
    return exp, hit


LOADERS = ["reference", "packed"]


@pytest.fixture(scope="module", params=LOADERS)
def examples(request):
    return all_examples(cfg(), loader=request.param)


def test_config_forbids_unknown_and_checks_probs():
    with pytest.raises(Exception):
        PretrainDataConfig(nope=1)
    with pytest.raises(Exception):
        PretrainDataConfig(mask_replace=0.95, mask_random=0.1)


def test_mlm_labels_only_at_masked_positions_and_rates(examples):
    outcomes = {"mask": 0, "random": 0, "keep": 0}
    ratios = []
    for e in examples:
        ids, orig, p = e["ids"], e["orig"], e["pos"]
        n_real = e["L"] - 3
        assert len(p) <= 20
        assert np.all(np.diff(p) > 0)
        # specials and padding never masked
        assert not np.isin(orig[p], [CLS, SEP, 0]).any()
        assert np.all(orig[p] >= 6)
        # outside the selected positions, nothing changed
        rest = np.setdiff1d(np.arange(e["L"]), p)
        assert not (ids[rest] == MASK).any()
        assert np.all(orig[rest] == ids[rest])
        for q in p:
            outcomes["mask" if ids[q] == MASK else "keep" if ids[q] == orig[q] else "random"] += 1
        assert np.all(ids[p][ids[p] != MASK] >= 6)
        if 0.15 * n_real < 19:
            ratios.append(len(p) / n_real)
        else:
            assert len(p) >= 17  # near the cap of 20 on long inputs
    total = sum(outcomes.values())
    assert total > 2000
    assert abs(outcomes["mask"] / total - 0.8) < 0.05
    assert abs(outcomes["random"] / total - 0.1) < 0.05
    assert abs(outcomes["keep"] / total - 0.1) < 0.05
    assert 0.12 < np.mean(ratios) < 0.17


def test_whole_word_groups_masked_together(examples):
    checked = 0
    for e in examples:
        orig, sep, L = e["orig"], e["sep"], e["L"]
        masked = set(e["pos"].tolist())
        for off, end in ((1, sep), (sep + 1, L - 1)):
            row = SENT[sid_of(orig[off:end])]
            n = end - off
            for s, t in zip(row["group_starts"].tolist(), row["group_ends"].tolist()):
                if t > n:
                    continue  # cut by truncation: its remaining tokens are single units
                span = range(off + s, off + t)
                hit = [q in masked for q in span]
                assert all(hit) or not any(hit)
                if all(hit):
                    checked += 1
                    got, was = e["ids"][off + s : off + t], orig[off + s : off + t]
                    # one draw per unit: all [MASK], all kept, or all random
                    assert (got == MASK).all() or (got == was).all() or not ((got == MASK) | (got == was)).any()
    assert checked > 50


def test_no_word_overlapping_a_masked_position_survives(examples):
    """The leak: a masked unit is a lexicon word, so its word id (and any word bridging into it) would tell
    the encoder the answer. Every word overlapping a masked position is gone from every slot; the rest stay."""
    removed = kept = 0
    for e in examples:
        words, L = e["words"], e["L"]
        exp, hit = expected_words(e)
        assert np.array_equal(words[:L], exp)
        assert not (words[e["pos"]] > 0).any()  # any word in a masked position's slots covers it
        removed += len(hit)
        kept += int((words[:L] > 0).any(axis=1).sum())
    assert removed > 200 and kept > 5 * removed  # words removed, yet most positions keep theirs


def test_a_masked_word_is_removed_from_every_slot_of_the_example():
    """The same word id occurring twice (A and B): masking one occurrence removes both."""
    toks_a, toks_b = 6 + np.arange(10), 6 + 1000 + np.arange(10)
    rows = []
    for doc, toks in (("d0", toks_a), ("d0", toks_b)):
        wid, ws, we = word_slots(toks, [2], [4])
        wid[wid > 0] = 77  # one word type in both sentences
        rows.append({"doc_id": doc, "n_tokens": 10, "char_ids": toks.astype(np.int32), "word_ids": wid.reshape(-1),
                     "word_starts": ws.reshape(-1), "word_ends": we.reshape(-1),
                     "group_starts": np.array([2], np.int32), "group_ends": np.array([4], np.int32)})
    seen = {"reference": 0, "packed": 0}
    for seed in range(100):
        c = cfg(nsp_random_prob=0.0, mask_prob=0.1, seed=seed, batch_size=1)
        ref = [(ex.mlm_positions, ex.word_ids) for ex in iter_examples(rows, c, VOCAB, W, np.random.default_rng(seed))]
        packed = [(b.mlm_positions.numpy(), b.word_ids[0].numpy()) for b in batches(c, "packed", rows=rows)]
        for loader, got in (("reference", ref), ("packed", packed)):
            for positions, words in got:
                hit_word = any(p in (3, 4, 14, 15) for p in positions.tolist())  # A's group at 3-4, B's at 14-15
                hit_bridge = any(p in (5, 16) for p in positions.tolist())  # the bridges' other tokens
                assert (words == 77).any() == (not (hit_word or hit_bridge))
                seen[loader] += hit_word
    assert min(seen.values()) > 10, seen


def test_nsp_pairs(examples):
    labels = []
    for e in examples:
        orig, sep, L = e["orig"], e["sep"], e["L"]
        a, b = SENT[sid_of(orig[1:sep])], SENT[sid_of(orig[sep + 1 : L - 1])]
        if e["nsp"] == 0:
            assert a["doc_id"] == b["doc_id"] and b["sent_idx"] == a["sent_idx"] + 1
        else:
            assert a["doc_id"] != b["doc_id"]
        # A and B are prefixes of their sentences
        assert np.array_equal(orig[1:sep], a["char_ids"][: sep - 1])
        assert np.array_equal(orig[sep + 1 : L - 1], b["char_ids"][: L - 2 - sep])
        labels.append(e["nsp"])
    assert abs(np.mean(labels) - 0.5) < 0.07


def test_nsp_fallbacks_with_empty_ring():
    c = cfg(nsp_random_prob=1.0)
    docs = sorted({r["doc_id"] for r in ROWS}, key=lambda d: int(d[3:]))
    d0 = [r for r in ROWS if r["doc_id"] == docs[0]]
    d1 = [r for r in ROWS if r["doc_id"] == docs[1]]
    assert len(d0) >= 2
    ex = list(iter_examples(d0 + d1, c, VOCAB, W, np.random.default_rng(0)))
    # no other document seen yet: doc 0 falls back to IsNext and its last sentence is not an A;
    # doc 1 then draws NotNext from the ring for every sentence, its last one included
    assert [e.nsp_label for e in ex] == [0] * (len(d0) - 1) + [1] * len(d1)


@pytest.mark.parametrize("loader", LOADERS)
def test_padding_and_dynamic_length(loader):
    for batch in batches(cfg(), loader):
        B, T = batch.input_ids.shape
        lengths = batch.attention_mask.sum(1)
        assert int(lengths.max()) == T
        assert batch.n_real_tokens == int(lengths.sum())
        pad = ~batch.attention_mask
        assert (batch.input_ids[pad] == 0).all() and (batch.word_ids[pad] == 0).all()
        assert (batch.segment_ids[pad] == 0).all()
        assert batch.input_ids.dtype == torch.int64 and batch.word_ids.shape == (B, T, W)
        assert batch.attention_mask.dtype == torch.bool
        assert (batch.mlm_positions < B * T).all() and (torch.diff(batch.mlm_positions) > 0).all()
        assert batch.attention_mask.flatten()[batch.mlm_positions].all()
        assert batch.nsp_labels.shape == (B,)
    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.n_real_tokens == batch.n_real_tokens


@pytest.mark.parametrize("loader", LOADERS)
def test_bucketing_groups_similar_lengths(loader):
    def mean_span(c):
        lens = [b.attention_mask.sum(1) for b in batches(c, loader)]
        return np.mean([int(x.max() - x.min()) for x in lens])

    # a pool of one batch is plain shuffling; a pool of 8 batches sorted by length is much tighter
    assert mean_span(cfg(bucket_batches=8)) < 0.5 * mean_span(cfg(bucket_batches=1))


@pytest.mark.parametrize("loader", LOADERS)
def test_all_examples_batched_last_partial_kept(loader):
    c = cfg(batch_size=7, bucket_batches=3, nsp_random_prob=0.0)
    n_ex = len(ROWS) - len({r["doc_id"] for r in ROWS})  # all IsNext: every sentence with a successor
    assert n_ex % 7
    sizes = [b.input_ids.shape[0] for b in batches(c, loader)]
    assert sum(sizes) == n_ex and max(sizes) == 7 and sizes.count(7) == len(sizes) - 1


def _same(x: Batch, y: Batch) -> bool:
    return all(
        torch.equal(getattr(x, k), getattr(y, k))
        for k in ("input_ids", "segment_ids", "attention_mask", "word_ids", "mlm_positions", "mlm_labels", "nsp_labels")
    )


def test_determinism_epochs_and_resume():
    c = cfg()
    a = list(iter_batches(ROWS, c, VOCAB, W, 0))
    b = list(iter_batches(iter(ROWS), c, VOCAB, W, 0))
    assert len(a) == len(b) > 10 and all(_same(x, y) for x, y in zip(a, b))
    other = list(iter_batches(ROWS, c, VOCAB, W, 1))
    assert not all(x.input_ids.shape == y.input_ids.shape and _same(x, y) for x, y in zip(a, other))
    k = 7
    tail = list(iter_batches(ROWS, c, VOCAB, W, 0, start_batch=k))
    assert len(tail) == len(a) - k and all(_same(x, y) for x, y in zip(a[k:], tail))
    tail2 = list(skip(iter_batches(ROWS, c, VOCAB, W, 0), k))
    assert all(_same(x, y) for x, y in zip(a[k:], tail2))
    reseeded = list(iter_batches(ROWS, cfg(seed=9), VOCAB, W, 0))
    assert not all(x.input_ids.shape == y.input_ids.shape and _same(x, y) for x, y in zip(a, reseeded))


def test_segment_ids(examples):
    for e in examples:
        seg, sep, L = e["seg"], e["sep"], e["L"]
        assert (seg[: sep + 1] == 0).all() and (seg[sep + 1 : L] == 1).all() and (seg[L:] == 0).all()
        assert e["orig"][0] == CLS and e["orig"][L - 1] == SEP


@pytest.mark.parametrize("loader", LOADERS)
def test_truncation_keeps_alignment(loader):
    rows = make_rows(n_docs=30, seed=3, min_len=30, max_len=120)
    global SENT
    saved, SENT = SENT, {(int(r["char_ids"][0]) - 6) // STRIDE: r for r in rows}
    try:
        c = cfg(max_seq_len=48)
        n = 0
        for batch in batches(c, loader, rows=rows):
            assert batch.input_ids.shape[1] <= 48
            for e in unpack(batch):
                orig, sep, L = e["orig"], e["sep"], e["L"]
                assert L == 48  # every pair is longer than the budget
                la, lb = sep - 1, L - sep - 2
                assert abs(la - lb) <= 1 or min(la, lb) == min(
                    SENT[sid_of(orig[1:sep])]["n_tokens"], SENT[sid_of(orig[sep + 1 : L - 1])]["n_tokens"])
                assert np.array_equal(e["words"][:L], expected_words(e)[0])
                assert (e["words"][[0, sep, L - 1]] == 0).all()
                n += 1
        assert n > 50
    finally:
        SENT = saved


def test_truncate_matches_one_token_at_a_time():
    def slow(la, lb, budget):
        while la + lb > budget:
            if la > lb:
                la -= 1
            else:
                lb -= 1
        return la, lb

    for la in range(0, 40, 3):
        for lb in range(0, 40, 2):
            for budget in (5, 17, 30, 125):
                assert _truncate(la, lb, budget) == slow(la, lb, budget)


def test_shuffle_buffer_permutes_and_bounds_lookahead():
    rng = np.random.default_rng(0)
    consumed = []

    def src():
        for i in range(100):
            consumed.append(i)
            yield i

    it = shuffle_buffer(src(), 10, rng)
    first = next(it)
    assert len(consumed) == 11 and first < 10
    assert sorted([first, *it]) == list(range(100))


def test_streaming_is_bounded():
    c = cfg(shuffle_buffer=16, bucket_batches=2, batch_size=4)
    consumed = 0

    def src():
        nonlocal consumed
        for r in ROWS:
            consumed += 1
            yield r

    next(iter_batches(src(), c, VOCAB, W, 0))
    assert consumed <= 16 + 2 * 4 + 3 < len(ROWS)


def test_iter_rows_from_artifact():
    store = ArtifactStore(f"memory://pt-{uuid.uuid4().hex}/store")
    w = begin(store, "lexicon", "v1")
    schema = pa.schema([
        ("doc_id", pa.string()), ("sent_idx", pa.int32()), ("text", pa.string()), ("n_tokens", pa.int32()),
        ("char_ids", pa.list_(pa.int32())), ("word_ids", pa.list_(pa.int32())),
        ("word_starts", pa.list_(pa.int32())), ("word_ends", pa.list_(pa.int32())),
        ("group_starts", pa.list_(pa.int32())), ("group_ends", pa.list_(pa.int32())),
    ])
    rows = ROWS[:50]
    files = {}
    for i, part in enumerate((rows[:20], rows[20:])):
        lists = ("char_ids", "word_ids", "word_starts", "word_ends", "group_starts", "group_ends")
        data = [{**r, "text": "x", **{k: r[k].tolist() for k in lists}} for r in part]
        rel = f"shards/part-{i:05d}.parquet"
        files[rel] = write_table(w, rel, pa.Table.from_pylist(data, schema=schema), row_group_rows=7)
    art = w.commit(code_version="t", config={}, parents=[], stats={"in": 50, "out": 50, "rejected": {}},
                   metrics={"max_word_num": W}, rows=files)
    assert max_word_num(art) == W
    got = list(iter_rows(art))
    assert len(got) == 50
    for g, r in zip(got, rows):
        assert g["doc_id"] == r["doc_id"] and g["n_tokens"] == r["n_tokens"]
        for k in ("char_ids", "word_ids", "word_starts", "word_ends", "group_starts", "group_ends"):
            assert np.array_equal(g[k], r[k])
    c = cfg()
    from_art, direct = iter_batches(iter_rows(art), c, VOCAB, W, 0), iter_batches(rows, c, VOCAB, W, 0)
    assert all(_same(x, y) for x, y in zip(from_art, direct))
