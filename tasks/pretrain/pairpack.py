"""Packed pretraining rows: whole NSP pairs bin-packed into rows of ``max_seq_len``, one static batch shape.

With ``pretrain.data.packing: pairs`` a batch is ``batch_size`` rows of ``max_seq_len`` tokens, each holding up to
``pairs_per_row`` whole pairs (Krell et al., "Efficient Sequence Packing without Cross-contamination"). Every pair
keeps what it had alone: its tokens attend only to its own tokens (``pair_ids``: the model builds a block-diagonal
mask), its positions start at 0 (``position_ids``), its masking is the unpacked batch's (:func:`make_batch` draws
it per pair), and NSP reads its own [CLS] (``cls_positions``). Padding is inert: padding tokens form a group of
their own, unused pair slots point at token 0 with the NSP label -100, unused masked positions carry the label
-100. The shape is fixed (rows, ``max_seq_len``, ``pairs_per_row`` pairs a row and :func:`masked_per_row` masked
positions a row), so a compiled or captured step has one graph.

An epoch's rows: a permutation of the pack's pairs cut into pools of about ``bucket_batches`` batches' pairs; each
pool best-fit-decreasing packed (longest first, each pair into the fullest row it still fits, a new row when none
does); all rows of the epoch shuffled and cut into batches. Deterministic like :mod:`tasks.pretrain.packed`:
the rows are a pure function of (pack, seed, epoch, rank), batch ``k``'s masking of (seed, epoch, rank, k).

:func:`with_word_rows` renumbers a batch's word ids into the rows of a sparse word table it touches, where the
batch is built (the loader's workers), so the training thread does not.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from tasks.pretrain.config import PretrainDataConfig
from tasks.pretrain.packed import BatchBuffer, Pack, PackedBatches, make_batch
from tasks.text.vocab import as_token_ids

IGNORE = -100


def best_fit_decreasing(lengths: np.ndarray, capacity: int, max_items: int) -> list[np.ndarray]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` total length and ``max_items`` items:
    longest first, each into the fullest open bin it fits (ties: the oldest), else a new bin. Bins are returned in
    the order they were opened; each holds its items in the order they were placed (longest first)."""
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"a pair of {int(lengths.max())} tokens does not fit a row of {capacity}")
    order = np.argsort(-np.asarray(lengths), kind="stable")
    open_at: list[list[int]] = [[] for _ in range(capacity + 1)]  # space left -> open bins (oldest first)
    n_open = np.zeros(capacity + 1, np.int64)
    bins: list[list[int]] = []
    for i in order:
        L = int(lengths[i])
        fits = np.flatnonzero(n_open[L:])
        if len(fits):
            left = L + int(fits[0])  # the least space left that still fits: the fullest bin
            b = open_at[left].pop(0)
            n_open[left] -= 1
        else:
            b, left = len(bins), capacity
            bins.append([])
        bins[b].append(int(i))
        left -= L
        if len(bins[b]) < max_items and left > 0:
            open_at[left].append(b)
            n_open[left] += 1
    return [np.asarray(b, np.int64) for b in bins]


def masked_per_row(cfg: PretrainDataConfig) -> int:
    """Masked positions a packed row has room for: no pair masks more than ``mask_prob * (len - 3) + 1`` tokens
    (and ``max_predictions_per_seq``), so a row of ``max_seq_len`` tokens and ``pairs_per_row`` pairs needs at most
    ``mask_prob * max_seq_len + pairs_per_row``."""
    return int(min(cfg.pairs_per_row * cfg.max_predictions_per_seq, int(cfg.mask_prob * cfg.max_seq_len)
                   + cfg.pairs_per_row))


