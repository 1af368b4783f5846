"""Packed rows (pretrain.data.packing: pairs): several whole pairs a row with no cross-contamination. A packed batch
gives the loss and the gradients of the same pairs run one a row; rows have one static shape; the bin packing
places every pair once within a row's room; a batch's word ids renumbered in the loader are the table's rows."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from models import LebertForPretraining, ModelConfig
from tasks.pretrain.config import PretrainDataConfig
from tasks.pretrain.packed import make_batch, pack_rows
from tasks.pretrain.pairpack import PairRows, best_fit_decreasing, masked_per_row, with_word_rows
from tests.test_pretrain_data import W, make_rows

V, WV = 97, 41


def small_rows(seed: int = 0) -> list[dict]:
    """tests.test_pretrain_data's rows with character ids below V and word ids below WV (0 stays empty)."""
    out = []
    for r in make_rows(n_docs=40, seed=seed, min_len=3, max_len=20):
        words = np.asarray(r["word_ids"])
        out.append({**r, "char_ids": (6 + np.asarray(r["char_ids"]) % (V - 6)).astype(np.int32),
                    "word_ids": np.where(words > 0, 1 + words % (WV - 1), 0).astype(np.int32)})
    return out


@pytest.fixture(scope="module")
def packed():
    c = PretrainDataConfig(max_seq_len=64, batch_size=4, pairs_per_row=6, packing="pairs", bucket_batches=2)
    return c, pack_rows(small_rows(), c, W)


def _model() -> LebertForPretraining:
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, ffn_size=64, hidden_dropout=0.0,
                     attention_dropout=0.0, max_len=64, use_adapter=True, adapter_layer=1, word_vocab_size=WV,
                     word_dim=8, max_word_num=W)
    return LebertForPretraining(mc)


