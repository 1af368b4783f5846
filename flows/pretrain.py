"""The ``pretrain`` flow: prepare (cached when already committed) -> MLM+NSP pretraining artifact."""

from __future__ import annotations

from prefect import flow

from flows.prepare import prepare_flow
from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from tasks.train import pretrain
from tasks.common.config import PipelineConfig, PrepareConfig
from tasks.common.stage import StageRun


def stage_pretrain(store: ArtifactStore, cfg: PipelineConfig, lexicon_ref: ArtifactRef) -> ArtifactRef:
    vocab_ref = next(p for p in open_artifact(lexicon_ref).manifest.parents if p.stage == "vocab")
    run = StageRun(store, "pretrain", pretrain.CODE_VERSION, cfg.pretrain.model_dump(mode="json"), [lexicon_ref, vocab_ref])
    if hit := run.cache_hit():
        return hit
    run.writer()
    res = pretrain.pretrain_task(store.uri, run.version, cfg.pretrain, lexicon_ref.uri, vocab_ref.uri, cfg.progress)
    art = run.commit({"in": res["metrics"]["steps"], "out": res["metrics"]["steps"], "rejected": {}}, res["metrics"], res["rows"])
    _publish_log(res["log"])
    return run.finish(art)


def _publish_log(log: list[dict]) -> None:
    from prefect.artifacts import create_table_artifact

    keep = ("step", "mlm_loss", "nsp_loss", "mlm_acc", "lr", "tokens_per_s", "mfu")
    create_table_artifact(key="pretrain-log", table=[{k: r.get(k) for k in keep} for r in log], description="pretraining log (per log_every steps)")


def prepare_and_pretrain(config: PipelineConfig) -> tuple[ArtifactRef, ArtifactRef]:
    """The shared front of the pretrain, pipeline and ner flows: (lexicon ref, pretrain ref)."""
    lex_ref = prepare_flow(PrepareConfig.model_validate(config.model_dump(include=set(PrepareConfig.model_fields))))
    return lex_ref, stage_pretrain(ArtifactStore(config.store_uri), config, lex_ref)


@flow(name="pretrain", log_prints=True)
def pretrain_flow(config: PipelineConfig) -> ArtifactRef:
    """prepare -> pretrain; every stage is skipped when its artifact version already exists."""
    return prepare_and_pretrain(config)[1]
