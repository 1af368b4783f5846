"""The one training loop: the seeded model, AdamW groups, optimizer step, early stopping, epoch fit, curves.

Devices, autocast and the numerics record are the runtime's (:mod:`tasks.inference.runtime`, shared with inference).
Pretraining (step-based, checkpoints, DDP) uses the seeded-model/optimizer/step helpers;
fine-tuning and NER hand :func:`fit` only their loss, their batch collation and their dev metric.

On CPU every run is bit-identical for a fixed seed: the model is built right after
``torch.manual_seed`` (:func:`seeded_model`), epoch ``e``'s batches come from
``np.random.default_rng([seed, e])`` and dropout draws from the torch RNG in batch order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from models import numerics  # called through the module: a test or a tool may substitute numerics_record
from tasks.common.plots import line_panels
from tasks.inference.runtime import autocast, resolve_device
from tasks.training.preempt import stop_scope, stopped
from tasks.training.progress import log as progress_log
from tasks.training.row_adam import SparseRows

EPOCH_HEARTBEAT_S = 60.0  # an in-epoch progress line at most this often, so a long epoch is never silent

BUCKET_POOL_BATCHES = 50  # length bucketing pool, in batches


# ============================================================================= the model


def seeded_model(
    make: Callable[[], torch.nn.Module],
    seed: int,
    threads: int | None,
    device_name: str,
    encoder_state: dict[str, torch.Tensor] | None = None,
    local_rank: int | None = None,
) -> tuple[torch.nn.Module, torch.device]:
    """Threads, ``torch.manual_seed(seed)``, then ``make()`` (its init draws the first random numbers),
    the pretrained encoder loaded (strict) when given, moved to the device. Returns (model, device)."""
    if threads:
        torch.set_num_threads(threads)
    numerics.numerics_record()  # refuses a process whose kernels were chosen before the pins (torch ran first)
    torch.manual_seed(seed)
    device = resolve_device(device_name, local_rank)
    model = make()
    if encoder_state is not None:
        model.load_pretrained_encoder(encoder_state)
    return model.to(device), device


# ============================================================================= optimizer


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    no_decay: Callable[[str], bool] | None = None,
    encoder_lr: float | None = None,
) -> list[dict[str, Any]]:
    """AdamW parameter groups over the trainable parameters, in ``named_parameters`` order.

    No weight decay on parameters with ``ndim < 2`` (biases, LayerNorm) nor on names where
    ``no_decay(name)`` holds (NER: the CRF). With ``encoder_lr``, parameters under ``encoder.``
    form their own groups at that LR. Group order: head decay, head no-decay, encoder decay,
    encoder no-decay (empty groups left out); head groups use the optimizer's default LR, so
    ``param_groups[0]["lr"]`` is always the head LR.
    """
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decay = p.ndim >= 2 and not (no_decay is not None and no_decay(name))
        enc = encoder_lr is not None and name.startswith("encoder.")
        groups.setdefault((enc, decay), []).append(p)
    out = []
    for enc, decay in ((False, True), (False, False), (True, True), (True, False)):
        if (enc, decay) in groups:
            g = {"params": groups[enc, decay], "weight_decay": weight_decay if decay else 0.0}
            out.append({**g, "lr": encoder_lr} if enc else g)
    return out


def make_adamw(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    no_decay: Callable[[str], bool] | None = None,
    encoder_lr: float | None = None,
    fast: bool = False,
) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`: one tensor at a time (``fused=False``, the arithmetic CPU runs are pinned
    to), or with ``fast`` (CUDA) fused into a few kernels for all parameters at once."""
    groups = param_groups(model, weight_decay, no_decay, encoder_lr)
    if fast:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=False)


