"""finetune: labelled sentiment data -> LebertClassifier on the pretrained encoder, threshold, test metrics.

This module holds what is particular to sentiment: the batches (texts padded per batch), the
loss (BCE on one logit) and the dev metric (AUC, plus the dev-F1 threshold search). The rows come
from :func:`tasks.common.labelled.load_data`; the epoch loop, early stopping and optimizer are
:mod:`tasks.pretrain.loop`'s; a thin Prefect task sits at the bottom.

Training: AdamW (no decay on biases/LayerNorm), length-bucketed batches with dynamic padding,
BCE on one logit. After each epoch: train AUC (on the epoch's own, dropout-on predictions), dev
loss/AUC and the dev-F1 threshold search. A non-improving dev AUC multiplies the LR by
``lr_decay``; ``patience`` such epochs in a row stop training; the best epoch's weights and
threshold are kept and evaluated on test. On CPU, runs are bit-identical for fixed seeds. Beside the
test metrics go a TF-IDF baseline's on the same rows and the train/test overlap (:mod:`tasks.finetune.baseline`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from prefect import task
from prefect.cache_policies import NONE

from tasks.common.config import FinetuneConfig
from tasks.common.labelled import REJECT_SCHEMA, LoadedData, load_data
from tasks.common.stage import StageResult
from tasks.finetune.baseline import (
    RESIDUAL,
    Blend,
    clean_test_metrics,
    comparison_markdown,
    fit_blend,
    paired_auc_difference,
    run_baseline,
)
from tasks.finetune.threshold import RULE as THRESHOLD_RULE
from tasks.finetune.threshold import ThresholdResult, search_threshold
from tasks.prepare.featurize import pad_encoded
from tasks.pretrain.downstream import pretrained_inputs, save_weights
from tasks.pretrain.loop import (
    EpochReport,
    autocast,
    fit,
    make_adamw,
    plot_epochs,
    publish_table,
    seeded_model,
    sorted_batches,
)

# finetune-2: rejected.parquet uses the standard reject columns and names (invalid_json, not bad_json)
# finetune-3: metrics add the TF-IDF baseline on the same rows (baseline_*) and contaminated_{test,dev}_rows
# finetune-4: the split hashes the normalised text (near-duplicates share a split)
# finetune-5: ``combine``: the shipped classifier stacks the encoder's logit with the baseline's (fitted on dev) or
# adds a residual encoder to it; test_*, threshold and dev predictions are the shipped classifier's, encoder_* the
# stacked encoder's alone; baseline.parquet and blend.json carry what labelling needs
# finetune-6: metrics add test_auc_vs_baseline (the AUC difference to the baseline with a paired-bootstrap interval)
# finetune-7: dev/test scoring runs the lexicon adapter sparsely (float sums in another order); config.truncation
# (head or head_tail), recorded in model_config.json
# finetune-8: when some test rows repeat a training text (a given split may: ChnSentiCorp's does), metrics add
# n_clean_test and {,encoder_,baseline_}clean_test_{auc,accuracy} on the others
# finetune-9: the stack is fitted on the dev rows that do not repeat a training text (blend_fit_rows)
CODE_VERSION = "finetune-9"
# classes: any runs (K = 2 included: K is known only once the data is read) version under their own code version,
# so binary-mode versions (and bytes) stay as they were:
# finetune-9-any-v2: K > 2 classes stack the encoder's K logits with the multinomial baseline's (combine: stack);
# K = 2 runs compute what they did before, under new versions
CLASSES_CODE_VERSION = "finetune-9-any-v2"


def code_version(cfg: FinetuneConfig) -> str:
    """The code version a run of ``cfg`` is versioned under (binary mode: :data:`CODE_VERSION`)."""
    return CLASSES_CODE_VERSION if cfg.classes == "any" else CODE_VERSION
# epochs.parquet columns, in order; the Prefect table and the report leave out ``improved``
EPOCH_COLUMNS = ("epoch", "train_loss", "train_auc", "dev_loss", "dev_auc", "lr", "best_threshold", "dev_f1",
                 "improved")
TABLE_COLUMNS = EPOCH_COLUMNS[:-1]
CURVES = (("AUC", (("train_auc", "train AUC"), ("dev_auc", "dev AUC"))),
          ("loss", (("train_loss", "train loss"), ("dev_loss", "dev loss"))))


# ============================================================================= batching


@dataclass
class LabelledSet:
    row_ids: np.ndarray  # int64 [N]
    labels: np.ndarray  # float32 [N], 0/1
    encoded: list  # list[tasks.prepare.featurize.Encoded]
    offset: np.ndarray | None = None  # float32 [N]: added to the model's logit (``combine: residual``)
    lengths: np.ndarray = field(init=False)  # int64 [N]

    def __post_init__(self):
        self.lengths = np.array([len(e.input_ids) for e in self.encoded], np.int64)

    def __len__(self) -> int:
        return len(self.encoded)


def encode_rows(rows: list[dict[str, Any]], featurizer) -> LabelledSet:
    row_ids = np.array([r["row_id"] for r in rows], np.int64)
    labels = np.array([r["label"] for r in rows], np.float32)
    return LabelledSet(row_ids, labels, featurizer.encode([r["text"] for r in rows]))


def collate(ds: LabelledSet, idx: np.ndarray, device: torch.device, with_words: bool) -> dict[str, torch.Tensor]:
    """Dynamic padding to the longest sequence of the batch (id 0 = [PAD], word id 0 = empty)."""
    ids, words, lens = pad_encoded([ds.encoded[i] for i in idx], with_words)  # [B, T], [B, T, k] | None, [B]
    mask = np.arange(ids.shape[1])[None, :] < lens[:, None]  # [B, T]
    out = {
        "input_ids": torch.from_numpy(ids).to(device),
        "attention_mask": torch.from_numpy(mask).to(device),
        "labels": torch.from_numpy(ds.labels[idx]).to(device),  # [B]
    }
    if ds.offset is not None:
        out["offset"] = torch.from_numpy(ds.offset[idx]).to(device)  # [B]
    if with_words:
        out["word_ids"] = torch.from_numpy(words).to(device)
    return out


# ============================================================================= training


def auc(y: np.ndarray, p: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, p)) if len(np.unique(y)) == 2 else float("nan")


@dataclass
class TrainResult:
    model: Any  # models.LebertClassifier with the best epoch's weights
    log: list[dict[str, Any]]
    best_epoch: int
    best_dev_auc: float
    threshold: ThresholdResult  # from the best epoch's dev predictions
    dev_prob: np.ndarray  # best epoch's dev probabilities


@torch.no_grad()
def predict(model, ds: LabelledSet, batch_size: int, device: torch.device,
            with_words: bool, logits_out: np.ndarray | None = None) -> tuple[float, np.ndarray]:
    """(mean BCE loss, probabilities [N] float32 in ds order), both of the logit plus ``ds.offset`` when set;
    batches sorted by length. ``logits_out`` (float32 [N]), when given, receives the model's own logits."""
    model.eval()
    prob = np.zeros(len(ds), np.float32)
    total = 0.0
    for idx in sorted_batches(ds.lengths, batch_size):
        b = collate(ds, idx, device, with_words)
        with autocast(device):
            logits = model(b["input_ids"], b["attention_mask"], b.get("word_ids"))  # [B]
        logits = logits.float()
        if logits_out is not None:
            logits_out[idx] = logits.cpu().numpy()  # the model's own logit, before any offset
        if "offset" in b:
            logits = logits + b["offset"]
        total += float(F.binary_cross_entropy_with_logits(logits, b["labels"], reduction="sum"))
        prob[idx] = torch.sigmoid(logits).cpu().numpy()
    return total / max(len(ds), 1), prob


