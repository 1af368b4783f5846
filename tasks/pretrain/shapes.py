"""Bounded compilation: compiled pretraining sees a handful of batch shapes, not one per batch length.

A packed batch is as long as its longest pair and has as many masked positions as its masking drew, so a compiled
model would meet a new shape almost every step and recompile (or fall back to dynamic shapes). With buckets, each
batch is padded on the host (in the loader's workers) to the next of ``n`` fixed lengths, its masked positions to
the most that length allows for the full batch, and a short last batch to the full batch size: at most ``n``
shapes per run. Padding is inert: padded tokens are masked out of attention, padded MLM positions carry the
ignore label -100, padded pairs the NSP label -100 (one visible [CLS] token each, so no attention row is empty).
"""

from __future__ import annotations

import numpy as np
import torch

from tasks.pretrain.config import PretrainDataConfig
from tasks.pretrain.packed import BatchBuffer
from tasks.text.vocab import CLS, as_token_ids

IGNORE = -100


def length_buckets(max_seq_len: int, n: int) -> list[int]:
    """``n`` sequence lengths up to ``max_seq_len``, evenly spaced and rounded up to multiples of 8."""
    cuts = {min(max_seq_len, (-(-max_seq_len * (i + 1) // n) + 7) // 8 * 8) for i in range(n)}
    return sorted(cuts | {max_seq_len})


def max_masked(cfg: PretrainDataConfig, T: int) -> int:
    """The most masked positions one pair of length <= ``T`` can have (the masking's cap, as in make_batch)."""
    return int(min(cfg.max_predictions_per_seq, max(1, int(cfg.mask_prob * (T - 3) + 0.5))))


def pad_batch(batch: BatchBuffer, T: int, n_masked: int, B: int, cls_id: int = CLS) -> BatchBuffer:
    """``batch`` padded to ``B`` pairs of ``T`` tokens with ``n_masked`` MLM positions (all at least as large as
    the batch's own); a padded pair is one visible ``cls_id`` token (the vocabulary's [CLS]). ``n_real_tokens`` and
    the real masked count (``n_masked``) are kept for the counts."""
    parts, at = {}, 0
    buf = batch.buf.numpy()
    for name, shape in batch.layout:
        size = int(np.prod(shape))
        parts[name] = buf[at: at + size].reshape(shape)
        at += size
    b0, t0 = parts["input_ids"].shape
    if b0 > B or t0 > T or len(parts["mlm_positions"]) > n_masked:
        raise ValueError(f"batch [{b0}, {t0}] with {len(parts['mlm_positions'])} masked positions does not fit the "
                         f"bucket [{B}, {T}] x {n_masked}")
    out = {}
    for name in ("input_ids", "segment_ids", "attention_mask"):
        grid = np.zeros((B, T), np.int64)
        grid[:b0, :t0] = parts[name]
        out[name] = grid
    out["input_ids"][b0:, 0] = cls_id
    out["attention_mask"][b0:, 0] = 1
    words = parts["word_ids"]
    grid = np.zeros((B, T, words.shape[2]), np.int64)
    grid[:b0, :t0] = words
    out["word_ids"] = grid
    real = len(parts["mlm_positions"])
    pos = np.zeros(n_masked, np.int64)  # padded positions point at token 0 and are ignored through their label
    pos[:real] = parts["mlm_positions"] // t0 * T + parts["mlm_positions"] % t0
    labels = np.full(n_masked, IGNORE, np.int64)
    labels[:real] = parts["mlm_labels"]
    out["mlm_positions"], out["mlm_labels"] = pos, labels
    nsp = np.full(B, IGNORE, np.int64)
    nsp[:b0] = parts["nsp_labels"]
    out["nsp_labels"] = nsp
    padded = BatchBuffer.of({name: out[name] for name, _ in batch.layout}, batch.n_real_tokens)
    return BatchBuffer(padded.buf, padded.layout, batch.n_real_tokens, n_masked=real, n_pairs=b0,
                       real_len=t0)


class BucketedBatches(torch.utils.data.Dataset):
    """A :class:`tasks.pretrain.packed.PackedBatches` whose batches come padded to one of ``n`` shapes
    (:func:`pad_batch`); the padding runs where the batch is built (the loader's workers)."""

    def __init__(self, inner, n: int):
        self.inner, self.cfg = inner, inner.cfg
        self.lengths = length_buckets(self.cfg.max_seq_len, n)

    def shape_for(self, T: int) -> tuple[int, int, int]:
        """(T, masked positions, B) of the bucket a batch of length ``T`` goes to."""
        Tb = next(x for x in self.lengths if x >= T)
        B = self.cfg.batch_size
        return Tb, B * max_masked(self.cfg, Tb), B

    def __getitem__(self, key):
        batch = self.inner[key]
        T = dict(batch.layout)["input_ids"][1]
        return pad_batch(batch, *self.shape_for(T), cls_id=as_token_ids(self.inner.vocab_size).cls)

    def per_epoch(self) -> int:
        """Batches per epoch (the wrapped loader's)."""
        return self.inner.per_epoch()
