"""A flow's config at run time: the ``config`` it was given, or a profile plus ``--set``-style overrides that the
run itself reads (a deployment names ``configs/full.yaml`` and its overrides, and every run reads the profile as it
is then). Either way the run publishes the config it resolved as a Prefect artifact (``run-config``).

A profile resolved here is loaded and checked exactly as ``lexiflow run <flow> --config PROFILE --set …`` loads and
checks it (:func:`flows.registry.load_flow_config`, :func:`flows.registry.preflight`): the same config, so the same
versions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flows.config import PipelineConfig, load_config
from flows.runtime import PrefectReporter
from storage.options import configure
from storage.urls import public_url
from tasks.prepare.config import PrepareConfig

CONFIG_ARTIFACT = "run-config"

# flow name -> its config model (the flow itself: flows.registry.flow_named)
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


def preflight(flow_name: str, cfg) -> None:
    """Check a flow's config before any work: every missing input listed in one error, the fine-tuning label column
    against ``finetune.classes``, then ``device: cuda`` where torch cannot use CUDA (``lexiflow run`` before a
    Prefect server or a Dask cluster starts; a flow given a profile when it resolves it)."""
    from tasks.prepare.preflight import check_inputs  # noqa: PLC0415  (reads the inputs' modules: only for a run)

    configure(cfg.storage_options)  # the inputs may be on an object store the profile configures
    if getattr(getattr(cfg, "pretrain", None), "node_rank", 0) == 0:  # another node joins; its data is rank 0's
        check_inputs(cfg, flow_name)
    check_devices(flow_name, cfg)


def check_devices(flow_name: str, cfg) -> None:
    """``device: cuda`` in a section the flow trains with, where this torch cannot use CUDA: one error naming the
    setting and the CUDA install guide, before any stage runs (torch is imported only when a section asks for
    CUDA)."""
    from tasks.prepare.preflight import FLOW_SECTIONS  # noqa: PLC0415

    sections = [s for s in ("pretrain", "finetune", "ner") if s in FLOW_SECTIONS.get(flow_name, ())]
    asked = [s for s in sections if getattr(getattr(cfg, s, None), "device", None) == "cuda"]
    if asked:
        from tasks.training.loop import check_device  # noqa: PLC0415  (imports torch)

        for s in asked:
            check_device("cuda", f"{s}.device")


def flow_config(flow_name: str, config: Any | None, profile: str | None, overrides: list[str] | None) -> Any:
    """The config ``flow_name`` runs: ``config`` as given (no profile, no overrides), or ``profile`` (a YAML file,
    relative to the run's working directory, or any fsspec URL; None: none) with ``overrides`` applied, loaded and
    checked now. Published as the run's ``run-config`` artifact."""
    if config is not None:
        if profile is not None or overrides:
            raise ValueError(f"{flow_name}: give either config, or profile with overrides, not both (a run that passes "
                             "config must set profile to null and overrides to [])")
        cfg = config
    else:
        try:
            cfg = load_flow_config(flow_name, profile, list(overrides or []))
        except Exception as e:  # say which profile, as `lexiflow run` does
            e.add_note(f"profile {public_url(str(profile))}" if profile is not None else "profile (none)")
            raise
        preflight(flow_name, cfg)  # every missing input in one error, before any stage starts
    publish_config(flow_name, cfg, profile, overrides)
    return cfg


def shown_override(item: str) -> str:
    """An override as the artifact shows it: a storage option's value hidden, URLs without userinfo or query."""
    key, sep, value = item.partition("=")
    if key.strip().startswith("storage_options"):
        return f"{key}{sep}***"
    return f"{key}{sep}{public_url(value) if '://' in value else value}"


def config_markdown(flow_name: str, cfg: Any, profile: str | None, overrides: list[str] | None) -> str:
    """The ``run-config`` artifact: where the config came from and the whole resolved config as YAML
    (``storage_options`` are never dumped)."""
    source = (f"profile `{public_url(str(profile))}`, read at run time" if profile is not None
              else "no profile" if overrides else "the `config` parameter")
    lines = [f"### {flow_name}: the resolved config", "", f"- source: {source}"]
    if overrides:
        lines.append("- overrides: " + ", ".join(f"`{shown_override(o)}`" for o in overrides))
    dump = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=100)
    return "\n".join([*lines, "", "```yaml", dump.rstrip("\n"), "```", ""])


def publish_config(flow_name: str, cfg: Any, profile: str | None, overrides: list[str] | None) -> None:
    """The ``run-config`` markdown artifact of the current run (nothing outside a run)."""
    reporter = PrefectReporter()
    if reporter.active:
        reporter.publish_markdown(CONFIG_ARTIFACT, config_markdown(flow_name, cfg, profile, overrides),
                                  f"{flow_name}: the config this run resolved and ran")
