"""Domain-adaptive pretraining: the TRAIN texts of labelled files -> pretraining rows, mixed into the corpus stream.

The texts go through the corpus preparation (normalise, split into sentences, ``#NUM#``, English
units) and the featurizer's matching (words outside the corpus word vocabulary are ignored, exactly
as at fine-tune time), so their rows look like the lexicon shards' rows (:data:`ROW_COLUMNS`). Only
the train split is read: ``split_rows`` with the configured ``split``/``split_seed`` is the split
fine-tuning makes of the same file, so no dev or test text reaches the encoder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from tasks.common.labelled import index_classes, read_labelled
from tasks.common.splits import split_rows
from tasks.common.text import normalize_text
from tasks.prepare.clean import split_sentences
from tasks.prepare.lexicon import whole_word_groups
from tasks.pretrain.config import ExtraTexts
from tasks.text.featurize import Featurizer
from tasks.text.matcher import find_matches, fmm_segments, slot_spans, spans_per_text, text_codepoints, top_k_ranks
from tasks.text.numbers import number_row, to_token_string
from tasks.text.vocab import token_ids

MIN_CHARS = 2  # sentences shorter than this carry nothing to mask


def train_texts(ex: ExtraTexts) -> list[str]:
    """The texts of the train split (``data_uri``) or of the whole ``train_uri`` file; rejects are skipped."""
    rows, _ = read_labelled(ex.data_uri or ex.train_uri, ex)
    if ex.data_uri:  # classes: any: labels -> class indices first, as fine-tuning splits them
        (rows,), _ = index_classes(ex, [rows])
        rows = split_rows(rows, ex.split, ex.split_seed)[0]
    return [r["text"] for r in rows]


def text_rows(texts: Iterable[str], feat: Featurizer, prefix: str) -> list[dict[str, Any]]:
    """One document per text (``doc_id`` = prefix + index), one row per sentence, with the lexicon shard
    columns: char ids, word ids with their spans (top-k known words per token), whole-word groups."""
    sents = []
    for i, t in enumerate(texts):
        j = 0
        for s in split_sentences(normalize_text(t)):
            if len(s) >= MIN_CHARS:
                sents.append(number_row({"doc_id": f"{prefix}{i}", "sent_idx": j, "text": s}))
                j += 1
    if not sents:
        return []
    toks = [to_token_string(r["text"]) for r in sents]
    cps = text_codepoints("\x00".join(toks))
    starts, lengths, ranks = find_matches(cps, feat.ct, feat.min_len)
    keep = feat.rank_to_word[ranks] >= 0 if len(ranks) else np.zeros(0, bool)  # known words only, as at fine-tune
    starts, lengths, ranks = starts[keep], lengths[keep], ranks[keep]
    top = top_k_ranks(len(cps), starts, lengths, ranks, feat.k)  # [C, k]
    ws, we = slot_spans(top, starts, lengths, ranks)
    wid = np.where(top >= 0, feat.rank_to_word[np.maximum(top, 0)], 0)
    fmm = fmm_segments(len(cps), starts, lengths)
    out, off = [], 0
    for r, t, lex in zip(sents, toks, spans_per_text(fmm, [len(t) for t in toks])):
        end = off + len(t)
        groups = whole_word_groups(t, list(zip(r["en_starts"], r["en_ends"])), lex)
        filled = top[off:end] >= 0
        out.append({
            "doc_id": r["doc_id"], "n_tokens": len(t),
            "char_ids": np.asarray(token_ids(t, feat.vocab_index, feat.ids), np.int32),
            "word_ids": wid[off:end].reshape(-1).astype(np.int32),
            "word_starts": np.where(filled, ws[off:end] - off, 0).reshape(-1).astype(np.int32),
            "word_ends": np.where(filled, we[off:end] - off, 0).reshape(-1).astype(np.int32),
            "group_starts": np.array([s for s, _ in groups], np.int32),
            "group_ends": np.array([e for _, e in groups], np.int32),
        })
        off = end + 1
    return out


def extra_rows(extras: list[ExtraTexts], feat: Featurizer) -> list[dict[str, Any]]:
    """Rows of every configured file, each text offered ``repeat`` times (as distinct documents)."""
    rows: list[dict[str, Any]] = []
    for i, ex in enumerate(extras):
        texts = train_texts(ex)
        base = text_rows(texts, feat, f"extra{i}/")
        for k in range(ex.repeat):
            rows += base if k == 0 else [{**r, "doc_id": f"{r['doc_id']}#{k}"} for r in base]
    return rows


def mix(corpus: Iterable[dict], extra: list[dict], n_corpus: int) -> Iterator[dict]:
    """The corpus rows with the extra documents spread evenly among them, inserted only between corpus
    documents (IsNext pairs stay intact); deterministic. ``n_corpus`` is the corpus row count (its manifest)."""
    docs = _documents(extra)
    per_row = len(extra) / max(n_corpus, 1)  # extra rows owed per corpus row
    owed, d, prev = 0.0, 0, None
    for row in corpus:
        if prev is not None and row["doc_id"] != prev:
            while d < len(docs) and owed >= len(docs[d]):
                owed -= len(docs[d])
                yield from docs[d]
                d += 1
        prev = row["doc_id"]
        owed += per_row
        yield row
    for doc in docs[d:]:
        yield from doc


def mixed_factory(corpus_factory: Callable[[int, int], Iterable[dict]], extra: list[dict],
                  n_corpus: int) -> Callable[[int, int], Iterator[dict]]:
    """A ``(rank, world)`` factory: this rank's corpus rows with its share of the extra documents (those whose
    index is ``rank`` modulo ``world``) spread among them."""
    def factory(rank: int = 0, world: int = 1) -> Iterator[dict]:
        docs = [d for k, d in enumerate(_documents(extra)) if k % world == rank]
        return mix(corpus_factory(rank, world), [r for d in docs for r in d], max(n_corpus // world, 1))

    return factory


def _documents(rows: list[dict]) -> list[list[dict]]:
    docs: list[list[dict]] = []
    for r in rows:
        if docs and docs[-1][0]["doc_id"] == r["doc_id"]:
            docs[-1].append(r)
        else:
            docs.append([r])
    return docs
