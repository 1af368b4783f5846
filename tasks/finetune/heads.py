"""What differs between two classes and K > 2 in fine-tuning: the head's size, the loss, the epoch metric (AUC or
macro-F1), the decision rule (a threshold picked on dev, or the arg-max), the combination with the baseline and
the report's wording. :func:`head_for` picks one from the classes a labelled file holds."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from storage.parquet import write_table
from tasks.common.plots import confusion_png
from tasks.finetune.baseline import (
    clean_test_metrics,
    fit_blend,
    fit_kblend,
    fmt,
    paired_auc_difference,
    run_baseline,
    run_kbaseline,
)
from tasks.finetune.metrics import (
    auc,
    binary_metrics,
    class_metrics,
    confusion,
    macro_f1,
    paired_macro_f1_difference,
    r6,
    softmax_np,
)
from tasks.finetune.threshold import ARGMAX_RULE, search_threshold
from tasks.finetune.threshold import RULE as THRESHOLD_RULE
from tasks.inference.blend import BASELINE, MULTINOMIAL, RESIDUAL


class BinaryHead:
    """Two classes: one logit, BCE, the epoch picked on dev AUC, a threshold picked on dev F1."""

    k = 2
    metric = "AUC"
    ascii_config = True  # model_config.json as binary runs always wrote it
    epoch_columns = ("epoch", "train_loss", "train_auc", "dev_loss", "dev_auc", "lr", "best_threshold", "dev_f1",
                     "improved")
    curves = (("AUC", (("train_auc", "train AUC"), ("dev_auc", "dev AUC"))),
              ("loss", (("train_loss", "train loss"), ("dev_loss", "dev loss"))))
    vs_key, test_metric = "test_auc_vs_baseline", "test AUC"
    # (label, model metric key, encoder-alone key or None, baseline metric key or None) for the side-by-side table
    compared = (("test AUC", "test_auc", "encoder_test_auc", "baseline_test_auc"),
                ("test accuracy", "test_accuracy", "encoder_test_accuracy", "baseline_test_accuracy"),
                ("test precision", "test_precision", None, None), ("test recall", "test_recall", None, None),
                ("test F1", "test_f1", "encoder_test_f1", "baseline_test_f1"),
                ("threshold (picked on dev)", "threshold", "encoder_threshold", "baseline_threshold"))

    def model_kwargs(self) -> dict[str, Any]:
        """Extra :class:`models.LebertClassifier` arguments (one logit: the default)."""
        return {}

    def check(self, cfg, train, dev) -> list[str]:
        """Refuse what cannot be trained before any work; the classes with no dev row (none for two classes)."""
        return []

    def check_splits(self, train, dev) -> None:
        """Both labels in train and dev (AUC and the threshold need them)."""
        for name, ds in (("train", train), ("dev", dev)):
            if len(np.unique(ds.labels)) < 2:
                labels = sorted(set(ds.labels.tolist()))
                raise ValueError(f"the {name} split needs both labels (has {len(ds)} rows, labels {labels})")

    def baseline(self, data):
        """The TF-IDF baseline on exactly these rows."""
        return run_baseline(data.train, data.dev, data.test)

    def labels(self, t: torch.Tensor) -> torch.Tensor:
        """Labels as the loss takes them: float 0/1."""
        return t

    def score_shape(self, n: int, model) -> tuple[int, ...]:
        """The shape of a split's scores: one probability per row."""
        return (n,)

    def loss(self, z: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """BCE on the logit."""
        return F.binary_cross_entropy_with_logits(z, labels, reduction=reduction)

    def scores(self, z: torch.Tensor) -> torch.Tensor:
        """Probabilities of the (offset) logits."""
        return torch.sigmoid(z)

    def probs(self, scores: np.ndarray) -> np.ndarray:
        """Probabilities from :meth:`scores`' output (already probabilities)."""
        return scores

    def batch_loss(self, z: torch.Tensor, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch's loss and its dropout-on probabilities (for the train AUC), left on the device: the
        epoch reads them all at once, so a step never waits for the device."""
        if "offset" in b:  # combine: residual: the model learns a correction to the baseline's logit
            z = z + b["offset"]
        prob = torch.sigmoid(z.detach().float())  # [B]
        return F.binary_cross_entropy_with_logits(z.float(), b["labels"]), prob

    def epoch(self, y_seen: np.ndarray, seen: np.ndarray, y_dev: np.ndarray, dev_loss: float,
              dev_scores: np.ndarray) -> tuple[float, dict[str, Any], Any]:
        """(dev AUC, the epoch's log values, its dev threshold)."""
        dev_auc = auc(y_dev, dev_scores)
        th = search_threshold(y_dev, dev_scores)
        row = {"train_auc": auc(y_seen, seen), "dev_loss": dev_loss, "dev_auc": dev_auc,
               "best_threshold": th.threshold, "dev_f1": th.f1}
        return dev_auc, row, th

    def combine(self, cfg, dev, base, z_dev: np.ndarray):
        """(blend or None, the dev rows it was fitted on, a note): the stack is fitted on the dev rows whose text is
        not in train (a memorised row would make the encoder look better than it is on new text), unless those lack
        a class; all dev rows when none repeats a training text."""
        fit = base.unseen("dev")
        if len(np.unique(dev.labels[fit])) < 2:
            fit = np.ones(len(dev), bool)
        if cfg.combine == "none":
            return None, fit, None
        if cfg.combine == "residual":
            return RESIDUAL, fit, None
        return fit_blend(dev.labels[fit], z_dev[fit], base.dev_logits[fit]), fit, None

    def decide(self, tr, dev, dev_prob: np.ndarray, blend):
        """The shipped threshold: re-picked on the shipped dev probabilities when combined."""
        return search_threshold(dev.labels, dev_prob) if blend is not None else tr.threshold

    def metrics(self, cfg, tr, base, test, enc_test_prob, test_prob, threshold, blend, fit, note,
                missing_dev) -> dict[str, Any]:
        """The test figures of the shipped classifier, the encoder alone when stacked, and the baseline."""
        no_test = dict.fromkeys(("auc", "accuracy", "precision", "recall", "f1"))
        enc_test = binary_metrics(test.labels, enc_test_prob, tr.threshold.threshold) if len(test) else no_test
        shipped = enc_test
        if blend is not None and len(test):
            shipped = binary_metrics(test.labels, test_prob, threshold.threshold)
        best_row = tr.log[tr.best_epoch - 1]
        stack = cfg.combine == "stack"
        return {
            **{f"test_{k}": r6(v) for k, v in shipped.items()},
            "threshold": threshold.threshold,
            "dev_f1": round(threshold.f1, 6),
            "best_epoch": tr.best_epoch,
            "dev_auc": round(tr.best_score, 6),
            "train_auc": round(best_row["train_auc"], 6),
            "epochs_run": len(tr.log),
            # the encoder alone (at its own dev threshold), then the cheap baseline on exactly these train/dev/test
            # rows, and the test/dev rows whose text occurs in train
            **({f"encoder_test_{k}": r6(v) for k, v in enc_test.items()} if stack else {}),
            **({"encoder_threshold": tr.threshold.threshold} if stack else {}),
            "combine": cfg.combine,
            "blend": blend.to_dict() if blend is not None else None,
            **({"blend_fit_rows": int(fit.sum())} if stack else {}),
            **base.metrics,
            # is the shipped classifier's test AUC above the baseline's by more than resampling noise?
            "test_auc_vs_baseline": paired_auc_difference(test.labels, test_prob, base.test_logits, seed=cfg.seed),
            # the same on the test rows whose text is not in train (only when some are)
            **clean_test_metrics(test.labels, base.unseen("test"), {
                "": (test_prob, threshold.threshold),
                **({"encoder_": (enc_test_prob, tr.threshold.threshold)} if stack else {}),
                "baseline_": (base.test_prob, base.metrics["baseline_threshold"])}),
        }

    def clean_metrics(self, test, base, enc_test_prob, test_prob, blend) -> dict[str, Any]:
        """Nothing more: the clean-row figures are among :meth:`metrics`."""
        return {}

    def class_facts(self, train) -> dict[str, Any]:
        """Metrics that describe the training labels: the positive rate."""
        return {"train_pos_rate": round(float(train.labels.mean()), 4)}

    def write_decision(self, writer, res, rows: dict[str, int]) -> None:
        """``threshold.json`` and ``threshold_table.parquet``: the threshold picked on dev."""
        th = res.threshold
        info = {"threshold": th.threshold, "dev_f1": th.f1, "epoch": res.train.best_epoch, "rule": THRESHOLD_RULE}
        writer.write_bytes("threshold.json", json.dumps(info, indent=1, sort_keys=True).encode())
        rows["threshold_table.parquet"] = write_table(writer, "threshold_table.parquet",
                                                      pa.Table.from_pylist(th.table))

    def predictions(self, ds, prob: np.ndarray):
        """row_id, label (int8) and prob (float32) per row."""
        return pa.table({
            "row_id": pa.array(ds.row_ids, pa.int64()),
            "label": pa.array(ds.labels.astype(np.int8), pa.int8()),
            "prob": pa.array(prob, pa.float32()),
        })

    def heldout_labels(self, rows: list[dict[str, Any]], classes: list[str] | None):
        """The held-out rows' labels as written: 0/1 (int8)."""
        return pa.array([int(r["label"]) for r in rows], pa.int8())

    def comparison_table(self, m: dict[str, Any]) -> str:
        """The shipped classifier beside the baseline (and the encoder alone when stacked), and how it ships."""
        blend = m.get("blend")
        if blend and m.get("combine") == "residual":
            out = "| metric | shipped (baseline + residual encoder) | baseline |\n|---|---|---|\n"
            out += "".join(f"| {name} | {fmt(m.get(k))} | {fmt(m.get(b)) if b else '—'} |\n"
                           for name, k, _, b in self.compared)
            return out + ("\nShipped: the baseline's logit plus the encoder's, the encoder trained on top of the "
                          "baseline's out-of-fold logits on the training rows (it learns what the baseline gets "
                          "wrong).\n")
        if blend:
            out = "| metric | shipped (encoder + baseline) | encoder alone | baseline |\n|---|---|---|---|\n"
            out += "".join(f"| {name} | {fmt(m.get(k))} | {fmt(m.get(e)) if e else '—'} | "
                           f"{fmt(m.get(b)) if b else '—'} |\n" for name, k, e, b in self.compared)
            return out + (f"\nShipped: a logistic regression on the encoder's and the baseline's logits, fitted on "
                          f"the dev rows (w_encoder {fmt(blend.get('w_encoder'))}, w_baseline "
                          f"{fmt(blend.get('w_baseline'))}, bias {fmt(blend.get('bias'))}).\n")
        out = "| metric | model | baseline |\n|---|---|---|\n"
        return out + "".join(f"| {name} | {fmt(m.get(k))} | {fmt(m.get(b)) if b else '—'} |\n"
                             for name, k, _, b in self.compared)

    def baseline_sentence(self, m: dict[str, Any]) -> str:
        """What the baseline is and how it was trained."""
        return (f"\nBaseline: {BASELINE}, trained on the same {fmt(m.get('n_train'))} training rows, threshold "
                "by the same rule on the same dev rows.\n\n")

    def title(self, m: dict[str, Any]) -> str:
        """What the report's title adds after the version."""
        return ""

    def report_extra(self, m: dict[str, Any], uri: str) -> str:
        """Report sections between the comparison and the epochs (none for two classes)."""
        return ""


class ClassesHead(BinaryHead):
    """K > 2 classes: K logits, cross-entropy, the epoch picked on dev macro-F1, the label is the arg-max; the
    multinomial baseline, stacked on dev (``combine: stack``) or beside the encoder alone."""

    metric = "macro-F1"
    ascii_config = False
    epoch_columns = ("epoch", "train_loss", "train_macro_f1", "dev_loss", "dev_macro_f1", "dev_accuracy", "lr",
                     "improved")
    curves = (("macro-F1", (("train_macro_f1", "train macro-F1"), ("dev_macro_f1", "dev macro-F1"))),
              ("loss", (("train_loss", "train loss"), ("dev_loss", "dev loss"))))
    vs_key, test_metric = "test_macro_f1_vs_baseline", "test macro-F1"
    compared = (("test macro-F1", "test_macro_f1", "encoder_test_macro_f1", "baseline_test_macro_f1"),
                ("test accuracy", "test_accuracy", "encoder_test_accuracy", "baseline_test_accuracy"))

    def __init__(self, classes: list[str]):
        self.classes, self.k = classes, len(classes)

    def model_kwargs(self) -> dict[str, Any]:
        """K logits."""
        return {"num_labels": self.k}

    def check(self, cfg, train, dev) -> list[str]:
        """Refuse ``combine: residual`` and classes without training rows; the classes with no dev row."""
        check_combine(cfg)
        return check_classes(self.classes, train.labels, dev.labels)

    def check_splits(self, train, dev) -> None:
        """A dev row at least (the epoch is selected on dev macro-F1)."""
        if len(dev) == 0:
            raise ValueError("the dev split is empty: the epoch is selected on dev macro-F1")

    def baseline(self, data):
        """The multinomial TF-IDF baseline on exactly these rows."""
        return run_kbaseline(data.train, data.dev, data.test, self.k)

    def labels(self, t: torch.Tensor) -> torch.Tensor:
        """Labels as the loss takes them: class indices."""
        return t.long()

    def score_shape(self, n: int, model) -> tuple[int, ...]:
        """The shape of a split's scores: K logits per row."""
        return (n, model.num_labels)

    def loss(self, z: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy on the K logits."""
        return F.cross_entropy(z, labels, reduction=reduction)

    def scores(self, z: torch.Tensor) -> torch.Tensor:
        """The logits themselves."""
        return z

    def probs(self, scores: np.ndarray) -> np.ndarray:
        """Softmax of the logits."""
        return softmax_np(scores)

    def batch_loss(self, z: torch.Tensor, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch's loss and its dropout-on arg-max (for the train macro-F1), left on the device (read
        once per epoch)."""
        z = z.float()  # [B, K]
        return F.cross_entropy(z, b["labels"]), z.detach().argmax(1)

    def epoch(self, y_seen: np.ndarray, seen: np.ndarray, y_dev: np.ndarray, dev_loss: float,
              dev_scores: np.ndarray) -> tuple[float, dict[str, Any], Any]:
        """(dev macro-F1, the epoch's log values, no threshold)."""
        y_dev = y_dev.astype(np.int64)
        pred = dev_scores.argmax(1)
        dev_f1 = macro_f1(y_dev, pred)
        row = {"train_macro_f1": macro_f1(y_seen.astype(np.int64), seen), "dev_loss": dev_loss,
               "dev_macro_f1": dev_f1, "dev_accuracy": float((pred == y_dev).mean())}
        return dev_f1, row, None

    def combine(self, cfg, dev, base, z_dev: np.ndarray):
        """(blend or None, the dev rows it was fitted on, why it was not stacked)."""
        if cfg.combine != "stack":
            return None, None, None
        y_dev = dev.labels.astype(np.int64)
        fit, note = stack_rows(y_dev, base.unseen("dev"), self.k)
        if fit is None:
            return None, None, note
        return fit_kblend(y_dev[fit], z_dev[fit], base.dev_logits[fit], self.k), fit, None

    def decide(self, tr, dev, dev_prob: np.ndarray, blend):
        """No threshold: the label is the arg-max."""
        return None

    def metrics(self, cfg, tr, base, test, enc_test_prob, test_prob, threshold, blend, fit, note,
                missing_dev) -> dict[str, Any]:
        """The test figures of the shipped classifier, the encoder alone and the baseline, and the confusion."""
        y_test, k = test.labels.astype(np.int64), self.k
        shipped, enc = class_metrics(y_test, test_prob), class_metrics(y_test, enc_test_prob)
        best = tr.log[tr.best_epoch - 1]
        metrics: dict[str, Any] = {
            "test_macro_f1": r6(shipped["macro_f1"]),
            "test_accuracy": r6(shipped["accuracy"]),
            "encoder_test_macro_f1": r6(enc["macro_f1"]),  # the encoder alone (the shipped model when not stacked)
            "encoder_test_accuracy": r6(enc["accuracy"]),
            "best_epoch": tr.best_epoch,
            "dev_macro_f1": r6(tr.best_score),
            "dev_accuracy": r6(best["dev_accuracy"]),
            "train_macro_f1": r6(best["train_macro_f1"]),
            "epochs_run": len(tr.log),
            "classes": self.classes,
            "num_classes": k,
            "combine": "stack" if blend is not None else "none",
            "blend": blend.to_dict() if blend is not None else None,
            **({"blend_fit_rows": int(fit.sum())} if blend is not None else {}),
            **({"combine_note": note} if note else {}),
            **base.metrics,
            # is the shipped classifier's test macro-F1 above the baseline's by more than resampling noise?
            "test_macro_f1_vs_baseline": paired_macro_f1_difference(y_test, test_prob.argmax(1),
                                                                    base.test_prob.argmax(1), k, seed=cfg.seed),
            "test_confusion": confusion(y_test, test_prob.argmax(1), k) if len(y_test) else None,
            "dev_missing_classes": missing_dev,
        }
        return metrics

    def clean_metrics(self, test, base, enc_test_prob, test_prob, blend) -> dict[str, Any]:
        """Macro-F1 and accuracy on the test rows whose text is not in train (only when some rows repeat it)."""
        y_test, clean = test.labels.astype(np.int64), base.unseen("test")
        if not (len(clean) and clean.any() and not clean.all()):
            return {}
        out: dict[str, Any] = {"n_clean_test": int(clean.sum())}
        scored = (("", test_prob), *((("encoder_", enc_test_prob),) if blend is not None else ()),
                  ("baseline_", base.test_prob))  # the encoder alone only when it is not what ships
        for prefix, prob in scored:
            c = class_metrics(y_test[clean], prob[clean])
            out.update({f"{prefix}clean_test_macro_f1": r6(c["macro_f1"]),
                        f"{prefix}clean_test_accuracy": r6(c["accuracy"])})
        return out

    def class_facts(self, train) -> dict[str, Any]:
        """Nothing beyond the classes already recorded."""
        return {}

    def write_decision(self, writer, res, rows: dict[str, int]) -> None:
        """``confusion.png``: the shipped classifier's test confusion matrix (no threshold files)."""
        if res.metrics.get("test_confusion"):
            writer.write_bytes("confusion.png", confusion_png(res.metrics["test_confusion"], self.classes,
                                                              "test confusion (rows: true class)"))

    def predictions(self, ds, prob: np.ndarray):
        """row_id, label and pred (class indices, int16) and probs (list<float32> [K]) per row."""
        k = prob.shape[1] if prob.ndim == 2 else 0
        flat = pa.array(np.ascontiguousarray(prob, np.float32).ravel(), pa.float32())
        return pa.table({
            "row_id": pa.array(ds.row_ids, pa.int64()),
            "label": pa.array(ds.labels.astype(np.int16), pa.int16()),
            "pred": pa.array(prob.argmax(1).astype(np.int16) if len(prob) else np.zeros(0, np.int16), pa.int16()),
            "probs": pa.FixedSizeListArray.from_arrays(flat, k),
        })

    def heldout_labels(self, rows: list[dict[str, Any]], classes: list[str] | None):
        """The held-out rows' labels as written: the class names."""
        return pa.array([classes[int(r["label"])] for r in rows], pa.string())

    def comparison_table(self, m: dict[str, Any]) -> str:
        """The shipped classifier beside the encoder alone (when stacked) and the baseline, and how it ships."""
        if m.get("combine") == "stack" and m.get("blend"):
            out = "| metric | shipped (encoder + baseline) | encoder alone | baseline |\n|---|---|---|---|\n"
            out += "".join(f"| {n} | {fmt(m.get(k))} | {fmt(m.get(e))} | {fmt(m.get(b))} |\n"
                           for n, k, e, b in self.compared)
            return out + (f"\nShipped: a multinomial logistic regression on the encoder's {m.get('num_classes')} "
                          f"logits and the baseline's, fitted on {m.get('blend_fit_rows')} dev rows (never test).\n")
        out = "| metric | shipped (encoder alone) | baseline |\n|---|---|---|\n"
        out += "".join(f"| {n} | {fmt(m.get(k))} | {fmt(m.get(b))} |\n" for n, k, _, b in self.compared)
        return out + (f"\n{m['combine_note']}.\n" if m.get("combine_note") else "")

    def baseline_sentence(self, m: dict[str, Any]) -> str:
        """What the baseline is, and the decision rule."""
        return (f"\nBaseline: {MULTINOMIAL}, on the same {fmt(m.get('n_train'))} training rows. Label: "
                f"{ARGMAX_RULE}.\n\n")

    def title(self, m: dict[str, Any]) -> str:
        """The number of classes."""
        return f" ({m.get('num_classes')} classes)"

    def report_extra(self, m: dict[str, Any], uri: str) -> str:
        """The test confusion matrix and where its plot is."""
        conf = confusion_markdown(m.get("test_confusion"), m.get("classes") or [])
        return f"## test confusion matrix (shipped)\n\n{conf}\nPlot: `{uri}/confusion.png`\n\n"


BINARY = BinaryHead()


def head_for(classes: list[str] | None) -> BinaryHead:
    """The head for a labelled file's classes: two (or binary mode, ``None``) or K > 2."""
    return ClassesHead(classes) if classes is not None and len(classes) > 2 else BINARY


def head_of_metrics(m: dict[str, Any]) -> BinaryHead:
    """The head a finetune's metrics were written by."""
    if "test_macro_f1" in m or (m.get("num_classes") or 2) > 2:
        return ClassesHead(m.get("classes") or [])
    return BINARY


def check_combine(cfg) -> None:
    """``combine: residual`` needs one logit: refused for K > 2 classes."""
    if cfg.combine == "residual":
        raise ValueError("finetune.combine: residual is implemented for two classes only; with K > 2 classes use "
                         "stack (the default: the encoder's and the baseline's logits stacked on dev) or none")


def check_classes(classes: list[str], train_labels: np.ndarray, dev_labels: np.ndarray) -> list[str]:
    """Every class must have training rows (else ValueError naming them); returns the classes with no dev row (the
    dev macro-F1 then averages over the others)."""
    k = len(classes)
    no_train = [classes[c] for c in range(k) if not (train_labels == c).any()]
    if no_train:
        raise ValueError(f"class(es) {no_train} have no training row (of {k} classes {classes}); the model could "
                         "never predict them: add rows or drop the class")
    return [classes[c] for c in range(k) if not (dev_labels == c).any()]


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


def confusion_markdown(matrix: list[list[int]] | None, classes: list[str]) -> str:
    """The test confusion matrix as a markdown table (rows: true class, columns: predicted)."""
    if not matrix:
        return "no test rows: no confusion matrix\n"
    head = "| true \\ predicted | " + " | ".join(classes) + " |\n|---|" + "---|" * len(classes) + "\n"
    return head + "".join(f"| {c} | " + " | ".join(str(v) for v in row) + " |\n" for c, row in zip(classes, matrix))
