"""The flows by name, for ``lexiflow run`` and ``lexiflow.run``: each one's config model, its flow, a run of it.

:func:`flow_named` imports a flow's module only to run it (Prefect and the flow's stages load then), each with its
own import statement, which the import contract (``lint-imports``) sees.
"""

from __future__ import annotations

from pathlib import Path

from flows.config import PipelineConfig, load_config
from storage.options import configure
from tasks.prepare.config import PrepareConfig

# flow name -> its config model (the flow itself: flow_named)
FLOWS = {
    "prepare": PrepareConfig,
    "pretrain": PipelineConfig,
    "pipeline": PipelineConfig,
    "ner": PipelineConfig,
}


def load_flow_config(flow_name: str, config: str | Path | None = None, sets: list[str] | None = None):
    """The validated config of a flow: a YAML profile (or none) plus ``--set``-style ``key=value`` overrides."""
    if flow_name not in FLOWS:
        raise ValueError(f"unknown flow {flow_name!r}; choose from {sorted(FLOWS)}")
    return load_config(FLOWS[flow_name], config, list(sets or []))


def flow_named(flow_name: str):
    """The Prefect flow of a name in :data:`FLOWS` (KeyError for another name)."""
    if flow_name == "prepare":
        from flows.prepare import prepare_flow  # noqa: PLC0415  (Prefect and the stages: only to run the flow)

        return prepare_flow
    if flow_name == "pretrain":
        from flows.pretrain import pretrain_flow  # noqa: PLC0415  (Prefect and the stages: only to run the flow)

        return pretrain_flow
    if flow_name == "pipeline":
        from flows.pipeline import pipeline_flow  # noqa: PLC0415  (Prefect and the stages: only to run the flow)

        return pipeline_flow
    if flow_name == "ner":
        from flows.ner import ner_flow  # noqa: PLC0415  (Prefect and the stages: only to run the flow)

        return ner_flow
    raise KeyError(flow_name)


def run_flow(flow_name: str, cfg):
    """Run a flow (its shard maps use the task runner its config names); returns the final ArtifactRef (CLI and
    ``lexiflow.run``). Its inputs are checked first, before a Prefect server or a Dask cluster starts: every
    missing input listed in one error, the fine-tuning label column against ``finetune.classes``."""
    from tasks.prepare.preflight import check_inputs  # noqa: PLC0415  (reads the inputs' modules: only for `run`)

    configure(cfg.storage_options)  # the inputs may be on an object store the profile configures
    if getattr(getattr(cfg, "pretrain", None), "node_rank", 0) == 0:  # another node joins; its data is rank 0's
        check_inputs(cfg, flow_name)

    return flow_named(flow_name)(cfg)
