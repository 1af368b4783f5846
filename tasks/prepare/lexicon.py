"""lexicon: match every character against the trie and write the matched Parquet shards.

Two map steps around one reduce, so work parallelises over shards while word ids stay
deterministic: (1) match each numbers shard -> ``_work`` part holding word *ranks*;
(2) the union of matched ranks, sorted, is the word vocabulary (ids 2..; 0=[PAD], 1=[UNK])
with its embedding matrix; (3) each part's ranks are remapped to ids -> ``shards/``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from storage.parquet import iter_batches, write_rows
from tasks.common.config import LexiconConfig
from tasks.common.stage import StageResult, run_map, shard_task
from tasks.prepare.matcher import (
    CompiledTrie,
    find_matches,
    fmm_segments,
    slot_spans,
    text_codepoints,
    top_k_ranks,
)
from tasks.prepare.numbers import NUM_CHAR, to_token_string
from tasks.prepare.tencent import load_embeddings
from tasks.prepare.trie import load_compiled
from tasks.prepare.vocab import parse_vocab, token_ids, vocab_bytes

CODE_VERSION = "lexicon-2"  # 2: word_starts/word_ends per slot; min_word_len is read
WORD_SPECIALS = ("[PAD]", "[UNK]")

SHARD_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("sent_idx", pa.int32()),
        ("text", pa.string()),
        ("n_tokens", pa.int32()),
        ("char_ids", pa.list_(pa.int32())),
        ("word_ids", pa.list_(pa.int32())),  # flat [n_tokens * max_word_num], 0 = [PAD]
        ("word_starts", pa.list_(pa.int32())),  # flat like word_ids: token span [start, end) of the slot's
        ("word_ends", pa.list_(pa.int32())),  # word occurrence covering that token; [0, 0) for [PAD]
        ("group_starts", pa.list_(pa.int32())),  # whole-word units, token spans [start, end)
        ("group_ends", pa.list_(pa.int32())),
    ]
)
_WORK_SCHEMA = pa.schema(
    [f if f.name != "word_ids" else pa.field("word_ranks", pa.list_(pa.int32())) for f in SHARD_SCHEMA]
)


def whole_word_groups(
    tokens: str, en_spans: list[tuple[int, int]], lex_spans: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Non-overlapping masking units: English words and ``#NUM#`` first, then lexicon (FMM) words."""
    taken = np.zeros(len(tokens) + 1, dtype=bool)
    groups = list(en_spans) + [(i, i + 1) for i, c in enumerate(tokens) if c == NUM_CHAR]
    for s, e in groups:
        taken[s:e] = True
    for s, e in lex_spans:
        if not taken[s:e].any():
            groups.append((s, e))
            taken[s:e] = True
    return sorted(groups)


def match_rows(
    rows: list[dict[str, Any]], ct: CompiledTrie, vocab_index: dict[str, int], k: int, min_len: int = 2
) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Match a batch of numbers rows in one jitted pass (words of >= ``min_len`` tokens).
    Returns work rows and the ranks seen."""
    toks = [to_token_string(r["text"]) for r in rows]
    if not toks:
        return [], np.zeros(0, np.int32)
    cps = text_codepoints("\x00".join(toks))
    starts, lengths, ranks = find_matches(cps, ct, min_len)
    top = top_k_ranks(len(cps), starts, lengths, ranks, k)
    w_start, w_end = slot_spans(top, starts, lengths, ranks)  # [C, k] absolute in cps
    fmm = fmm_segments(len(cps), starts, lengths)
    out, off, j = [], 0, 0
    for r, t in zip(rows, toks):
        end = off + len(t)
        lex = []
        while j < len(fmm) and fmm[j][0] < end:
            lex.append((fmm[j][0] - off, fmm[j][1] - off))
            j += 1
        groups = whole_word_groups(t, list(zip(r["en_starts"], r["en_ends"])), lex)
        filled = top[off:end] >= 0
        out.append(
            {
                "doc_id": r["doc_id"],
                "sent_idx": r["sent_idx"],
                "text": r["text"],
                "n_tokens": len(t),
                "char_ids": token_ids(t, vocab_index),
                "word_ranks": top[off:end].reshape(-1).tolist(),
                "word_starts": np.where(filled, w_start[off:end] - off, 0).reshape(-1).tolist(),
                "word_ends": np.where(filled, w_end[off:end] - off, 0).reshape(-1).tolist(),
                "group_starts": [s for s, _ in groups],
                "group_ends": [e for _, e in groups],
            }
        )
        off = end + 1
    seen = np.unique(ranks).astype(np.int32) if len(ranks) else np.zeros(0, np.int32)
    return out, seen


def match_shard(
    numbers_art, rel: str, ct: CompiledTrie, vocab_index: dict[str, int], k: int, writer, out_rel: str,
    min_len: int = 2,
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for batch in iter_batches(numbers_art, rel):
        rows.extend(batch.to_pylist())
    work, seen = match_rows(rows, ct, vocab_index, k, min_len)
    write_rows(writer, out_rel, work, _WORK_SCHEMA)
    covered = sum(sum(1 for i in range(0, len(w["word_ranks"]), k) if w["word_ranks"][i] >= 0) for w in work)
    tokens = sum(w["n_tokens"] for w in work)
    return {"rel": out_rel, "rows": len(work), "tokens": tokens, "covered": covered, "ranks": seen}


def word_vocab(
    rank_sets: list[np.ndarray], emb_words: list[str], emb_vectors: np.ndarray, seed: int
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Sorted matched ranks, the word list (with specials) and its float32 matrix.

    Rows come from the Tencent vectors where the word has one; [UNK] and any word without a
    vector get seeded uniform(-sqrt(3/d), sqrt(3/d)); [PAD] is zeros.
    """
    ranks = np.unique(np.concatenate(rank_sets)) if rank_sets else np.zeros(0, np.int32)
    d = emb_vectors.shape[1]
    rng = np.random.default_rng(seed)
    scale = np.sqrt(3.0 / d)
    mat = rng.uniform(-scale, scale, size=(len(ranks) + len(WORD_SPECIALS), d)).astype(np.float32)
    mat[0] = 0.0
    words = list(WORD_SPECIALS) + [emb_words[r] for r in ranks.tolist()]
    has_vec = ranks < len(emb_vectors)
    idx = np.nonzero(has_vec)[0]
    mat[idx + len(WORD_SPECIALS)] = np.asarray(emb_vectors[ranks[has_vec]], dtype=np.float32)
    return ranks, words, mat


