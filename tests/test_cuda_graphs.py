"""pretrain.cuda_graphs: the whole step captured per batch shape on CUDA, checked on CPU where it can be.

A real capture needs a GPU. Here: the option's validation and dump, that on CPU it is ignored with one line and
changes no byte, the capture wrapper's bookkeeping with a capture that replays the step eagerly (so a run through
it must give the bytes of a run whose capture failed and fell back), the fallback's one warning, and the
capturable optimizer's tensor learning rate under the scheduler and a checkpoint round trip; a sparse word table
through the captured step (the same bytes as its fallback, and resumed exactly).
"""

from __future__ import annotations

import contextlib
import logging
import uuid

import fsspec
import pytest
import torch
from pydantic import ValidationError

from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.train import lr_lambda
from tasks.training import graphs as step_graphs
from tasks.training.graphs import StepGraphs, make_capturable
from tasks.training.loop import make_adamw
from tests.test_pretrain import WV, _cfg, _train


def _same_run(a, b, exact: bool = True):
    """Two training runs' logs and weights: the same bytes (``exact``: the same computation run twice, or the resume
    promise), else equal to float tolerance (other shapes or another kernel: other bits on another CPU)."""
    (m1, log1), (m2, log2) = a, b
    for key in ("mlm_loss", "grad_norm"):
        got, want = [r[key] for r in log1], [r[key] for r in log2]
        assert got == want if exact else got == pytest.approx(want, rel=1e-5), key
    for (name, p), q in zip(m1.state_dict().items(), m2.state_dict().values()):
        if exact:
            assert torch.equal(p, q), name
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_option_is_validated_and_left_out_of_dumps_while_off():
    assert "cuda_graphs" not in PretrainConfig().model_dump()
    assert PretrainConfig(cuda_graphs=True).model_dump()["cuda_graphs"] is True
    with pytest.raises(ValidationError, match="cuda_graphs"):
        PretrainConfig(cuda_graphs="maybe")


def test_on_cpu_the_option_is_ignored_with_one_line_and_the_same_bytes(caplog):
    cfg = _cfg(steps=4)
    with caplog.at_level(logging.INFO, logger="lexiflow"):
        on = _train(cfg.model_copy(update={"cuda_graphs": True}))
    lines = [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()]
    assert lines == ["pretrain: cuda_graphs is on but the device is cpu: ignored (CUDA only)"]
    _same_run(on, _train(cfg))


def test_wanted_only_on_cuda_and_one_process(caplog):
    cuda = torch.device("cuda")
    assert not step_graphs.wanted(False, cuda, 1)
    assert step_graphs.wanted(True, cuda, 1)
    with caplog.at_level(logging.INFO, logger="lexiflow"):
        assert not step_graphs.wanted(True, cuda, 2)
    assert "2-process DDP run: ignored" in caplog.records[-1].getMessage()


def _eager_capture(step, static):
    """A stand-in for a CUDA graph on CPU: replaying runs the captured step on the static buffers (the gradients
    set to None first, as a graph's backward writes them afresh)."""
    opt = step.__self__.opt

    def replay():
        opt.zero_grad(set_to_none=True)
        return step(static)

    return replay


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """The loop's CUDA-graph path on CPU: the option taken as wanted, the warm-up on the current stream, and the
    instances created kept for the test to inspect."""
    made = []
    monkeypatch.setattr(step_graphs, "wanted", lambda enabled, device, world, name="pretrain": enabled)
    monkeypatch.setattr(step_graphs, "side_stream", contextlib.nullcontext)
    real_init = StepGraphs.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(StepGraphs, "__init__", init)
    return made


def test_capture_per_shape_replays_and_a_failed_capture_goes_on_with_one_warning(graphs_on_cpu, monkeypatch,
                                                                                   caplog):
    cfg = _cfg(steps=10, cuda_graphs=True, compile_buckets=2)
    monkeypatch.setattr(step_graphs, "capture_step", _eager_capture)
    with caplog.at_level(logging.INFO, logger="lexiflow"):
        replayed = _train(cfg)
    g = graphs_on_cpu[-1]
    assert g.failed is None and 1 <= len(g.graphs) <= 2 and g.replays == 10 - len(g.graphs)
    assert sum("CUDA graph" in r.getMessage() and "captured" in r.getMessage() for r in caplog.records) \
        == len(g.graphs)

    def broken(step, static):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore text")

    monkeypatch.setattr(step_graphs, "capture_step", broken)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lexiflow"):
        fell_back = _train(cfg)
    g = graphs_on_cpu[-1]
    assert g.failed == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert g.replays == 0 and not g.graphs
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["pretrain: CUDA graph capture failed (RuntimeError: CUDA error: operation not permitted "
                        "when stream is capturing); the run goes on without CUDA graphs"]
    _same_run(replayed, fell_back)  # the replays ran the same steps as the eager fallback