def optimizer_step(
    opt: torch.optim.Optimizer, loss: torch.Tensor, params: Any, clip: float | None, rows: SparseRows | None = None
) -> torch.Tensor | None:
    """zero_grad, backward, clip the global grad norm to ``clip`` (skipped when falsy), step.
    Returns the pre-clip total grad norm (a 0-dim tensor, not read here), or None without clipping. On CUDA torch
    clips with its multi-tensor (foreach) kernels; on CPU one tensor at a time, as it always has.

    ``rows``: a word table trained sparsely (:class:`tasks.training.row_adam.SparseRows`, gathered for this batch):
    its rows' gradients are averaged over the DDP ranks, count in the global norm and are clipped with the rest,
    then its rows step at the LR of ``opt``'s first group (the schedule's)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if rows is not None:
        rows.reduce()
        params = [*params, *rows.clip_tensors()]
    gnorm = torch.nn.utils.clip_grad_norm_(params, clip) if clip else None
    opt.step()
    if rows is not None:
        rows.step(opt.param_groups[0]["lr"])
    return gnorm


# ============================================================================= batches


def bucket_batches(
    lengths: np.ndarray, batch_size: int, rng: np.random.Generator, pool_batches: int = BUCKET_POOL_BATCHES
) -> list[np.ndarray]:
    """Shuffle, sort by length within pools of ``pool_batches`` batches, cut, shuffle batch order.

    ``lengths`` int64 [N] -> batches of indices int64 [<= batch_size]; every index exactly once."""
    perm = rng.permutation(len(lengths))
    pool = batch_size * pool_batches
    batches = []
    for s in range(0, len(perm), pool):
        chunk = perm[s : s + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


# ============================================================================= early stopping


class EarlyStopper:
    """Dev-score bookkeeping (higher is better). ``update(score) -> (improved, lr_scale, stop)``.

    Improvement = strictly greater than the best so far (the first finite value always improves;
    NaN never does). A non-improving epoch returns lr_scale = ``factor`` (multiply the LR by it)
    and counts towards ``patience``; ``stop`` is True once ``patience`` non-improving epochs have
    happened in a row. ``best_epoch`` is 1-based (0 until something improved)."""

    def __init__(self, patience: int, factor: float):
        self.patience, self.factor = patience, factor
        self.best = -math.inf
        self.best_epoch = 0
        self.epoch = 0
        self.bad = 0

    def update(self, score: float) -> tuple[bool, float, bool]:
        """One epoch's dev score: (improved, LR factor to apply, stop)."""
        self.epoch += 1
        if score > self.best:  # NaN never improves
            self.best, self.best_epoch, self.bad = score, self.epoch, 0
            return True, 1.0, False
        self.bad += 1
        return False, self.factor, self.bad >= self.patience


# ============================================================================= epoch loop


@dataclass
class EpochReport:
    """What a task's ``evaluate`` returns after an epoch."""

    score: float  # the dev metric that early stopping watches (higher is better)
    fields: dict[str, Any]  # the task's columns of the epoch's log row
    keep: Any = None  # kept when this epoch is the best (e.g. its dev predictions)


@dataclass
class FitResult:
    """What :func:`fit` returns: the epoch log and the best epoch."""
    log: list[dict[str, Any]]  # one row per epoch, keys in ``columns`` order
    best_epoch: int  # 1-based; the model holds this epoch's weights
    best_score: float
    best: Any  # the best epoch's ``EpochReport.keep``