def train_classifier(
    cfg: FinetuneConfig,
    train: LabelledSet,
    dev: LabelledSet,
    model_cfg,
    encoder_state: dict[str, torch.Tensor] | None = None,
    progress: bool = False,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
) -> TrainResult:
    """Fine-tune; returns the best-dev-AUC model (weights restored), the epoch log and its threshold."""
    from models import LebertClassifier

    for name, ds in (("train", train), ("dev", dev)):
        if len(np.unique(ds.labels)) < 2:
            labels = sorted(set(ds.labels.tolist()))
            raise ValueError(f"the {name} split needs both labels (has {len(ds)} rows, labels {labels})")
    model, device = seeded_model(lambda: LebertClassifier(model_cfg, use_layers=cfg.use_layers, dropout=cfg.dropout),
                                 cfg.seed, cfg.threads, cfg.device, encoder_state)
    with_words = model.uses_lexicon
    opt = make_adamw(model, cfg.lr, cfg.weight_decay)

    def batch_loss(model, idx: np.ndarray):
        b = collate(train, idx, device, with_words)
        logits = model(b["input_ids"], b["attention_mask"], b.get("word_ids"))  # [B]
        if "offset" in b:  # combine: residual: the model learns a correction to the baseline's logit
            logits = logits + b["offset"]
        prob = torch.sigmoid(logits.detach().float()).cpu().numpy()  # [B]: the train AUC's dropout-on predictions
        return F.binary_cross_entropy_with_logits(logits.float(), b["labels"]), len(idx), prob

    def evaluate(model, batches: list[np.ndarray], probs: list[np.ndarray]) -> EpochReport:
        train_auc = auc(train.labels[np.concatenate(batches)], np.concatenate(probs))
        dev_loss, dev_prob = predict(model, dev, cfg.batch_size, device, with_words)
        dev_auc = auc(dev.labels, dev_prob)
        th = search_threshold(dev.labels, dev_prob)
        row = {"train_auc": train_auc, "dev_loss": dev_loss, "dev_auc": dev_auc, "best_threshold": th.threshold,
               "dev_f1": th.f1}
        return EpochReport(dev_auc, row, keep=(th, dev_prob))

    res = fit(model, opt, train.lengths, batch_loss, evaluate, cfg, EPOCH_COLUMNS, cfg.lr_decay, "finetune", "AUC",
              progress, on_epoch)
    th, dev_prob = res.best
    return TrainResult(model, res.log, res.best_epoch, res.best_score, th, dev_prob)


