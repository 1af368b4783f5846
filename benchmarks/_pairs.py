"""The corpus's own pretraining pairs for the benchmarks: packed rows and the same pairs one a row, padded.

The pairs are the pipeline's (:func:`tasks.pretrain.packed.pack_rows` over the demo store's matched shards, or a
lexicon artifact's; synthetic rows with the demo's sentence lengths when there is no store), and a batch is built
by the pipeline's own code: :class:`tasks.pretrain.pairpack.PairRows`' rows of whole pairs (best-fit-decreasing),
:func:`tasks.pretrain.packed.make_batch`'s masking, :func:`tasks.pretrain.pairpack.layout_rows`' packed layout. The
unpacked twin holds exactly the same pairs with the same masks, one a row, padded to the batch's longest pair:
what a model without packing (Hugging Face's ``BertForPreTraining``) runs for the same work.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loader import demo_rows  # noqa: E402

from tasks.pretrain.config import PretrainDataConfig  # noqa: E402
from tasks.pretrain.packed import BatchBuffer, Pack, make_batch, pack_rows  # noqa: E402
from tasks.pretrain.pairpack import PairRows, layout_rows, masked_per_row  # noqa: E402
from tasks.text.vocab import as_token_ids  # noqa: E402


@dataclass
class CorpusPairs:
    """A corpus's pairs at one sequence length: the pack, its word slots ``W``, vocabulary size ``V``, source."""

    pack: Pack
    W: int
    V: int
    source: str

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each pair (A + B + 3 specials), int64 [N]."""
        return self.pack.lengths


def corpus_pairs(seq_len: int, lexicon: str | None = None) -> CorpusPairs:
    """The pairs of ``lexicon``'s matched shards (default: the newest lexicon of the demo store; synthetic rows
    with the demo's sentence lengths without one) cut to ``seq_len`` tokens, as pretraining cuts them."""
    rows, W, V, source = demo_rows(lexicon)
    return CorpusPairs(pack_rows(rows, PretrainDataConfig(max_seq_len=seq_len), W), W, V, source)


def same_pairs(pairs: CorpusPairs, seq_len: int, rows: int, pairs_per_row: int, n: int, seed: int = 0
               ) -> list[tuple[BatchBuffer, BatchBuffer]]:
    """``n`` batches of epoch 0 as (packed: ``rows`` rows of ``seq_len`` tokens, the pipeline's layout; the same
    pairs one a row, padded to their longest, with the same masks)."""
    cfg = PretrainDataConfig(max_seq_len=seq_len, batch_size=rows, packing="pairs", pairs_per_row=pairs_per_row,
                             seed=seed)
    data = PairRows(pairs.pack, cfg, pairs.V)
    masked, pad = masked_per_row(cfg), as_token_ids(pairs.V).pad
    out = []
    batches = data.batches(0)
    for k in range(n):
        batch_rows = batches[k % data.per_epoch()]
        rng = np.random.default_rng([seed, 0, 0, 1, k])
        one_a_row = make_batch(pairs.pack, np.concatenate(batch_rows), cfg, pairs.V, rng)
        out.append((layout_rows(one_a_row, batch_rows, rows, seq_len, pairs_per_row, masked, pad), one_a_row))
    return out


def mlm_labels_dense(batch: BatchBuffer) -> np.ndarray:
    """An unpacked batch's MLM labels as Hugging Face takes them: [B, T], -100 except at the masked positions."""
    parts = batch.parts()
    labels = np.full(parts["input_ids"].size, -100, np.int64)
    labels[parts["mlm_positions"]] = parts["mlm_labels"]
    return labels.reshape(parts["input_ids"].shape)


def attention_len(lengths: np.ndarray) -> float:
    """The length attention FLOPs are counted at when each token attends over its own pair: sum(l^2) / sum(l)."""
    lengths = np.asarray(lengths, np.float64)
    return float((lengths**2).sum() / lengths.sum()) if lengths.sum() else 0.0
