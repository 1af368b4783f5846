"""The packed loader's own guarantees: batch ``(epoch, k)`` is the same bytes whoever builds it (inline, a thread,
a worker process) and after a restart at ``k``; packs on disk equal packs in memory and are reused from the cache;
ranks read disjoint shares that cover the rows; the vectorised greedy is the reference's walk.
(Masking, pairing and leak-removal properties: tests/test_pretrain_data.py, for both loaders.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.pretrain.data import rows_of
from tasks.pretrain.packed import (
    PackedBatches,
    Schedule,
    _greedy_units,
    cached_pack,
    loader,
    open_pack,
    pack_rows,
)
from tests.test_pretrain_data import ROWS, VOCAB, W, cfg

FIELDS = ("input_ids", "segment_ids", "attention_mask", "word_ids", "mlm_positions", "mlm_labels", "nsp_labels")


def _same(a, b) -> bool:
    return a.n_real_tokens == b.n_real_tokens and all(torch.equal(getattr(a, k), getattr(b, k)) for k in FIELDS)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    c = cfg()
    d = tmp_path_factory.mktemp("pack")
    return c, pack_rows(ROWS, c, W, d), d


def test_pack_on_disk_equals_pack_in_memory(packed):
    c, disk, d = packed
    mem = pack_rows(ROWS, c, W)
    for k in ("chars", "slots", "offsets", "len_a", "nsp"):
        assert np.array_equal(getattr(disk, k), getattr(mem, k)), k
    reopened = open_pack(d)
    assert np.array_equal(reopened.slots, mem.slots) and reopened.meta["rows"] == len(ROWS)


def test_a_batch_is_the_same_bytes_inline_in_a_thread_in_a_process_and_after_a_restart(packed):
    """Batch (epoch, k) draws from its own generator: who builds it, and in what order, cannot matter."""
    c, _, d = packed
    data = PackedBatches(d, c, VOCAB)
    n = data.per_epoch()
    keys = list(Schedule(0, 0, 2 * n + 3, n))
    assert keys[n] == (1, 0) and keys[-1] == (2, 2)
    inline = [data[key].to("cpu") for key in keys]
    for kind, workers in (("thread", 2), ("process", 1)):
        got = [(key, b.to("cpu")) for key, b in loader(data, Schedule(0, 0, len(keys), n), workers, 2, False, kind)]
        assert [key for key, _ in got] == keys, kind
        assert all(_same(a, b) for a, (_, b) in zip(inline, got)), kind
    restart = [b.to("cpu") for _, b in loader(data, Schedule(1, 3, 5, n), 1, 2, False)]  # resume at epoch 1, batch 3
    assert all(_same(a, b) for a, b in zip(inline[n + 3 : n + 8], restart))
    epochs_differ = [a.input_ids.shape != b.input_ids.shape or not _same(a, b) for a, b in zip(inline, inline[n:])]
    assert all(epochs_differ[:n])  # another epoch: another order and other masks


def test_cached_pack_is_built_once_and_reused(tmp_path):
    c, calls = cfg(), []

    def build(out):
        calls.append(out)
        return pack_rows(ROWS, c, W, out)

    a = cached_pack(tmp_path, "key1", build)
    b = cached_pack(tmp_path, "key1", build)
    assert len(calls) == 1 and np.array_equal(a.chars, b.chars)
    assert [p.name for p in tmp_path.iterdir()] == ["key1"]  # the temporary build directory is gone


def test_ranks_read_disjoint_shares_that_cover_every_row():
    share = rows_of(ROWS)
    parts = [list(share(r, 3)) for r in range(3)]
    ids = [id(row) for p in parts for row in p]
    assert sorted(ids) == sorted(id(r) for r in ROWS) and len(set(ids)) == len(ROWS)
    docs = [{r["doc_id"] for r in p} for p in parts]
    assert not (docs[0] & docs[1]) and not (docs[1] & docs[2])  # whole documents, so IsNext pairs stay inside
    assert all(len(p) > 0.2 * len(ROWS) for p in parts)


def test_vectorised_greedy_is_the_reference_walk():
    """Take a unit when it fits what is left, skip it otherwise, in order: the passes reproduce it exactly."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        B, U = int(rng.integers(1, 6)), int(rng.integers(1, 30))
        lens = rng.integers(0, 5, size=(B, U)).astype(np.int32)
        lens = -np.sort(-lens, axis=1) if rng.random() < 0.2 else lens  # units that exist first, or anywhere
        budget = rng.integers(1, 12, size=B)
        got = _greedy_units(lens, budget)
        for b in range(B):
            left, want = int(budget[b]), []
            for u in range(U):
                take = 0 < lens[b, u] <= left
                want.append(take)
                left -= lens[b, u] if take else 0
            assert got[b].tolist() == want
