"""The ``ner`` flow (prepare -> pretrain -> ner tagger, selected on dev F1) and ``ner-label``
(a ner artifact + a table of texts -> Parquet rows of entities, with the labeller's resume and
reconciliation rules)."""

from __future__ import annotations

import json
from typing import Any

from prefect import flow

from flows.config import PipelineConfig
from flows.label import label_task, publish_label
from flows.pretrain import prepare_and_pretrain
from flows.profiles import flow_config
from flows.runner import label_runtime, start_run
from flows.settings import apply_storage_secret, profile_overrides
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.common.stage import run_stage
from tasks.common.ui import bars
from tasks.inference.ner import NerScorer
from tasks.inference.runtime import default_device
from tasks.label.config import LabelOptions
from tasks.ner import train as ner


@flow(name="ner", log_prints=True)
def ner_flow(config: PipelineConfig | None = None,
        profile: str | None = None, overrides: list[str] | None = None) -> ArtifactRef:
    """prepare -> pretrain -> ner (each skipped when its artifact already exists).

    Give ``config``, or ``profile`` (a YAML file, relative to the run's working directory, or any fsspec URL; read
    when the run starts) with ``overrides`` (``--set``-style ``key=value`` items, after the roots that Prefect
    Variables set: :func:`flows.settings.profile_overrides`): the run is then exactly
    ``lexiflow run ner --config PROFILE --set …``. The resolved config is published as the ``run-config``
    artifact."""
    apply_storage_secret()  # a Secret block's credentials, before the inputs are checked
    config = flow_config("ner", config, profile, profile_overrides(profile, overrides))
    rt = start_run(config)
    lex_ref, pre_ref = prepare_and_pretrain(rt, config, needs="ner")
    ref = run_stage(rt, ArtifactStore(config.store_uri), ner.STAGE, config.ner, pretrain_ref=pre_ref,
                    lexicon_ref=lex_ref, progress=bars(config.progress))
    print(json.dumps({"ner": ref.model_dump()}))
    return ref


@flow(name="ner-label", log_prints=True)
def ner_label_flow(
    model_uri: str, input_uri: str, output_uri: str | None = None,
    options: LabelOptions = LabelOptions(text_column="text"), output_root: str | None = None, overwrite: bool = False,
) -> dict[str, Any]:
    """Entities for every row of ``input_uri`` (CSV/TSV/JSONL/Parquet, globs) into ``output_uri`` or
    ``output_root/<label version>``; ``options``: text/id column, rows per output shard, texts per forward pass."""
    rt = label_runtime()
    scorer = NerScorer(model_uri, default_device(), options.batch_size)
    res = label_task(scorer, input_uri, output_uri, options, overwrite=overwrite, output_root=output_root,
                     progress=bars(True), runtime=rt)
    publish_label(rt, res)
    return res
