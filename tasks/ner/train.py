"""ner: train the character NER tagger (LEBERT encoder + softmax or CRF head), plus the HMM baseline.

Data: character-per-line files read by :func:`tasks.ner.data.read_ner` (tags -> BIO), either given
``train_uri``/``dev_uri``(/``test_uri``) or one ``data_uri`` split by ``split``/``split_seed``.
Features and long-sentence chunks are the inference side's (:mod:`tasks.inference.ner`), so training
and tagging see the same inputs; metrics are computed on the re-joined sentences.

This module holds what is particular to NER: the tag set, the tagger's loss (per character,
softmax or CRF) and the dev metric (entity P/R/F1, :mod:`tasks.ner.metrics`). The epoch loop is
:func:`tasks.training.loop.fit`: AdamW (no decay on biases/LayerNorm/CRF; ``encoder_lr`` for the
pretrained encoder), length-bucketed batches, and after every epoch the dev set is tagged and
scored; the model is selected on DEV F1 only (first epoch with the best value), ``patience``
non-improving epochs stop training (the LR never decays), and the best epoch's weights are then
scored once on test.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from models import LebertTagger
from storage.artifacts import ArtifactRef
from storage.parquet import write_table
from tasks.common.context import StageContext
from tasks.common.rejects import reject_schema
from tasks.common.splits import subsample
from tasks.common.stage import Stage, StageResult, file_name
from tasks.common.ui import Reporter
from tasks.inference.ner import ChunkSet, build_chunks, collate, predict_tags
from tasks.ner.config import NerConfig
from tasks.ner.data import read_ner, split_sentences
from tasks.ner.hmm import HMM
from tasks.ner.metrics import entity_prf
from tasks.pretrain.downstream import on_pretrained_config, pretrained_inputs, save_weights
from tasks.text.featurize import Featurizer
from tasks.training.loop import EpochReport, fit, make_adamw, plot_epochs, seeded_model
from tasks.training.preempt import poll, stoppable

CODE_VERSION = "ner-4"  # bump when the same inputs give other bytes
EPOCH_COLUMNS = ("epoch", "train_loss", "dev_f1", "dev_precision", "dev_recall", "lr", "improved")  # epochs.parquet
CURVES = (("entity score", (("dev_f1", "dev f1"), ("dev_precision", "dev precision"), ("dev_recall", "dev recall"))),
          ("loss", (("train_loss", "train loss (per char)"),)))


# ============================================================================= data


@dataclass
class NerSplits:
    """The NER sentences split into train, dev and test, with rejects and the readers' counts."""
    train: list[dict[str, Any]]  # read_ner sentences {chars, tags (BIO), line}
    dev: list[dict[str, Any]]
    test: list[dict[str, Any]]
    rejects: list[dict[str, Any]]  # {source, line, reason, text}
    stats: dict[str, Any]  # {"in", "out", "rejected": {reason: n}} over every file read
    data: dict[str, Any]  # the readers' other counts, summed (repaired_i_start, multi_char, types ...)
    capped: dict[str, int]  # sentences left out by the caps, per split


def load_ner_splits(cfg: NerConfig) -> NerSplits:
    """Read the NER files that ``cfg`` names (or one file split), apply the caps, sum the counts."""
    uris = [cfg.data_uri] if cfg.data_uri else [cfg.train_uri, cfg.dev_uri, cfg.test_uri]
    parts, rejects, agg = [], [], Counter()
    types: Counter = Counter()
    for uri in uris:
        if not uri:
            parts.append([])
            continue
        d = read_ner(uri, cfg.strip_suffix)
        parts.append(d.sentences)
        rejects += [{"source": file_name(uri), **r} for r in d.rejects]  # a name: the directory is not versioned
        agg.update({k: v for k, v in d.stats.items() if isinstance(v, int)})
        agg.update({f"rejected.{k}": v for k, v in d.stats["rejected"].items()})
        types.update(d.stats["types"])
    train, dev, test = split_sentences(parts[0], cfg.split, cfg.split_seed) if cfg.data_uri else parts
    full = {"train": len(train), "dev": len(dev), "test": len(test)}
    train = subsample(train, cfg.max_train_sentences, cfg.split_seed + 1)
    dev = subsample(dev, cfg.max_eval_sentences, cfg.split_seed + 2)
    test = subsample(test, cfg.max_eval_sentences, cfg.split_seed + 3)
    capped = {k: full[k] - len(v) for k, v in (("train", train), ("dev", dev), ("test", test))}
    rejected = {k.split(".", 1)[1]: v for k, v in sorted(agg.items()) if k.startswith("rejected.")}
    stats = {"in": agg["in"], "out": agg["out"], "rejected": rejected}
    data = {k: v for k, v in sorted(agg.items()) if k not in ("in", "out") and not k.startswith("rejected.")}
    return NerSplits(train, dev, test, rejects, stats, {**data, "types": dict(sorted(types.items()))}, capped)


