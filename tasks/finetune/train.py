"""finetune: labelled data -> LebertClassifier on the pretrained encoder, its decision rule, test metrics; one path
for any number of classes K >= 2.

What differs between two classes and K > 2 is a head (:mod:`tasks.finetune.heads`): one logit, BCE, the epoch
picked on dev AUC and a threshold picked on dev F1; or K logits, cross-entropy, dev macro-F1 and the arg-max. The
rows come from :func:`tasks.common.labelled.load_data`; the epoch loop, early stopping and optimizer are
:mod:`tasks.training.loop`'s; the stage is :data:`STAGE`.

Training: AdamW (no decay on biases/LayerNorm), length-bucketed batches with dynamic padding. After each epoch: the
train metric (on the epoch's own, dropout-on predictions), dev loss and metric (and, for two classes, the dev-F1
threshold search). A non-improving dev metric multiplies the LR by ``lr_decay``; ``patience`` such epochs in a row
stop training; the best epoch's weights (and threshold) are kept and evaluated on test. On CPU, runs are
bit-identical for fixed seeds. Beside the test metrics go a TF-IDF baseline's on the same rows and the train/test
overlap (:mod:`tasks.finetune.baseline`); ``combine`` says how the shipped classifier uses that baseline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from models import LebertClassifier
from models.bert import padding_of
from storage.artifacts import ArtifactRef
from storage.parquet import write_table
from tasks.common.context import StageContext
from tasks.common.labelled import REJECT_SCHEMA, LoadedData, load_data
from tasks.common.stage import Stage, StageResult
from tasks.finetune.config import FinetuneConfig
from tasks.finetune.heads import BINARY, BinaryHead, head_for
from tasks.finetune.report import publish
from tasks.finetune.threshold import ThresholdResult
from tasks.inference.blend import Blend, KBlend
from tasks.inference.explain import explain_dev
from tasks.inference.runtime import autocast, sorted_batches, to_device
from tasks.pretrain.downstream import on_pretrained_config, pretrained_inputs, save_weights
from tasks.text.featurize import pad_encoded
from tasks.training.loop import EpochReport, fit, make_adamw, plot_epochs, seeded_model
from tasks.training.preempt import poll, stoppable

# hashed into every finetune version: a change to what a run writes or computes takes a new one
CODE_VERSION = "finetune-9"
# runs with ``classes: any`` (K = 2 included: K is known only once the data is read) have their own, so binary-mode
# versions and bytes stay as they are
CLASSES_CODE_VERSION = "finetune-9-any-v2"


def code_version(cfg: FinetuneConfig) -> str:
    """The code version a run of ``cfg`` is versioned under (binary mode: :data:`CODE_VERSION`)."""
    return CLASSES_CODE_VERSION if cfg.classes == "any" else CODE_VERSION


# ============================================================================= batching


@dataclass
class LabelledSet:
    """One split encoded for the model: row ids, labels (0/1 or class indices, as float32), features."""

    row_ids: np.ndarray  # int64 [N]
    labels: np.ndarray  # float32 [N]: 0/1, or a class index
    encoded: list  # list[tasks.text.featurize.Encoded]
    offset: np.ndarray | None = None  # float32 [N]: added to the model's logit (``combine: residual``)
    lengths: np.ndarray = field(init=False)  # int64 [N]

    def __post_init__(self):
        self.lengths = np.array([len(e.input_ids) for e in self.encoded], np.int64)

    def __len__(self) -> int:
        return len(self.encoded)


def encode_rows(rows: list[dict[str, Any]], featurizer) -> LabelledSet:
    """Encode labelled rows ({row_id, label, text}) with ``featurizer``."""
    row_ids = np.array([r["row_id"] for r in rows], np.int64)
    labels = np.array([r["label"] for r in rows], np.float32)
    return LabelledSet(row_ids, labels, featurizer.encode([r["text"] for r in rows]))


def collate(ds: LabelledSet, idx: np.ndarray, device: torch.device, with_words: bool,
            head: BinaryHead = BINARY) -> dict[str, torch.Tensor]:
    """Dynamic padding to the longest sequence of the batch (id 0 = [PAD], word id 0 = empty). On CUDA the arrays
    go through pinned memory without waiting (:func:`tasks.inference.runtime.to_device`)."""
    ids, words, lens = pad_encoded([ds.encoded[i] for i in idx], with_words)  # [B, T], [B, T, k] | None, [B]
    mask = np.arange(ids.shape[1])[None, :] < lens[:, None]  # [B, T]
    out = {
        "input_ids": to_device(ids, device),
        "attention_mask": to_device(mask, device),
        "labels": head.labels(to_device(ds.labels[idx], device)),  # [B]
    }
    if ds.offset is not None:
        out["offset"] = to_device(ds.offset[idx], device)  # [B]
    if with_words:
        out["word_ids"] = to_device(words, device)
    if device.type == "cuda":  # where the padding is, from the host mask: attention is routed without a device read
        out["padded"] = padding_of(torch.from_numpy(mask), device)
    return out


# ============================================================================= training


@dataclass
class TrainResult:
    """The trained classifier at its best epoch, the epoch log, and its dev outputs at that epoch."""

    model: Any  # models.LebertClassifier with the best epoch's weights
    log: list[dict[str, Any]]
    best_epoch: int
    best_score: float  # dev AUC (two classes) or macro-F1 (K > 2) of the best epoch
    threshold: ThresholdResult | None  # from the best epoch's dev predictions; None for K > 2
    dev_scores: np.ndarray  # the best epoch's dev probabilities [N] (two classes) or logits [N, K]
    dev_logits: np.ndarray  # the best epoch's dev logits, before any offset: [N] or [N, K]


@torch.no_grad()
def predict(model, ds: LabelledSet, batch_size: int, device: torch.device, with_words: bool,
            logits_out: np.ndarray | None = None, head: BinaryHead = BINARY) -> tuple[float, np.ndarray]:
    """(mean loss, scores in ds order): two classes, probabilities [N] float32 of the logit plus ``ds.offset`` when
    set; K > 2, the logits [N, K]. Batches sorted by length. ``logits_out``, when given, receives the model's own
    logits."""
    model.eval()
    # kept on the device and read once at the end (no device read per batch): the loss summed in float64 in batch
    # order (the bits of summing float(loss) on the host), the scores and logits in batch order
    total = torch.zeros((), dtype=torch.float64, device=device)
    order, scores, logits = [], [], []
    for idx in sorted_batches(ds.lengths, batch_size):
        poll()  # a stop signal during a training stage's evaluation ends it between two batches
        b = collate(ds, idx, device, with_words, head)
        with autocast(device):
            z = model(b["input_ids"], b["attention_mask"], b.get("word_ids"), b.get("padded"))  # [B] | [B, K]
        z = z.float()
        if logits_out is not None:
            logits.append(z)  # the model's own logits, before any offset
        if "offset" in b:
            z = z + b["offset"]
        total += head.loss(z, b["labels"], reduction="sum").to(torch.float64)
        scores.append(head.scores(z))
        order.append(idx)
    out = np.zeros(head.score_shape(len(ds), model), np.float32)
    if order:
        rows = np.concatenate(order)
        out[rows] = torch.cat(scores).cpu().numpy()
        if logits_out is not None:
            logits_out[rows] = torch.cat(logits).cpu().numpy()
    return float(total) / max(len(ds), 1), out


def train_classifier(
    cfg: FinetuneConfig,
    train: LabelledSet,
    dev: LabelledSet,
    model_cfg,
    encoder_state: dict[str, torch.Tensor] | None = None,
    progress: bool = False,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    head: BinaryHead = BINARY,
) -> TrainResult:
    """Fine-tune; returns the best-dev model (weights restored), the epoch log and its dev outputs."""
    head.check_splits(train, dev)
    model, device = seeded_model(lambda: LebertClassifier(model_cfg, use_layers=cfg.use_layers, dropout=cfg.dropout,
                                                          **head.model_kwargs()),
                                 cfg.seed, cfg.threads, cfg.device, encoder_state)
    with_words = model.uses_lexicon
    opt = make_adamw(model, cfg.lr, cfg.weight_decay)

    def batch_loss(model, idx: np.ndarray):
        b = collate(train, idx, device, with_words, head)
        loss, seen = head.batch_loss(model(b["input_ids"], b["attention_mask"], b.get("word_ids"), b.get("padded")), b)
        return loss, len(idx), seen

    def evaluate(model, batches: list[np.ndarray], seen: list[np.ndarray]) -> EpochReport:
        logits = np.zeros(head.score_shape(len(dev), model), np.float32)
        dev_loss, scores = predict(model, dev, cfg.batch_size, device, with_words, logits, head)
        seen_host = torch.cat(seen).cpu().numpy()  # the epoch's training outputs, read once (not per step)
        score, row, decision = head.epoch(train.labels[np.concatenate(batches)], seen_host, dev.labels, dev_loss,
                                          scores)
        return EpochReport(score, row, keep=(decision, scores, logits))

    res = fit(model, opt, train.lengths, batch_loss, evaluate, cfg, head.epoch_columns, cfg.lr_decay, "finetune",
              head.metric, progress, on_epoch)
    decision, scores, logits = res.best
    return TrainResult(model, res.log, res.best_epoch, res.best_score, decision, scores, logits)


# ============================================================================= stage


@dataclass
class FinetuneResult:
    """Everything a finetune run produced, before any of it is written."""

    train: TrainResult
    data: LoadedData
    dev: LabelledSet
    test: LabelledSet
    test_prob: np.ndarray  # the shipped classifier's test probabilities: [N], or [N, K]
    metrics: dict[str, Any]
    max_len: int
    dev_prob: np.ndarray  # the shipped classifier's dev probabilities (the threshold stage re-reads them)
    threshold: ThresholdResult | None  # picked on dev_prob; None for K > 2 (the label is the arg-max)
    baseline: Any = None  # tasks.inference.blend.BaselineModel, shipped when ``blend`` is set
    blend: Blend | KBlend | None = None
    run: dict[str, Any] = field(default_factory=dict)  # measured: wall_s (the manifest's run section, not metrics)
    head: BinaryHead = BINARY

    @property
    def classes(self) -> list[str] | None:
        """The class names in label order (``classes: any``), None in binary mode."""
        return self.data.classes


def split_facts(cfg: FinetuneConfig, data, train_ds, dev_ds, test_ds) -> dict[str, Any]:
    """The seeds and split sizes a finetune's metrics record."""
    return {"seed": cfg.seed, "split_seed": cfg.split_seed, "n_train": len(train_ds), "n_dev": len(dev_ds),
            "n_test": len(test_ds), "capped": data.capped}


