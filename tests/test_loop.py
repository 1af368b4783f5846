"""The shared training loop: early stopping, AdamW groups, the optimizer step, batching, fit, curves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tasks.inference.runtime import autocast, resolve_device, sorted_batches
from tasks.training import loop
from tasks.training.loop import (
    EarlyStopper,
    EpochReport,
    bucket_batches,
    fit,
    make_adamw,
    optimizer_step,
    param_groups,
    plot_epochs,
    seeded_model,
)

# ----------------------------------------------------------------------------- early stopping


def test_early_stopper_scripted_sequence():
    s = EarlyStopper(patience=3, factor=0.8)
    aucs = [0.6, 0.7, 0.7, 0.65, 0.72, 0.71, 0.70, 0.69, 0.99]
    lr, trace = 1.0, []
    for a in aucs:
        improved, scale, stop = s.update(a)
        trace.append((improved, stop, lr))
        lr *= scale
        if stop:
            break
    assert [t[0] for t in trace] == [True, True, False, False, True, False, False, False]
    assert [t[1] for t in trace] == [False] * 7 + [True]  # 3 non-improving epochs in a row: stop at epoch 8
    assert [t[2] for t in trace] == pytest.approx([1.0, 1.0, 1.0, 0.8, 0.64, 0.64, 0.512, 0.4096])
    assert lr == pytest.approx(0.32768)
    assert (s.best_epoch, s.best) == (5, 0.72)


def test_early_stopper_nan_never_improves():
    s = EarlyStopper(patience=2, factor=1.0)
    assert s.update(float("nan")) == (False, 1.0, False)
    assert s.update(0.1) == (True, 1.0, False)
    assert s.update(float("nan")) == (False, 1.0, False)
    assert s.update(0.1) == (False, 1.0, True)  # equal is not better
    assert (s.best_epoch, s.best) == (2, 0.1)


# ----------------------------------------------------------------------------- optimizer


class _Net(torch.nn.Module):
    """Names like the real models': an ``encoder.`` part, a head and a CRF."""

    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 2)
        self.crf = torch.nn.Module()
        self.crf.transitions = torch.nn.Parameter(torch.zeros(2, 2))
        self.crf.start = torch.nn.Parameter(torch.zeros(2))
        self.frozen = torch.nn.Parameter(torch.zeros(5, 5), requires_grad=False)

    def forward(self, x):  # [B, 3] -> [B, 2]
        return self.head(self.encoder(x))


def _names(model, group):
    ids = {id(p) for p in group["params"]}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_param_groups_decay_and_no_decay_in_named_order():
    m = _Net()
    groups = param_groups(m, 0.01)
    assert [_names(m, g) for g in groups] == [
        ["encoder.0.weight", "head.weight", "crf.transitions"],  # ndim >= 2 decays; frozen left out
        ["encoder.0.bias", "encoder.1.weight", "encoder.1.bias", "head.bias", "crf.start"],
    ]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and all("lr" not in g for g in groups)


def test_param_groups_extra_no_decay_and_encoder_lr():
    m = _Net()
    opt = make_adamw(m, 1e-3, 0.1, no_decay=lambda n: n.startswith("crf."), encoder_lr=5e-5)
    g = opt.param_groups
    assert [_names(m, x) for x in g] == [
        ["head.weight"],
        ["head.bias", "crf.transitions", "crf.start"],
        ["encoder.0.weight"],
        ["encoder.0.bias", "encoder.1.weight", "encoder.1.bias"],
    ]
    assert [x["lr"] for x in g] == [1e-3, 1e-3, 5e-5, 5e-5]  # group 0 (the logged LR) is the head's
    assert [x["weight_decay"] for x in g] == [0.1, 0.0, 0.1, 0.0]
    assert all(x["betas"] == (0.9, 0.999) and not x["fused"] for x in g)


def test_optimizer_step_clips_and_returns_the_norm():
    torch.manual_seed(0)
    m = _Net()
    x = torch.randn(8, 3)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    before = [p.detach().clone() for p in m.parameters()]
    loss = (m(x) ** 2).sum() * 100
    loss.backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None]))
    m.zero_grad()
    gnorm = optimizer_step(opt, (m(x) ** 2).sum() * 100, m.parameters(), clip=0.5)
    assert float(gnorm) == pytest.approx(float(want), rel=1e-5) and float(gnorm) > 0.5
    step = torch.linalg.vector_norm(torch.stack([(p.detach() - q).norm() for p, q in zip(m.parameters(), before)]))
    assert float(step) == pytest.approx(0.5, rel=1e-4)  # SGD lr 1: the update is the clipped gradient
    assert optimizer_step(opt, (m(x) ** 2).sum(), m.parameters(), clip=None) is None


