"""The ``pipeline`` flow: prepare -> pretrain -> finetune -> threshold -> bundle -> label.

Order and wiring only: each stage is the ``STAGE`` of its module (config, version, build). Every stage is
content-addressed and skipped when its artifact version already exists, so a scheduled re-run with unchanged
inputs and config does no work.
"""

from __future__ import annotations

import json

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.config import PipelineConfig
from flows.events import emit_promotion
from flows.label import label_flow
from flows.pretrain import prepare_and_pretrain
from flows.profiles import flow_config
from flows.runner import start_run
from flows.settings import apply_storage_secret, profile_overrides
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.urls import public_url
from tasks.bundle import bundle, promote
from tasks.common.stage import run_stage
from tasks.common.ui import bars
from tasks.finetune import threshold
from tasks.finetune import train as finetune


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig | None = None,
        profile: str | None = None, overrides: list[str] | None = None) -> ArtifactRef:
    """The whole pipeline; returns the bundle ref (labelled output is reported in the logs).

    Give ``config``, or ``profile`` (a YAML file, relative to the run's working directory, or any fsspec URL; read
    when the run starts) with ``overrides`` (``--set``-style ``key=value`` items, after the roots that Prefect
    Variables set: :func:`flows.settings.profile_overrides`): the run is then exactly
    ``lexiflow run pipeline --config PROFILE --set …``. The resolved config is published as the ``run-config``
    artifact."""
    apply_storage_secret()  # a Secret block's credentials, before the inputs are checked
    config = flow_config("pipeline", config, profile, profile_overrides(profile, overrides))
    rt = start_run(config)
    lex_ref, pre_ref = prepare_and_pretrain(rt, config, needs="finetune")
    store = ArtifactStore(config.store_uri)
    ft_ref = run_stage(rt, store, finetune.STAGE, config.finetune, pretrain_ref=pre_ref, lexicon_ref=lex_ref,
                       progress=bars(config.progress))
    th_ref = run_stage(rt, store, threshold.STAGE, None, finetune_ref=ft_ref)
    b_ref = run_stage(rt, store, bundle.STAGE, None, finetune_ref=ft_ref, threshold_ref=th_ref, lexicon_ref=lex_ref,
                      dev_data=config.finetune)
    rt.reporter.publish_link("bundle-link", b_ref.uri, f"bundle {b_ref.version}", "the bundle this run built or found")
    if config.promote.alias:
        decision = promote_task(store.uri, b_ref, config.promote)
        rt.log.info("promote %s@%s: %s", b_ref.stage, config.promote.alias, decision["reason"])
    lc = config.label
    if lc.input_uri:
        # "@heldout": the fine-tuning test split that the bundle never saw
        src = f"{ft_ref.uri}/heldout.parquet" if lc.input_uri == "@heldout" else lc.input_uri
        out = lc.output_uri or f"{store.uri}/labelled/{b_ref.version}"
        summary = label_flow(b_ref.uri, src, out, lc.options(), runner=config.runner, monitor=config.monitor,
                             fingerprint_store=store.uri)  # the inputs' fingerprints through this run's cache
        rt.reporter.publish_link("labelled-link", summary.get("uri", out), f"labelled output {summary.get('version')}")
        rt.log.info("labelled %s -> %s", public_url(lc.input_uri), public_url(out))
        done = {"labelled": summary.get("output_uri", out), "stats": summary.get("stats")}
        print(json.dumps(done, ensure_ascii=False, default=str))
    return b_ref


@task(name="promote", task_run_name="promote", cache_policy=NONE, persist_result=False)
def promote_task(store_uri: str, bundle_ref: ArtifactRef, cfg) -> dict:
    """Move ``cfg.alias`` to the new bundle when the metric gate passes (:mod:`tasks.bundle.promote`)."""
    return promote.gate(store_uri, bundle_ref, cfg, on_promoted=emit_promotion)