def model_facts(model, device) -> dict[str, Any]:
    """What the trained classifier ran: blocks used, lexicon on or off, device."""
    return {"use_layers": model.use_layers, "uses_lexicon": model.uses_lexicon, "device": str(device)}


def finetune(cfg: FinetuneConfig, featurizer, model_cfg, encoder_state=None, progress: bool = False,
             on_epoch=None) -> FinetuneResult:
    """Read, split, encode, train, evaluate on test with the best epoch's decision rule (no I/O out).

    ``cfg.combine`` says how the shipped classifier uses the TF-IDF baseline (fitted on the train rows): ``stack``
    fits a logistic regression on the encoder's and the baseline's logits on the dev rows (multinomial on the 2K
    logits for K > 2); ``residual`` (two classes only) trains the encoder on top of the baseline's logit
    (out-of-fold on train, so it learns what the baseline gets wrong on unseen text) and adds the two. For two
    classes the threshold is picked on the shipped classifier's dev probabilities. The baseline alone (and, for
    ``stack``, the encoder alone) is reported beside it on the same rows."""
    t0 = time.perf_counter()
    data = load_data(cfg)
    train_ds, dev_ds, test_ds = (encode_rows(r, featurizer) for r in (data.train, data.dev, data.test))
    head = head_for(data.classes)
    missing_dev = head.check(cfg, train_ds, dev_ds)
    base = head.baseline(data)  # the cheap baseline on exactly these rows
    if cfg.combine == "residual":
        train_ds.offset = base.train_logits_out_of_fold().astype(np.float32)
        dev_ds.offset, test_ds.offset = base.dev_logits.astype(np.float32), base.test_logits.astype(np.float32)
    tr = train_classifier(cfg, train_ds, dev_ds, model_cfg, encoder_state, progress, on_epoch, head)
    device = next(tr.model.parameters()).device
    z_dev = tr.dev_logits
    z_test = np.zeros(head.score_shape(len(test_ds), tr.model), np.float32)
    _, test_scores = predict(tr.model, test_ds, cfg.batch_size, device, tr.model.uses_lexicon, z_test, head)
    enc_dev_prob, enc_test_prob = head.probs(tr.dev_scores), head.probs(test_scores)
    blend, fit_rows, note = head.combine(cfg, dev_ds, base, z_dev)
    dev_prob, test_prob = enc_dev_prob, enc_test_prob
    if blend is not None:
        dev_prob, test_prob = blend.prob(z_dev, base.dev_logits), blend.prob(z_test, base.test_logits)
    threshold = head.decide(tr, dev_ds, dev_prob, blend)
    metrics = {
        **head.metrics(cfg, tr, base, test_ds, enc_test_prob, test_prob, threshold, blend, fit_rows, note,
                       missing_dev),
        **split_facts(cfg, data, train_ds, dev_ds, test_ds),
        **head.class_facts(train_ds),
        **model_facts(tr.model, device),
        **head.clean_metrics(test_ds, base, enc_test_prob, test_prob, blend),
    }
    return FinetuneResult(tr, data, dev_ds, test_ds, test_prob, metrics, featurizer.max_len, dev_prob, threshold,
                          base.model if blend is not None else None, blend,
                          run={"wall_s": round(time.perf_counter() - t0, 1)}, head=head)