# ----------------------------------------------------------------------------- device, model, batches


def test_cpu_device_and_autocast_off_on_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
    with autocast(torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_seeded_model_is_reproducible():
    a, dev = seeded_model(lambda: torch.nn.Linear(4, 4), seed=7, threads=None, device_name="cpu")
    b, _ = seeded_model(lambda: torch.nn.Linear(4, 4), seed=7, threads=None, device_name="cpu")
    c, _ = seeded_model(lambda: torch.nn.Linear(4, 4), seed=8, threads=None, device_name="cpu")
    assert dev == torch.device("cpu")
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)


def test_bucket_batches_cover_everything_sorted_within_pools():
    lengths = np.random.default_rng(0).integers(3, 60, size=103)
    batches = bucket_batches(lengths, 4, np.random.default_rng([1, 1]), pool_batches=5)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(103)) and max(len(b) for b in batches) == 4
    assert all(np.all(np.diff(lengths[b]) >= 0) for b in batches)  # each batch is a run of a length-sorted pool
    again = bucket_batches(lengths, 4, np.random.default_rng([1, 1]), pool_batches=5)
    assert all(np.array_equal(x, y) for x, y in zip(batches, again))
    ev = list(sorted_batches(lengths, 10))
    assert np.array_equal(np.concatenate(ev), np.argsort(lengths, kind="stable")) and len(ev) == 11


# ----------------------------------------------------------------------------- fit


class _Cfg:
    seed, batch_size, max_epochs, patience, grad_clip = 3, 4, 10, 2, 1.0


def _toy(n=24):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    x = torch.randn(n, 2)
    y = x @ torch.tensor([[1.5], [-2.0]])
    return model, x, y


def test_fit_restores_the_best_epoch_not_the_last():
    model, x, y = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scores = iter([0.5, 0.9, 0.7, 0.6, 0.95])  # best at epoch 2; epochs 3 and 4 do not improve: stop
    snapshots, rows, seen = {}, [], []

    def batch_loss(model, idx):
        seen.append(idx)
        return ((model(x[idx]) - y[idx]) ** 2).mean(), len(idx), len(idx)

    def evaluate(model, batches, outs):
        assert sum(outs) == len(x) and [len(b) for b in batches] == outs
        epoch = len(snapshots) + 1
        snapshots[epoch] = {k: v.clone() for k, v in model.state_dict().items()}
        return EpochReport(next(scores), {"dev": float(epoch)}, keep=f"kept {epoch}")

    cols = ("epoch", "lr", "train_loss", "dev", "improved")
    res = fit(model, opt, np.ones(len(x), np.int64), batch_loss, evaluate, _Cfg, cols, lr_decay=0.5,
              on_epoch=rows.append)
    assert [r["epoch"] for r in res.log] == [1, 2, 3, 4] and rows == res.log
    assert (res.best_epoch, res.best_score, res.best) == (2, 0.9, "kept 2")
    assert [r["improved"] for r in res.log] == [True, True, False, False]
    assert [r["lr"] for r in res.log] == [0.1, 0.1, 0.1, 0.05]  # logged before the epoch's decay
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    assert list(res.log[0]) == list(cols) and all(r["train_loss"] > 0 for r in res.log)
    assert not torch.equal(snapshots[4]["weight"], snapshots[2]["weight"])
    for k, v in model.state_dict().items():  # epoch 2's weights, not the last epoch's
        assert torch.equal(v, snapshots[2][k]), k
    assert not model.training
    # epoch e's batches are bucket_batches(lengths, batch_size, default_rng([seed, e]))
    want = bucket_batches(np.ones(len(x), np.int64), 4, np.random.default_rng([3, 1]))
    assert all(np.array_equal(a, b) for a, b in zip(seen[: len(want)], want))


def test_fit_keeps_the_lr_by_default_when_an_epoch_does_not_improve():
    model, x, y = _toy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scores = iter([0.9, 0.5, 0.4, 0.3])  # no improvement after epoch 1; patience 2 stops after epoch 3

    def batch_loss(model, idx):
        return ((model(x[idx]) - y[idx]) ** 2).mean(), len(idx), None

    res = fit(model, opt, np.ones(len(x), np.int64), batch_loss, lambda m, b, o: EpochReport(next(scores), {}),
              _Cfg, ("epoch", "train_loss", "lr", "improved"))
    assert [r["lr"] for r in res.log] == [0.1, 0.1, 0.1] and opt.param_groups[0]["lr"] == 0.1  # lr_decay 1.0