def binary_metrics(y: np.ndarray, prob: np.ndarray, threshold: float) -> dict[str, float]:
    """AUC, accuracy, precision, recall, F1 of ``prob >= threshold`` (sklearn, zero_division=0)."""
    from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score

    y = np.asarray(y).astype(np.int64)
    pred = (np.asarray(prob, np.float64) >= threshold).astype(np.int64)
    return {
        "auc": auc(y, prob),
        "accuracy": float(accuracy_score(y, pred)),
        "precision": float(precision_score(y, pred, zero_division=0)),
        "recall": float(recall_score(y, pred, zero_division=0)),
        "f1": float(f1_score(y, pred, zero_division=0)),
    }


# ============================================================================= stage


@dataclass
class FinetuneResult:
    train: TrainResult
    data: LoadedData
    dev: LabelledSet
    test: LabelledSet
    test_prob: np.ndarray  # the shipped classifier's test probabilities
    metrics: dict[str, Any]
    max_len: int
    dev_prob: np.ndarray  # the shipped classifier's dev probabilities (the threshold stage re-reads them)
    threshold: ThresholdResult  # picked on dev_prob
    baseline: Any = None  # tasks.finetune.baseline.BaselineModel, shipped when ``blend`` is set
    blend: Blend | None = None
    run: dict[str, Any] = field(default_factory=dict)  # measured: wall_s (the manifest's run section, not metrics)


def split_facts(cfg: FinetuneConfig, data, train_ds, dev_ds, test_ds) -> dict[str, Any]:
    """The seeds and split sizes a finetune's metrics record (binary and K-class alike)."""
    return {"seed": cfg.seed, "split_seed": cfg.split_seed, "n_train": len(train_ds), "n_dev": len(dev_ds),
            "n_test": len(test_ds), "capped": data.capped}


def model_facts(model, device) -> dict[str, Any]:
    """What the trained classifier ran: blocks used, lexicon on or off, device."""
    return {"use_layers": model.use_layers, "uses_lexicon": model.uses_lexicon, "device": str(device)}


