"""The flows by name, for ``lexiflow run`` and ``lexiflow.run``: each one's config model, its flow, a run of it.

:func:`flow_named` imports a flow's module only to run it (Prefect and the flow's stages load then), each with its
own import statement, which the import contract (``lint-imports``) sees.
"""

from __future__ import annotations

from flows.profiles import FLOWS, load_flow_config, preflight

__all__ = ["FLOWS", "flow_named", "load_flow_config", "preflight", "run_flow"]


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
    ``lexiflow.run``). Its inputs are checked first (:func:`preflight`)."""
    preflight(flow_name, cfg)
    return flow_named(flow_name)(cfg)