def write_outputs(writer, res: FinetuneResult, cfg: FinetuneConfig) -> dict[str, int]:
    """Write the stage files; returns {file: rows} for the manifest: the model, model_config.json (with
    ``classes`` under ``classes: any``), epochs, curves, the decision files (two classes: threshold.json and its
    table; K > 2: the confusion plot), dev/test predictions of the shipped classifier, heldout, rejects, and when
    combined ``baseline.parquet`` and ``blend.json``."""
    model, tr, head = res.train.model, res.train, res.head
    save_weights(writer, model)
    mc = {"model": model.cfg.model_dump(), "use_layers": model.use_layers, "dropout": cfg.dropout,
          "max_len": res.max_len, "truncation": cfg.truncation}
    if res.classes is not None:
        mc["classes"] = res.classes
    writer.write_bytes("model_config.json",
                       json.dumps(mc, indent=1, sort_keys=True, ensure_ascii=head.ascii_config).encode())
    rows = {"epochs.parquet": write_table(writer, "epochs.parquet", pa.Table.from_pylist(tr.log))}
    writer.write_bytes("curves.png", plot_epochs(tr.log, head.curves, tr.best_epoch, "best epoch {}",
                                                 f"finetune (best epoch {tr.best_epoch})"))
    head.write_decision(writer, res, rows)
    for name, ds, prob in (("test", res.test, res.test_prob), ("dev", res.dev, res.dev_prob)):
        rows[f"{name}_predictions.parquet"] = write_table(writer, f"{name}_predictions.parquet",
                                                          head.predictions(ds, prob))
    # the held-out texts themselves, so the pipeline can label them with the bundle (`label.input_uri: "@heldout"`)
    held = pa.table({
        "row_id": pa.array([r["row_id"] for r in res.data.test], pa.int64()),
        "review": pa.array([r["text"] for r in res.data.test], pa.string()),
        "label": head.heldout_labels(res.data.test, res.classes),
    })
    rows["heldout.parquet"] = write_table(writer, "heldout.parquet", held)
    if res.blend is not None:  # what labelling needs to score the shipped (combined) classifier
        rows["baseline.parquet"] = write_table(writer, "baseline.parquet", res.baseline.to_table())
        writer.write_bytes("blend.json", json.dumps(res.blend.to_dict(), indent=1, sort_keys=True).encode())
    rejects = pa.Table.from_pylist(res.data.rejects, schema=REJECT_SCHEMA)
    rows["rejected.parquet"] = write_table(writer, "rejected.parquet", rejects)
    return rows