def tag_list(sentences: Sequence[dict[str, Any]]) -> list[str]:
    """``O``, then ``B-X``, ``I-X`` for every type in the (training) sentences, types sorted."""
    kinds = sorted({t[2:] for s in sentences for t in s["tags"] if t != "O"})
    return ["O"] + [f"{p}-{k}" for k in kinds for p in "BI"]


# ============================================================================= training


@dataclass
class NerTrainResult:
    """The tagger with the best dev F1, its epoch log and which epoch that was."""
    model: Any  # models.LebertTagger with the best epoch's weights (eval mode)
    log: list[dict[str, Any]]
    best_epoch: int
    best_dev_f1: float
    dev_pred: list[list[str]]  # best epoch's dev tags


def _is_crf(name: str) -> bool:
    return name.startswith("crf.")


def train_tagger(cfg: NerConfig, train: ChunkSet, dev: ChunkSet, dev_gold: list[list[str]], tags: list[str], model_cfg,
                 encoder_state: dict[str, torch.Tensor] | None = None, progress: bool = False,
                 on_epoch: Callable[[dict[str, Any]], None] | None = None) -> NerTrainResult:
    """Train; the epoch with the best dev entity F1 is kept (never looks at test)."""
    model, device = seeded_model(lambda: LebertTagger(model_cfg, len(tags), cfg.use_layers, cfg.dropout, cfg.use_crf),
                                 cfg.seed, cfg.threads, cfg.device, encoder_state)
    with_words = cfg.use_adapter and model.uses_lexicon
    opt = make_adamw(model, cfg.lr, cfg.weight_decay, no_decay=_is_crf, encoder_lr=cfg.encoder_lr or cfg.lr)

    def batch_loss(model, idx: np.ndarray):
        b = collate(train, idx, device, with_words)
        loss = model.loss(b["input_ids"], b["attention_mask"], b["word_ids"], b["tags"], b["tag_mask"],  # per char
                          b["padded"])
        return loss, b["n_tags"], None  # the weight counted on the host: no device read per step

    def evaluate(model, batches: list[np.ndarray], outs: list[None]) -> EpochReport:
        pred = predict_tags(model, dev, tags, cfg.batch_size, device, with_words, poll)
        m = entity_prf(dev_gold, pred)["overall"]
        row = {"dev_f1": m["f1"], "dev_precision": m["precision"], "dev_recall": m["recall"]}
        return EpochReport(m["f1"], row, keep=pred)

    res = fit(model, opt, train.lengths, batch_loss, evaluate, cfg, EPOCH_COLUMNS, 1.0, "ner", "F1", progress, on_epoch)
    return NerTrainResult(model, res.log, res.best_epoch, res.best_score, res.best)


