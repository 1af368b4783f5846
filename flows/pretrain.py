"""The ``pretrain`` flow: prepare (cached when already committed) -> MLM+NSP pretraining artifact.

Order and wiring only: the stage (its config, version and build) is :data:`tasks.pretrain.stage.STAGE`."""

from __future__ import annotations

from prefect import flow

from flows.config import PipelineConfig, PrepareFlowConfig
from flows.prepare import prepare_flow
from flows.profiles import flow_config
from flows.runner import start_run
from flows.runtime import PrefectRuntime
from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from tasks.common.stage import run_stage
from tasks.common.ui import bars
from tasks.pretrain import import_hf
from tasks.pretrain import stage as pretrain


def stage_pretrain(rt: PrefectRuntime, store: ArtifactStore, cfg: PipelineConfig, lexicon_ref: ArtifactRef
                   ) -> ArtifactRef:
    """The pretrain stage. On node ``pretrain.node_rank`` > 0 of a run on several machines, this node's processes
    join node 0's torchrun and the stage returns once node 0 has committed (node 0 holds the stage's lease)."""
    vocab_ref = next(p for p in open_artifact(lexicon_ref).manifest.parents if p.stage == "vocab")
    if cfg.pretrain.node_rank > 0:
        return pretrain.join(store, cfg.pretrain, lexicon_ref, vocab_ref)
    return run_stage(rt, store, pretrain.STAGE, cfg.pretrain, lexicon_ref=lexicon_ref, vocab_ref=vocab_ref,
                     progress=bars(cfg.progress))


def prepare_and_pretrain(rt: PrefectRuntime, config: PipelineConfig, needs: str | None = None
                         ) -> tuple[ArtifactRef, ArtifactRef]:
    """The shared front of the pretrain, pipeline and ner flows: (lexicon ref, pretrain ref).

    ``needs`` names the config section the calling flow trains on; it is checked before any work."""
    if needs is not None and getattr(config, needs) is None:
        raise ValueError(f"this flow needs a `{needs}:` section with data_uri (or train_uri/dev_uri)")
    import_hf.check_config(config.pretrain)  # a checkpoint that contradicts the config fails before any work
    lex_ref = prepare_flow(config.narrowed(PrepareFlowConfig))  # a subflow: its own runtime maps its shards
    return lex_ref, stage_pretrain(rt, ArtifactStore(config.store_uri), config, lex_ref)


@flow(name="pretrain", log_prints=True)
def pretrain_flow(config: PipelineConfig | None = None,
        profile: str | None = None, overrides: list[str] | None = None) -> ArtifactRef:
    """prepare -> pretrain; every stage is skipped when its artifact version already exists.

    Give ``config``, or ``profile`` (a YAML file, relative to the run's working directory, or any fsspec URL; read
    when the run starts) with ``overrides`` (``--set``-style ``key=value`` items): the run is then exactly
    ``lexiflow run pretrain --config PROFILE --set …``. The resolved config is published as the ``run-config``
    artifact."""
    config = flow_config("pretrain", config, profile, overrides)
    return prepare_and_pretrain(start_run(config), config)[1]