def _rounded(m: dict[str, float | None], prefix: str) -> dict[str, float | None]:
    return {f"{prefix}{k}": (round(v, 6) if v is not None and v == v else None) for k, v in m.items()}


def finetune(cfg: FinetuneConfig, featurizer, model_cfg, encoder_state=None, progress: bool = False,
             on_epoch=None):
    """Read, split, encode, train, evaluate on test at the best epoch and its dev threshold (no I/O out).

    ``cfg.combine`` says how the shipped classifier uses the TF-IDF baseline (fitted on the train rows): ``stack``
    fits a logistic regression on the encoder's and the baseline's logits on the dev rows
    (:func:`tasks.finetune.baseline.fit_blend`); ``residual`` trains the encoder on top of the baseline's logit
    (out-of-fold on train, so it learns what the baseline gets wrong on unseen text) and adds the two. The
    threshold is picked on the shipped classifier's dev probabilities; the baseline alone (and, for ``stack``,
    the encoder alone) is reported beside it on the same rows. With ``classes: any`` and K > 2 classes the run is
    :func:`tasks.finetune.multiclass.finetune_multiclass`'s (a :class:`~tasks.finetune.multiclass.KFinetuneResult`)."""
    t0 = time.perf_counter()
    data = load_data(cfg)
    train_ds, dev_ds, test_ds = (encode_rows(r, featurizer) for r in (data.train, data.dev, data.test))
    if data.classes is not None and len(data.classes) > 2:  # K classes: softmax head, arg-max, no threshold
        from tasks.finetune.multiclass import finetune_multiclass

        return finetune_multiclass(cfg, data, train_ds, dev_ds, test_ds, featurizer, model_cfg, encoder_state,
                                   progress, on_epoch, t0)
    base = run_baseline(data.train, data.dev, data.test)  # the cheap baseline on exactly these rows
    if cfg.combine == "residual":
        train_ds.offset = base.train_logits_out_of_fold().astype(np.float32)
        dev_ds.offset, test_ds.offset = base.dev_logits.astype(np.float32), base.test_logits.astype(np.float32)
    tr = train_classifier(cfg, train_ds, dev_ds, model_cfg, encoder_state, progress, on_epoch)
    device = next(tr.model.parameters()).device
    with_words = tr.model.uses_lexicon
    z_dev, z_test = np.zeros(len(dev_ds), np.float32), np.zeros(len(test_ds), np.float32)
    if cfg.combine != "none":  # the best epoch's dev logits, for the combination
        predict(tr.model, dev_ds, cfg.batch_size, device, with_words, z_dev)
    _, enc_test_prob = predict(tr.model, test_ds, cfg.batch_size, device, with_words, z_test)
    no_test = dict.fromkeys(("auc", "accuracy", "precision", "recall", "f1"))
    enc_test = binary_metrics(test_ds.labels, enc_test_prob, tr.threshold.threshold) if len(test_ds) else no_test
    blend, dev_prob, threshold, test_prob, test = None, tr.dev_prob, tr.threshold, enc_test_prob, enc_test
    # the stack is fitted on the dev rows whose text is not in train (a memorised row would make the encoder look
    # better than it is on new text), unless those lack a class; all dev rows when none repeats a training text
    fit = base.unseen("dev")
    if len(np.unique(dev_ds.labels[fit])) < 2:
        fit = np.ones(len(dev_ds), bool)
    if cfg.combine != "none":
        if cfg.combine == "residual":
            blend = RESIDUAL
        else:
            blend = fit_blend(dev_ds.labels[fit], z_dev[fit], base.dev_logits[fit])
        dev_prob = blend.prob(z_dev, base.dev_logits)
        threshold = search_threshold(dev_ds.labels, dev_prob)
        test_prob = blend.prob(z_test, base.test_logits)
        test = binary_metrics(test_ds.labels, test_prob, threshold.threshold) if len(test_ds) else no_test
    best_row = tr.log[tr.best_epoch - 1]
    metrics = {
        **_rounded(test, "test_"),
        "threshold": threshold.threshold,
        "dev_f1": round(threshold.f1, 6),
        "best_epoch": tr.best_epoch,
        "dev_auc": round(tr.best_dev_auc, 6),
        "train_auc": round(best_row["train_auc"], 6),
        "epochs_run": len(tr.log),
        # the encoder alone (at its own dev threshold), then the cheap baseline on exactly these train/dev/test
        # rows, and the test/dev rows whose text occurs in train
        **{k: v for k, v in _rounded(enc_test, "encoder_test_").items() if cfg.combine == "stack"},
        **({"encoder_threshold": tr.threshold.threshold} if cfg.combine == "stack" else {}),
        "combine": cfg.combine,
        "blend": blend.to_dict() if blend is not None else None,
        **({"blend_fit_rows": int(fit.sum())} if cfg.combine == "stack" else {}),
        **base.metrics,
        # is the shipped classifier's test AUC above the baseline's by more than resampling noise?
        "test_auc_vs_baseline": paired_auc_difference(test_ds.labels, test_prob, base.test_logits, seed=cfg.seed),
        # the same on the test rows whose text is not in train (only when some are: a given split may repeat texts)
        **clean_test_metrics(test_ds.labels, base.unseen("test"), {
            "": (test_prob, threshold.threshold),
            **({"encoder_": (enc_test_prob, tr.threshold.threshold)} if cfg.combine == "stack" else {}),
            "baseline_": (base.test_prob, base.metrics["baseline_threshold"])}),
        **split_facts(cfg, data, train_ds, dev_ds, test_ds),
        "train_pos_rate": round(float(train_ds.labels.mean()), 4),
        **model_facts(tr.model, device),
    }
    return FinetuneResult(tr, data, dev_ds, test_ds, test_prob, metrics, featurizer.max_len, dev_prob, threshold,
                          base.model if blend is not None else None, blend,
                          run={"wall_s": round(time.perf_counter() - t0, 1)})