SPARSE_MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "ffn_size": 64, "hidden_dropout": 0.1,
                "attention_dropout": 0.1, "max_len": 64, "word_table": "sparse"}


def test_a_sparse_word_table_is_captured_with_the_step_and_gives_the_ordinary_steps_bytes(graphs_on_cpu,
                                                                                          monkeypatch):
    # The reference is the same run whose capture fails: every step then is the loop's ordinary sparse step over
    # the same (bucketed) batches, the rows padded alike. A run with cuda_graphs off reads unbucketed batches of
    # other shapes (other dropout draws), so it is no byte reference. The replayed step does the ordinary step's
    # ops in its order on the same batches, but RowAdamW's update runs over the padded rows (step_static) where the
    # ordinary step runs over the batch's words only: other tensor sizes, so equal to float tolerance, not in bits.
    cfg = _cfg(steps=10, cuda_graphs=True, compile_buckets=2, model=SPARSE_MODEL)
    monkeypatch.setattr(step_graphs, "capture_step", _eager_capture)
    replayed = _train(cfg)
    g = graphs_on_cpu[-1]
    assert g.rows is not None and g.rows.fixed_shape  # static rows: one graph per batch shape, not per batch
    assert g.failed is None and 1 <= len(g.graphs) <= 2 and g.replays == 10 - len(g.graphs)
    assert all(any(k == "word_row_ids" for k, _ in key) for key in g.graphs)

    def broken(step, static):
        raise RuntimeError("no capture")

    monkeypatch.setattr(step_graphs, "capture_step", broken)
    fell_back = _train(cfg)
    assert graphs_on_cpu[-1].failed == "RuntimeError: no capture"
    _same_run(replayed, fell_back, exact=False)
    table = replayed[0].encoder.adapter.word_embeddings.weight.detach()
    assert torch.equal(table[0], torch.from_numpy(WV[0]))  # [PAD] never steps
    assert not torch.equal(table[1:], torch.from_numpy(WV[1:]))  # the batches' words were trained


@pytest.mark.parametrize("word_table", ["dense", "sparse"])
def test_resume_through_the_graph_path_is_exact(graphs_on_cpu, monkeypatch, word_table):
    cfg = _cfg(steps=8, cuda_graphs=True, compile_buckets=2, model={**SPARSE_MODEL, "word_table": word_table})
    monkeypatch.setattr(step_graphs, "capture_step", _eager_capture)
    full = _train(cfg)
    fs, ck = fsspec.filesystem("memory"), f"/ck-{uuid.uuid4().hex}"
    _train(cfg, ckpt_fs=fs, ckpt_dir=ck, stop_at=3)
    _same_run(full, _train(cfg, ckpt_fs=fs, ckpt_dir=ck))


def test_step_graphs_key_and_static_buffers():
    model = torch.nn.Linear(3, 1)
    opt = make_adamw(model, 1e-2, 0.0)
    seen = []

    class Out:
        def __init__(self, loss):
            self.loss = loss

    def forward(x, flag):
        seen.append(x)
        return Out(model(x).pow(2).mean())

    g = StepGraphs(forward, opt, list(model.parameters()), 1.0, capture=_eager_capture,
                   warm_stream=contextlib.nullcontext)
    x1, x2 = torch.ones(2, 3), torch.full((2, 3), 2.0)
    g({"x": x1, "flag": True})  # warm-up (the real step), then captured
    g({"x": x2, "flag": True})  # replayed: copied into the static buffer
    assert seen[-1] is not x2 and torch.equal(seen[-1], x2)
    g({"x": x2, "flag": False})  # another key: its own graph
    g({"x": torch.ones(4, 3), "flag": False})
    assert len(g.graphs) == 3 and g.replays == 1
    assert StepGraphs.key({"x": x1, "flag": None, "y": None}) == (("x", ((2, 3), torch.float32)), ("flag", None),
                                                                  ("y", None))


