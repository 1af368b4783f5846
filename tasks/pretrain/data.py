"""Pretraining examples for LEBERT: matched shards -> NSP pairs -> whole-word MLM -> bucketed batches.

This module defines what an example is (pairing, truncation, whole-word units, the answer-leak rule) and keeps
the per-example streaming path (``iter_batches``) as the reference: the trainer reads the packed loader
(:mod:`tasks.pretrain.packed`), which reuses these pieces and is tested against the same properties;
``benchmarks/bench_loader.py`` runs both.

Pure logic, no Prefect. Everything downstream of the rows is a pure function of
(rows, cfg, epoch): one ``np.random.default_rng([seed, epoch])`` drives pairing,
masking, the shuffle buffer and the bucketing, so a trainer resumes exactly by
re-generating the stream and skipping ``k`` batches (``start_batch=k``).
Memory is bounded by the shuffle buffer, the bucketing pool and the NSP ring.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from storage.artifacts import Artifact
from tasks.pretrain.config import PretrainDataConfig
from tasks.text.vocab import FIRST_REGULAR, TokenIds, as_token_ids

# a counted vocabulary's ids; ``vocab`` arguments below take its size or an imported vocabulary's TokenIds
PAD, UNK, CLS, SEP, MASK, NUM = 0, 1, 2, 3, 4, 5
__all__ = ["FIRST_REGULAR", "TokenIds"]
ROW_COLUMNS = ["doc_id", "n_tokens", "char_ids", "word_ids", "word_starts", "word_ends", "group_starts", "group_ends"]


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


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, T]
    segment_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # bool [B, T]
    word_ids: torch.Tensor  # int64 [B, T, W]
    mlm_positions: torch.Tensor  # int64 [N], flat indices into B*T, sorted
    mlm_labels: torch.Tensor  # int64 [N]
    nsp_labels: torch.Tensor  # int64 [B]
    n_real_tokens: int  # non-pad tokens, specials included

    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
        return Batch(**moved)

    def pin_memory(self) -> "Batch":
        """Page-locked copies (torch's DataLoader calls this with ``pin_memory=True``): the copy to a GPU can then
        run asynchronously (``to(device, non_blocking=True)``)."""
        return Batch(**{f.name: (v.pin_memory() if isinstance(v, torch.Tensor) else v)
                        for f in fields(self) for v in [getattr(self, f.name)]})


# ---------------------------------------------------------------- rows


def max_word_num(art: Artifact) -> int:
    """W of the lexicon artifact (words per character in ``word_ids``)."""
    return int(art.manifest.metrics["max_word_num"])


def iter_rows(art: Artifact, prefix: str = "shards/", rank: int = 0, world: int = 1) -> Iterator[dict[str, Any]]:
    """Stream sentence rows shard by shard, row group by row group; list columns as numpy.

    Under ``world`` > 1 this reads only its share: the row groups (of every shard, counted in order) whose index
    is ``rank`` modulo ``world``. A document cut by a row-group boundary loses that one IsNext pair."""
    g = 0
    for rel in art.files(prefix):
        with art.fs.open(art.file_path(rel), "rb") as f:
            pf = pq.ParquetFile(f)
            mine = [i for i in range(pf.metadata.num_row_groups) if (g + i) % world == rank]
            g += pf.metadata.num_row_groups
            if not mine:
                continue
            for rb in pf.iter_batches(row_groups=mine, columns=ROW_COLUMNS):
                yield from _batch_rows(rb)


def _batch_rows(rb) -> Iterator[dict[str, Any]]:
    doc_ids = rb.column("doc_id").to_pylist()
    n_tokens = rb.column("n_tokens").to_numpy(zero_copy_only=False)
    lists = {}
    for name in ROW_COLUMNS[2:]:
        col = rb.column(name)
        lists[name] = (col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False))
    for i, doc in enumerate(doc_ids):
        row = {"doc_id": doc, "n_tokens": int(n_tokens[i])}
        for name, (off, vals) in lists.items():
            row[name] = vals[off[i] : off[i + 1]]
        yield row


def is_heldout(doc_id: str, frac: float, seed: int) -> bool:
    """Whether a document belongs to the held-out MLM evaluation slice: blake2b(seed, doc_id) < frac.
    Deterministic, independent of order and of every other document."""
    if frac <= 0:
        return False
    h = hashlib.blake2b(f"{seed}\x00{doc_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < frac


def split_heldout(rows_factory, frac: float, seed: int):
    """(train rows factory, held-out rows factory), each called like ``rows_factory`` (``(rank, world)``):
    the documents with ``is_heldout`` never reach training."""
    def train(*share):
        return (r for r in rows_factory(*share) if not is_heldout(r["doc_id"], frac, seed))

    def heldout(*share):
        return (r for r in rows_factory(*share) if is_heldout(r["doc_id"], frac, seed))

    return train, heldout


def rows_of(rows: list[dict]):
    """A ``(rank, world)`` rows factory over rows in memory: rank ``r`` gets the documents whose index (in order of
    first appearance) is ``r`` modulo ``world``."""
    def factory(rank: int = 0, world: int = 1):
        doc, k = None, -1
        for row in rows:
            if row["doc_id"] != doc:
                doc, k = row["doc_id"], k + 1
            if k % world == rank:
                yield row

    return factory


# ---------------------------------------------------------------- examples


def _with_next(rows: Iterable[dict]) -> Iterator[tuple[dict, dict | None]]:
    """(row, its successor in the same document or None), one row of lookahead."""
    prev = None
    for row in rows:
        if prev is not None:
            yield prev, (row if row["doc_id"] == prev["doc_id"] else None)
        prev = row
    if prev is not None:
        yield prev, None


class _Ring:
    """The last ``size`` sentences seen, and how many at its tail share the newest document."""

    def __init__(self, size: int):
        self.size, self.buf, self.n, self.tail_doc, self.tail = size, [None] * size, 0, None, 0

    def push(self, row: dict) -> None:
        self.buf[self.n % self.size] = row
        self.n += 1
        self.tail = self.tail + 1 if row["doc_id"] == self.tail_doc else 1
        self.tail_doc = row["doc_id"]

    def sample_other(self, doc_id: Any, rng: np.random.Generator) -> dict | None:
        held = min(self.n, self.size)
        same = min(self.tail, held) if doc_id == self.tail_doc else 0
        if held - same <= 0:
            return None
        i = int(rng.integers(held - same))  # the oldest held - same entries are other documents
        return self.buf[(self.n - held + i) % self.size]


def _truncate(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Trim the longer of A/B by one token at a time (B on ties) until la + lb <= budget."""
    excess = la + lb - budget
    if excess <= 0:
        return la, lb
    cut = min(excess, abs(la - lb))
    la, lb = (la - cut, lb) if la > lb else (la, lb - cut)
    rest = excess - cut
    return la - rest // 2, lb - (rest + 1) // 2


def _units(row: dict, n: int, off: int) -> list[tuple[int, int]]:
    """Whole-word units of the first ``n`` tokens of ``row``, shifted by ``off``: groups that
    still fit entirely, and single tokens elsewhere."""
    units, pos = [], 0
    for s, e in zip(np.asarray(row["group_starts"]).tolist(), np.asarray(row["group_ends"]).tolist()):
        if e > n:
            break
        if e <= s or s < pos:
            continue
        units.extend((off + i, off + i + 1) for i in range(pos, s))
        units.append((off + s, off + e))
        pos = e
    units.extend((off + i, off + i + 1) for i in range(pos, n))
    return units


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
