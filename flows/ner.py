"""The ``ner`` flow (prepare -> pretrain -> ner tagger, selected on dev F1) and ``ner-label``
(a ner artifact + a table of texts -> Parquet rows of entities, with the labeller's resume and
reconciliation rules)."""

from __future__ import annotations

import json
from typing import Any

import torch
from prefect import flow, task
from prefect.cache_policies import NONE

from flows.label import label_task, publish_label
from flows.pretrain import prepare_and_pretrain, stage_on_pretrained
from flows.runner import start_run
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.common.config import LabelOptions, PipelineConfig
from tasks.common.ui import bars
from tasks.ner import train as ner
from tasks.ner.scorer import NerScorer

# the stage's training step, a task of its own in the run graph
ner_task = task(ner.train_stage, name="ner-train", cache_policy=NONE)


def stage_ner(store: ArtifactStore, cfg: PipelineConfig, pretrain_ref: ArtifactRef,
              lexicon_ref: ArtifactRef) -> ArtifactRef:
    """The ner stage: the tagger trained on the pretrained encoder."""
    return stage_on_pretrained(store, "ner", ner.CODE_VERSION, ner_task, cfg.ner, pretrain_ref, lexicon_ref,
                               cfg.progress)


@flow(name="ner", log_prints=True)
def ner_flow(config: PipelineConfig) -> ArtifactRef:
    """prepare -> pretrain -> ner (each skipped when its artifact already exists)."""
    start_run(config)
    lex_ref, pre_ref = prepare_and_pretrain(config, needs="ner")
    ref = stage_ner(ArtifactStore(config.store_uri), config, pre_ref, lex_ref)
    print(json.dumps({"ner": ref.model_dump()}))
    return ref


@flow(name="ner-label", log_prints=True)
def ner_label_flow(
    model_uri: str, input_uri: str, output_uri: str | None = None,
    options: LabelOptions = LabelOptions(text_column="text"), output_root: str | None = None, overwrite: bool = False,
) -> dict[str, Any]:
    """Entities for every row of ``input_uri`` (CSV/TSV/JSONL/Parquet, globs) into ``output_uri`` or
    ``output_root/<label version>``; ``options``: text/id column, rows per output shard, texts per forward pass."""
    scorer = NerScorer(model_uri, "cuda" if torch.cuda.is_available() else "cpu", options.batch_size)
    res = label_task(scorer, input_uri, output_uri, options, overwrite=overwrite, output_root=output_root,
                     progress=bars(True))
    publish_label(res)
    return res
