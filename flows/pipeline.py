"""The ``pipeline`` flow: prepare -> pretrain -> finetune -> threshold -> bundle -> label.

Every stage is content-addressed and skipped when its artifact version already exists, so a
scheduled re-run with unchanged inputs and config does no work.
"""

from __future__ import annotations

import json

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.events import emit_promotion
from flows.finetune import finetune_task
from flows.label import label_flow
from flows.pretrain import prepare_and_pretrain, stage_on_pretrained
from flows.runner import start_run
from flows.stage import run_stage
from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from storage.urls import public_url
from tasks.bundle import bundle, promote
from tasks.common.config import PipelineConfig
from tasks.common.stage import logger
from tasks.common.ui import publish_link
from tasks.finetune import threshold
from tasks.finetune import train as finetune


def stage_finetune(store: ArtifactStore, cfg: PipelineConfig, pretrain_ref: ArtifactRef,
                   lexicon_ref: ArtifactRef) -> ArtifactRef:
    """The finetune stage: the classifier trained on the pretrained encoder."""
    return stage_on_pretrained(store, "finetune", finetune.code_version(cfg.finetune), finetune_task,
                               cfg.finetune, pretrain_ref, lexicon_ref, cfg.progress)


def stage_threshold(store: ArtifactStore, cfg: PipelineConfig, finetune_ref: ArtifactRef) -> ArtifactRef:
    """The threshold stage: the decision threshold chosen on the classifier's dev predictions."""
    return run_stage(store, "threshold", threshold.CODE_VERSION, {}, [finetune_ref],
                     lambda writer, version: threshold.build(writer, open_artifact(finetune_ref)))


def stage_bundle(store: ArtifactStore, finetune_ref: ArtifactRef, threshold_ref: ArtifactRef,
                 lexicon_ref: ArtifactRef) -> ArtifactRef:
    """The bundle stage: everything ``label`` needs, in one artifact."""
    parents = [finetune_ref, threshold_ref, lexicon_ref]
    return run_stage(store, "bundle", bundle.CODE_VERSION, {}, parents,
                     lambda writer, version: bundle.build(writer, *map(open_artifact, parents)))


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig) -> ArtifactRef:
    """The whole pipeline; returns the bundle ref (labelled output is reported in the logs)."""
    start_run(config)
    lex_ref, pre_ref = prepare_and_pretrain(config, needs="finetune")
    store = ArtifactStore(config.store_uri)
    ft_ref = stage_finetune(store, config, pre_ref, lex_ref)
    th_ref = stage_threshold(store, config, ft_ref)
    b_ref = stage_bundle(store, ft_ref, th_ref, lex_ref)
    publish_link("bundle-link", b_ref.uri, f"bundle {b_ref.version}", "the bundle this run built or found")
    if config.promote.alias:
        decision = promote_task(store.uri, b_ref, config.promote)
        logger().info("promote %s@%s: %s", b_ref.stage, config.promote.alias, decision["reason"])
    lc = config.label
    if lc.input_uri:
        # "@heldout": the fine-tuning test split that the bundle never saw
        src = f"{ft_ref.uri}/heldout.parquet" if lc.input_uri == "@heldout" else lc.input_uri
        out = lc.output_uri or f"{store.uri}/labelled/{b_ref.version}"
        summary = label_flow(b_ref.uri, src, out, lc.options())
        publish_link("labelled-link", summary.get("uri", out), f"labelled output {summary.get('version')}")
        logger().info("labelled %s -> %s", public_url(lc.input_uri), public_url(out))
        done = {"labelled": summary.get("output_uri", out), "stats": summary.get("stats")}
        print(json.dumps(done, ensure_ascii=False, default=str))
    return b_ref


@task(name="promote", task_run_name="promote", cache_policy=NONE, persist_result=False)
def promote_task(store_uri: str, bundle_ref: ArtifactRef, cfg) -> dict:
    """Move ``cfg.alias`` to the new bundle when the metric gate passes (:mod:`tasks.bundle.promote`)."""
    return promote.gate(store_uri, bundle_ref, cfg, on_promoted=emit_promotion)