def finalize_shard(writer, work_rel: str, out_rel: str, sorted_ranks: np.ndarray) -> int:
    """Remap a work part's ranks to word ids and write the final shard; removes the part."""
    rows = []
    for batch in iter_batches(writer, work_rel):
        for r in batch.to_pylist():
            wr = np.asarray(r.pop("word_ranks"), dtype=np.int64)
            ids = np.searchsorted(sorted_ranks, wr) + len(WORD_SPECIALS)
            r["word_ids"] = np.where(wr < 0, 0, ids).astype(np.int32).tolist()
            rows.append(r)
    n = write_rows(writer, out_rel, rows, SHARD_SCHEMA)
    writer.fs.rm(writer.file_path(work_rel))
    return n


def load_vocab_index(art) -> dict[str, int]:
    return {t: i for i, t in enumerate(parse_vocab(art.read_verified("vocab.txt")))}


# ----------------------------------------------------------------------------- Prefect wrappers


def match_shard_task(
    store_uri: str, version: str, numbers_uri: str, rel: str, trie_uri: str, vocab_uri: str, k: int, out_rel: str,
    min_len: int = 2,
) -> dict[str, Any]:
    writer = ArtifactStore(store_uri).attach("lexicon", version)
    ct = load_compiled(open_artifact(trie_uri))
    return match_shard(
        open_artifact(numbers_uri), rel, ct, load_vocab_index(open_artifact(vocab_uri)), k, writer, out_rel, min_len
    )


def finalize_shard_task(store_uri: str, version: str, work_rel: str, out_rel: str, sorted_ranks: np.ndarray) -> int:
    return finalize_shard(ArtifactStore(store_uri).attach("lexicon", version), work_rel, out_rel, sorted_ranks)


# ----------------------------------------------------------------------------- the stage


def build(
    writer,
    version: str,
    *,
    numbers_ref: ArtifactRef,
    vocab_ref: ArtifactRef,
    emb_ref: ArtifactRef,
    trie_ref: ArtifactRef,
    cfg: LexiconConfig,
) -> StageResult:
    """Match every numbers shard (one task each), build the word vocabulary from the matched ranks
    (words.txt, word_vectors.npy), then remap each shard's ranks to word ids (one task each)."""
    store_uri, k = writer.store.uri, cfg.max_word_num
    src = open_artifact(numbers_ref)
    seen = [np.zeros(0, np.int32)]  # union of matched ranks, folded in as shards complete

    def fold(res):
        seen[0] = np.union1d(seen[0], res.pop("ranks"))
        return res

    items = [
        dict(
            store_uri=store_uri,
            version=version,
            numbers_uri=src.uri,
            rel=r,
            trie_uri=trie_ref.uri,
            vocab_uri=vocab_ref.uri,
            k=k,
            out_rel=f"_work/{i:05d}.parquet",
            min_len=cfg.min_word_len,
        )
        for i, r in enumerate(src.files("shards/"))
    ]
    matched = run_map(shard_task(match_shard_task, "lexicon-match"), items, "lexicon", fold=fold)
    emb = open_artifact(emb_ref)
    emb_words, emb_vectors = load_embeddings(emb.fs, emb.path, mmap=True)
    ranks, words, mat = word_vocab(seen, emb_words, emb_vectors, cfg.seed)
    writer.write_bytes("words.txt", vocab_bytes(words))
    with writer.open("word_vectors.npy") as f:
        np.save(f, mat)
    out_rels = [f"shards/part-{i:05d}.parquet" for i in range(len(matched))]
    items = [
        dict(store_uri=store_uri, version=version, work_rel=m["rel"], out_rel=o) for m, o in zip(matched, out_rels)
    ]
    n_out = run_map(shard_task(finalize_shard_task, "lexicon-finalize"), items, "lexicon-finalize",
                    shared={"sorted_ranks": ranks})  # one copy per worker, not one per shard
    tokens = sum(m["tokens"] for m in matched)
    metrics = {
        "word_vocab": len(words),
        "dim": int(mat.shape[1]),
        "tokens": tokens,
        "char_coverage": round(sum(m["covered"] for m in matched) / max(tokens, 1), 6),
        "max_word_num": k,
        "min_word_len": cfg.min_word_len,
        "seed": cfg.seed,
    }
    return StageResult(
        stats={"in": sum(m["rows"] for m in matched), "out": int(sum(n_out)), "rejected": {}},
        metrics=metrics,
        rows={**dict(zip(out_rels, n_out)), "words.txt": len(words)},
    )
