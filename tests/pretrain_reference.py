"""The per-example pretraining batch stream (NSP pairs -> whole-word MLM -> shuffle buffer -> bucketed batches),
kept as the reference for the packed loader (:mod:`tasks.pretrain.packed`): the tests hold both to the same
properties and ``benchmarks/bench_loader.py`` runs both. Not used by the pipeline.

Everything downstream of the rows is a pure function of (rows, cfg, epoch): one ``np.random.default_rng([seed,
epoch])`` drives pairing, masking, the shuffle buffer and the bucketing, so a stream resumes exactly by
re-generating it and skipping ``k`` batches (``start_batch=k``). Memory is bounded by the shuffle buffer, the
bucketing pool and the NSP ring.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tasks.pretrain.config import PretrainDataConfig
from tasks.pretrain.data import Batch, _Ring, _truncate, _units, _with_next
from tasks.text.vocab import TokenIds, as_token_ids


@dataclass
class Example:
    input_ids: np.ndarray  # int64 [L]
    segment_ids: np.ndarray  # int64 [L]
    word_ids: np.ndarray  # int64 [L, W]
    mlm_positions: np.ndarray  # int64 [n], sorted, positions in this example
    mlm_labels: np.ndarray  # int64 [n], original ids
    nsp_label: int  # 0 IsNext, 1 NotNext
    index: int  # creation counter: tie-break for bucketing

    def __len__(self) -> int:
        return len(self.input_ids)



def _make_example(a: dict, b: dict, label: int, cfg: PretrainDataConfig, vocab: int | TokenIds, W: int,
                  rng: np.random.Generator, index: int) -> Example:
    tid = as_token_ids(vocab)
    la, lb = _truncate(a["n_tokens"], b["n_tokens"], cfg.max_seq_len - 3)
    L, sb = la + lb + 3, la + 2  # total length, start of B
    ids = np.empty(L, np.int64)
    ids[0], ids[la + 1], ids[L - 1] = tid.cls, tid.sep, tid.sep
    ids[1 : la + 1], ids[sb : sb + lb] = a["char_ids"][:la], b["char_ids"][:lb]
    seg = np.zeros(L, np.int64)
    seg[sb:] = 1
    words = np.zeros((L, W), np.int64)
    words[1 : la + 1] = np.asarray(a["word_ids"]).reshape(-1, W)[:la]
    words[sb : sb + lb] = np.asarray(b["word_ids"]).reshape(-1, W)[:lb]
    w_start, w_end = np.zeros((L, W), np.int64), np.zeros((L, W), np.int64)  # slot word spans, example positions
    for row, n, off in ((a, la, 1), (b, lb, sb)):
        w_start[off : off + n] = np.minimum(np.asarray(row["word_starts"]).reshape(-1, W)[:n], n) + off
        w_end[off : off + n] = np.minimum(np.asarray(row["word_ends"]).reshape(-1, W)[:n], n) + off

    units = _units(a, la, 1) + _units(b, lb, sb)
    n_mask = min(cfg.max_predictions_per_seq, max(1, int(cfg.mask_prob * (la + lb) + 0.5)))
    chosen, count = [], 0
    for k in rng.permutation(len(units)).tolist():
        s, e = units[k]
        if count + e - s > n_mask:  # a unit that would overshoot is skipped, the next one tried
            continue
        chosen.append((s, e))
        count += e - s
        if count == n_mask:
            break
    positions = np.array(sorted(p for s, e in chosen for p in range(s, e)), np.int64)
    labels = ids[positions].copy()
    _hide_answers(words, w_start, w_end, positions)
    for s, e in chosen:
        u = rng.random()
        if u < cfg.mask_replace:
            ids[s:e] = tid.mask
        elif u < cfg.mask_replace + cfg.mask_random:
            ids[s:e] = tid.draw(rng, e - s)
    return Example(ids, seg, words, positions, labels, label, index)


def _hide_answers(words: np.ndarray, w_start: np.ndarray, w_end: np.ndarray, positions: np.ndarray) -> None:
    """In place: every word whose span overlaps a masked position is removed (id 0) from every slot of the
    example, so the lexicon channel cannot give away what MLM asks for. ``words``/``w_start``/``w_end``
    are [L, W]; spans are ``[start, end)`` in example positions, ``[x, x)`` for empty slots."""
    if not len(positions):
        return
    masked = np.zeros(len(words) + 1, np.int64)
    masked[positions + 1] = 1
    before = np.cumsum(masked)  # before[i] = masked positions < i
    hit = (before[w_end] > before[w_start]) & (words > 0)  # [L, W] slot's word covers a masked position
    if hit.any():
        words[np.isin(words, np.unique(words[hit]))] = 0


def iter_examples(rows: Iterable[dict], cfg: PretrainDataConfig, vocab_size: int | TokenIds, W: int,
                  rng: np.random.Generator) -> Iterator[Example]:
    """NSP pairs with whole-word MLM, in corpus order. Every sentence is offered as A once:
    with ``nsp_random_prob`` it pairs with a ring sentence of another document (NotNext),
    otherwise with its successor (IsNext). If the ring holds no other document yet, IsNext is
    used instead; a last sentence whose draw asked for IsNext is not used as A (so the NotNext
    rate stays ``nsp_random_prob`` instead of rising with short documents)."""
    vocab_size = as_token_ids(vocab_size)
    vocab_size.check()
    ring, index = _Ring(cfg.nsp_pool), 0
    for a, nxt in _with_next(rows):
        want_random = rng.random() < cfg.nsp_random_prob
        other = ring.sample_other(a["doc_id"], rng) if want_random else None
        ring.push(a)
        if other is not None:
            b, label = other, 1
        elif nxt is not None:
            b, label = nxt, 0
        else:
            continue
        yield _make_example(a, b, label, cfg, vocab_size, W, rng, index)
        index += 1


def shuffle_buffer(items: Iterable[Any], size: int, rng: np.random.Generator) -> Iterator[Any]:
    """Fill ``size`` slots; then each arrival evicts a uniformly chosen slot; drain shuffled."""
    buf: list[Any] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        j = int(rng.integers(size))
        yield buf[j]
        buf[j] = item
    for j in rng.permutation(len(buf)).tolist():
        yield buf[j]


# ---------------------------------------------------------------- batches


def collate(examples: list[Example], W: int) -> Batch:
    """Pad to the longest member only."""
    B, T = len(examples), max(len(e) for e in examples)
    ids, seg = np.zeros((B, T), np.int64), np.zeros((B, T), np.int64)
    mask, words = np.zeros((B, T), bool), np.zeros((B, T, W), np.int64)
    pos, lab, nsp = [], [], np.empty(B, np.int64)
    for i, e in enumerate(examples):
        n = len(e)
        ids[i, :n], seg[i, :n], mask[i, :n], words[i, :n] = e.input_ids, e.segment_ids, True, e.word_ids
        pos.append(e.mlm_positions + i * T)
        lab.append(e.mlm_labels)
        nsp[i] = e.nsp_label
    t = torch.from_numpy
    return Batch(
        input_ids=t(ids), segment_ids=t(seg), attention_mask=t(mask), word_ids=t(words),
        mlm_positions=t(np.concatenate(pos).astype(np.int64)), mlm_labels=t(np.concatenate(lab).astype(np.int64)),
        nsp_labels=t(nsp), n_real_tokens=int(mask.sum()),
    )


def _bucketed(examples: Iterator[Example], cfg: PretrainDataConfig,
              rng: np.random.Generator) -> Iterator[list[Example]]:
    """Pools of ``bucket_batches * batch_size``: sort by (length, index), cut, shuffle batch order."""
    pool_size = cfg.bucket_batches * cfg.batch_size
    while pool := list(itertools.islice(examples, pool_size)):
        pool.sort(key=lambda e: (len(e), e.index))
        groups = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
        for j in rng.permutation(len(groups)).tolist():
            yield groups[j]


def iter_batches(rows: Iterable[dict], cfg: PretrainDataConfig, vocab_size: int, W: int, epoch: int,
                 start_batch: int = 0) -> Iterator[Batch]:
    """The epoch's batch stream, a pure function of (rows, cfg, epoch). ``start_batch=k`` still
    generates the first k batches (same rng draws) but skips collating them."""
    rng = np.random.default_rng([cfg.seed, epoch])
    examples = shuffle_buffer(iter_examples(rows, cfg, vocab_size, W, rng), cfg.shuffle_buffer, rng)
    for k, group in enumerate(_bucketed(examples, cfg, rng)):
        if k >= start_batch:
            yield collate(group, W)


def skip(batches: Iterator[Batch], k: int) -> Iterator[Batch]:
    """Drop the first ``k`` items of an iterator (prefer ``start_batch``, which skips collation)."""
    return itertools.islice(batches, k, None)
