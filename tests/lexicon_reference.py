"""The lexicon stage's earlier shard path (per-row Python), kept as the reference for the fast one.

``benchmarks/bench_lexicon_stage.py`` and ``tests/test_lexicon_stage.py`` run it next to
:mod:`tasks.prepare.lexicon` and require the same shard bytes. Not used by the pipeline (so it lives with the tests).

It matched each numbers shard into a ``_work`` part holding word *ranks* (per-row Python lists, Parquet),
then, once the union of ranks was known, read every part back, remapped ranks to word ids row by row and
wrote the final shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from storage.parquet import iter_batches, write_rows
from tasks.prepare.lexicon import _WORK_SCHEMA, SHARD_SCHEMA, WORD_SPECIALS, whole_word_groups
from tasks.text.matcher import (
    CompiledTrie,
    find_matches,
    fmm_segments,
    slot_spans,
    spans_per_text,
    text_codepoints,
    top_k_ranks,
)
from tasks.text.numbers import to_token_string
from tasks.text.vocab import TokenIds, token_ids


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
    specials = TokenIds.of(vocab_index)
    out, off = [], 0
    for r, t, lex in zip(rows, toks, spans_per_text(fmm, [len(t) for t in toks])):
        end = off + len(t)
        groups = whole_word_groups(t, list(zip(r["en_starts"], r["en_ends"])), lex)
        filled = top[off:end] >= 0
        out.append(
            {
                "doc_id": r["doc_id"],
                "sent_idx": r["sent_idx"],
                "text": r["text"],
                "n_tokens": len(t),
                "char_ids": token_ids(t, vocab_index, specials),
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
    """One numbers shard matched row by row in Python and written as a lexicon shard (the reference path)."""
    rows: list[dict[str, Any]] = []
    for batch in iter_batches(numbers_art, rel):
        rows.extend(batch.to_pylist())
    work, seen = match_rows(rows, ct, vocab_index, k, min_len)
    write_rows(writer, out_rel, work, _WORK_SCHEMA)
    covered = sum(sum(1 for i in range(0, len(w["word_ranks"]), k) if w["word_ranks"][i] >= 0) for w in work)
    tokens = sum(w["n_tokens"] for w in work)
    return {"rel": out_rel, "rows": len(work), "tokens": tokens, "covered": covered, "ranks": seen}


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


def run_shards(numbers_art, rels: list[str], ct: CompiledTrie, vocab_index: dict[str, int], k: int, writer,
               min_len: int = 2) -> dict[str, Any]:
    """The old stage's two map steps over ``rels`` in this process: match every shard into a work part, union
    the ranks, finalize every part into ``shards/part-{i:05d}.parquet``. Returns the sorted ranks and the
    per-shard counts."""
    matched = [match_shard(numbers_art, r, ct, vocab_index, k, writer, f"_work/{i:05d}.parquet", min_len)
               for i, r in enumerate(rels)]
    ranks = np.unique(np.concatenate([np.zeros(0, np.int32)] + [m.pop("ranks") for m in matched]))
    n_out = [finalize_shard(writer, m["rel"], f"shards/part-{i:05d}.parquet", ranks) for i, m in enumerate(matched)]
    return {"ranks": ranks, "matched": matched, "out": n_out}
