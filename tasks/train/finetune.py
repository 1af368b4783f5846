"""finetune: labelled sentiment data -> LebertClassifier on the pretrained encoder, threshold, test metrics.

Pure logic first (reader, split, batching, early stopping, training, metrics, plot, stage function),
then a thin Prefect task at the bottom.

Data: one labelled file (``data_uri``, split deterministically) or given ``train_uri``/``dev_uri``
(/``test_uri``) files, CSV/TSV/JSON lines/Parquet on any fsspec URL (compression inferred from the
suffix). A header row is required. Every record is kept or rejected with a reason, so
``in == out + sum(rejected)`` holds; ``row_id`` is the 1-based line where a record starts
(Parquet: its 1-based row number).

Training: AdamW (no decay on biases/LayerNorm), length-bucketed batches with dynamic padding,
BCE on one logit. After each epoch: train AUC (on the epoch's own, dropout-on predictions), dev
loss/AUC and the dev-F1 threshold search. A non-improving dev AUC multiplies the LR by
``lr_decay``; ``patience`` such epochs in a row stop training; the best epoch's weights and
threshold are kept and evaluated on test. On CPU, runs are bit-identical for fixed seeds.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tasks.common.config import FinetuneConfig
from tasks.common.splits import split_rows, subsample  # noqa: F401 - re-exported for callers
from tasks.train.labelled import LoadedData, load_data, parse_label, read_labelled  # noqa: F401
from tasks.train.threshold import RULE as THRESHOLD_RULE
from tasks.train.threshold import ThresholdResult, search_threshold

CODE_VERSION = "finetune-1"
BUCKET_POOL_BATCHES = 50  # length bucketing pool, in batches
ENCODE_CHUNK = 8192



# ============================================================================= batching

@dataclass
class LabelledSet:
    row_ids: np.ndarray  # int64 [N]
    labels: np.ndarray  # float32 [N], 0/1
    encoded: list  # list[tasks.train.featurize.Encoded]
    lengths: np.ndarray = field(init=False)  # int64 [N]

    def __post_init__(self):
        self.lengths = np.array([len(e.input_ids) for e in self.encoded], np.int64)

    def __len__(self) -> int:
        return len(self.encoded)


def encode_rows(rows: list[dict[str, Any]], featurizer) -> LabelledSet:
    enc = []
    for i in range(0, len(rows), ENCODE_CHUNK):
        enc += featurizer.encode([r["text"] for r in rows[i : i + ENCODE_CHUNK]])
    return LabelledSet(np.array([r["row_id"] for r in rows], np.int64), np.array([r["label"] for r in rows], np.float32), enc)


def bucket_batches(lengths: np.ndarray, batch_size: int, rng: np.random.Generator, pool_batches: int = BUCKET_POOL_BATCHES) -> list[np.ndarray]:
    """Shuffle, sort by length within pools of ``pool_batches`` batches, cut, shuffle batch order."""
    perm = rng.permutation(len(lengths))
    pool = batch_size * pool_batches
    batches = []
    for s in range(0, len(perm), pool):
        chunk = perm[s : s + pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(ds: LabelledSet, idx: np.ndarray, device: torch.device, with_words: bool) -> dict[str, torch.Tensor]:
    """Dynamic padding to the longest sequence of the batch (id 0 = [PAD], word id 0 = empty)."""
    T = int(ds.lengths[idx].max())
    B = len(idx)
    ids = np.zeros((B, T), np.int64)
    words = np.zeros((B, T, ds.encoded[idx[0]].word_ids.shape[1]), np.int64) if with_words else None
    for b, i in enumerate(idx):
        e = ds.encoded[i]
        ids[b, : len(e.input_ids)] = e.input_ids
        if with_words:
            words[b, : len(e.input_ids)] = e.word_ids
    mask = np.arange(T)[None, :] < ds.lengths[idx][:, None]
    out = {
        "input_ids": torch.from_numpy(ids).to(device),
        "attention_mask": torch.from_numpy(mask).to(device),
        "labels": torch.from_numpy(ds.labels[idx]).to(device),
    }
    if with_words:
        out["word_ids"] = torch.from_numpy(words).to(device)
    return out


# ============================================================================= early stopping

class EarlyStopper:
    """Dev-AUC bookkeeping. ``update(auc) -> (improved, lr_scale, stop)``.

    Improvement = strictly greater than the best so far (the first finite value always improves).
    A non-improving epoch returns lr_scale = ``factor`` (multiply the LR by it) and counts towards
    ``patience``; ``stop`` is True once ``patience`` non-improving epochs have happened in a row.
    ``best_epoch`` is 1-based."""

    def __init__(self, patience: int, factor: float):
        self.patience, self.factor = patience, factor
        self.best = -math.inf
        self.best_epoch = 0
        self.epoch = 0
        self.bad = 0

    def update(self, score: float) -> tuple[bool, float, bool]:
        self.epoch += 1
        if score > self.best:  # NaN never improves
            self.best, self.best_epoch, self.bad = score, self.epoch, 0
            return True, 1.0, False
        self.bad += 1
        return False, self.factor, self.bad >= self.patience


# ============================================================================= training

def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


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
def predict(model, ds: LabelledSet, batch_size: int, device: torch.device, with_words: bool) -> tuple[float, np.ndarray]:
    """(mean BCE loss, probabilities [N] float32 in ds order); batches sorted by length."""
    model.eval()
    prob = np.zeros(len(ds), np.float32)
    total = 0.0
    order = np.argsort(ds.lengths, kind="stable")
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        b = collate(ds, idx, device, with_words)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(b["input_ids"], b["attention_mask"], b.get("word_ids"))
        logits = logits.float()
        total += float(F.binary_cross_entropy_with_logits(logits, b["labels"], reduction="sum"))
        prob[idx] = torch.sigmoid(logits).cpu().numpy()
    return total / max(len(ds), 1), prob


def make_optimizer(model: torch.nn.Module, cfg: FinetuneConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, fused=False)


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
    from tqdm.auto import tqdm

    from models import LebertClassifier

    for name, ds in (("train", train), ("dev", dev)):
        if len(np.unique(ds.labels)) < 2:
            raise ValueError(f"the {name} split needs both labels (has {len(ds)} rows, labels {sorted(set(ds.labels.tolist()))})")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    model = LebertClassifier(model_cfg, use_layers=cfg.use_layers, dropout=cfg.dropout)
    if encoder_state is not None:
        model.load_pretrained_encoder(encoder_state)
    model.to(device)
    with_words = model.uses_lexicon
    opt = make_optimizer(model, cfg)
    stopper = EarlyStopper(cfg.patience, cfg.lr_decay)
    log: list[dict[str, Any]] = []
    best_state, best_th, best_prob = None, None, None
    for epoch in range(1, cfg.max_epochs + 1):
        lr = opt.param_groups[0]["lr"]
        model.train()
        batches = bucket_batches(train.lengths, cfg.batch_size, np.random.default_rng([cfg.seed, epoch]))
        seen = np.concatenate(batches)
        probs, loss_sum = [], 0.0
        for idx in tqdm(batches, desc=f"finetune epoch {epoch}", unit="batch", disable=not progress, leave=False, mininterval=2):
            b = collate(train, idx, device, with_words)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(b["input_ids"], b["attention_mask"], b.get("word_ids"))
            loss = F.binary_cross_entropy_with_logits(logits.float(), b["labels"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            loss_sum += float(loss.detach()) * len(idx)
            probs.append(torch.sigmoid(logits.detach().float()).cpu().numpy())
        train_auc = auc(train.labels[seen], np.concatenate(probs))
        dev_loss, dev_prob = predict(model, dev, cfg.batch_size, device, with_words)
        dev_auc = auc(dev.labels, dev_prob)
        th = search_threshold(dev.labels, dev_prob)
        improved, scale, stop = stopper.update(dev_auc)
        if improved:
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            best_th, best_prob = th, dev_prob
        row = {
            "epoch": epoch,
            "train_loss": loss_sum / len(train),
            "train_auc": train_auc,
            "dev_loss": dev_loss,
            "dev_auc": dev_auc,
            "lr": lr,
            "best_threshold": th.threshold,
            "dev_f1": th.f1,
            "improved": improved,
        }
        log.append(row)
        if on_epoch:
            on_epoch(row)
        for g in opt.param_groups:
            g["lr"] *= scale
        if stop:
            break
    if best_state is None:
        raise RuntimeError("dev AUC was never finite; cannot pick an epoch")
    model.load_state_dict(best_state)
    model.eval()
    return TrainResult(model, log, stopper.best_epoch, stopper.best, best_th, best_prob)


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


def plot_epochs(log: list[dict[str, Any]], title: str = "finetune") -> bytes:
    """PNG: train/dev AUC and train/dev loss against epoch; the best epoch marked."""
    from tasks.common.plots import subplots, to_png

    ep = [r["epoch"] for r in log]
    best = max(log, key=lambda r: (r["dev_auc"] if r["dev_auc"] == r["dev_auc"] else -1, -r["epoch"]))["epoch"] if log else None
    fig, (a, b) = subplots(2)
    for ax, key, name in ((a, "auc", "AUC"), (b, "loss", "loss")):
        ax.plot(ep, [r[f"train_{key}"] for r in log], marker="o", ms=3, label=f"train {name}")
        ax.plot(ep, [r[f"dev_{key}"] for r in log], marker="o", ms=3, label=f"dev {name}")
        if best is not None:
            ax.axvline(best, color="grey", ls="--", lw=1, label=f"best epoch {best}")
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend()
    return to_png(fig, title)


# ============================================================================= stage

@dataclass
class FinetuneResult:
    train: TrainResult
    data: LoadedData
    dev: LabelledSet
    test: LabelledSet
    test_prob: np.ndarray
    metrics: dict[str, Any]
    max_len: int


def finetune(cfg: FinetuneConfig, featurizer, model_cfg, encoder_state=None, progress: bool = False, on_epoch=None) -> FinetuneResult:
    """Read, split, encode, train, evaluate on test at the best epoch and its dev threshold (no I/O out)."""
    t0 = time.perf_counter()
    data = load_data(cfg)
    train_ds, dev_ds, test_ds = (encode_rows(r, featurizer) for r in (data.train, data.dev, data.test))
    tr = train_classifier(cfg, train_ds, dev_ds, model_cfg, encoder_state, progress, on_epoch)
    device = next(tr.model.parameters()).device
    if len(test_ds):
        _, test_prob = predict(tr.model, test_ds, cfg.batch_size, device, tr.model.uses_lexicon)
        test = binary_metrics(test_ds.labels, test_prob, tr.threshold.threshold)
    else:
        test_prob = np.zeros(0, np.float32)
        test = dict.fromkeys(("auc", "accuracy", "precision", "recall", "f1"))
    best_row = tr.log[tr.best_epoch - 1]
    metrics = {
        **{f"test_{k}": (round(v, 6) if v is not None and v == v else None) for k, v in test.items()},
        "threshold": tr.threshold.threshold,
        "dev_f1": round(tr.threshold.f1, 6),
        "best_epoch": tr.best_epoch,
        "dev_auc": round(tr.best_dev_auc, 6),
        "train_auc": round(best_row["train_auc"], 6),
        "epochs_run": len(tr.log),
        "seed": cfg.seed,
        "split_seed": cfg.split_seed,
        "n_train": len(train_ds),
        "n_dev": len(dev_ds),
        "n_test": len(test_ds),
        "capped": data.capped,
        "train_pos_rate": round(float(train_ds.labels.mean()), 4),
        "use_layers": tr.model.use_layers,
        "uses_lexicon": tr.model.uses_lexicon,
        "device": str(device),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return FinetuneResult(tr, data, dev_ds, test_ds, test_prob, metrics, featurizer.max_len)


REJECT_COLUMNS = ("source", "line", "reason", "label", "text")


def write_outputs(writer, res: FinetuneResult, cfg: FinetuneConfig) -> dict[str, int]:
    """Write the stage files; returns {file: rows} for the manifest."""
    import pyarrow as pa
    from safetensors.torch import save as st_save

    from storage.parquet import write_table

    model = res.train.model
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    writer.write_bytes("model.safetensors", st_save(sd, metadata={"format": "pt"}))
    mc = {"model": model.cfg.model_dump(), "use_layers": model.use_layers, "dropout": cfg.dropout, "max_len": res.max_len}
    writer.write_bytes("model_config.json", json.dumps(mc, indent=1, sort_keys=True).encode())
    rows = {}
    rows["epochs.parquet"] = write_table(writer, "epochs.parquet", pa.Table.from_pylist(res.train.log))
    writer.write_bytes("curves.png", plot_epochs(res.train.log, f"finetune (best epoch {res.train.best_epoch})"))
    th = res.train.threshold
    info = {"threshold": th.threshold, "dev_f1": th.f1, "epoch": res.train.best_epoch, "rule": THRESHOLD_RULE}
    writer.write_bytes("threshold.json", json.dumps(info, indent=1, sort_keys=True).encode())
    rows["threshold_table.parquet"] = write_table(writer, "threshold_table.parquet", pa.Table.from_pylist(th.table))
    pred = pa.table({
        "row_id": pa.array(res.test.row_ids, pa.int64()),
        "label": pa.array(res.test.labels.astype(np.int8), pa.int8()),
        "prob": pa.array(res.test_prob, pa.float32()),
    })
    rows["test_predictions.parquet"] = write_table(writer, "test_predictions.parquet", pred)
    # the held-out texts themselves, so the pipeline can label them with the bundle (`label.input_uri: "@heldout"`)
    held = pa.table({
        "row_id": pa.array([r["row_id"] for r in res.data.test], pa.int64()),
        "review": pa.array([r["text"] for r in res.data.test], pa.string()),
        "label": pa.array([int(r["label"]) for r in res.data.test], pa.int8()),
    })
    rows["heldout.parquet"] = write_table(writer, "heldout.parquet", held)
    dev = pa.table({
        "row_id": pa.array(res.dev.row_ids, pa.int64()),
        "label": pa.array(res.dev.labels.astype(np.int8), pa.int8()),
        "prob": pa.array(res.train.dev_prob, pa.float32()),
    })
    rows["dev_predictions.parquet"] = write_table(writer, "dev_predictions.parquet", dev)  # best epoch's
    schema = pa.schema([("source", pa.string()), ("line", pa.int64()), ("reason", pa.string()), ("label", pa.string()), ("text", pa.string())])
    rows["rejected.parquet"] = write_table(writer, "rejected.parquet", pa.Table.from_pylist(res.data.rejects, schema=schema))
    return rows


def load_pretrained(pretrain_uri: str):
    """(ModelConfig, state dict) from a committed pretrain artifact, checksum-verified."""
    from safetensors.torch import load as st_load

    from models import ModelConfig
    from storage.artifacts import open_artifact

    art = open_artifact(pretrain_uri)
    model_cfg = ModelConfig.model_validate(json.loads(art.read_verified("model_config.json")))
    return model_cfg, st_load(art.read_verified("model.safetensors"))


def run_finetune_stage(writer, cfg: FinetuneConfig, pretrain_uri: str, lexicon_uri: str, progress: bool = True, on_epoch=None) -> dict[str, Any]:
    """Load the pretrained encoder and the featuriser, fine-tune, write every output into ``writer``."""
    from storage.artifacts import open_artifact
    from tasks.train.featurize import Featurizer

    model_cfg, state = load_pretrained(pretrain_uri)
    max_len = min(cfg.max_len, model_cfg.max_len)
    featurizer = Featurizer.from_artifacts(open_artifact(lexicon_uri), max_len)
    res = finetune(cfg, featurizer, model_cfg, state, progress, on_epoch)
    rows = write_outputs(writer, res, cfg)
    return {"log": res.train.log, "metrics": res.metrics, "stats": res.data.stats, "rows": rows}


def report_markdown(log: list[dict[str, Any]], art) -> str:
    """Markdown for the Prefect UI: test metrics, the epoch table, where the curves are."""
    m = art.manifest.metrics
    head = "| metric | value |\n|---|---|\n" + "".join(
        f"| {k} | {m[k]:.4f} |\n" for k in ("test_auc", "test_accuracy", "test_precision", "test_recall", "test_f1", "threshold") if isinstance(m.get(k), (int, float))
    )
    cols = ("epoch", "train_loss", "train_auc", "dev_loss", "dev_auc", "lr", "best_threshold", "dev_f1")
    rows = "".join("| " + " | ".join(f"{r.get(c):.4g}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols) + " |\n" for r in log)
    table = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n" + rows
    return f"# finetune `{art.manifest.version}`\n\nbest epoch {m.get('best_epoch')}\n\n{head}\n## epochs\n\n{table}\nCurves: `{art.uri}/curves.png`\n"


def publish_epochs(log: list[dict[str, Any]], art=None) -> None:
    """Prefect UI: the epoch log as a table artifact (a no-op outside a run)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    keep = ("epoch", "train_loss", "train_auc", "dev_loss", "dev_auc", "lr", "best_threshold", "dev_f1")
    desc = "fine-tuning, one row per epoch" + (f"\n\n`{art.uri}`" if art is not None else "")
    try:
        create_table_artifact(key="finetune-epochs", table=[{k: r.get(k) for k in keep} for r in log], description=desc)
        if art is not None:
            create_markdown_artifact(key="finetune-report", markdown=report_markdown(log, art), description="fine-tuning report")
    except Exception as e:  # convenience only; the artifact is already committed
        import logging

        logging.getLogger("lexiflow").debug("could not publish finetune epochs: %s", e)


# ============================================================================= Prefect wrapper
from prefect import task  # noqa: E402
from prefect.cache_policies import NONE  # noqa: E402


@task(name="finetune-train", cache_policy=NONE)
def finetune_task(store_uri: str, version: str, cfg: FinetuneConfig, pretrain_uri: str, lexicon_uri: str, progress: bool = True) -> dict[str, Any]:
    """Run the stage into the staging directory that the flow's StageRun already began."""
    from storage.artifacts import ArtifactStore
    from tasks.common.stage import Progress

    store = ArtifactStore(store_uri)
    bar = Progress("finetune", cfg.max_epochs)
    return run_finetune_stage(store.attach("finetune", version), cfg, pretrain_uri, lexicon_uri, progress, lambda row: bar.step())
