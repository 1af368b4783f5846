"""The ``pretrain`` flow: prepare (cached when already committed) -> MLM+NSP pretraining artifact."""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.prepare import prepare_flow
from flows.runner import start_run
from flows.stage import run_stage
from storage.artifacts import ArtifactRef, ArtifactStore, compute_version, open_artifact
from tasks.common.config import PipelineConfig, PrepareConfig
from tasks.common.stage import input_names, input_source
from tasks.common.ui import bars
from tasks.pretrain import import_hf
from tasks.pretrain import stage as pretrain
from tasks.pretrain.launch import join_as_node
from tasks.training.loop import numerics_config

# training stages carry this tag: `prefect concurrency-limit create gpu 1` keeps two flows off one GPU
GPU = ("gpu",)

# the stage's training step, a task of its own in the run graph
pretrain_task = task(pretrain.train_stage, name="pretrain-train", cache_policy=NONE)


def stage_pretrain(store: ArtifactStore, cfg: PipelineConfig, lexicon_ref: ArtifactRef) -> ArtifactRef:
    """The pretrain stage. On node ``pretrain.node_rank`` > 0 of a run on several machines, this node's processes
    join node 0's torchrun and the stage returns once node 0 has committed (node 0 holds the stage's lease)."""
    vocab_ref = next(p for p in open_artifact(lexicon_ref).manifest.parents if p.stage == "vocab")

    def build(writer, version: str):
        return pretrain_task(store.uri, version, cfg.pretrain, lexicon_ref.uri, vocab_ref.uri,
                                      bars(cfg.progress))

    config = {**version_config(cfg), "numerics": numerics_config(cfg.pretrain.threads, cfg.pretrain.device)}
    parents = [lexicon_ref, vocab_ref]
    if cfg.pretrain.node_rank > 0:
        version = compute_version("pretrain", pretrain.CODE_VERSION, config, parents)
        return join_as_node(store, version, cfg.pretrain, lexicon_ref.uri, vocab_ref.uri)
    return run_stage(store, "pretrain", pretrain.CODE_VERSION, config, parents, build, tags=GPU)


def version_config(cfg: PipelineConfig) -> dict:
    """What the pretrain version covers besides its parents: the section, and the fingerprints of the
    ``extra_texts`` files when there are any (their bytes are training data too: new data, new version).
    Their URIs stay in the manifest; the version counts the fingerprints in their place
    (``storage.artifacts.without_locations``). So does ``init_from``: the checkpoint's config.json, weights
    and vocab.txt."""
    config = cfg.pretrain.model_dump(mode="json", exclude=cfg.pretrain.NOT_VERSIONED)
    if cfg.pretrain.init_from is not None:  # the checkpoint's files by their bytes, their location as provenance
        config["init_from"] = import_hf.checkpoint_sources(cfg.pretrain.init_from)
    if cfg.pretrain.extra_texts:
        config["extra_inputs"] = [input_source(ex.data_uri or ex.train_uri) for ex in cfg.pretrain.extra_texts]
    return config


def stage_on_pretrained(store: ArtifactStore, stage: str, code_version: str, train_task, stage_cfg,
                        pretrain_ref: ArtifactRef, lexicon_ref: ArtifactRef, progress: bool) -> ArtifactRef:
    """A task trained on the pretrained encoder (finetune, ner) as one stage: its version covers the stage
    config, the data files' fingerprints (new data, new version) and both parents.
    ``train_task(store_uri, version, stage_cfg, pretrain_uri, lexicon_uri, progress) -> StageResult``."""

    def build(writer, version: str):
        return train_task(store.uri, version, stage_cfg, pretrain_ref.uri, lexicon_ref.uri, bars(progress))

    config = {**on_pretrained_config(stage_cfg), "numerics": numerics_config(stage_cfg.threads, stage_cfg.device)}
    return run_stage(store, stage, code_version, config, [pretrain_ref, lexicon_ref], build, tags=GPU)


def on_pretrained_config(stage_cfg) -> dict:
    """The config of a stage trained on the pretrained encoder: its section plus ``inputs``, each data file
    (by role: ``data_uri``, ``train_uri`` ...) with its URI, name and fingerprint. The version counts the
    names and bytes in place of the URIs (``storage.artifacts.without_locations``): the same files in
    another directory give the same version."""
    uris = stage_cfg.input_uris()
    names = dict(zip(uris, input_names(list(uris.values()))))
    inputs = {k: input_source(u, names[k]) for k, u in uris.items()}
    return {**stage_cfg.model_dump(mode="json"), "inputs": inputs}


def prepare_and_pretrain(config: PipelineConfig, needs: str | None = None) -> tuple[ArtifactRef, ArtifactRef]:
    """The shared front of the pretrain, pipeline and ner flows: (lexicon ref, pretrain ref).

    ``needs`` names the config section the calling flow trains on; it is checked before any work."""
    if needs is not None and getattr(config, needs) is None:
        raise ValueError(f"this flow needs a `{needs}:` section with data_uri (or train_uri/dev_uri)")
    import_hf.check_config(config.pretrain)  # a checkpoint that contradicts the config fails before any work
    prep = PrepareConfig.model_validate(config.model_dump(include=set(PrepareConfig.model_fields)))
    prep.storage_options = config.storage_options  # excluded from dumps: carried over by hand
    lex_ref = prepare_flow(prep)  # maps its shard tasks on the configured runner (its own shard_runner)
    return lex_ref, stage_pretrain(ArtifactStore(config.store_uri), config, lex_ref)


@flow(name="pretrain", log_prints=True)
def pretrain_flow(config: PipelineConfig) -> ArtifactRef:
    """prepare -> pretrain; every stage is skipped when its artifact version already exists."""
    start_run(config)
    return prepare_and_pretrain(config)[1]