def _round(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


@dataclass
class NerResult:
    """Everything the ner stage writes: the trained tagger, the splits, the tags, test predictions and metrics."""
    train: NerTrainResult
    splits: NerSplits
    tags: list[str]
    test_pred: list[list[str]]
    metrics: dict[str, Any]
    max_len: int
    run: dict[str, Any] = field(default_factory=dict)  # measured: wall_s (the manifest's run section)


def train_ner(cfg: NerConfig, feat: Featurizer, model_cfg, encoder_state=None, max_len: int | None = None,
              progress: bool = False, on_epoch=None) -> NerResult:
    """Read, encode, train (select on dev), tag test at the best epoch (no I/O out)."""
    t0 = time.perf_counter()
    max_len = min(max_len or cfg.max_len, model_cfg.max_len)
    sp = load_ner_splits(cfg)
    if not sp.train or not sp.dev:
        raise ValueError(f"ner needs non-empty train and dev splits (train {len(sp.train)}, dev {len(sp.dev)})")
    if model_cfg.use_adapter and len(feat.rank_to_word) and int(feat.rank_to_word.max()) >= model_cfg.word_vocab_size:
        raise ValueError("the lexicon's word ids exceed the model's word_vocab_size: lexicon and pretrain artifacts "
                         "do not match")
    tags = tag_list(sp.train)
    tag_index = {t: i for i, t in enumerate(tags)}
    train_ds = build_chunks([s["chars"] for s in sp.train], feat, max_len, [s["tags"] for s in sp.train], tag_index)
    dev_ds, test_ds = (build_chunks([s["chars"] for s in ss], feat, max_len) for ss in (sp.dev, sp.test))
    tr = train_tagger(cfg, train_ds, dev_ds, [s["tags"] for s in sp.dev], tags, model_cfg, encoder_state, progress,
                      on_epoch)
    device = next(tr.model.parameters()).device
    with_words = cfg.use_adapter and tr.model.uses_lexicon
    test_pred = predict_tags(tr.model, test_ds, tags, cfg.batch_size, device, with_words, poll)
    test = entity_prf([s["tags"] for s in sp.test], test_pred) if sp.test else None
    hmm = run_hmm_eval(sp.train, sp.dev, sp.test)  # the baseline on exactly these sentences
    best = tr.log[tr.best_epoch - 1]
    metrics = {
        **({f"test_{k}": round(test["overall"][k], 6) for k in ("precision", "recall", "f1")} if test else
           dict.fromkeys(("test_precision", "test_recall", "test_f1"))),
        "test_support": test["overall"]["support"] if test else 0,
        "test_per_type": {k: _round(v) for k, v in test["per_type"].items()} if test else {},
        "best_epoch": tr.best_epoch,
        "dev_f1": round(best["dev_f1"], 6),
        "dev_precision": round(best["dev_precision"], 6),
        "dev_recall": round(best["dev_recall"], 6),
        "epochs_run": len(tr.log),
        **{f"hmm_{k}": hmm[k] for k in ("test_precision", "test_recall", "test_f1", "dev_f1")},
        "selected_on": "dev",
        "n_train": len(sp.train), "n_dev": len(sp.dev), "n_test": len(sp.test),
        "n_train_chunks": len(train_ds),
        "capped": sp.capped,
        "data": sp.data,
        "num_tags": len(tags),
        "use_crf": cfg.use_crf,
        "use_adapter": cfg.use_adapter,
        "uses_lexicon": with_words,
        "use_layers": tr.model.use_layers,
        "max_len": max_len,
        "seed": cfg.seed,
        "device": str(device),
    }
    return NerResult(tr, sp, tags, test_pred, metrics, max_len, {"wall_s": round(time.perf_counter() - t0, 1)})


# ============================================================================= stage


def write_ner_outputs(writer, res: NerResult, cfg: NerConfig, feat: Featurizer) -> dict[str, int]:
    """Model, config, tags, epoch log + plot, test predictions, rejects and the featuriser
    (:meth:`tasks.text.featurize.Featurizer.save`) so the artifact is self-contained."""
    model, tr = res.train.model, res.train
    save_weights(writer, model)
    # the featurizer's files; its settings live in model_config.json (read back by Featurizer.load): the tagger's
    # max_len (its chunk length) and the lexicon's two, no truncation (a sentence is cut into chunks instead)
    settings = feat.save(writer, settings_file=None)
    mc = {"model": model.cfg.model_dump(), "num_tags": len(res.tags), "tags": res.tags, "use_layers": model.use_layers,
          "dropout": cfg.dropout, "use_crf": cfg.use_crf, "use_adapter": cfg.use_adapter, "max_len": res.max_len,
          "max_word_num": settings["max_word_num"], "min_word_len": settings["min_word_len"]}
    writer.write_bytes("model_config.json", json.dumps(mc, indent=1, sort_keys=True, ensure_ascii=False).encode())
    writer.write_bytes("tags.json", json.dumps(res.tags, ensure_ascii=False).encode())
    rows = {"epochs.parquet": write_table(writer, "epochs.parquet", pa.Table.from_pylist(tr.log))}
    curves = plot_epochs(tr.log, CURVES, tr.best_epoch, "best dev epoch {}", f"ner (best dev epoch {tr.best_epoch})")
    writer.write_bytes("curves.png", curves)
    strs = pa.list_(pa.string())
    test = pa.table({
        "sentence": pa.array(range(len(res.splits.test)), pa.int64()),
        "line": pa.array([s["line"] for s in res.splits.test], pa.int64()),
        "chars": pa.array([s["chars"] for s in res.splits.test], strs),
        "gold": pa.array([s["tags"] for s in res.splits.test], strs),
        "pred": pa.array(res.test_pred, strs),
    })
    rows["test_predictions.parquet"] = write_table(writer, "test_predictions.parquet", test)
    rejects = pa.Table.from_pylist(res.splits.rejects, schema=reject_schema("source", "line", "reason", "text"))
    rows["rejected.parquet"] = write_table(writer, "rejected.parquet", rejects)
    return rows


@stoppable("ner")  # SIGTERM/SIGINT in any phase: stops within 15 s; the rerun runs the stage again
def run_ner_stage(writer, cfg: NerConfig, pretrain_uri: str, lexicon_uri: str, progress: bool = True,
                  on_epoch=None) -> StageResult:
    """Load the pretrained encoder and the featuriser, train, write every output into ``writer``."""
    model_cfg, state, feat, max_len = pretrained_inputs(pretrain_uri, lexicon_uri, cfg.max_len)
    res = train_ner(cfg, feat, model_cfg, state, max_len, progress, on_epoch)
    rows = write_ner_outputs(writer, res, cfg, feat)
    return StageResult(res.splits.stats, res.metrics, rows, publish=partial(publish, res.train.log), run=res.run)


def publish(log: list[dict[str, Any]], art, reporter: Reporter) -> None:
    """The UI, once committed: the epoch log as a table artifact (nothing where there is no UI)."""
    desc = f"NER training, one row per epoch (selected on dev F1)\n\n`{art.uri}`"
    m = art.manifest.metrics

    def f(v):
        return "n/a" if v is None else f"{v:.4f}"

    md = ("| entity F1 (exact span and type) | LEBERT tagger | HMM baseline |\n|---|---|---|\n"
          f"| test | {f(m.get('test_f1'))} | {f(m.get('hmm_test_f1'))} |\n"
          f"| dev | {f(m.get('dev_f1'))} | {f(m.get('hmm_dev_f1'))} |\n\n"
          f"Same train/dev/test sentences ({m.get('n_train')}/{m.get('n_dev')}/{m.get('n_test')}); `{art.uri}`\n")
    reporter.publish_table("ner-epochs", log, EPOCH_COLUMNS, desc,
                           markdown=("ner-report", md, "NER: tagger beside the HMM"))


# ============================================================================= HMM baseline


def run_hmm_eval(train: Sequence[dict[str, Any]], dev: Sequence[dict[str, Any]],
                 test: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fit :class:`tasks.ner.hmm.HMM` on train; entity P/R/F1 on dev and test (``None`` for an empty split)."""
    hmm = HMM().fit(train)

    def score(ss):
        return entity_prf([s["tags"] for s in ss], hmm.predict_many([s["chars"] for s in ss])) if ss else None

    d, t = score(dev), score(test)
    flat = {f"{name}_{k}": (round(m["overall"][k], 6) if m else None)
            for name, m in (("dev", d), ("test", t)) for k in ("precision", "recall", "f1")}
    return {**flat, "dev": d, "test": t}


# ============================================================================= the stage


def build(ctx: StageContext, pretrain_ref: ArtifactRef, lexicon_ref: ArtifactRef, progress: bool = True
          ) -> StageResult:
    """Train the tagger into the stage's staging as its training step (``ctx.step``: :func:`run_ner_stage`)."""
    bar = ctx.progress(ctx.cfg.max_epochs, "ner: epochs done")
    return ctx.step(run_ner_stage, writer=ctx.writer, cfg=ctx.cfg, pretrain_uri=pretrain_ref.uri,
                    lexicon_uri=lexicon_ref.uri, progress=progress, on_epoch=lambda row: bar.step())


STAGE = Stage("ner", CODE_VERSION, NerConfig, parents=("pretrain_ref", "lexicon_ref"), build=build,
              version_config=on_pretrained_config, tags=("gpu",))
