"""What a pipeline run leaves behind, in lines for the end of the run: the bundle and its numerics, the test
metrics beside the baseline, the plots, the promotion gate's outcome and the labelled output's digest."""

from __future__ import annotations

import hashlib
import json
from typing import Protocol

import fsspec

from storage.aliases import read_alias
from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from tasks.bundle import promote
from tasks.bundle.config import PromoteConfig
from tasks.finetune.baseline import clean_test_line, vs_baseline
from tasks.label.config import LabelConfig


class RunSections(Protocol):
    """What the summary reads of a run's config (the pipeline's :class:`flows.config.PipelineConfig`)."""

    store_uri: str
    promote: PromoteConfig
    label: LabelConfig

def _figure_keys(m: dict) -> tuple[str, ...]:
    """The test figures a finetune's metrics hold: macro-F1 and accuracy for K > 2 classes, else AUC, accuracy, F1."""
    return ("macro_f1", "accuracy") if "test_macro_f1" in m else ("auc", "accuracy", "f1")


def _rule(threshold: float | None) -> str:
    """The decision rule a bundle applies, in words."""
    return "arg-max over the classes" if threshold is None else f"threshold {threshold}"


def _baseline(m: dict) -> str:
    """The cheap baseline's test figures and the contamination counts, from finetune metrics."""
    keys = _figure_keys(m)
    if not isinstance(m.get(f"baseline_test_{keys[0]}"), (int, float)):
        return "not recorded"
    figs = ", ".join(f"{k}={m[f'baseline_test_{k}']:.4f}" for k in keys)
    contaminated = f"{m.get('contaminated_test_rows')} test / {m.get('contaminated_dev_rows')} dev rows"
    return f"TF-IDF char 1-2-gram LR {figs}  (contaminated: {contaminated})"


def summary_lines(config: RunSections, bundle_ref: ArtifactRef) -> list[str]:
    """Where everything is, for the end of a run: bundle, test metrics, plots, labelled output."""
    b = open_artifact(bundle_ref)
    parents = {p.stage: p for p in b.manifest.parents}
    ft = open_artifact(parents["finetune"])
    pre = open_artifact(next(p for p in ft.manifest.parents if p.stage == "pretrain"))
    m = ft.manifest.metrics
    keys = (("test_macro_f1", "test_accuracy") if "test_macro_f1" in m else
            ("test_auc", "test_accuracy", "test_precision", "test_recall", "test_f1"))
    metrics = ", ".join(f"{k[5:]}={m[k]:.4f}" for k in keys if isinstance(m.get(k), (int, float)))
    pm = pre.manifest.metrics
    combined = f"; combine: {m.get('combine')} with the baseline" if m.get("blend") else ""
    lines = [
        f"bundle:          {b.uri}",
        f"bundle version:  {b.manifest.version}  (numerics: {numerics_line(ft.manifest.config.get('numerics'))})",
        f"test metrics:    {metrics}  ({_rule(b.manifest.metrics.get('threshold'))}, "
        f"best epoch {m.get('best_epoch')}{combined})",
    ]
    if m.get("combine") == "stack":
        enc = ", ".join(f"{k}={m[f'encoder_test_{k}']:.4f}" for k in _figure_keys(m)
                        if isinstance(m.get(f"encoder_test_{k}"), (int, float)))
        lines.append(f"encoder alone:   {enc}")
    lines.append(f"baseline (same rows): {_baseline(m)}")
    if isinstance(vs := m.get("test_auc_vs_baseline"), dict):
        lines.append(f"vs baseline:     {vs_baseline(vs)}")
    elif isinstance(vs := m.get("test_macro_f1_vs_baseline"), dict):  # K > 2 classes
        lines.append(f"vs baseline:     {vs_baseline(vs, 'test macro-F1')}")
    if clean := clean_test_line(m):
        lines.append(f"uncontaminated:  {clean}")
    lines += [
        f"pretrain plot:   {pre.file_path('loss.png')}  "
        f"(MLM loss {pm.get('first_mlm_loss')} -> {pm.get('last_mlm_loss')})",
        f"finetune plot:   {ft.file_path('curves.png')}",
    ]
    if config.promote.alias:
        store_uri = b.uri.rsplit("/", 2)[0]
        rec = read_alias(store_uri, "bundle", config.promote.alias)
        if rec is not None and rec.get("version") == b.manifest.version:
            lines.append(f"bundle@{config.promote.alias}: this bundle  ({rec.get('reason')})")
        else:  # not promoted: the gate's reason, recomputed against the current holder (nothing moves)
            why = promote.verdict(store_uri, bundle_ref, config.promote, rec)[1]
            lines.append(f"bundle@{config.promote.alias}: still {rec and rec.get('version')}  (gate not passed: {why})")
    if config.label.input_uri:
        out = config.label.output_uri or f"{ArtifactStore(config.store_uri).uri}/labelled/{bundle_ref.version}"
        lines.append(f"labelled output: {out}")
        lines.append(f"labelled sha256: {labelled_digest(out)}  (part and reject files; same on any machine "
                     "with the same numerics)")
    return lines


def numerics_line(record: dict | None) -> str:
    """The recorded CPU numerics in one line (``models.numerics.numerics_record``)."""
    if not record:
        return "not recorded"
    keys = ("cpu_capability", "mkl_cbwr", "mkl_cpu", "threads", "torch", "device")
    return ", ".join(f"{k}={record[k]}" for k in keys if record.get(k) is not None)


def labelled_digest(out_uri: str) -> str:
    """One sha256 over a committed label output's data files (name and sha256 of each part and reject file, from
    its manifest): what two machines compare to check they labelled the same bytes."""
    with fsspec.open(f"{out_uri.rstrip('/')}/_manifest.json", "rb") as f:
        files = json.load(f)["files"]
    listed = sorted(f"{e['path']} {e['sha256']}" for e in files if e["path"].startswith(("part-", "rejected-")))
    return hashlib.sha256("\n".join(listed).encode()).hexdigest()
