"""The ``ner`` flow (prepare -> pretrain -> ner tagger, selected on dev F1) and ``ner-label``
(a ner artifact + a table of texts -> Parquet rows of entities, with the labeller's resume and
reconciliation rules)."""

from __future__ import annotations

import json
from typing import Any

from prefect import flow

from flows.label import publish_label
from flows.pretrain import prepare_and_pretrain
from storage.artifacts import ArtifactRef, ArtifactStore, fingerprint_uri
from tasks.ner import train as ner
from tasks.common.config import PipelineConfig
from tasks.common.stage import StageRun


def stage_ner(store: ArtifactStore, cfg: PipelineConfig, pretrain_ref: ArtifactRef, lexicon_ref: ArtifactRef) -> ArtifactRef:
    nc = cfg.ner
    inputs = {k: {"uri": u, **fingerprint_uri(u)} for k in ("data_uri", "train_uri", "dev_uri", "test_uri") if (u := getattr(nc, k))}
    run = StageRun(store, "ner", ner.CODE_VERSION, {**nc.model_dump(mode="json"), "inputs": inputs}, [pretrain_ref, lexicon_ref])
    if hit := run.cache_hit():
        return hit
    run.writer()
    res = ner.ner_task(store.uri, run.version, nc, pretrain_ref.uri, lexicon_ref.uri, cfg.progress)
    art = run.commit(res["stats"], res["metrics"], res["rows"])
    ner.publish_epochs(res["log"], art)
    return run.finish(art)


@flow(name="ner", log_prints=True)
def ner_flow(config: PipelineConfig) -> ArtifactRef:
    """prepare -> pretrain -> ner (each skipped when its artifact already exists)."""
    if config.ner is None:
        raise ValueError("the ner flow needs a `ner:` section with data_uri (or train_uri/dev_uri)")
    store = ArtifactStore(config.store_uri)
    lex_ref, pre_ref = prepare_and_pretrain(config)
    ref = stage_ner(store, config, pre_ref, lex_ref)
    print(json.dumps({"ner": ref.model_dump()}))
    return ref


@flow(name="ner-label", log_prints=True)
def ner_label_flow(
    model_uri: str,
    input_uri: str,
    output_uri: str,
    text_column: str = "text",
    id_column: str | None = None,
    shard_rows: int = 50_000,
    batch_size: int = 64,
) -> dict[str, Any]:
    """Entities for every row of ``input_uri`` (CSV/TSV/JSONL/Parquet, globs) into ``output_uri``."""
    import torch

    from tasks.label import label_task

    scorer = ner.NerScorer(model_uri, "cuda" if torch.cuda.is_available() else "cpu", batch_size)
    res = label_task(scorer, input_uri, output_uri, text_column, id_column, shard_rows, batch_size)
    publish_label(res)
    return res
