"""The ``pipeline`` flow: prepare -> pretrain -> finetune -> threshold -> bundle -> label.

Every stage is content-addressed and skipped when its artifact version already exists, so a
scheduled re-run with unchanged inputs and config does no work.
"""

from __future__ import annotations

import json

from prefect import flow

from flows.pretrain import prepare_and_pretrain, stage_on_pretrained
from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from storage.options import configure as configure_storage
from tasks.common.config import PipelineConfig
from tasks.common.stage import logger, run_stage
from tasks.train import bundle, finetune, threshold


def stage_finetune(store: ArtifactStore, cfg: PipelineConfig, pretrain_ref: ArtifactRef,
                   lexicon_ref: ArtifactRef) -> ArtifactRef:
    return stage_on_pretrained(store, "finetune", finetune.CODE_VERSION, finetune.finetune_task, cfg.finetune,
                               pretrain_ref, lexicon_ref, cfg.progress)


def stage_threshold(store: ArtifactStore, cfg: PipelineConfig, finetune_ref: ArtifactRef) -> ArtifactRef:
    return run_stage(store, "threshold", threshold.CODE_VERSION, {}, [finetune_ref],
                     lambda writer, version: threshold.build(writer, open_artifact(finetune_ref)))


def stage_bundle(store: ArtifactStore, finetune_ref: ArtifactRef, threshold_ref: ArtifactRef,
                 lexicon_ref: ArtifactRef) -> ArtifactRef:
    parents = [finetune_ref, threshold_ref, lexicon_ref]
    return run_stage(store, "bundle", bundle.CODE_VERSION, {}, parents,
                     lambda writer, version: bundle.build(writer, *map(open_artifact, parents)))


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig) -> ArtifactRef:
    """The whole pipeline; returns the bundle ref (labelled output is reported in the logs)."""
    configure_storage(config.storage_options)
    lex_ref, pre_ref = prepare_and_pretrain(config, needs="finetune")
    store = ArtifactStore(config.store_uri)
    ft_ref = stage_finetune(store, config, pre_ref, lex_ref)
    th_ref = stage_threshold(store, config, ft_ref)
    b_ref = stage_bundle(store, ft_ref, th_ref, lex_ref)
    lc = config.label
    if lc.input_uri:
        from flows.label import label_flow

        # "@heldout": the fine-tuning test split that the bundle never saw
        src = f"{ft_ref.uri}/heldout.parquet" if lc.input_uri == "@heldout" else lc.input_uri
        out = lc.output_uri or f"{store.uri}/labelled/{b_ref.version}"
        summary = label_flow(b_ref.uri, src, out, lc.options())
        logger().info("labelled %s -> %s", lc.input_uri, out)
        done = {"labelled": summary.get("output_uri", out), "stats": summary.get("stats")}
        print(json.dumps(done, ensure_ascii=False, default=str))
    return b_ref


def _baseline(m: dict) -> str:
    """The cheap baseline's test figures and the contamination counts, from finetune metrics."""
    if not isinstance(m.get("baseline_test_auc"), (int, float)):
        return "not recorded"
    figs = ", ".join(f"{k}={m[f'baseline_test_{k}']:.4f}" for k in ("auc", "accuracy", "f1"))
    contaminated = f"{m.get('contaminated_test_rows')} test / {m.get('contaminated_dev_rows')} dev rows"
    return f"TF-IDF char 1-2-gram LR {figs}  (contaminated: {contaminated})"


def summary_lines(config: PipelineConfig, bundle_ref: ArtifactRef) -> list[str]:
    """Where everything is, for the end of a run: bundle, test metrics, plots, labelled output."""
    b = open_artifact(bundle_ref)
    parents = {p.stage: p for p in b.manifest.parents}
    ft = open_artifact(parents["finetune"])
    pre = open_artifact(next(p for p in ft.manifest.parents if p.stage == "pretrain"))
    m = ft.manifest.metrics
    keys = ("test_auc", "test_accuracy", "test_precision", "test_recall", "test_f1")
    metrics = ", ".join(f"{k[5:]}={m[k]:.4f}" for k in keys if isinstance(m.get(k), (int, float)))
    pm = pre.manifest.metrics
    lines = [
        f"bundle:          {b.uri}",
        f"test metrics:    {metrics}  (threshold {b.manifest.metrics.get('threshold')}, "
        f"best epoch {m.get('best_epoch')})",
        f"baseline (same rows): {_baseline(m)}",
        f"pretrain plot:   {pre.file_path('loss.png')}  "
        f"(MLM loss {pm.get('first_mlm_loss')} -> {pm.get('last_mlm_loss')})",
        f"finetune plot:   {ft.file_path('curves.png')}",
    ]
    if config.label.input_uri:
        out = config.label.output_uri or f"{ArtifactStore(config.store_uri).uri}/labelled/{bundle_ref.version}"
        lines.append(f"labelled output: {out}")
    return lines