def test_packed_loss_and_gradients_equal_the_same_pairs_unpacked(packed):
    c, pack = packed
    data = PairRows(pack, c, V)
    rows = data.batches(0)[0]
    assert max(len(r) for r in rows) > 1  # rows do hold several pairs
    b = data[0, 0].to("cpu")
    one = make_batch(pack, np.concatenate(rows), c, V, np.random.default_rng([c.seed, 0, 0, 1, 0])).to("cpu")
    m1 = _model()
    m2 = copy.deepcopy(m1)
    p = m1(b.input_ids, b.segment_ids, b.attention_mask, b.word_ids, b.mlm_positions, b.mlm_labels, b.nsp_labels,
           position_ids=b.position_ids, pair_ids=b.pair_ids, cls_positions=b.cls_positions)
    u = m2(one.input_ids, one.segment_ids, one.attention_mask, one.word_ids, one.mlm_positions, one.mlm_labels,
           one.nsp_labels)
    assert int((b.mlm_labels != -100).sum()) == len(one.mlm_labels)  # the same masked positions, padded
    torch.testing.assert_close(p.mlm_loss, u.mlm_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p.nsp_loss, u.nsp_loss, rtol=1e-5, atol=1e-6)
    assert int(p.mlm_correct) == int(u.mlm_correct) and int(p.nsp_correct) == int(u.nsp_correct)
    p.loss.backward()
    u.loss.backward()
    for (name, a), (_, g) in zip(m1.named_parameters(), m2.named_parameters()):
        if a.grad is None:
            assert g.grad is None, name
            continue
        torch.testing.assert_close(a.grad, g.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_cross_pair_leak_would_change_the_outputs(packed):
    """The check above can fail: the same packed rows with one attention group a row (or one position run) give
    other hidden states at the pairs' tokens."""
    c, pack = packed
    b = PairRows(pack, c, V)[0, 0].to("cpu")
    m = _model().eval()
    real = b.attention_mask.bool()

    def hidden(**kw):
        with torch.no_grad():
            return m.encoder(b.input_ids, b.segment_ids, b.attention_mask, b.word_ids, **kw)[real]

    kept = hidden(position_ids=b.position_ids, pair_ids=b.pair_ids)
    for other in (dict(position_ids=b.position_ids, pair_ids=torch.zeros_like(b.pair_ids)),
                  dict(pair_ids=b.pair_ids)):
        assert float((kept - hidden(**other)).abs().max()) > 1e-2


def test_rows_have_one_static_shape_and_fill_their_room(packed):
    c, pack = packed
    data = PairRows(pack, c, V)
    n = data.per_epoch()
    shapes, real, positions, pairs = set(), 0, 0, 0
    for e in (0, 1):
        for k in range(n):
            buf = data[e, k]
            shapes.add(buf.layout)
            b = buf.to("cpu")
            real += b.n_real_tokens
            positions += buf.seq_positions()
            pairs += buf.n_pairs
            # each pair's [CLS] opens it, and its positions restart at 0 there
            cls = b.cls_positions[b.nsp_labels != -100]
            assert bool((b.input_ids.reshape(-1)[cls] == 2).all())
            assert bool((b.position_ids.reshape(-1)[cls] == 0).all())
            assert int(b.attention_mask.sum()) == b.n_real_tokens
    assert len(shapes) == 1
    B, T = dict(next(iter(shapes)))["input_ids"]
    assert (B, T) == (c.batch_size, c.max_seq_len)
    assert dict(next(iter(shapes)))["mlm_labels"] == (c.batch_size * masked_per_row(c),)
    assert real / positions > 0.85  # these pairs are 9-43 tokens: rows of 64 are mostly full
    assert pairs > 2 * n * c.batch_size  # several pairs a row


def test_best_fit_decreasing_places_every_item_once_within_each_bins_room():
    rng = np.random.default_rng(3)
    lengths = rng.integers(10, 200, 2000)
    bins = best_fit_decreasing(lengths, 512, 16)
    placed = np.concatenate(bins)
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    assert all(lengths[b].sum() <= 512 and len(b) <= 16 for b in bins)
    assert lengths.sum() / (512 * len(bins)) > 0.97  # a real packing: the tail of small items fills the gaps
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing(np.array([600]), 512, 8)


@pytest.mark.parametrize("fixed", [False, True])
def test_word_ids_renumbered_where_the_batch_is_built_index_the_same_rows(packed, fixed):
    c, pack = packed
    raw = PairRows(pack, c, V)[0, 0]
    buf = with_word_rows(raw, fixed)
    got, want = buf.to("cpu"), raw.to("cpu")
    # exact: int64 word ids renumbered and looked back up (no floating point), the same on any CPU
    assert torch.equal(got.word_row_ids[got.word_ids], want.word_ids)
    ids = got.word_row_ids[: buf.n_word_rows]
    assert int(ids[0]) == 0 and bool((ids[1:] > 0).all()) and bool((ids[1:].diff() > 0).all())
    if fixed:
        assert got.word_row_ids.numel() == want.word_ids.numel() + 1


def test_a_packed_run_with_the_sparse_table_learns_and_records_what_it_fed(monkeypatch):
    """The training loop on packed rows (compiled, one static shape; the sparse word table's ids renumbered in the
    loader): the loss falls, every step has one shape, and the run records fill and host_ms."""
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.train import train
    from tests.test_pretrain import WV, _cfg, _rows
    from tests.test_pretrain import V as PV
    from tests.test_pretrain import W as PW

    seen: list = []
    real = PairRows.__getitem__
    monkeypatch.setattr(PairRows, "__getitem__", lambda self, key: seen.append(real(self, key).layout) or real(
        self, key))
    cfg = _cfg(steps=30, log_every=10, lr=3e-3, warmup_steps=3, compile=True, compile_backend="aot_eager",
               model={"hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_size": 64, "hidden_dropout": 0.0,
                      "attention_dropout": 0.0, "max_len": 64, "word_table": "sparse"},
               data={"max_seq_len": 64, "batch_size": 2, "bucket_batches": 2, "packing": "pairs"})
    fed: dict = {}
    model, log = train(cfg, rows_of(_rows(n_docs=10)), PV, WV, PW, progress=False, on_data=fed.update)
    assert log[-1]["mlm_loss"] < log[0]["mlm_loss"], [r["mlm_loss"] for r in log]
    assert len(set(seen)) == 1 and len(seen) >= 30
    assert 0.7 < fed["fill"] <= 1.0 and fed["host_ms"] > 0  # pairs of ~23 tokens in rows of 64