def test_fit_train_loss_is_the_weighted_mean_and_runs_are_identical():
    def run():
        model, x, y = _toy(10)
        opt = make_adamw(model, 0.01, 0.0)
        losses = []

        def batch_loss(model, idx):
            loss = ((model(x[idx]) - y[idx]) ** 2).mean()
            losses.append((float(loss.detach()), len(idx)))
            return loss, len(idx), None

        cfg = type("C", (), {"seed": 1, "batch_size": 3, "max_epochs": 1, "patience": 1, "grad_clip": None})
        res = fit(model, opt, np.arange(10), batch_loss, lambda m, b, o: EpochReport(1.0, {}), cfg,
                  ("epoch", "train_loss", "lr", "improved"))
        return res, losses, model.weight.detach().clone()

    (a, losses, wa), (b, _, wb) = run(), run()
    total = 0.0
    for v, n in losses:  # the per-step float() sum in step order, which the on-device float64 sum reproduces
        total += v * n
    assert a.log[0]["train_loss"] == total / 10  # exact: same float64 operations in the same order
    assert a.log == b.log and torch.equal(wa, wb)


def test_fit_logs_each_epoch_and_a_heartbeat_inside_a_long_epoch(monkeypatch, caplog):
    model, x, y = _toy(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scores = iter([0.5, 0.7])

    def batch_loss(model, idx):
        return ((model(x[idx]) - y[idx]) ** 2).mean(), len(idx), None

    monkeypatch.setattr(loop, "EPOCH_HEARTBEAT_S", 0.0)  # every batch is "a minute later"
    cfg = type("C", (), {"seed": 1, "batch_size": 4, "max_epochs": 2, "patience": 2, "grad_clip": None})
    with caplog.at_level("INFO", logger="lexiflow.progress"):
        res = fit(model, opt, np.ones(8, np.int64), batch_loss, lambda m, b, o: EpochReport(next(scores), {}),
                  cfg, ("epoch", "train_loss", "lr", "improved"), name="toy", metric="AUC")
    lines = [r.getMessage() for r in caplog.records if r.name == "lexiflow.progress"]
    epochs = [m for m in lines if " | train loss " in m]
    assert len(epochs) == 2 and epochs[0].startswith("toy epoch 1/2 | train loss ")
    assert f"{res.log[1]['train_loss']:.4f}" in epochs[1] and "dev AUC 0.7000 (best so far)" in epochs[1]
    assert [m for m in lines if "batch 1/2" in m] == ["toy epoch 1/2: batch 1/2, 0 s into the epoch",
                                                       "toy epoch 2/2: batch 1/2, 0 s into the epoch"]


def test_fit_raises_when_the_score_is_never_finite_and_checks_columns():
    model, x, y = _toy(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def batch_loss(model, idx):
        return ((model(x[idx]) - y[idx]) ** 2).mean(), len(idx), None

    def nan(model, batches, outs):
        return EpochReport(math.nan, {})

    cols = ("epoch", "train_loss", "lr", "improved")
    with pytest.raises(RuntimeError, match="dev F1 was never finite"):
        fit(model, opt, np.ones(4, np.int64), batch_loss, nan, _Cfg, cols, metric="F1")
    with pytest.raises(RuntimeError, match="dev score was never finite"):  # the default name of the metric
        fit(model, opt, np.ones(4, np.int64), batch_loss, nan, _Cfg, cols)
    with pytest.raises(ValueError, match="columns"):
        fit(model, opt, np.ones(4, np.int64), batch_loss, lambda m, b, o: EpochReport(1.0, {"extra": 1}), _Cfg, cols)


# ----------------------------------------------------------------------------- curves, publishing


def test_plot_epochs_is_a_deterministic_png():
    log = [{"epoch": e, "a": e / 10, "b": 1 - e / 10, "loss": 2.0 / e} for e in (1, 2, 3)]
    panels = (("score", (("a", "A"), ("b", "B"))), ("loss", (("loss", "train loss"),)))
    png = plot_epochs(log, panels, 2, "best epoch {}", "t")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == plot_epochs(log, panels, 2, "best epoch {}", "t")
    assert png != plot_epochs(log, panels, 3, "best epoch {}", "t")