def test_capturable_optimizer_lr_is_a_tensor_the_scheduler_fills_and_survives_a_checkpoint():
    cfg = _cfg(steps=10, warmup_steps=3)
    model = torch.nn.Linear(3, 2)
    opt = make_adamw(model, cfg.lr, 0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    make_capturable(opt, torch.device("cpu"), capturable=False)  # the flag itself is for CUDA only
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(torch.is_tensor(t) and t.dtype == torch.float32 for t in lrs)
    expect = []
    for step in range(5):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
        expect.append(cfg.lr * lr_lambda(cfg)(step + 1))
        assert opt.param_groups[0]["lr"] is lrs[0]  # filled in place: a captured step reads the new value
        assert float(sched.get_last_lr()[0]) == pytest.approx(expect[-1], rel=1e-6)
    saved = {"opt": opt.state_dict(), "sched": sched.state_dict()}
    opt2 = make_adamw(model, cfg.lr, 0.01)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda(cfg))
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    make_capturable(opt2, torch.device("cpu"), capturable=False)
    assert all(torch.is_tensor(g["lr"]) for g in opt2.param_groups)
    sched2.step()
    assert float(opt2.param_groups[0]["lr"]) == pytest.approx(cfg.lr * lr_lambda(cfg)(6), rel=1e-6)
    assert all(torch.is_tensor(s["step"]) and s["step"].dtype == torch.float32 for s in opt2.state.values())


def test_the_loops_padding_hint_agrees_with_the_mask_packed_and_bucketed():
    """On CUDA the loop tells the model about a batch's padding from its host copy (no device read): whether it has
    any (the mask's answer) and, for an eager step, where its real tokens are; for packed batches and for batches
    padded to a bucket (some have no padding)."""
    from models import bert
    from tasks.pretrain.data import rows_of
    from tasks.pretrain.packed import PackedBatches, pack_rows
    from tasks.pretrain.shapes import BucketedBatches
    from tasks.pretrain.train import has_padding, padding_hint
    from tests.test_pretrain import V, W, _rows

    cfg = _cfg(data={"max_seq_len": 16, "batch_size": 2, "bucket_batches": 1, "heldout_frac": 0.0})
    data = PackedBatches(pack_rows(rows_of(_rows(n_docs=8, per_doc=6, seed=3))(0, 1), cfg.data, W), cfg.data, V)
    seen = set()
    for source in (data, BucketedBatches(data, 2)):
        for k in range(data.per_epoch()):
            buf = source[0, k]
            b = buf.to()
            assert has_padding(b) == (not bool(b.attention_mask.all()))
            seen.add(has_padding(b))
            cpu = torch.device("cpu")
            hint = padding_hint(buf, b, cpu, static=False)
            if has_padding(b):  # its real tokens, found on the host
                assert hint.rows.tolist() == b.attention_mask.reshape(-1).nonzero().squeeze(1).tolist()
                assert hint.offsets.tolist() == [0, *b.attention_mask.sum(1).cumsum(0).tolist()]
                assert padding_hint(buf, b, cpu, static=True) is True  # compiled or captured: the masked kernel
            else:
                assert hint is False and padding_hint(buf, b, cpu, static=True) is False
    assert seen == {True, False}
    jagged = bert._jagged_state["on"]
    try:
        bert._jagged_state["on"] = False
        assert padding_hint(buf, b, cpu, static=False) is has_padding(b)
    finally:
        bert._jagged_state["on"] = jagged


def test_make_capturable_moves_a_learning_rate_a_checkpoint_loaded_onto_the_host_to_the_device():
    """A checkpoint is loaded onto the host (``map_location="cpu"``), so a captured run's resumed optimizer holds its
    learning rates as host tensors: make_capturable puts floats and host tensors alike on the step's device (the
    meta device stands in for a GPU here), and keeps a tensor already there (the scheduler fills that one)."""
    p = torch.nn.Parameter(torch.zeros(2, device="meta"))
    opt = torch.optim.AdamW([{"params": [p], "lr": 1e-3}, {"params": [], "lr": torch.tensor(2e-3)}])
    make_capturable(opt, torch.device("meta"), capturable=False)
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(torch.is_tensor(lr) and lr.device.type == "meta" and lr.dtype == torch.float32 for lr in lrs)
    make_capturable(opt, torch.device("meta"), capturable=False)
    assert all(g["lr"] is lr for g, lr in zip(opt.param_groups, lrs))  # already on the device: the same tensor