def fit(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    lengths: np.ndarray,
    batch_loss: Callable[[torch.nn.Module, np.ndarray], tuple[torch.Tensor, int, Any]],
    evaluate: Callable[[torch.nn.Module, list[np.ndarray], list[Any]], EpochReport],
    cfg: Any,
    columns: Sequence[str],
    lr_decay: float = 1.0,
    name: str = "train",
    metric: str = "score",
    progress: bool = False,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> FitResult:
    """Train epochs of length-bucketed batches over the ``lengths`` [N] training examples.

    ``cfg`` gives ``seed``, ``batch_size``, ``max_epochs``, ``patience`` and ``grad_clip`` (None:
    no clipping); ``columns`` the log row's keys in order; ``name`` labels the progress bar and
    ``metric`` the error raised when the dev score is never finite.

    ``batch_loss(model, idx) -> (mean loss, weight, out)`` runs under autocast for every batch
    (``weight``: what the mean is over, e.g. examples or characters; ``out``: anything the
    task wants back). After each epoch ``evaluate(model, batches, outs) -> EpochReport`` scores
    dev. The log row holds ``epoch``, ``train_loss`` (weighted mean), ``lr`` (group 0's, before
    this epoch's decay), ``improved`` and the report's fields. A non-improving epoch multiplies
    every group's LR by ``lr_decay``; ``cfg.patience`` of them in a row stop training.
    The best epoch's weights are restored (model left in eval mode).

    SIGTERM/SIGINT end training after the current batch with one line that says so
    (:class:`tasks.training.preempt.Preempted`; the stage is run again from its start); in the dev evaluation, the
    task's own loop polls (:func:`tasks.training.preempt.poll`).
    """
    with stop_scope(name) as signals:
        return _fit(model, opt, lengths, batch_loss, evaluate, cfg, columns, lr_decay, name, metric, progress,
                    on_epoch, signals)


def _fit(model, opt, lengths, batch_loss, evaluate, cfg, columns, lr_decay, name, metric, progress, on_epoch,
         signals) -> FitResult:
    device = next(model.parameters()).device
    stopper = EarlyStopper(cfg.patience, lr_decay)
    log: list[dict[str, Any]] = []
    best_state, best = None, None
    for epoch in range(1, cfg.max_epochs + 1):
        lr = opt.param_groups[0]["lr"]
        model.train()
        batches = bucket_batches(lengths, cfg.batch_size, np.random.default_rng([cfg.seed, epoch]))
        # The weighted loss sum stays on the device in float64, added in step order: the same bits as summing
        # float(loss) * w per step, without a device read (a CUDA synchronisation) on every step.
        loss_sum, weight, outs = torch.zeros((), dtype=torch.float64, device=device), 0, []
        bar = dict(desc=f"{name} epoch {epoch}", unit="batch", disable=not progress, leave=False,  # pragma: no mutate
                   mininterval=2)  # pragma: no mutate (the progress bar only)
        started = last_line = time.monotonic()
        for idx in tqdm(batches, **bar):
            with autocast(device):
                loss, w, out = batch_loss(model, idx)  # loss: 0-dim, mean over the batch's w units
            optimizer_step(opt, loss, model.parameters(), cfg.grad_clip)
            loss_sum += loss.detach().to(torch.float64) * w
            weight += w
            outs.append(out)
            if signals.signum is not None:
                raise stopped(name, signals.signum, f"in epoch {epoch}, batch {len(outs)}/{len(batches)}", resume=False)
            if time.monotonic() - last_line >= EPOCH_HEARTBEAT_S:
                last_line = time.monotonic()
                progress_log.info("%s epoch %d/%d: batch %d/%d, %.0f s into the epoch", name, epoch,
                                  cfg.max_epochs, len(outs), len(batches), last_line - started)
        signals.phase = f"evaluating epoch {epoch} on dev"
        rep = evaluate(model, batches, outs)
        signals.phase = "training"
        improved, scale, stop = stopper.update(rep.score)
        if improved:
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best = rep.keep
        train_loss = float(loss_sum) / max(weight, 1)
        row = _row(columns, epoch=epoch, train_loss=train_loss, lr=lr, improved=improved, **rep.fields)
        log.append(row)
        progress_log.info("%s epoch %d/%d | train loss %.4f | dev %s %.4f%s | %.0f s", name, epoch, cfg.max_epochs,
                          train_loss, metric, rep.score, " (best so far)" if improved else "",
                          time.monotonic() - started)
        if on_epoch:
            on_epoch(row)
        for g in opt.param_groups:
            g["lr"] *= scale
        if stop:
            break
    if best_state is None:
        raise RuntimeError(f"dev {metric} was never finite; cannot pick an epoch")
    model.load_state_dict(best_state)
    model.eval()
    return FitResult(log, stopper.best_epoch, stopper.best, best)


def _row(columns: Sequence[str], **values: Any) -> dict[str, Any]:
    if sorted(columns) != sorted(values):
        raise ValueError(f"epoch row columns {sorted(columns)} != the values given {sorted(values)}")
    return {k: values[k] for k in columns}


# ============================================================================= curves and the UI


Panels = Sequence[tuple[str, Sequence[tuple[str, str]]]]  # [(y label, [(log column, legend), ...]), ...]


def plot_epochs(log: list[dict[str, Any]], panels: Panels, best_epoch: int | None, best_label: str,
                title: str) -> bytes:
    """PNG: one panel per ``(y label, [(column, legend), ...])`` against epoch, markers on; the
    best epoch marked by a dashed line labelled ``best_label.format(best_epoch)``."""
    ep = [r["epoch"] for r in log]
    dots = {"marker": "o", "ms": 3}
    lines = [(ylabel, [([r[c] for r in log], legend, dots) for c, legend in cols]) for ylabel, cols in panels]
    vline = (best_epoch, best_label.format(best_epoch)) if best_epoch is not None else None
    return line_panels(ep, lines, "epoch", title, vline)