def write_outputs(writer, res: FinetuneResult, cfg: FinetuneConfig) -> dict[str, int]:
    """Write the stage files; returns {file: rows} for the manifest."""
    import pyarrow as pa

    from storage.parquet import write_table

    model, tr = res.train.model, res.train
    save_weights(writer, model)
    mc = {"model": model.cfg.model_dump(), "use_layers": model.use_layers, "dropout": cfg.dropout,
          "max_len": res.max_len, "truncation": cfg.truncation}
    if res.data.classes is not None:  # classes: any with K = 2 (a binary-mode run's file is as it always was)
        mc["classes"] = res.data.classes
    writer.write_bytes("model_config.json", json.dumps(mc, indent=1, sort_keys=True).encode())
    rows = {}
    rows["epochs.parquet"] = write_table(writer, "epochs.parquet", pa.Table.from_pylist(tr.log))
    curves = plot_epochs(tr.log, CURVES, tr.best_epoch, "best epoch {}", f"finetune (best epoch {tr.best_epoch})")
    writer.write_bytes("curves.png", curves)
    th = res.threshold
    info = {"threshold": th.threshold, "dev_f1": th.f1, "epoch": tr.best_epoch, "rule": THRESHOLD_RULE}
    writer.write_bytes("threshold.json", json.dumps(info, indent=1, sort_keys=True).encode())
    rows["threshold_table.parquet"] = write_table(writer, "threshold_table.parquet", pa.Table.from_pylist(th.table))
    test = _predictions(res.test, res.test_prob)
    rows["test_predictions.parquet"] = write_table(writer, "test_predictions.parquet", test)
    # the held-out texts themselves, so the pipeline can label them with the bundle (`label.input_uri: "@heldout"`)
    held = pa.table({
        "row_id": pa.array([r["row_id"] for r in res.data.test], pa.int64()),
        "review": pa.array([r["text"] for r in res.data.test], pa.string()),
        "label": pa.array([int(r["label"]) for r in res.data.test], pa.int8()),
    })
    rows["heldout.parquet"] = write_table(writer, "heldout.parquet", held)
    dev = _predictions(res.dev, res.dev_prob)
    rows["dev_predictions.parquet"] = write_table(writer, "dev_predictions.parquet", dev)
    if res.blend is not None:  # what labelling needs to score the shipped (stacked) classifier
        rows["baseline.parquet"] = write_table(writer, "baseline.parquet", res.baseline.to_table())
        writer.write_bytes("blend.json", json.dumps(res.blend.to_dict(), indent=1, sort_keys=True).encode())
    rejects = pa.Table.from_pylist(res.data.rejects, schema=REJECT_SCHEMA)
    rows["rejected.parquet"] = write_table(writer, "rejected.parquet", rejects)
    return rows


