"""The ``prepare`` flow: clean -> numbers -> vocab; embeddings -> trie; -> lexicon (matched shards).

Order and wiring only: each stage's body is ``build`` in its ``tasks.prepare`` module, run by
:func:`flows.stage.run_stage` as a Prefect task named after the stage, which skips a stage whose
version is already committed (a cache hit, shown as ``Cached``). Shard work is mapped on the configured
task runner (:func:`flows.runner.shard_runner`), whatever runner the flow itself was given.
"""

from __future__ import annotations

import json
from functools import partial

from prefect import flow

from flows.runner import shard_runner, start_run
from flows.stage import run_stage
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.common.config import PrepareConfig
from tasks.common.ui import bars
from tasks.prepare import clean, embeddings, lexicon, numbers, trie, vocab
from tasks.prepare.corpus import corpus_files


@flow(name="prepare", log_prints=True)
def prepare_flow(config: PrepareConfig) -> ArtifactRef:
    """Corpus + Tencent embeddings -> matched Parquet shards (and vocab, word vectors, trie)."""
    start_run(config)
    with shard_runner(config.runner):  # thread pool or Dask, as configured, for every shard map below
        lex_ref = _stages(config)
    print(json.dumps({"prepared": lex_ref.model_dump()}, ensure_ascii=False))
    return lex_ref


def _stages(config: PrepareConfig) -> ArtifactRef:
    store = ArtifactStore(config.store_uri)
    files = corpus_files(config.corpus_uri)
    clean_ref = run_stage(
        store, "clean", clean.CODE_VERSION, clean.version_config(config.clean, files), [],
        partial(clean.build, files=files, cfg=config.clean, progress=bars(config.progress)),
    )
    numbers_ref = run_stage(
        store, "numbers", numbers.CODE_VERSION, config.numbers.model_dump(), [clean_ref],
        partial(numbers.build, clean_ref=clean_ref, cfg=config.numbers),
    )
    vocab_ref = run_stage(
        store, "vocab", vocab.CODE_VERSION, vocab.version_config(config.vocab), [numbers_ref],
        partial(vocab.build, numbers_ref=numbers_ref, cfg=config.vocab),
    )
    emb_uri = config.embeddings_uri
    emb_ref = run_stage(
        store, "embeddings", embeddings.CODE_VERSION, embeddings.version_config(config.embeddings, emb_uri), [],
        partial(embeddings.build, uri=emb_uri, cfg=config.embeddings, progress=bars(config.progress)),
    )
    trie_ref = run_stage(
        store, "trie", trie.CODE_VERSION, config.trie.model_dump(), [emb_ref],
        partial(trie.build, emb_ref=emb_ref, cfg=config.trie),
    )
    inputs = dict(numbers_ref=numbers_ref, vocab_ref=vocab_ref, emb_ref=emb_ref, trie_ref=trie_ref)
    lex_ref = run_stage(
        store, "lexicon", lexicon.CODE_VERSION, config.lexicon.model_dump(), list(inputs.values()),
        partial(lexicon.build, **inputs, cfg=config.lexicon),
    )
    return lex_ref