@stoppable("finetune")  # SIGTERM/SIGINT in any phase: stops within 15 s; the rerun runs the stage again
def run_finetune_stage(writer, cfg: FinetuneConfig, pretrain_uri: str, lexicon_uri: str, progress: bool = True,
                       on_epoch=None) -> StageResult:
    """Load the pretrained encoder and the featuriser, fine-tune, write every output into ``writer``."""
    model_cfg, state, featurizer, _ = pretrained_inputs(pretrain_uri, lexicon_uri, cfg.max_len)
    featurizer = replace(featurizer, truncation=cfg.truncation)
    res = finetune(cfg, featurizer, model_cfg, state, progress, on_epoch)
    rows = write_outputs(writer, res, cfg)
    explain = partial(explain_dev, res, featurizer, lexicon_uri)  # a few dev examples explained, in a run only
    return StageResult(res.data.stats, res.metrics, rows, publish=partial(publish, res.train.log, explain=explain),
                       run=res.run)


def build(ctx: StageContext, pretrain_ref: ArtifactRef, lexicon_ref: ArtifactRef, progress: bool = True
          ) -> StageResult:
    """Fine-tune into the stage's staging as its training step (``ctx.step``: :func:`run_finetune_stage`)."""
    bar = ctx.progress(ctx.cfg.max_epochs, "finetune: epochs done")
    return ctx.step(run_finetune_stage, writer=ctx.writer, cfg=ctx.cfg, pretrain_uri=pretrain_ref.uri,
                    lexicon_uri=lexicon_ref.uri, progress=progress, on_epoch=lambda row: bar.step())


STAGE = Stage("finetune", CODE_VERSION, FinetuneConfig, parents=("pretrain_ref", "lexicon_ref"), build=build,
              version_config=on_pretrained_config, code=code_version, tags=("gpu",))
