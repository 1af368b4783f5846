"""lexicon: match every character against the trie and write the matched Parquet shards.

Two map steps around one reduce, so work parallelises over shards while word ids stay
deterministic: (1) walk each numbers shard for the word *ranks* it matches (the matches are kept in
``_work/``, 12 bytes each); (2) the union of matched ranks, sorted, is the word vocabulary (ids 2..;
0=[PAD], 1=[UNK]) with its embedding matrix; (3) finish each shard from its kept matches (top-k, spans,
groups) and write it with word ids -> ``shards/``.

A shard is matched in one pass over flat arrays (:func:`match_table`): codepoints straight from the
Arrow text buffer, the jitted walk / top-k / spans / FMM / whole-word groups over the whole shard,
and the list columns built from flat buffers plus offsets, with no per-row or per-character Python.
The shard bytes are those of the per-row path it replaced (kept with the tests, ``tests/lexicon_reference.py``).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.artifacts import ArtifactRef, StagingHandle, open_artifact
from storage.parquet import read_table, write_table
from tasks.common.context import StageContext
from tasks.common.stage import Stage, StageResult
from tasks.prepare.config import LexiconConfig
from tasks.prepare.numbers import SCHEMA as NUMBERS_SCHEMA_FULL
from tasks.text.embedding_files import VectorRows, load_embedding_words
from tasks.text.match_kernels import fmm_spans, shard_slots, utf8_token_codepoints, word_groups
from tasks.text.matcher import CompiledTrie, find_matches, load_compiled, slot_spans, top_k_ranks
from tasks.text.numbers import NUM_CHAR
from tasks.text.vocab import NUM, NUM_ID, UNK, parse_vocab, vocab_bytes

CODE_VERSION = "lexicon-2"  # bump when the same inputs give other bytes
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


NUMBERS_COLUMNS = ["doc_id", "sent_idx", "text", "en_starts", "en_ends"]  # what the stage reads
NUMBERS_SCHEMA = pa.schema([NUMBERS_SCHEMA_FULL.field(c) for c in NUMBERS_COLUMNS])


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


def char_id_table(vocab_index: dict[str, int]) -> np.ndarray:
    """int32 codepoint -> character id, as :func:`tasks.prepare.vocab.token_ids` maps a token: ``U+E000``
    (``#NUM#``) -> ``#NUM#``'s id, a one-character vocab entry -> its id, anything else -> ``[UNK]``. Codepoints
    past the table's end are ``[UNK]`` too."""
    unk, num = vocab_index.get("[UNK]", UNK), vocab_index.get(NUM, NUM_ID)  # an imported vocabulary's ids
    singles = [(ord(t), i) for t, i in vocab_index.items() if len(t) == 1]
    top = max([cp for cp, _ in singles] + [ord(NUM_CHAR)])
    table = np.full(top + 1, unk, dtype=np.int32)
    for cp, i in singles:
        table[cp] = i
    table[ord(NUM_CHAR)] = num
    table[0] = unk  # the separator between texts, never a token: match_table reads [UNK]'s id here
    return table


def token_codepoints(text: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The token strings (``#NUM#`` -> ``U+E000``) of a string column, straight from its Arrow buffers, joined
    by the separator 0 as one int32 codepoint array; with each row's start in it and its length (tokens)."""
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks() if text.num_chunks != 1 else text.chunk(0)
    if text.null_count:
        raise ValueError(f"lexicon: {text.null_count} rows have no text (null) in the numbers shard")
    if pa.types.is_string(text.type):
        offs = np.frombuffer(text.buffers()[1], np.int32, len(text) + 1, text.offset * 4).astype(np.int64)
    elif pa.types.is_large_string(text.type):
        offs = np.frombuffer(text.buffers()[1], np.int64, len(text) + 1, text.offset * 8)
    else:
        raise TypeError(f"lexicon: the text column is {text.type}, expected a string column")
    buf = text.buffers()[2]
    data = np.frombuffer(buf, np.uint8) if buf is not None and buf.size else np.zeros(1, np.uint8)
    cps, row_start, row_len, bad = utf8_token_codepoints(data, offs)
    if bad >= 0:
        raise ValueError(f"lexicon: row {bad} of the numbers shard is not valid UTF-8 text")
    return cps, row_start, row_len


def _list_array(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
    """list<int32> from int64 row offsets and flat values (no copies beyond the int32 casts)."""
    if len(offsets) and offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"lexicon: {offsets[-1]:,} list values in one shard overflow int32 offsets; use smaller "
                         "shards (prepare.clean.shard_rows)")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values.astype(np.int32)))


def _plain_column(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    return col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)


def _groups(table: pa.Table, cps, row_start, row_len, fmm: np.ndarray):
    """Whole-word groups of every row (flat starts, ends, int64 offsets): the jitted kernel, or, for a shard
    whose English spans the kernel does not take (unequal lists, nulls, spans outside the row),
    :func:`whole_word_groups` row by row (same result)."""
    es, ee = _plain_column(table, "en_starts"), _plain_column(table, "en_ends")
    n = len(table)
    ok = es.null_count == ee.null_count == es.values.null_count == ee.values.null_count == 0
    if ok:
        es_off, ee_off = es.offsets.to_numpy().astype(np.int64), ee.offsets.to_numpy().astype(np.int64)
        es_v = es.values.to_numpy(zero_copy_only=False)[es_off[0]: es_off[-1]] if n else np.zeros(0, np.int32)
        ee_v = ee.values.to_numpy(zero_copy_only=False)[ee_off[0]: ee_off[-1]] if n else np.zeros(0, np.int32)
        ok = (np.array_equal(es_off - es_off[0], ee_off - ee_off[0])
              and not (es_v.size and (es_v.min() < 0 or ee_v.min() < 0))
              and bool(np.all(ee_v <= np.repeat(row_len, np.diff(ee_off)))))
    if ok:
        return word_groups(cps, row_start, row_len, np.ascontiguousarray(es_v, np.int32),
                           np.ascontiguousarray(ee_v, np.int32), es_off - es_off[0], fmm, ord(NUM_CHAR))
    starts, ends, offs, j = [], [], [0], 0
    tok = cps.tobytes()
    for r, (s_list, e_list) in enumerate(zip(es.to_pylist(), ee.to_pylist())):
        a, b = int(row_start[r]), int(row_start[r] + row_len[r])
        t = tok[4 * a: 4 * b].decode("utf-32-le")
        lex = []
        while j < len(fmm) and fmm[j, 0] < b:
            lex.append((int(fmm[j, 0]) - a, int(fmm[j, 1]) - a))
            j += 1
        groups = whole_word_groups(t, list(zip(s_list, e_list)), lex)
        starts += [s for s, _ in groups]
        ends += [e for _, e in groups]
        offs.append(len(starts))
    return np.asarray(starts, np.int32), np.asarray(ends, np.int32), np.asarray(offs, np.int64)


def match_table(
    table: pa.Table, ct: CompiledTrie, char_table: np.ndarray, k: int, min_len: int = 2,
    sorted_ranks: np.ndarray | None = None, kept: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[pa.Table, np.ndarray, int]:
    """Match every row of a numbers table in one pass over flat arrays, with no per-row Python.

    Returns ``(table, ranks seen, covered tokens)``. With ``sorted_ranks`` (the union of every shard's
    matched ranks) the table is a final shard (:data:`SHARD_SCHEMA`, ``word_ids``); without, a work table
    (``word_ranks``: the matched ranks, ``-1`` for ``[PAD]``) and the sorted distinct ranks matched (None for
    a final shard). The values of ``tests/lexicon_reference.py``'s ``match_rows``, row by row.
    ``kept``: the number of codepoints and the ``find_matches`` result that :func:`shard_ranks` kept for this
    table, used when the codepoint count agrees (else the walk runs again).
    """
    cps, row_start, row_len = token_codepoints(table.column("text"))
    if kept is not None and kept[0] == len(cps):
        starts, lengths, ranks = kept[1:]
    else:
        starts, lengths, ranks = find_matches(cps, ct, min_len)
    top = top_k_ranks(len(cps), starts, lengths, ranks, k)
    w_start, w_end = slot_spans(top, starts, lengths, ranks)  # [C, k] absolute in cps
    fmm = fmm_spans(len(cps), starts, lengths.astype(np.int64))
    g_start, g_end, g_off = _groups(table, cps, row_start, row_len, fmm)
    tok_off = np.zeros(len(table) + 1, dtype=np.int64)
    np.cumsum(row_len, out=tok_off[1:])
    if sorted_ranks is None:
        id_of_rank, schema, name = np.zeros(0, np.int32), _WORK_SCHEMA, "word_ranks"
    else:
        id_of_rank, schema, name = _id_of_rank(sorted_ranks, top), SHARD_SCHEMA, "word_ids"
    char_ids, words, word_starts, word_ends, covered = shard_slots(
        cps, top, w_start, w_end, row_start, row_len, id_of_rank, char_table, int(char_table[0]))
    if sorted_ranks is not None and words.size and words.min() < 0:
        raise ValueError("lexicon: a shard matched a word rank that is not in the union of matched ranks")
    columns = {
        "doc_id": _plain_column(table, "doc_id"),
        "sent_idx": _plain_column(table, "sent_idx"),
        "text": _plain_column(table, "text"),
        "n_tokens": pa.array(row_len.astype(np.int32)),
        "char_ids": _list_array(tok_off, char_ids),
        name: _list_array(tok_off * k, words),
        "word_starts": _list_array(tok_off * k, word_starts),
        "word_ends": _list_array(tok_off * k, word_ends),
        "group_starts": _list_array(g_off, g_start),
        "group_ends": _list_array(g_off, g_end),
    }
    out = pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
    return out, (_unique(ranks) if sorted_ranks is None else None), int(covered)


def _unique(ranks: np.ndarray) -> np.ndarray:
    """Sorted distinct ranks (int32), by marking them in a table as long as the largest: no sort."""
    if not len(ranks):
        return np.zeros(0, np.int32)
    mark = np.zeros(int(ranks.max()) + 1, dtype=bool)
    mark[ranks] = True
    return np.flatnonzero(mark).astype(np.int32)


def _id_of_rank(sorted_ranks: np.ndarray, top: np.ndarray) -> np.ndarray:
    """int32 rank -> word id (``2 + `` its index in ``sorted_ranks``), -1 for a rank not in it; covers every
    rank in ``top``."""
    sorted_ranks = np.asarray(sorted_ranks, dtype=np.int64)
    size = max(int(top.max()) if top.size else -1, int(sorted_ranks[-1]) if sorted_ranks.size else -1) + 1
    lut = np.full(size, -1, dtype=np.int32)
    lut[sorted_ranks] = np.arange(len(WORD_SPECIALS), len(sorted_ranks) + len(WORD_SPECIALS), dtype=np.int32)
    return lut


def match_rows(
    rows: list[dict[str, Any]], ct: CompiledTrie, vocab_index: dict[str, int], k: int, min_len: int = 2
) -> tuple[list[dict[str, Any]], np.ndarray]:
    """Match numbers rows (dicts): work rows (``word_ranks``) and the ranks seen, by :func:`match_table`."""
    table = pa.Table.from_pylist(rows, schema=NUMBERS_SCHEMA)
    out, seen, _ = match_table(table, ct, char_id_table(vocab_index), k, min_len)
    return out.to_pylist(), seen


def shard_ranks(numbers_art, rel: str, ct: CompiledTrie, min_len: int = 2, writer=None,
                work_rel: str | None = None) -> dict[str, Any]:
    """Map step 1: the ranks a numbers shard matches (the walk alone), and its rows. With ``writer`` the
    matches are kept in the staging directory at ``work_rel`` for :func:`finalize_shard` (12 bytes a match,
    written in a few ms where the walk takes tens)."""
    text = read_table(numbers_art, rel, columns=["text"]).column("text")
    cps, _, _ = token_codepoints(text)
    starts, lengths, ranks = find_matches(cps, ct, min_len)
    if writer is not None:
        buf = io.BytesIO()
        np.savez(buf, n=np.asarray([len(cps)], np.int64), starts=starts.astype(np.int32), lengths=lengths,
                 ranks=ranks)
        writer.write_bytes(work_rel, buf.getvalue())
    return {"rows": len(text), "ranks": _unique(ranks)}


def _kept_matches(writer, work_rel: str | None):
    """``(codepoints, starts, lengths, ranks)`` that :func:`shard_ranks` kept, or None when there are none
    (no ``work_rel``, or a retried task that had removed them)."""
    if work_rel is None or not writer.fs.exists(writer.file_path(work_rel)):
        return None
    with writer.fs.open(writer.file_path(work_rel), "rb") as f:
        data = f.read()
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return int(z["n"][0]), z["starts"].astype(np.int64), z["lengths"], z["ranks"]


def finalize_shard(
    numbers_art, rel: str, ct: CompiledTrie, char_table: np.ndarray, k: int, writer, out_rel: str,
    sorted_ranks: np.ndarray, min_len: int = 2, work_rel: str | None = None,
) -> dict[str, Any]:
    """Map step 2: match a numbers shard (reusing step 1's matches kept at ``work_rel`` when they are there,
    then removing them) and write its final shard (word ids from ``sorted_ranks``)."""
    table = read_table(numbers_art, rel, columns=NUMBERS_COLUMNS)
    kept = _kept_matches(writer, work_rel)
    out, _, covered = match_table(table, ct, char_table, k, min_len, np.asarray(sorted_ranks), kept)
    n = write_table(writer, out_rel, out)
    if kept is not None:
        writer.fs.rm(writer.file_path(work_rel))
    return {"rel": out_rel, "rows": n, "tokens": int(pc.sum(out.column("n_tokens")).as_py() or 0),
            "covered": covered}


def word_vocab(
    rank_sets: list[np.ndarray], emb_words: list[str], emb_vectors: np.ndarray | VectorRows, seed: int
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Sorted matched ranks, the word list (with specials) and its float32 matrix (``emb_vectors`` is indexed
    once, with the ascending ranks that have a vector).

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


def load_vocab_index(art) -> dict[str, int]:
    """Character -> id of a vocab artifact (checksum-verified)."""
    return {t: i for i, t in enumerate(parse_vocab(art.read_verified("vocab.txt")))}


def load_char_table(art) -> np.ndarray:
    """:func:`char_id_table` of a vocab artifact (checksum-verified)."""
    return char_id_table(load_vocab_index(art))


# ----------------------------------------------------------------------------- shard task entry points


def match_shard_task(staging: StagingHandle, numbers_uri: str, rel: str, trie_uri: str, work_rel: str,
                     min_len: int = 2) -> dict[str, Any]:
    """Pass 1 of one numbers shard: the trie ranks it matches, staged under ``work_rel`` (a shard task)."""
    ct = load_compiled(open_artifact(trie_uri), with_words=False)
    return shard_ranks(open_artifact(numbers_uri), rel, ct, min_len, staging.writer(), work_rel)


def finalize_shard_task(
    staging: StagingHandle, numbers_uri: str, rel: str, trie_uri: str, work_rel: str, vocab_uri: str, k: int,
    out_rel: str, sorted_ranks: np.ndarray, min_len: int = 2,
) -> dict[str, Any]:
    """Pass 2 of one numbers shard: its matched Parquet shard in the final word ids (a shard task)."""
    ct = load_compiled(open_artifact(trie_uri), with_words=False)
    return finalize_shard(open_artifact(numbers_uri), rel, ct, load_char_table(open_artifact(vocab_uri)), k,
                          staging.writer(), out_rel, sorted_ranks, min_len, work_rel)


# ----------------------------------------------------------------------------- the stage


def build(ctx: StageContext, numbers_ref: ArtifactRef, vocab_ref: ArtifactRef, emb_ref: ArtifactRef,
          trie_ref: ArtifactRef) -> StageResult:
    """Find the ranks every numbers shard matches (one task each; its matches are kept in ``_work/``), build
    the word vocabulary from their union (words.txt, word_vectors.npy), then finish matching each shard from
    its kept matches and write it with word ids (one task each; the ``_work`` file is removed)."""
    cfg, writer = ctx.cfg, ctx.writer
    k = cfg.max_word_num
    src = open_artifact(numbers_ref)
    seen = [np.zeros(0, np.int32)]  # union of matched ranks, folded in as shards complete

    def fold(res):
        seen[0] = np.union1d(seen[0], res.pop("ranks"))
        return res

    rels = src.files("shards/")
    common = dict(staging=ctx.staging, numbers_uri=src.uri, trie_uri=trie_ref.uri, min_len=cfg.min_word_len)
    work_rels = [f"_work/{i:05d}.npz" for i in range(len(rels))]
    scanned = ctx.map(match_shard_task, [dict(common, rel=r, work_rel=w) for r, w in zip(rels, work_rels)],
                      name="lexicon-match", fold=fold)  # pragma: no mutate (UI names)
    emb = open_artifact(emb_ref)
    emb_words = load_embedding_words(emb.fs, emb.path)
    emb_vectors = VectorRows(emb.fs, emb.path)  # only the matched words' rows are read, on any store
    ranks, words, mat = word_vocab(seen, emb_words, emb_vectors, cfg.seed)
    del emb_words, emb_vectors
    writer.write_bytes("words.txt", vocab_bytes(words))
    with writer.open("word_vectors.npy") as f:
        np.save(f, mat)
    out_rels = [f"shards/part-{i:05d}.parquet" for i in range(len(rels))]
    items = [dict(common, rel=r, work_rel=w, vocab_uri=vocab_ref.uri, k=k, out_rel=o)
             for r, w, o in zip(rels, work_rels, out_rels)]
    done = ctx.map(finalize_shard_task, items, name="lexicon-finalize", stage="lexicon-finalize",
                   shared={"sorted_ranks": ranks})  # one copy per worker, not one per shard
    tokens = sum(d["tokens"] for d in done)
    metrics = {
        "word_vocab": len(words),
        "dim": int(mat.shape[1]),
        "tokens": tokens,
        "char_coverage": round(sum(d["covered"] for d in done) / max(tokens, 1), 6),
        "max_word_num": k,
        "min_word_len": cfg.min_word_len,
        "seed": cfg.seed,
    }
    return StageResult(
        stats={"in": sum(s["rows"] for s in scanned), "out": sum(d["rows"] for d in done), "rejected": {}},
        metrics=metrics,
        rows={**{d["rel"]: d["rows"] for d in done}, "words.txt": len(words)},
    )


STAGE = Stage("lexicon", CODE_VERSION, LexiconConfig, parents=("numbers_ref", "vocab_ref", "emb_ref", "trie_ref"),
              build=build)
