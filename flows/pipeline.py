"""The ``pipeline`` flow: prepare -> pretrain -> finetune -> threshold -> bundle -> label.

Every stage is content-addressed and skipped when its artifact version already exists, so a
scheduled re-run with unchanged inputs and config does no work.
"""

from __future__ import annotations

import json

from prefect import flow

from flows.pretrain import prepare_and_pretrain
from storage.artifacts import ArtifactRef, ArtifactStore, fingerprint_uri, open_artifact
from tasks.train import bundle, finetune, threshold
from tasks.common.config import PipelineConfig
from tasks.common.stage import StageRun, logger


def _inputs(cfg) -> dict:
    """Fingerprints of the labelled data files, so new data gives a new version."""
    uris = {k: getattr(cfg, k) for k in ("data_uri", "train_uri", "dev_uri", "test_uri") if getattr(cfg, k)}
    return {k: {"uri": u, **fingerprint_uri(u)} for k, u in uris.items()}


def stage_finetune(store: ArtifactStore, cfg: PipelineConfig, pretrain_ref: ArtifactRef, lexicon_ref: ArtifactRef) -> ArtifactRef:
    fc = cfg.finetune
    run = StageRun(store, "finetune", finetune.CODE_VERSION, {**fc.model_dump(mode="json"), "inputs": _inputs(fc)}, [pretrain_ref, lexicon_ref])
    if hit := run.cache_hit():
        return hit
    run.writer()
    res = finetune.finetune_task(store.uri, run.version, fc, pretrain_ref.uri, lexicon_ref.uri, cfg.progress)
    art = run.commit(res["stats"], res["metrics"], res["rows"])
    finetune.publish_epochs(res["log"], art)
    return run.finish(art)


def stage_threshold(store: ArtifactStore, cfg: PipelineConfig, finetune_ref: ArtifactRef) -> ArtifactRef:
    run = StageRun(store, "threshold", threshold.CODE_VERSION, {}, [finetune_ref])
    if hit := run.cache_hit():
        return hit
    res = threshold.threshold_stage(run.writer(), open_artifact(finetune_ref))
    art = run.commit(res["stats"], res["metrics"], res["rows"])
    return run.finish(art)


def stage_bundle(store: ArtifactStore, finetune_ref: ArtifactRef, threshold_ref: ArtifactRef, lexicon_ref: ArtifactRef) -> ArtifactRef:
    run = StageRun(store, "bundle", bundle.CODE_VERSION, {}, [finetune_ref, threshold_ref, lexicon_ref])
    if hit := run.cache_hit():
        return hit
    metrics = bundle.build_bundle(run.writer(), open_artifact(finetune_ref), open_artifact(threshold_ref), open_artifact(lexicon_ref))
    n = len(bundle.FILES)
    art = run.commit({"in": n, "out": n, "rejected": {}}, metrics)
    return run.finish(art)


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig) -> ArtifactRef:
    """The whole pipeline; returns the bundle ref (labelled output is reported in the logs)."""
    if config.finetune is None:
        raise ValueError("the pipeline needs a `finetune:` section with data_uri (or train_uri/dev_uri)")
    store = ArtifactStore(config.store_uri)
    lex_ref, pre_ref = prepare_and_pretrain(config)
    ft_ref = stage_finetune(store, config, pre_ref, lex_ref)
    th_ref = stage_threshold(store, config, ft_ref)
    b_ref = stage_bundle(store, ft_ref, th_ref, lex_ref)
    lc = config.label
    if lc.input_uri:
        from flows.label import label_flow

        # "@heldout": the fine-tuning test split that the bundle never saw
        src = f"{ft_ref.uri}/heldout.parquet" if lc.input_uri == "@heldout" else lc.input_uri
        out = lc.output_uri or f"{store.uri}/labelled/{b_ref.version}"
        summary = label_flow(b_ref.uri, src, out, lc.text_column, lc.id_column, lc.shard_rows, lc.batch_size)
        logger().info("labelled %s -> %s", lc.input_uri, out)
        print(json.dumps({"labelled": summary.get("output_uri", out), "stats": summary.get("stats")}, ensure_ascii=False, default=str))
    return b_ref


def summary_lines(config: PipelineConfig, bundle_ref: ArtifactRef) -> list[str]:
    """Where everything is, for the end of a run: bundle, test metrics, plots, labelled output."""
    b = open_artifact(bundle_ref)
    parents = {p.stage: p for p in b.manifest.parents}
    ft = open_artifact(parents["finetune"])
    pre = open_artifact(next(p for p in ft.manifest.parents if p.stage == "pretrain"))
    m = ft.manifest.metrics
    metrics = ", ".join(f"{k[5:]}={m[k]:.4f}" for k in ("test_auc", "test_accuracy", "test_precision", "test_recall", "test_f1") if isinstance(m.get(k), (int, float)))
    lines = [
        f"bundle:          {b.uri}",
        f"test metrics:    {metrics}  (threshold {b.manifest.metrics.get('threshold')}, best epoch {m.get('best_epoch')})",
        f"pretrain plot:   {pre.file_path('loss.png')}  (MLM loss {pre.manifest.metrics.get('first_mlm_loss')} -> {pre.manifest.metrics.get('last_mlm_loss')})",
        f"finetune plot:   {ft.file_path('curves.png')}",
    ]
    if config.label.input_uri:
        lines.append(f"labelled output: {config.label.output_uri or f'{ArtifactStore(config.store_uri).uri}/labelled/{bundle_ref.version}'}")
    return lines
