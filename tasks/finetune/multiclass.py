"""Fine-tuning with K > 2 classes (``finetune.classes: any``): a softmax head over the same mean-max pooling,
cross-entropy, the epoch picked on dev macro-F1, no threshold (the label is the arg-max).

The K-class TF-IDF baseline (multinomial logistic regression on the same training rows) is reported beside the
model and, with ``combine: stack`` (the default), stacked with it: a multinomial logistic regression on the
encoder's K logits and the baseline's K logits, fitted on the dev rows (:class:`tasks.finetune.baseline.KBlend`).
``combine: none`` ships the encoder alone; ``residual`` is for two classes only. The rows come from
:func:`tasks.common.labelled.load_data` with each label an index into ``classes`` (sorted order).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tasks.common.config import FinetuneConfig
from tasks.finetune.baseline import MULTINOMIAL, clean_test_line, vs_baseline

EPOCH_COLUMNS = ("epoch", "train_loss", "train_macro_f1", "dev_loss", "dev_macro_f1", "dev_accuracy", "lr",
                 "improved")
TABLE_COLUMNS = EPOCH_COLUMNS[:-1]
CURVES = (("macro-F1", (("train_macro_f1", "train macro-F1"), ("dev_macro_f1", "dev macro-F1"))),
          ("loss", (("train_loss", "train loss"), ("dev_loss", "dev loss"))))
RULE = "arg-max over the K classes' probabilities (no threshold: the threshold stage applies to K = 2 only)"
BASELINE = MULTINOMIAL  # the K-class baseline, in words


def macro_f1(y: np.ndarray, pred: np.ndarray, k: int | None = None) -> float:
    """Macro-F1 over the classes present in ``y`` (a class absent from ``y`` has no F1 to average; sklearn,
    zero_division=0); nan without rows."""
    from sklearn.metrics import f1_score

    if len(y) == 0:
        return float("nan")
    return float(f1_score(y, pred, labels=np.unique(y), average="macro", zero_division=0))


def class_metrics(y: np.ndarray, prob: np.ndarray) -> dict[str, float | None]:
    """macro_f1 and accuracy of the arg-max of ``prob`` [N, K] against ``y`` [N]."""
    if len(y) == 0:
        return {"macro_f1": None, "accuracy": None}
    pred = np.asarray(prob).argmax(1)
    return {"macro_f1": macro_f1(y, pred), "accuracy": float((pred == y).mean())}


def paired_macro_f1_difference(y: np.ndarray, pred_a: np.ndarray, pred_b: np.ndarray, k: int,
                               resamples: int = 1000, seed: int = 0) -> dict[str, Any] | None:
    """macro-F1(a) - macro-F1(b) on the same rows (class predictions ``pred_a``, ``pred_b`` against ``y``), with a
    95 % paired-bootstrap interval (rows resampled together for both, ``resamples`` times from ``seed``; each
    resample's macro-F1 averages over the classes present in it, as :func:`macro_f1`) and the share of resamples in
    which a is not better: the K-class twin of :func:`tasks.finetune.baseline.paired_auc_difference`. None without
    rows. Counted with ``np.bincount``, :data:`BOOTSTRAP_CHUNK` resamples at a time."""
    from tasks.finetune.baseline import _r6

    y = np.asarray(y, np.int64)
    if len(y) == 0:
        return None
    n = len(y)
    pred_a, pred_b = np.asarray(pred_a, np.int64), np.asarray(pred_b, np.int64)
    rng = np.random.default_rng(seed)
    d = np.concatenate([_f1_difference(rng.integers(0, n, (r, n)), y, pred_a, pred_b, k)  # [r, n] rows each
                        for r in np.diff(np.r_[0:resamples:BOOTSTRAP_CHUNK, resamples])])
    lo, hi = np.percentile(d, [2.5, 97.5])
    return {"diff": _r6(macro_f1(y, np.asarray(pred_a)) - macro_f1(y, np.asarray(pred_b))),
            "ci95": [_r6(lo), _r6(hi)], "p_not_better": _r6(float((d <= 0).mean())), "resamples": resamples,
            "seed": seed}


BOOTSTRAP_CHUNK = 50  # resamples counted at once: memory is [chunk, n_test] per array, whatever the test size


def _f1_difference(rows: np.ndarray, y: np.ndarray, pred_a: np.ndarray, pred_b: np.ndarray, k: int) -> np.ndarray:
    """macro-F1(a) - macro-F1(b) for each resample (``rows`` [R, n] row indices), from per-class counts."""
    r = len(rows)
    base = np.arange(r)[:, None] * k  # [R, 1]
    yy = y[rows]
    true = np.bincount((base + yy).ravel(), minlength=r * k).reshape(r, k)
    present = true > 0

    def f1s(pred: np.ndarray) -> np.ndarray:  # [R] macro-F1 over the classes present in each resample
        pp = pred[rows]
        predicted = np.bincount((base + pp).ravel(), minlength=r * k).reshape(r, k)
        tp = np.bincount((base + yy).ravel(), weights=(pp == yy).ravel(), minlength=r * k).reshape(r, k)
        denom = predicted + true
        f1 = np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)
        return (f1 * present).sum(1) / present.sum(1)

    return f1s(pred_a) - f1s(pred_b)


def confusion(y: np.ndarray, pred: np.ndarray, k: int) -> list[list[int]]:
    """counts [K, K]: row = true class, column = predicted class."""
    m = np.zeros((k, k), np.int64)
    np.add.at(m, (np.asarray(y, np.int64), np.asarray(pred, np.int64)), 1)
    return m.tolist()


def softmax_np(z: np.ndarray) -> np.ndarray:
    """float32 [N, K] probabilities of logits [N, K] (training-time metrics only; labelling uses
    :func:`models.rowwise.softmax_rows`)."""
    return torch.softmax(torch.from_numpy(np.ascontiguousarray(z, np.float32)), dim=-1).numpy()


# ============================================================================= training


def _collate(ds, idx, device, with_words):
    from tasks.finetune.train import collate

    b = collate(ds, idx, device, with_words)
    b["labels"] = b["labels"].long()  # class indices
    return b


@torch.no_grad()
def predict_logits(model, ds, batch_size: int, device, with_words: bool) -> tuple[float, np.ndarray]:
    """(mean cross-entropy, logits float32 [N, K] in ds order)."""
    from tasks.pretrain.loop import autocast, sorted_batches

    model.eval()
    out = np.zeros((len(ds), model.num_labels), np.float32)
    total = 0.0
    for idx in sorted_batches(ds.lengths, batch_size):
        b = _collate(ds, idx, device, with_words)
        with autocast(device):
            z = model(b["input_ids"], b["attention_mask"], b.get("word_ids"))  # [B, K]
        z = z.float()
        total += float(F.cross_entropy(z, b["labels"], reduction="sum"))
        out[idx] = z.cpu().numpy()
    return total / max(len(ds), 1), out


@dataclass
class KTrainResult:
    model: Any
    log: list[dict[str, Any]]
    best_epoch: int
    best_dev_macro_f1: float
    dev_logits: np.ndarray  # float32 [n_dev, K] at the best epoch


def check_classes(classes: list[str], train_labels: np.ndarray, dev_labels: np.ndarray) -> list[str]:
    """Every class must have training rows (else ValueError naming them); returns the classes with no dev row (the
    dev macro-F1 then averages over the others)."""
    k = len(classes)
    no_train = [classes[c] for c in range(k) if not (train_labels == c).any()]
    if no_train:
        raise ValueError(f"class(es) {no_train} have no training row (of {k} classes {classes}); the model could "
                         "never predict them: add rows or drop the class")
    return [classes[c] for c in range(k) if not (dev_labels == c).any()]


def train_multiclass(cfg: FinetuneConfig, train, dev, model_cfg, k: int, encoder_state=None, progress: bool = False,
                     on_epoch=None) -> KTrainResult:
    from models import LebertClassifier
    from tasks.pretrain.loop import EpochReport, fit, make_adamw, seeded_model

    if len(dev) == 0:
        raise ValueError("the dev split is empty: the epoch is selected on dev macro-F1")
    model, device = seeded_model(lambda: LebertClassifier(model_cfg, use_layers=cfg.use_layers, dropout=cfg.dropout,
                                                          num_labels=k),
                                 cfg.seed, cfg.threads, cfg.device, encoder_state)
    with_words = model.uses_lexicon
    opt = make_adamw(model, cfg.lr, cfg.weight_decay)
    y_train, y_dev = train.labels.astype(np.int64), dev.labels.astype(np.int64)

    def batch_loss(model, idx):
        b = _collate(train, idx, device, with_words)
        z = model(b["input_ids"], b["attention_mask"], b.get("word_ids")).float()  # [B, K]
        return F.cross_entropy(z, b["labels"]), len(idx), z.detach().argmax(1).cpu().numpy()

    def evaluate(model, batches, preds) -> EpochReport:
        train_f1 = macro_f1(y_train[np.concatenate(batches)], np.concatenate(preds))
        dev_loss, z = predict_logits(model, dev, cfg.batch_size, device, with_words)
        pred = z.argmax(1)
        dev_f1 = macro_f1(y_dev, pred)
        row = {"train_macro_f1": train_f1, "dev_loss": dev_loss, "dev_macro_f1": dev_f1,
               "dev_accuracy": float((pred == y_dev).mean())}
        return EpochReport(dev_f1, row, keep=z)

    res = fit(model, opt, train.lengths, batch_loss, evaluate, cfg, EPOCH_COLUMNS, cfg.lr_decay, "finetune",
              "macro-F1", progress, on_epoch)
    return KTrainResult(model, res.log, res.best_epoch, res.best_score, res.best)


# ============================================================================= baseline


@dataclass
class KBaseline:
    model: Any  # tasks.finetune.baseline.BaselineModel (multinomial: K logits per text)
    metrics: dict[str, Any]
    dev_logits: np.ndarray  # float64 [n_dev, K]
    test_logits: np.ndarray  # float64 [n_test, K]
    test_prob: np.ndarray  # [n_test, K]
    unseen: dict[str, np.ndarray]  # split -> bool [n]: text not among the training rows

    @property
    def unseen_test(self) -> np.ndarray:
        return self.unseen["test"]


def run_kbaseline(train, dev, test, k: int) -> KBaseline:
    """The multinomial TF-IDF baseline fitted on exactly the ``train`` rows (every class must have one:
    :func:`check_classes`), as arrays (:class:`tasks.finetune.baseline.BaselineModel`, the form a bundle ships); its
    dev/test logits, test macro-F1/accuracy, and the contamination counts (dev/test rows whose normalised text
    occurs among the training rows)."""
    from tasks.common.text import normalize_text
    from tasks.finetune.baseline import BaselineModel, _r6, fit_baseline

    texts = {s: [normalize_text(r["text"]) for r in rows] for s, rows in (("train", train), ("dev", dev),
                                                                          ("test", test))}
    y = np.array([r["label"] for r in train], np.int64)
    model = BaselineModel.from_sklearn(fit_baseline(texts["train"], y, multinomial=True))
    z = {s: model.logits(texts[s]).reshape(len(texts[s]), k) for s in ("dev", "test")}
    prob = softmax_np(z["test"])
    m = class_metrics(np.array([r["label"] for r in test], np.int64), prob)
    seen = set(texts["train"])
    unseen = {s: np.array([t not in seen for t in texts[s]], bool) for s in ("dev", "test")}
    metrics = {"baseline_test_macro_f1": _r6(m["macro_f1"]), "baseline_test_accuracy": _r6(m["accuracy"]),
               "contaminated_test_rows": int((~unseen["test"]).sum()),
               "contaminated_dev_rows": int((~unseen["dev"]).sum())}
    return KBaseline(model, metrics, z["dev"], z["test"], prob, unseen)


def stack_rows(y_dev: np.ndarray, unseen_dev: np.ndarray, k: int) -> tuple[np.ndarray | None, str | None]:
    """The dev rows the K-class stack is fitted on: those whose text is not among the training rows (a memorised
    row would make the encoder look better than it is on new text), or every dev row when those lack a class;
    (None, why) when the dev split itself lacks a class (no weights could be fitted for it)."""
    present = lambda rows: set(np.unique(y_dev[rows]).tolist()) == set(range(k))  # noqa: E731
    if present(unseen_dev):
        return unseen_dev, None
    everything = np.ones(len(y_dev), bool)
    if present(everything):
        return everything, None
    return None, "the dev split lacks a class: not stacked, the encoder alone is shipped"


# ============================================================================= stage


@dataclass
class KFinetuneResult:
    train: KTrainResult
    data: Any  # LoadedData
    dev: Any
    test: Any
    classes: list[str]
    dev_prob: np.ndarray  # [n_dev, K]: the shipped classifier's
    test_prob: np.ndarray  # [n_test, K]: the shipped classifier's
    metrics: dict[str, Any]
    max_len: int
    run: dict[str, Any] = field(default_factory=dict)
    baseline: Any = None  # tasks.finetune.baseline.BaselineModel, shipped when ``blend`` is set
    blend: Any = None  # tasks.finetune.baseline.KBlend


def finetune_multiclass(cfg: FinetuneConfig, data, train_ds, dev_ds, test_ds, featurizer, model_cfg,
                        encoder_state=None, progress: bool = False, on_epoch=None, t0: float | None = None
                        ) -> KFinetuneResult:
    """Train the K-class encoder, fit the baseline on the same training rows and (``combine: stack``) the stack on
    dev; the shipped classifier, the encoder alone and the baseline scored on the same test rows."""
    from tasks.finetune.baseline import _r6, fit_kblend
    from tasks.finetune.train import model_facts, split_facts

    t0 = time.perf_counter() if t0 is None else t0
    if cfg.combine == "residual":
        raise ValueError("finetune.combine: residual is implemented for two classes only; with K > 2 classes use "
                         "stack (the default: the encoder's and the baseline's logits stacked on dev) or none")
    classes, k = data.classes, len(data.classes)
    missing_dev = check_classes(classes, train_ds.labels, dev_ds.labels)
    base = run_kbaseline(data.train, data.dev, data.test, k)
    tr = train_multiclass(cfg, train_ds, dev_ds, model_cfg, k, encoder_state, progress, on_epoch)
    device = next(tr.model.parameters()).device
    _, z_test = predict_logits(tr.model, test_ds, cfg.batch_size, device, tr.model.uses_lexicon)
    enc_dev_prob, enc_test_prob = softmax_np(tr.dev_logits), softmax_np(z_test)
    y_dev, y_test = dev_ds.labels.astype(np.int64), test_ds.labels.astype(np.int64)
    blend, combine, note, fit = None, "none", None, None
    if cfg.combine == "stack":
        fit, note = stack_rows(y_dev, base.unseen["dev"], k)
        if fit is not None:
            blend, combine = fit_kblend(y_dev[fit], tr.dev_logits[fit], base.dev_logits[fit], k), "stack"
    dev_prob, test_prob = enc_dev_prob, enc_test_prob
    if blend is not None:
        dev_prob, test_prob = blend.prob(tr.dev_logits, base.dev_logits), blend.prob(z_test, base.test_logits)
    test, enc = class_metrics(y_test, test_prob), class_metrics(y_test, enc_test_prob)
    best = tr.log[tr.best_epoch - 1]
    metrics: dict[str, Any] = {
        "test_macro_f1": _r6(test["macro_f1"]),
        "test_accuracy": _r6(test["accuracy"]),
        "encoder_test_macro_f1": _r6(enc["macro_f1"]),  # the encoder alone (the shipped model when not stacked)
        "encoder_test_accuracy": _r6(enc["accuracy"]),
        "best_epoch": tr.best_epoch,
        "dev_macro_f1": _r6(tr.best_dev_macro_f1),
        "dev_accuracy": _r6(best["dev_accuracy"]),
        "train_macro_f1": _r6(best["train_macro_f1"]),
        "epochs_run": len(tr.log),
        "classes": classes,
        "num_classes": k,
        "combine": combine,
        "blend": blend.to_dict() if blend is not None else None,
        **({"blend_fit_rows": int(fit.sum())} if blend is not None else {}),
        **({"combine_note": note} if note else {}),
        **base.metrics,
        # is the shipped classifier's test macro-F1 above the baseline's by more than resampling noise?
        "test_macro_f1_vs_baseline": paired_macro_f1_difference(y_test, test_prob.argmax(1),
                                                                base.test_prob.argmax(1), k, seed=cfg.seed),
        "test_confusion": confusion(y_test, test_prob.argmax(1), k) if len(y_test) else None,
        "dev_missing_classes": missing_dev,
        **split_facts(cfg, data, train_ds, dev_ds, test_ds),
        **model_facts(tr.model, device),
    }
    clean = base.unseen_test
    if len(clean) and clean.any() and not clean.all():  # as the binary metrics: only when some rows repeat train
        metrics["n_clean_test"] = int(clean.sum())
        scored = (("", test_prob), *((("encoder_", enc_test_prob),) if blend is not None else ()),
                  ("baseline_", base.test_prob))  # the encoder alone only when it is not what ships
        for prefix, prob in scored:
            c = class_metrics(y_test[clean], prob[clean])
            metrics.update({f"{prefix}clean_test_macro_f1": _r6(c["macro_f1"]),
                            f"{prefix}clean_test_accuracy": _r6(c["accuracy"])})
    return KFinetuneResult(tr, data, dev_ds, test_ds, classes, dev_prob, test_prob, metrics, featurizer.max_len,
                           run={"wall_s": round(time.perf_counter() - t0, 1)},
                           baseline=base.model if blend is not None else None, blend=blend)


def write_outputs(writer, res: KFinetuneResult, cfg: FinetuneConfig) -> dict[str, int]:
    """The K-class finetune files: model, model_config.json (with ``classes``), epochs, curves, the confusion
    plot, dev/test predictions of the shipped classifier (``label``/``pred`` class indices, ``probs``
    list<float32> [K]), heldout, rejects, and when stacked ``baseline.parquet`` and ``blend.json``; no threshold
    files."""
    import json

    import pyarrow as pa

    from storage.parquet import write_table
    from tasks.common.labelled import REJECT_SCHEMA
    from tasks.common.plots import confusion_png
    from tasks.pretrain.downstream import save_weights
    from tasks.pretrain.loop import plot_epochs

    model, tr = res.train.model, res.train
    save_weights(writer, model)
    mc = {"model": model.cfg.model_dump(), "use_layers": model.use_layers, "dropout": cfg.dropout,
          "max_len": res.max_len, "truncation": cfg.truncation, "classes": res.classes}
    writer.write_bytes("model_config.json", json.dumps(mc, indent=1, sort_keys=True, ensure_ascii=False).encode())
    rows = {"epochs.parquet": write_table(writer, "epochs.parquet", pa.Table.from_pylist(tr.log))}
    writer.write_bytes("curves.png", plot_epochs(tr.log, CURVES, tr.best_epoch, "best epoch {}",
                                                 f"finetune (best epoch {tr.best_epoch})"))
    if res.metrics.get("test_confusion"):
        writer.write_bytes("confusion.png", confusion_png(res.metrics["test_confusion"], res.classes,
                                                          "test confusion (rows: true class)"))
    for name, ds, prob in (("test", res.test, res.test_prob), ("dev", res.dev, res.dev_prob)):
        rows[f"{name}_predictions.parquet"] = write_table(writer, f"{name}_predictions.parquet",
                                                          predictions_table(ds, prob))
    held = pa.table({
        "row_id": pa.array([r["row_id"] for r in res.data.test], pa.int64()),
        "review": pa.array([r["text"] for r in res.data.test], pa.string()),
        "label": pa.array([res.classes[int(r["label"])] for r in res.data.test], pa.string()),
    })
    rows["heldout.parquet"] = write_table(writer, "heldout.parquet", held)
    if res.blend is not None:  # what labelling needs to score the shipped (stacked) classifier
        rows["baseline.parquet"] = write_table(writer, "baseline.parquet", res.baseline.to_table())
        writer.write_bytes("blend.json", json.dumps(res.blend.to_dict(), indent=1, sort_keys=True).encode())
    rows["rejected.parquet"] = write_table(writer, "rejected.parquet",
                                           pa.Table.from_pylist(res.data.rejects, schema=REJECT_SCHEMA))
    return rows


def predictions_table(ds, prob: np.ndarray):
    import pyarrow as pa

    k = prob.shape[1] if prob.ndim == 2 else 0
    flat = pa.array(np.ascontiguousarray(prob, np.float32).ravel(), pa.float32())
    return pa.table({
        "row_id": pa.array(ds.row_ids, pa.int64()),
        "label": pa.array(ds.labels.astype(np.int16), pa.int16()),
        "pred": pa.array(prob.argmax(1).astype(np.int16) if len(prob) else np.zeros(0, np.int16), pa.int16()),
        "probs": pa.FixedSizeListArray.from_arrays(flat, k),
    })


def confusion_markdown(matrix: list[list[int]] | None, classes: list[str]) -> str:
    """The test confusion matrix as a markdown table (rows: true class, columns: predicted)."""
    if not matrix:
        return "no test rows: no confusion matrix\n"
    head = "| true \\ predicted | " + " | ".join(classes) + " |\n|---|" + "---|" * len(classes) + "\n"
    return head + "".join(f"| {c} | " + " | ".join(str(v) for v in row) + " |\n" for c, row in zip(classes, matrix))


def comparison_markdown(m: dict[str, Any]) -> str:
    """The shipped K-class classifier beside the encoder alone (when stacked) and the baseline on the same test
    rows, how it was combined, the clean-row figures and the contamination counts (finetune metrics ``m``)."""
    f = lambda v: "n/a" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    stacked = m.get("combine") == "stack" and m.get("blend")
    names = [("test macro-F1", "test_macro_f1"), ("test accuracy", "test_accuracy")]
    if stacked:
        out = "| metric | shipped (encoder + baseline) | encoder alone | baseline |\n|---|---|---|---|\n"
        out += "".join(f"| {n} | {f(m.get(k))} | {f(m.get('encoder_' + k))} | {f(m.get('baseline_' + k))} |\n"
                       for n, k in names)
        out += (f"\nShipped: a multinomial logistic regression on the encoder's {m.get('num_classes')} logits and the "
                f"baseline's, fitted on {m.get('blend_fit_rows')} dev rows (never test).\n")
    else:
        out = "| metric | shipped (encoder alone) | baseline |\n|---|---|---|\n"
        out += "".join(f"| {n} | {f(m.get(k))} | {f(m.get('baseline_' + k))} |\n" for n, k in names)
        if m.get("combine_note"):
            out += f"\n{m['combine_note']}.\n"
    if isinstance(vs := m.get("test_macro_f1_vs_baseline"), dict):
        out += f"\nShipped against the baseline: {vs_baseline(vs, 'test macro-F1')}.\n"
    if clean := clean_test_line(m):
        out += f"\n{clean}\n"
    return (out + f"\nBaseline: {BASELINE}, on the same {m.get('n_train')} training rows. Label: {RULE}.\n\n"
            f"Contamination: {m.get('contaminated_test_rows')} of {m.get('n_test')} test rows and "
            f"{m.get('contaminated_dev_rows')} of {m.get('n_dev')} dev rows have a text that, normalised, also "
            "occurs among the training rows.\n")


def report_markdown(log: list[dict[str, Any]], art) -> str:
    """Prefect markdown for a K-class finetune: the shipped model beside the baseline, the confusion matrix, epochs."""
    from tasks.finetune.train import _cell

    m = art.manifest.metrics
    head = comparison_markdown(m)
    if m.get("dev_missing_classes"):
        head += f"\nClasses with no dev row (dev macro-F1 averages over the others): {m['dev_missing_classes']}\n"
    conf = confusion_markdown(m.get("test_confusion"), m.get("classes") or [])
    rows = "".join("| " + " | ".join(_cell(r.get(c)) for c in TABLE_COLUMNS) + " |\n" for r in log)
    table = "| " + " | ".join(TABLE_COLUMNS) + " |\n|" + "---|" * len(TABLE_COLUMNS) + "\n" + rows
    return (f"# finetune `{art.manifest.version}` ({m.get('num_classes')} classes)\n\nbest epoch "
            f"{m.get('best_epoch')}\n\n{head}\n## test confusion matrix (shipped)\n\n{conf}\nPlot: "
            f"`{art.uri}/confusion.png`\n\n## epochs\n\n{table}\nCurves: `{art.uri}/curves.png`\n")


def publish(log: list[dict[str, Any]], art, explain=None) -> None:
    """As :func:`tasks.finetune.train.publish`: the epoch table, the report and (``explain``) the explained dev
    examples."""
    from tasks.pretrain.loop import publish_table

    report = ("finetune-report", report_markdown(log, art), "fine-tuning report")
    publish_table("finetune-epochs", log, TABLE_COLUMNS, f"fine-tuning, one row per epoch\n\n`{art.uri}`", report)
    if explain is not None:
        explain(art)
