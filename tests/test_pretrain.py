"""Pretraining loop: exact resume, run-to-run determinism, loss goes down."""

from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pytest
import torch

from tasks.common.config import PretrainConfig
from tasks.train.pretrain import lr_lambda, train

V, W = 40, 2


def _rows(n_docs=6, per_doc=5, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for d in range(n_docs):
        for s in range(per_doc):
            n = int(rng.integers(6, 14))
            start = int(rng.integers(0, V - 6))
            ids = (6 + (start + np.arange(n)) % (V - 6)).astype(np.int32)  # learnable: counting sequences
            rows.append(
                {
                    "doc_id": f"d{d}",
                    "n_tokens": n,
                    "char_ids": ids,
                    "word_ids": rng.integers(0, 5, size=n * W).astype(np.int32),
                    "group_starts": np.array([0], np.int32),
                    "group_ends": np.array([2], np.int32),
                }
            )
    return rows


def _cfg(**kw):
    base = {
        "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_size": 64, "hidden_dropout": 0.1,
                  "attention_dropout": 0.1, "max_len": 64},
        "data": {"max_seq_len": 32, "batch_size": 4, "shuffle_buffer": 8, "bucket_batches": 2},
        "steps": 12,
        "warmup_steps": 2,
        "lr": 3e-3,
        "log_every": 1,
        "checkpoint_every": 1000,
        "threads": 1,
    }
    base.update(kw)
    return PretrainConfig.model_validate(base)


WV = np.random.default_rng(1).normal(size=(5, 8)).astype(np.float32)


def _train(cfg, **kw):
    rows = _rows()
    return train(cfg, lambda: iter(rows), V, WV, W, progress=False, **kw)


def test_resume_is_exact_across_epochs():
    cfg = _cfg()
    full, log_full = _train(cfg)
    fs = fsspec.filesystem("memory")
    ck = f"/ck-{uuid.uuid4().hex}"
    _, log_a = _train(cfg, ckpt_fs=fs, ckpt_dir=ck, stop_at=5)
    resumed, log_b = _train(cfg, ckpt_fs=fs, ckpt_dir=ck)
    assert log_full[-1]["epoch"] >= 1, "the run should cross an epoch boundary"
    assert [r["step"] for r in log_a] == [r["step"] for r in log_full if r["step"] <= 5]
    for (name, p), (_, q) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(p, q), name
    # the resumed run's log is whole: the rows before the checkpoint travel with it
    assert [r["step"] for r in log_b] == [r["step"] for r in log_full]
    assert [r["mlm_loss"] for r in log_b] == [r["mlm_loss"] for r in log_full]


def test_cpu_training_is_deterministic_and_lowers_the_loss():
    cfg = _cfg(
        steps=300, log_every=50, lr=2e-3, warmup_steps=20,
        data={"max_seq_len": 32, "batch_size": 16, "shuffle_buffer": 8, "bucket_batches": 2},
        model={"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_size": 128, "hidden_dropout": 0.0,
               "attention_dropout": 0.0, "max_len": 64},
    )
    rows = _rows(n_docs=20)
    _, log1 = train(cfg, lambda: iter(rows), V, WV, W, progress=False)
    _, log2 = train(cfg, lambda: iter(rows), V, WV, W, progress=False)
    assert [r["mlm_loss"] for r in log1] == [r["mlm_loss"] for r in log2]  # bit-identical on CPU
    losses = [round(r["mlm_loss"], 3) for r in log1]
    assert losses[-1] < losses[0] - 0.8, losses


def test_warmup_then_decay_schedules():
    lin = lr_lambda(_cfg(steps=10, warmup_steps=2, schedule="linear"))
    cos = lr_lambda(_cfg(steps=10, warmup_steps=2, schedule="cosine"))
    assert [round(lin(s), 3) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert cos(2) == pytest.approx(1.0) and cos(6) == pytest.approx(0.5) and cos(10) == pytest.approx(0.0)


def test_stage_result_counts_steps_and_publishes_the_log(monkeypatch):
    import pickle

    from tasks.train import loop
    from tasks.train.pretrain import stage_result

    log = [{"step": s, "mlm_loss": 1.0 / s, "nsp_loss": 0.5, "mlm_acc": 0.1, "lr": 1e-3, "tokens_per_s": 9.0,
            "mfu": None, "grad_norm": 2.0} for s in (5, 10)]
    res = stage_result(log, {"steps": 10, "seed": 1})
    assert res.stats == {"in": 10, "out": 10, "rejected": {}} and res.rows == {"log.parquet": 2}
    made = []
    monkeypatch.setattr("prefect.artifacts.create_table_artifact", lambda **kw: made.append(kw))
    monkeypatch.setattr(loop, "_in_run", lambda: True)
    pickle.loads(pickle.dumps(res.publish))(None)
    assert made[0]["key"] == "pretrain-log"
    keep = ("step", "mlm_loss", "nsp_loss", "mlm_acc", "lr", "tokens_per_s", "mfu")
    assert made[0]["table"] == [{k: r[k] for k in keep} for r in log]  # grad_norm left out
