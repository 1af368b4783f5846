"""Pretraining loop: exact resume, run-to-run determinism, loss goes down."""

from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pytest
import torch

from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.data import rows_of
from tasks.pretrain.train import lr_lambda, train

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
                    "word_starts": np.repeat(np.arange(n, dtype=np.int32), W),  # each slot: its own token
                    "word_ends": np.repeat(np.arange(1, n + 1, dtype=np.int32), W),
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
    return train(cfg, rows_of(rows), V, WV, W, progress=False, **kw)


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
    _, log1 = train(cfg, rows_of(rows), V, WV, W, progress=False)
    _, log2 = train(cfg, rows_of(rows), V, WV, W, progress=False)
    assert [r["mlm_loss"] for r in log1] == [r["mlm_loss"] for r in log2]  # bit-identical on CPU
    losses = [round(r["mlm_loss"], 3) for r in log1]
    assert losses[-1] < losses[0] - 0.8, losses


def test_warmup_then_decay_schedules():
    lin = lr_lambda(_cfg(steps=10, warmup_steps=2, schedule="linear"))
    cos = lr_lambda(_cfg(steps=10, warmup_steps=2, schedule="cosine"))
    assert [round(lin(s), 3) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert cos(2) == pytest.approx(1.0) and cos(6) == pytest.approx(0.5) and cos(10) == pytest.approx(0.0)


def test_stage_result_counts_steps_and_publishes_the_log():
    import pickle

    from tasks.pretrain.stage import stage_result
    from tests.reporting import Recording

    log = [{"step": s, "mlm_loss": 1.0 / s, "nsp_loss": 0.5, "mlm_acc": 0.1, "lr": 1e-3, "tokens_per_s": 9.0,
            "mfu": None, "grad_norm": 2.0} for s in (5, 10)]
    res = stage_result(log, {"steps": 10, "seed": 1})
    assert res.stats == {"in": 10, "out": 10, "rejected": {}} and res.rows == {"log.parquet": 2}
    rec = Recording()
    pickle.loads(pickle.dumps(res.publish))(None, rec)
    made = rec.artifacts
    assert made[0]["key"] == "pretrain-log"
    keep = ("step", "mlm_loss", "nsp_loss", "mlm_acc", "heldout_mlm_acc", "lr", "tokens_per_s", "mfu", "data_wait")
    assert made[0]["table"] == [{k: r.get(k) for k in keep} for r in log]  # grad_norm left out


def test_timings_go_to_the_run_record_never_to_the_log_file():
    from tasks.pretrain.stage import TIMING_COLUMNS, learned, run_record, stage_result

    log = [{"step": s, "mlm_loss": 1.0 / s, "tokens_per_s": 100.0 * s + 0.04, "mfu": None, "data_wait": s / 100}
           for s in (5, 10, 15)]
    assert learned(log) == [{"step": s, "mlm_loss": 1.0 / s} for s in (5, 10, 15)]
    assert log[0]["tokens_per_s"] == 500.04  # the rows themselves (live UI, checkpoints) keep them
    run = run_record(log, 12.345)
    assert run == {"wall_s": 12.3, "median_tokens_per_s": 1000.0, "median_data_wait": 0.1,
                   "log": {"step": [5, 10, 15], "tokens_per_s": [500.0, 1000.0, 1500.0], "mfu": [None] * 3,
                           "data_wait": [0.05, 0.1, 0.15]}}
    assert run_record([{**r, "mfu": 0.25} for r in log], 1.0)["median_mfu"] == 0.25
    assert set(TIMING_COLUMNS) == {"tokens_per_s", "mfu", "data_wait", "wall_tokens_per_s", "wall_mfu"}
    walled = [{**r, "wall_tokens_per_s": 50.0 * r["step"], "wall_mfu": None} for r in log]
    assert learned(walled) == learned(log)
    tp = {"tokens": 10, "mfu": None}
    rec = run_record(walled, 1.0, tp)
    assert rec["throughput"] == tp and rec["log"]["wall_tokens_per_s"] == [250.0, 500.0, 750.0]
    assert stage_result(log, {"steps": 15}, run).run == run


def test_heldout_documents_are_never_trained_on_and_scored_at_eval_steps():
    from tasks.pretrain.data import is_heldout, split_heldout

    rows = _rows(n_docs=30)
    cfg = _cfg(steps=12, log_every=2, eval_every=4, eval_batches=2,
               data={"max_seq_len": 32, "batch_size": 4, "shuffle_buffer": 8, "bucket_batches": 2,
                     "heldout_frac": 0.3})
    held = {r["doc_id"] for r in rows if is_heldout(r["doc_id"], 0.3, cfg.data.seed)}
    assert 0 < len(held) < 30
    train_f, held_f = split_heldout(rows_of(rows), 0.3, cfg.data.seed)
    assert {r["doc_id"] for r in train_f()}.isdisjoint(held) and {r["doc_id"] for r in held_f()} == held
    _, log = train(cfg, rows_of(rows), V, WV, W, progress=False)
    scored = {r["step"]: r["heldout_mlm_acc"] for r in log}
    assert [s for s, a in scored.items() if a is not None] == [4, 8, 12]
    assert all(0.0 <= scored[s] <= 1.0 for s in (4, 8, 12)) and log[-1]["heldout_mlm_loss"] > 0
    _, log2 = train(cfg, rows_of(rows), V, WV, W, progress=False)
    assert [r["heldout_mlm_acc"] for r in log2] == [r["heldout_mlm_acc"] for r in log]  # deterministic
    none = _cfg(steps=4, log_every=2, data={"max_seq_len": 32, "batch_size": 4, "shuffle_buffer": 8,
                                            "bucket_batches": 2, "heldout_frac": 0.0})
    _, log3 = train(none, rows_of(rows), V, WV, W, progress=False)
    assert all(r["heldout_mlm_acc"] is None for r in log3)


def test_mix_spreads_extra_documents_between_corpus_documents():
    from tasks.pretrain.domain import mix

    corpus = [{"doc_id": f"c{d}", "i": k} for d in range(20) for k in range(5)]  # 100 rows, 20 docs
    extra = [{"doc_id": f"e{d}", "i": k} for d in range(10) for k in range(2)]  # 20 rows, 10 docs
    out = list(mix(iter(corpus), extra, len(corpus)))
    assert sorted(map(str, out)) == sorted(map(str, corpus + extra))
    ids = [r["doc_id"] for r in out]
    for d in {r["doc_id"] for r in out}:  # every document stays contiguous
        at = [i for i, x in enumerate(ids) if x == d]
        assert at == list(range(at[0], at[-1] + 1)), d
    first_half = ids[: len(ids) // 2]
    assert 3 <= sum(x.startswith("e") for x in first_half) / 2 <= 7  # spread, not appended at the end


def test_throughput_two_ways_counts_flops_at_each_batch_real_length(monkeypatch):
    """Each log row has tokens/s over the steps' time and over the wall time (which holds the waits, evaluation and
    saves, so it is never faster); the stage's totals count each batch's real tokens at its real length (the
    longest pair, not the bucket it was padded to), and MFU is None on CPU."""
    from models import LebertForPretraining
    from tasks.pretrain import packed

    lengths = []  # (real tokens, real length, padded length) per training batch
    real_seq_len = packed.BatchBuffer.seq_len

    def seq_len(self):
        lengths.append((self.n_real_tokens, real_seq_len(self), dict(self.layout)["input_ids"][1]))
        return real_seq_len(self)

    per_token = {}
    counted = LebertForPretraining.flops_per_token

    def flops_per_token(self, t, f=0.15):
        per_token[t] = counted(self, t, f)
        return per_token[t]

    monkeypatch.setattr(packed.BatchBuffer, "seq_len", seq_len)
    monkeypatch.setattr(LebertForPretraining, "flops_per_token", flops_per_token)
    monkeypatch.setattr(torch, "compile", lambda m, **kw: m)  # the buckets of a compiled run, without compiling
    data: dict = {}
    _, log = _train(_cfg(steps=6, log_every=3, compile=True, compile_buckets=1), on_data=data.update)
    assert [r["step"] for r in log] == [3, 6]
    for r in log:
        assert 0 < r["wall_tokens_per_s"] <= r["tokens_per_s"] and r["mfu"] is None and r["wall_mfu"] is None
    assert len(lengths) == 6 and all(real <= padded == 32 for _, real, padded in lengths)
    assert any(real < padded for _, real, padded in lengths)
    tp = data["throughput"]
    assert tp["tokens"] == sum(n for n, _, _ in lengths) and tp["mfu"] is None and tp["peak_flops"] is None
    # FLOPs per token are linear in the attention length: asked at 0 and 1 once, then taken at each batch's real
    # length (its longest pair, not the bucket)
    assert set(per_token) == {0, 1}
    at = lambda t: per_token[0] + (per_token[1] - per_token[0]) * t  # noqa: E731
    assert tp["flops"] == pytest.approx(sum(n * at(real) for n, real, _ in lengths))
    assert tp["flops"] != pytest.approx(sum(n * at(padded) for n, _, padded in lengths))  # not the padded length
    assert 0 < tp["wall_tokens_per_s"] <= tp["tokens_per_s"] and tp["compute_s"] <= tp["wall_s"]


def test_window_times_steps_by_their_events_when_given_and_counts_the_wall_apart(monkeypatch):
    """On CUDA a step's compute time is the device time between the events recorded around it, read at the log row
    (never per step); the host time is then not used. The wall time runs from the window's start; a checkpointed
    window carries both into the resumed run."""
    from types import SimpleNamespace

    from tasks.training import progress
    from tasks.training.progress import Window

    class Event:  # what torch.cuda.Event offers the window
        def __init__(self, ms: float):
            self.ms, self.synced = ms, 0

        def elapsed_time(self, end: "Event") -> float:
            return end.ms - self.ms

        def synchronize(self) -> None:
            self.synced += 1

    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    out = SimpleNamespace(mlm_loss=torch.tensor(2.0), nsp_loss=torch.tensor(0.5), mlm_correct=torch.tensor(3.0),
                          nsp_correct=torch.tensor(1.0))
    w = Window()
    ends = []
    for i in range(4):  # 4 steps of 250 ms on the device, 1 s each on the host (the host waited on something else)
        start, end = Event(1000.0 * i), Event(1000.0 * i + 250.0)
        ends.append(end)
        w.add(out, 5, 2, 100, 1.0, None, 0.0, 1e9, (start, end))
    assert not any(e.synced for e in ends)  # nothing read before the row
    clock[0] += 4.0  # the window's wall time: 4 s
    row = w.flush(4, 0, 1e-3, None, 4e9)
    assert row["tokens_per_s"] == pytest.approx(400 / 1.0) and row["mfu"] == pytest.approx(4e9 / 1.0 / 4e9)
    assert row["wall_tokens_per_s"] == pytest.approx(100.0) and row["wall_mfu"] == pytest.approx(0.25)
    assert w.last == {"tokens": 400, "flops": 4e9, "compute_s": pytest.approx(1.0)}
    w.add(out, 5, 2, 100, 1.0, None, 0.0, 1e9, (Event(0.0), Event(500.0)))
    clock[0] += 2.0
    saved = w.state()  # a checkpoint between rows
    assert saved["time"] == pytest.approx(0.5) and saved["wall"] == pytest.approx(2.0) and saved["flops"] == 1e9
    resumed = Window()
    resumed.restore(saved, torch.device("cpu"))
    resumed.add(out, 5, 2, 100, 9.0, None, 0.0, 1e9, (Event(0.0), Event(500.0)))
    clock[0] += 1.0
    row = resumed.flush(2, 0, 1e-3, None, None)
    assert row["tokens_per_s"] == pytest.approx(200 / 1.0) and row["wall_tokens_per_s"] == pytest.approx(200 / 3.0)
    assert row["mfu"] is None and row["wall_mfu"] is None  # no peak (CPU)