def _predictions(ds: LabelledSet, prob: np.ndarray):
    import pyarrow as pa

    return pa.table({
        "row_id": pa.array(ds.row_ids, pa.int64()),
        "label": pa.array(ds.labels.astype(np.int8), pa.int8()),
        "prob": pa.array(prob, pa.float32()),
    })


def run_finetune_stage(writer, cfg: FinetuneConfig, pretrain_uri: str, lexicon_uri: str, progress: bool = True,
                       on_epoch=None) -> StageResult:
    """Load the pretrained encoder and the featuriser, fine-tune, write every output into ``writer``."""
    model_cfg, state, featurizer, _ = pretrained_inputs(pretrain_uri, lexicon_uri, cfg.max_len)
    featurizer = replace(featurizer, truncation=cfg.truncation)
    res = finetune(cfg, featurizer, model_cfg, state, progress, on_epoch)
    if not isinstance(res, FinetuneResult):  # K > 2 classes
        from tasks.finetune import multiclass

        rows = multiclass.write_outputs(writer, res, cfg)
    else:
        rows = write_outputs(writer, res, cfg)
    from tasks.bundle.explain import explain_dev  # the finetune-explain artifact (a few dev examples explained)

    explain = partial(explain_dev, res, featurizer, lexicon_uri)
    if not isinstance(res, FinetuneResult):
        return StageResult(res.data.stats, res.metrics, rows,
                           publish=partial(multiclass.publish, res.train.log, explain=explain), run=res.run)
    return StageResult(res.data.stats, res.metrics, rows, publish=partial(publish, res.train.log, explain=explain),
                       run=res.run)


def report_markdown(log: list[dict[str, Any]], art) -> str:
    """Markdown for the Prefect UI: test metrics beside the baseline's, the epoch table, where the curves are."""
    m = art.manifest.metrics
    head = comparison_markdown(m)  # the model beside the TF-IDF baseline on the same rows, and contamination
    rows = "".join("| " + " | ".join(_cell(r.get(c)) for c in TABLE_COLUMNS) + " |\n" for r in log)
    table = "| " + " | ".join(TABLE_COLUMNS) + " |\n|" + "---|" * len(TABLE_COLUMNS) + "\n" + rows
    return (f"# finetune `{art.manifest.version}`\n\nbest epoch {m.get('best_epoch')}\n\n{head}\n## epochs\n\n{table}\n"
            f"Curves: `{art.uri}/curves.png`\n")


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def publish(log: list[dict[str, Any]], art, explain: Callable[[Any], Any] | None = None) -> None:
    """Prefect UI, once committed: the epoch table and the markdown report (a no-op outside a run); ``explain``:
    the explained dev examples (:func:`tasks.bundle.explain.explain_dev`)."""
    report = ("finetune-report", report_markdown(log, art), "fine-tuning report")
    publish_table("finetune-epochs", log, TABLE_COLUMNS, f"fine-tuning, one row per epoch\n\n`{art.uri}`", report)
    if explain is not None:
        explain(art)


# ============================================================================= Prefect wrapper


@task(name="finetune-train", cache_policy=NONE)
def finetune_task(store_uri: str, version: str, cfg: FinetuneConfig, pretrain_uri: str, lexicon_uri: str,
                  progress: bool = True) -> StageResult:
    """Run the stage into the staging directory that :func:`tasks.common.stage.run_stage` began."""
    from storage.artifacts import ArtifactStore
    from tasks.common.stage import Progress

    store = ArtifactStore(store_uri)
    bar = Progress("finetune", cfg.max_epochs)
    writer = store.attach("finetune", version)
    return run_finetune_stage(writer, cfg, pretrain_uri, lexicon_uri, progress, lambda row: bar.step())
