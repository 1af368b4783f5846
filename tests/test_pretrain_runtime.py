"""The pretraining loop at run time: no device read on a step that does not log, bounded compilation, progress
lines and heartbeat, and a SIGTERM that stops after the step, checkpoints and resumes to the same bytes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from tasks.pretrain.data import rows_of
from tasks.pretrain.train import train
from tasks.training.checkpoint import latest_state
from tests.test_pretrain import WV, V, W, _cfg, _rows

REPO = Path(__file__).resolve().parents[1]
OWN_CODE = tuple(str(REPO / d) for d in ("tasks", "models", "storage", "flows", "lexiflow"))

# every Tensor method that copies a device value to the host (or waits for the device)
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class DeviceReads:
    """Counts device reads whose caller is lexiflow's own code (torch's internals excluded), per training step."""

    def __init__(self, monkeypatch):
        self.by_step: dict[int, int] = {}
        self.step = 0
        for name in READS:
            self._wrap(monkeypatch, name)
        real_sync = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", self._counting(real_sync, torch_method=False))

    def _counting(self, fn, torch_method=True):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OWN_CODE):
                self.by_step[self.step] = self.by_step.get(self.step, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    def _wrap(self, monkeypatch, name):
        monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))


def test_a_step_that_does_not_log_reads_nothing_from_the_device(monkeypatch):
    """Reads are attributed to the step that is running (the counter moves on at each step's end, seen through the
    progress log's host counter). Steps 1-4 and 6-9 log nothing: zero reads; the log rows read (a few at most)."""
    from tasks.training import progress

    reads = DeviceReads(monkeypatch)
    real_advance = progress.ProgressLog.advance

    def advance(self, step):
        real_advance(self, step)
        reads.step = step  # what follows belongs to the next step (the log row of `step` is read after this)

    monkeypatch.setattr(progress.ProgressLog, "advance", advance)
    cfg = _cfg(steps=10, log_every=5, eval_every=1000, data={"max_seq_len": 32, "batch_size": 4,
                                                             "bucket_batches": 2, "loader_workers": 0})
    _, log = train(cfg, rows_of(_rows()), V, WV, W, progress=False)
    assert [r["step"] for r in log] == [5, 10]
    log_steps = {5, 10}
    during = {s: n for s, n in reads.by_step.items() if 1 <= s < 10}
    # reads counted under `step` happen after step `step` ended: the log row of `step` when it logs, else none
    assert {s for s, n in during.items() if n} <= log_steps, reads.by_step
    assert reads.by_step.get(5, 0) >= 1, "the counter must see the log row's read"
    assert max(reads.by_step.get(s, 0) for s in log_steps) <= 4


def test_cpu_log_rows_are_the_per_step_reads_summed_in_step_order():
    """The device sums give the figures the per-step float() reads gave: the mean MLM loss of a window of k steps
    is the mean of the k one-step rows (float64 sums in the same order: equal, not close)."""
    base = dict(steps=6, data={"max_seq_len": 32, "batch_size": 4, "bucket_batches": 2, "loader_workers": 0})
    _, ones = train(_cfg(**base, log_every=1), rows_of(_rows()), V, WV, W, progress=False)
    _, threes = train(_cfg(**base, log_every=3), rows_of(_rows()), V, WV, W, progress=False)
    for i, row in enumerate(threes):
        part = ones[3 * i: 3 * i + 3]
        total = 0.0
        for r in part:
            total += r["mlm_loss"]
        assert row["mlm_loss"] == total / 3
        assert row["grad_norm"] == sum(r["grad_norm"] for r in part) / 3


# ----------------------------------------------------------------------------- bounded compilation


def test_compiled_run_over_many_batch_lengths_compiles_one_graph_per_bucket():
    """Rows of many lengths make batches of many lengths and masked counts; with compile they are padded to
    ``compile_buckets`` shapes, and dynamo compiles no more graphs than that."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from tasks.pretrain.packed import PackedBatches, pack_rows
    from tasks.pretrain.shapes import BucketedBatches

    cfg = _cfg(steps=16, log_every=4, compile=True, compile_backend="aot_eager", compile_buckets=3,
               data={"max_seq_len": 32, "batch_size": 2, "bucket_batches": 1, "loader_workers": 0,
                     "heldout_frac": 0.0},
               model={"hidden_size": 16, "num_layers": 1, "num_heads": 2, "ffn_size": 32, "hidden_dropout": 0.0,
                      "attention_dropout": 0.0, "max_len": 64})
    rows = _rows(n_docs=8, per_doc=6, seed=3)
    data = PackedBatches(pack_rows(iter(rows), cfg.data, W), cfg.data, V)
    shapes = {(b.input_ids.shape, b.mlm_positions.shape) for b in (data[0, k].to() for k in range(16))}
    assert len(shapes) > 3, shapes  # without buckets, this many graphs (or a dynamic one)
    padded = BucketedBatches(data, 3)
    assert len({(b.input_ids.shape, b.mlm_positions.shape) for b in (padded[0, k].to() for k in range(16))}) <= 3
    torch._dynamo.reset()
    counters.clear()
    _, log = train(cfg, rows_of(rows), V, WV, W, progress=False)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 3, dict(counters["stats"])
    assert all(np.isfinite(r["mlm_loss"]) for r in log)
    torch._dynamo.reset()


def test_padding_to_a_bucket_changes_no_loss():
    """A padded batch (longer, more pairs, more masked positions) gives the same losses and counts as the batch
    itself: padding is masked out of attention and ignored by both losses."""
    from models import LebertForPretraining, ModelConfig
    from tasks.pretrain.packed import PackedBatches, pack_rows
    from tasks.pretrain.shapes import BucketedBatches

    cfg = _cfg(data={"max_seq_len": 32, "batch_size": 4, "bucket_batches": 1, "heldout_frac": 0.0})
    data = PackedBatches(pack_rows(iter(_rows()), cfg.data, W), cfg.data, V)
    torch.manual_seed(0)
    model = LebertForPretraining(ModelConfig(vocab_size=V, word_vocab_size=5, word_dim=8, max_word_num=W,
                                             hidden_size=16, num_layers=1, num_heads=2, ffn_size=32, max_len=64,
                                             hidden_dropout=0.0, attention_dropout=0.0)).eval()
    last = data.per_epoch() - 1
    for k in (0, last):
        raw = data[0, k]
        big = BucketedBatches(data, 2)
        T = dict(raw.layout)["input_ids"][1]
        from tasks.pretrain.shapes import pad_batch

        pad = pad_batch(raw, *(s + extra for s, extra in zip(big.shape_for(T), (3, 5, 2))))
        outs = []
        for buf in (raw, pad):
            b = buf.to()
            outs.append(model(b.input_ids, b.segment_ids, b.attention_mask, b.word_ids, b.mlm_positions,
                              b.mlm_labels, b.nsp_labels))
        assert pad.counts() == raw.counts()
        assert outs[1].mlm_loss.item() == pytest.approx(outs[0].mlm_loss.item(), rel=1e-5)
        assert outs[1].nsp_loss.item() == pytest.approx(outs[0].nsp_loss.item(), rel=1e-5)
        assert int(outs[1].mlm_correct) == int(outs[0].mlm_correct)
        assert int(outs[1].nsp_correct) == int(outs[0].nsp_correct)


def test_padded_pairs_use_the_vocabularys_own_cls_id():
    """An imported checkpoint's [CLS] is not the counted vocabulary's id 2: padded pairs take the artifact's."""
    from tasks.pretrain.packed import PackedBatches, pack_rows
    from tasks.pretrain.shapes import BucketedBatches
    from tasks.text.vocab import TokenIds

    cfg = _cfg(data={"max_seq_len": 32, "batch_size": 4, "bucket_batches": 1, "heldout_frac": 0.0})
    counted = PackedBatches(pack_rows(iter(_rows()), cfg.data, W), cfg.data, V)
    vocab = ["[PAD]", "[unused1]", "[unused2]"] + [f"c{i}" for i in range(V + 100)] + ["[UNK]", "[CLS]", "[SEP]",
                                                                                      "[MASK]"]
    ids = TokenIds.of(vocab)
    assert ids.cls != 2
    imported = PackedBatches(pack_rows(iter(_rows()), cfg.data, W, specials=ids), cfg.data, ids)
    for data, cls in ((counted, 2), (imported, ids.cls)):
        raw = data[0, data.per_epoch() - 1]
        padded = BucketedBatches(data, 1)[0, data.per_epoch() - 1].to()
        b0 = dict(raw.layout)["input_ids"][0]
        assert b0 < padded.input_ids.shape[0], "the last batch must be short for this test"
        assert set(padded.input_ids[b0:, 0].tolist()) == {cls}


def test_compile_buckets_stays_out_of_the_version_at_its_default():
    cfg = _cfg()
    assert "compile_buckets" not in cfg.model_dump(mode="json")
    assert _cfg(compile_buckets=2).model_dump(mode="json")["compile_buckets"] == 2


# ----------------------------------------------------------------------------- progress lines


def test_each_log_row_is_a_progress_line_and_silence_gets_a_heartbeat(caplog):
    """One INFO line per log row (step/total, losses, tokens/s, data wait, ETA), the phases before the first step
    with their times, and a heartbeat when the rows are slow to come (here: a slow corpus read)."""

    def slow_rows(rank=0, world=1):
        for r in _rows(n_docs=20):
            time.sleep(0.008)  # about a second of reading: several heartbeats of 0.2 s
            yield r

    caplog.set_level(logging.INFO, logger="lexiflow")
    cfg = _cfg(steps=6, log_every=2, data={"max_seq_len": 32, "batch_size": 4, "bucket_batches": 2,
                                           "loader_workers": 0, "heldout_frac": 0.2})
    train(cfg, slow_rows, V, WV, W, progress=False, heartbeat_s=0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "lexiflow.progress"]
    rows = [m for m in lines if m.startswith("pretrain step ")]
    assert [m.split(" | ")[0] for m in rows] == ["pretrain step 2/6", "pretrain step 4/6", "pretrain step 6/6"]
    assert all("tok/s" in m and "data wait" in m and "ETA" in m and "loss" in m for m in rows), rows
    assert any("held-out acc" in m for m in rows)  # the last row is evaluated
    assert any("packing the training rows done in" in m and "pairs" in m for m in lines), lines
    assert any("first step done in" in m for m in lines), lines
    assert any("still reading" in m for m in lines), lines


# ----------------------------------------------------------------------------- SIGTERM: stop, checkpoint, resume

SCRIPT = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import fsspec
    from safetensors.torch import save
    from tasks.training.checkpoint import weights
    from tasks.pretrain.train import train
    from tasks.pretrain.data import rows_of
    from tests.test_pretrain import WV, V, W, _cfg, _rows

    ckpt, marker, out = sys.argv[1:4]
    def on_log(row):
        if row["step"] == 4:
            Path(marker).write_text("x")
    cfg = _cfg(**json.loads(sys.argv[4]))
    model, log = train(cfg, rows_of(_rows()), V, WV, W, fsspec.filesystem("file"), ckpt, on_log=on_log,
                       progress=False)
    Path(out).write_bytes(save(weights(model)))
""")

SIGTERM_CFG = dict(steps=24, log_every=4, checkpoint_every=1000,
                   model={"hidden_size": 48, "num_layers": 2, "num_heads": 4, "ffn_size": 128, "hidden_dropout": 0.1,
                          "attention_dropout": 0.1, "max_len": 64},
                   data={"max_seq_len": 32, "batch_size": 8, "bucket_batches": 2, "loader_workers": 0})


def _script(tmp_path, *args):
    path = tmp_path / "run.py"
    path.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    return subprocess.Popen([sys.executable, str(path), *args, json.dumps(SIGTERM_CFG)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_stops_after_the_step_checkpoints_and_the_rerun_gives_the_same_bytes(tmp_path):
    from safetensors.torch import save

    from tasks.training.checkpoint import weights

    ckpt, marker = tmp_path / "ckpt", tmp_path / "marker"
    proc = _script(tmp_path, str(ckpt), str(marker), str(tmp_path / "a.safetensors"))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    time.sleep(0.1)  # somewhere between two log rows, most likely
    proc.send_signal(signal.SIGTERM)
    t = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t < 15
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    stopped_at = latest_state(fsspec.filesystem("file"), str(ckpt)).step
    assert 4 <= stopped_at < 24
    [line] = [ln for ln in err.splitlines() if "stopped by SIGTERM" in ln]
    assert f"at step {stopped_at}/24" in line and "run the same command again to resume" in line
    assert not (tmp_path / "a.safetensors").exists()

    rerun = _script(tmp_path, str(ckpt), str(tmp_path / "marker2"), str(tmp_path / "b.safetensors"))
    _, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err[-3000:]
    model, log = train(_cfg(**SIGTERM_CFG), rows_of(_rows()), V, WV, W, progress=False)
    assert (tmp_path / "b.safetensors").read_bytes() == save(weights(model))
    state = latest_state(fsspec.filesystem("file"), str(ckpt))
    assert state.step == 24
    assert [(r["step"], r["mlm_loss"], r["grad_norm"]) for r in state.log] == \
        [(r["step"], r["mlm_loss"], r["grad_norm"]) for r in log]  # the window cut by the stop resumed whole


def test_fine_tuning_stops_after_the_batch_on_sigterm_with_one_line(caplog):
    """fit() (fine-tuning and NER): a SIGTERM during batch 2 ends training after that batch, with one line saying
    where and that the stage runs again; the handler is gone afterwards (the default action is back)."""
    from tasks.training.loop import fit
    from tasks.training.preempt import Preempted
    from tests.test_loop import _Cfg, _toy

    model, x, y = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def batch_loss(model, idx):
        seen.append(idx)
        if len(seen) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return ((model(x[idx]) - y[idx]) ** 2).mean(), len(idx), len(idx)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as e:
        fit(model, opt, np.ones(len(x), np.int64), batch_loss, lambda *a: None, _Cfg,
            ("epoch", "lr", "train_loss", "improved"), name="finetune")
    assert len(seen) == 2 and e.value.code == 128 + signal.SIGTERM
    assert e.value.line == "finetune stopped by SIGTERM in epoch 1, batch 2/6; run the same command again to run " \
                           "the stage again"
    assert [r.getMessage() for r in caplog.records if "stopped by" in r.getMessage()] == [e.value.line]
    assert signal.getsignal(signal.SIGTERM) is before
