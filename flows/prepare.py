"""The ``prepare`` flow: clean -> numbers -> vocab; embeddings -> trie; -> lexicon (matched shards).

Order and wiring only: each stage is the ``STAGE`` of its ``tasks.prepare`` module (its config, version and
build), run by :func:`tasks.common.stage.run_stage` with this run's runtime (:func:`flows.runner.start_run`): a
Prefect task named after the stage, which skips a stage whose version is already committed (a cache hit, shown as
``Cached``). Shard work is mapped on the configured shard runner (``runtime.shards``), whatever runner the flow
itself was given.
"""

from __future__ import annotations

import json

from prefect import flow

from flows.config import PrepareFlowConfig
from flows.profiles import flow_config
from flows.runner import start_run
from flows.runtime import PrefectRuntime
from flows.settings import apply_storage_secret, profile_overrides
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.common.stage import run_stage
from tasks.common.ui import bars
from tasks.prepare import clean, embeddings, lexicon, numbers, trie, vocab
from tasks.prepare.corpus import corpus_files


@flow(name="prepare", log_prints=True)
def prepare_flow(config: PrepareFlowConfig | None = None,
        profile: str | None = None, overrides: list[str] | None = None) -> ArtifactRef:
    """Corpus + Tencent embeddings -> matched Parquet shards (and vocab, word vectors, trie).

    Give ``config``, or ``profile`` (a YAML file, relative to the run's working directory, or any fsspec URL; read
    when the run starts) with ``overrides`` (``--set``-style ``key=value`` items, after the roots that Prefect
    Variables set: :func:`flows.settings.profile_overrides`): the run is then exactly
    ``lexiflow run prepare --config PROFILE --set …``. The resolved config is published as the ``run-config``
    artifact."""
    apply_storage_secret()  # a Secret block's credentials, before the inputs are checked
    config = flow_config("prepare", config, profile, profile_overrides(profile, overrides))
    runtime = start_run(config)
    with runtime.shards(config.runner):  # thread pool or Dask, as configured, for every shard map below
        lex_ref = _stages(runtime, config)
    print(json.dumps({"prepared": lex_ref.model_dump()}, ensure_ascii=False))
    return lex_ref


def _stages(rt: PrefectRuntime, config: PrepareFlowConfig) -> ArtifactRef:
    store, prep = ArtifactStore(config.store_uri), config.prepare
    clean_ref = run_stage(rt, store, clean.STAGE, prep.clean, files=corpus_files(prep.corpus_uri),
                          progress=bars(config.progress))
    numbers_ref = run_stage(rt, store, numbers.STAGE, prep.numbers, clean_ref=clean_ref)
    vocab_ref = run_stage(rt, store, vocab.STAGE, prep.vocab, numbers_ref=numbers_ref)
    emb_ref = run_stage(rt, store, embeddings.STAGE, prep.embeddings, uri=prep.embeddings_uri,
                        progress=bars(config.progress))
    trie_ref = run_stage(rt, store, trie.STAGE, prep.trie, emb_ref=emb_ref)
    return run_stage(rt, store, lexicon.STAGE, prep.lexicon, numbers_ref=numbers_ref, vocab_ref=vocab_ref,
                     emb_ref=emb_ref, trie_ref=trie_ref)
