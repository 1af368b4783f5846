"""The benchmarks' corpus pairs: packed rows and their unpacked twin hold the same pairs and masks; attention FLOPs
are counted over the pairs' lengths."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from _pairs import CorpusPairs, attention_len, mlm_labels_dense, same_pairs  # noqa: E402
from bench_loader import synthetic_rows  # noqa: E402

from tasks.pretrain.config import PretrainDataConfig  # noqa: E402
from tasks.pretrain.packed import pack_rows  # noqa: E402


def test_packed_rows_and_their_padded_twin_hold_the_same_pairs_and_masks():
    V, W, T = 300, 3, 128
    rows = synthetic_rows(60, 0, W, V, 500)
    pairs = CorpusPairs(pack_rows(rows, PretrainDataConfig(max_seq_len=T), W), W, V, "synthetic")
    (packed, one), = same_pairs(pairs, T, rows=4, pairs_per_row=8, n=1)
    p, u = packed.parts(), one.parts()
    assert p["input_ids"].shape == (4, T) and packed.n_real_tokens == one.n_real_tokens == u["attention_mask"].sum()
    lens = u["attention_mask"].sum(1)
    assert packed.n_pairs == len(lens) > 4  # several pairs a row
    # every pair's tokens, in order, in its packed row (positions restarting at 0)
    for r in range(4):
        for slot in range(8):
            at = p["pair_ids"][r] == slot
            if not at.any():
                continue
            tokens = p["input_ids"][r][at]
            assert (p["position_ids"][r][at] == np.arange(at.sum())).all()
            assert any(len(tokens) == n and (u["input_ids"][i, :n] == tokens).all() for i, n in enumerate(lens))
    # the same masked tokens and labels
    dense = mlm_labels_dense(one)
    assert sorted(dense[dense != -100].tolist()) == sorted(p["mlm_labels"][p["mlm_labels"] != -100].tolist())
    assert sorted(p["nsp_labels"][p["nsp_labels"] != -100].tolist()) == sorted(u["nsp_labels"].tolist())
    # attention over each pair's own length, not the row's
    assert packed.attention_len() == attention_len(lens) == float((lens.astype(float) ** 2).sum() / lens.sum())
    assert packed.attention_len() < lens.max() < T