def epoch_rows(lengths: np.ndarray, cfg: PretrainDataConfig, rng: np.random.Generator) -> list[np.ndarray]:
    """The epoch's rows (pair indices each), shuffled: a permutation cut into pools of about ``bucket_batches``
    batches' pairs, each pool packed by :func:`best_fit_decreasing`."""
    perm = rng.permutation(len(lengths))
    mean = float(lengths.mean()) if len(lengths) else 1.0
    per_row = min(cfg.pairs_per_row, max(1.0, cfg.max_seq_len / mean))
    pool = max(cfg.pairs_per_row, int(cfg.bucket_batches * cfg.batch_size * per_row))
    rows: list[np.ndarray] = []
    for s in range(0, len(perm), pool):
        p = perm[s: s + pool]
        rows.extend(p[b] for b in best_fit_decreasing(lengths[p], cfg.max_seq_len, cfg.pairs_per_row))
    return [rows[j] for j in rng.permutation(len(rows))]


def layout_rows(batch: BatchBuffer, rows: list[np.ndarray], R: int, T: int, P: int, M: int, pad_id: int = 0
                ) -> BatchBuffer:
    """The pairs of ``batch`` (:func:`make_batch` over the rows' pairs in row order) laid out in ``R`` rows of ``T``
    tokens with ``P`` pair slots and ``M`` masked positions a row; ``rows[r]`` counts the pairs of row ``r``."""
    parts = batch.parts()
    n, Tp = parts["input_ids"].shape
    W = parts["word_ids"].shape[2]
    counts = np.array([len(r) for r in rows], np.int64)
    row_of = np.repeat(np.arange(len(rows)), counts)  # [n] row of each pair
    slot = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # [n] pair slot within its row
    lens = parts["attention_mask"].sum(1)  # [n]
    before = np.cumsum(lens) - lens  # [n] tokens of the pairs before each one, over all rows
    offset = before - np.repeat(before[np.cumsum(counts) - counts], counts)  # [n] its first token in its row
    valid = parts["attention_mask"].astype(bool)  # [n, Tp]
    dest = (row_of * T + offset)[:, None] + np.arange(Tp)  # [n, Tp] flat position in R*T
    at = dest[valid]
    out = {
        "input_ids": np.full(R * T, pad_id, np.int64),
        "segment_ids": np.zeros(R * T, np.int64),
        "attention_mask": np.zeros(R * T, np.int64),
        "word_ids": np.zeros((R * T, W), np.int64),
        "position_ids": np.zeros(R * T, np.int64),
        "pair_ids": np.full(R * T, P, np.int64),  # padding: a group of its own
    }
    out["input_ids"][at] = parts["input_ids"][valid]
    out["segment_ids"][at] = parts["segment_ids"][valid]
    out["attention_mask"][at] = 1
    out["word_ids"][at] = parts["word_ids"][valid]
    out["position_ids"][at] = np.broadcast_to(np.arange(Tp), (n, Tp))[valid]
    out["pair_ids"][at] = np.broadcast_to(slot[:, None], (n, Tp))[valid]
    pos = parts["mlm_positions"]
    real = len(pos)
    if real > R * M:
        raise ValueError(f"{real} masked positions do not fit {R} rows x {M}")
    mlm_pos = np.zeros(R * M, np.int64)  # padding points at token 0 and is ignored through its label
    mlm_pos[:real] = dest.reshape(-1)[pos]
    mlm_labels = np.full(R * M, IGNORE, np.int64)
    mlm_labels[:real] = parts["mlm_labels"]
    cls = np.zeros(R * P, np.int64)
    cls[row_of * P + slot] = row_of * T + offset
    nsp = np.full(R * P, IGNORE, np.int64)
    nsp[row_of * P + slot] = parts["nsp_labels"]
    layout = {"input_ids": out["input_ids"].reshape(R, T), "segment_ids": out["segment_ids"].reshape(R, T),
              "attention_mask": out["attention_mask"].reshape(R, T), "word_ids": out["word_ids"].reshape(R, T, W),
              "mlm_positions": mlm_pos, "mlm_labels": mlm_labels, "nsp_labels": nsp,
              "position_ids": out["position_ids"].reshape(R, T), "pair_ids": out["pair_ids"].reshape(R, T),
              "cls_positions": cls}
    packed = BatchBuffer.of(layout, batch.n_real_tokens)
    attn = float((lens.astype(np.float64) ** 2).sum() / lens.sum()) if n else 0.0  # attention over pair lengths
    return dataclasses.replace(packed, n_masked=real, n_pairs=n, real_len=int(lens.max()) if n else 0,
                               attn_len=attn)


