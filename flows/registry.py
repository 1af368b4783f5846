"""The flows by name: one table of each flow's function, config model and the config sections it reads, and how a
flow's config is loaded, checked and run (``lexiflow run``, ``lexiflow.run``, a deployment's run, the docs).

A flow's module is imported only to run it (Prefect and the flow's stages load then); the table names it as
``module:function`` (importlib: each flow module resolves its config through :mod:`flows.profiles`, which reads
this table, so an import statement here would close a circle).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from flows.config import PipelineConfig, PrepareFlowConfig, load_config
from storage.options import configure


@dataclass(frozen=True)
class Flow:
    """One flow: its name, its function (``module:function``), its config model and the sections it reads."""

    name: str
    function: str
    model: type
    sections: tuple[str, ...]


FLOWS = {f.name: f for f in (
    Flow("prepare", "flows.prepare:prepare_flow", PrepareFlowConfig, ("prepare",)),
    Flow("pretrain", "flows.pretrain:pretrain_flow", PipelineConfig, ("prepare", "pretrain")),
    Flow("pipeline", "flows.pipeline:pipeline_flow", PipelineConfig,
         ("prepare", "pretrain", "finetune", "label", "monitor", "promote")),
    Flow("ner", "flows.ner:ner_flow", PipelineConfig, ("prepare", "pretrain", "ner")),
)}


def flow_named(flow_name: str):
    """The Prefect flow of a name in :data:`FLOWS` (KeyError for another name)."""
    module, _, function = FLOWS[flow_name].function.partition(":")
    return getattr(importlib.import_module(module), function)


def load_flow_config(flow_name: str, config: str | Path | None = None, sets: list[str] | None = None):
    """The validated config of a flow: a YAML profile (or none) plus ``--set``-style ``key=value`` overrides."""
    if flow_name not in FLOWS:
        raise ValueError(f"unknown flow {flow_name!r}; choose from {sorted(FLOWS)}")
    return load_config(FLOWS[flow_name].model, config, list(sets or []))


def preflight(flow_name: str, cfg) -> None:
    """Check a flow's config before any work: every missing input listed in one error, the fine-tuning label column
    against ``finetune.classes``, then ``device: cuda`` where torch cannot use CUDA (``lexiflow run`` before a
    Prefect server or a Dask cluster starts; a flow given a profile when it resolves it)."""
    from tasks.prepare.preflight import check_inputs  # noqa: PLC0415  (reads the inputs' modules: only for a run)

    configure(cfg.storage_options)  # the inputs may be on an object store the profile configures
    if getattr(getattr(cfg, "pretrain", None), "node_rank", 0) == 0:  # another node joins; its data is rank 0's
        check_inputs(cfg, FLOWS[flow_name].sections)
    check_devices(flow_name, cfg)


def check_devices(flow_name: str, cfg) -> None:
    """``device: cuda`` in a section the flow trains with, where this torch cannot use CUDA: one error naming the
    setting and the CUDA install guide, before any stage runs (torch is imported only when a section asks for
    CUDA)."""
    sections = [s for s in ("pretrain", "finetune", "ner") if s in FLOWS[flow_name].sections]
    asked = [s for s in sections if getattr(getattr(cfg, s, None), "device", None) == "cuda"]
    if asked:
        from tasks.inference.runtime import check_device  # noqa: PLC0415  (imports torch)

        for s in asked:
            check_device("cuda", f"{s}.device")


def run_flow(flow_name: str, cfg):
    """Run a flow (its shard maps use the task runner its config names); returns the final ArtifactRef (CLI and
    ``lexiflow.run``). Its inputs are checked first (:func:`preflight`)."""
    preflight(flow_name, cfg)
    return flow_named(flow_name)(cfg)