def with_word_rows(batch: BatchBuffer, fixed: bool) -> BatchBuffer:
    """``batch`` with its word ids renumbered into ``word_row_ids`` (row 0 the [PAD] word, then the batch's
    distinct word ids ascending; with ``fixed``, padded with 0 to one more than the batch's word slots, a static
    shape): ``word_row_ids[word_ids] `` is the original ids. What :meth:`tasks.training.row_adam.SparseRows.index`
    does, done where the batch is built."""
    parts = batch.parts()
    words = parts["word_ids"]
    uniq, inv = np.unique(np.concatenate([[0], words.reshape(-1)]), return_inverse=True)
    n = len(uniq)
    ids = np.zeros(words.size + 1 if fixed else n, np.int64)
    ids[:n] = uniq
    parts = {**parts, "word_ids": inv[1:].reshape(words.shape), "word_row_ids": ids}
    out = BatchBuffer.of(parts, batch.n_real_tokens)
    return dataclasses.replace(batch, buf=out.buf, layout=out.layout, n_word_rows=n)


class PairRows(PackedBatches):
    """:class:`tasks.pretrain.packed.PackedBatches` whose batches are packed rows (the module docstring): item
    ``(epoch, k)`` is ``batch_size`` rows of ``max_seq_len`` tokens, one static shape."""

    def __init__(self, pack: Pack | str, cfg: PretrainDataConfig, vocab_size, rank: int = 0):
        super().__init__(pack, cfg, vocab_size, rank)
        self.masked = masked_per_row(cfg)

    def batches(self, epoch: int) -> list[list[np.ndarray]]:
        """The epoch's batches, each a list of rows (pair indices), computed once per process (two epochs kept)."""
        if epoch not in self._orders:
            rng = np.random.default_rng([self.cfg.seed, epoch, self.rank, 2])
            rows = epoch_rows(self.pack.lengths, self.cfg, rng)
            R = self.cfg.batch_size
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = [rows[s: s + R] for s in range(0, len(rows), R)]
        return self._orders[epoch]

    def per_epoch(self) -> int:
        """Batches per epoch, the same every epoch: epoch 0's, less a margin (another epoch's packing may need a
        few rows more or less), so an epoch's last batches (at least its last, short one) are left out."""
        n = len(self.batches(0))
        return n if n <= 1 else 1 if n == 2 else max(1, n * 99 // 100 - 1)

    def __getitem__(self, key: tuple[int, int]) -> BatchBuffer:
        epoch, k = key
        batches = self.batches(epoch)
        if k >= len(batches):
            raise IndexError(f"epoch {epoch} packed into {len(batches)} batches, fewer than batch {k + 1}")
        rows = batches[k]
        rng = np.random.default_rng([self.cfg.seed, epoch, self.rank, 1, k])
        pairs = make_batch(self.pack, np.concatenate(rows), self.cfg, self.vocab_size, rng)
        return layout_rows(pairs, rows, self.cfg.batch_size, self.cfg.max_seq_len, self.cfg.pairs_per_row,
                           self.masked, as_token_ids(self.vocab_size).pad)


class WordRows(torch.utils.data.Dataset):
    """A batch dataset whose batches come with their sparse word-table rows renumbered (:func:`with_word_rows`),
    in the loader's workers."""

    def __init__(self, inner, fixed: bool):
        self.inner, self.cfg, self.fixed = inner, inner.cfg, fixed

    def __getitem__(self, key):
        return with_word_rows(self.inner[key], self.fixed)

    def per_epoch(self) -> int:
        """Batches per epoch (the wrapped dataset's)."""
        return self.inner.per_epoch()
