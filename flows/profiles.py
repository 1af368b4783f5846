"""A flow's config at run time: the ``config`` it was given, or a profile plus ``--set``-style overrides that the
run itself reads (a deployment names ``configs/full.yaml`` and its overrides, and every run reads the profile as it
is then). Either way the run publishes the config it resolved as a Prefect artifact (``run-config``).

A profile resolved here is loaded and checked exactly as ``lexiflow run <flow> --config PROFILE --set …`` loads and
checks it (:func:`flows.registry.load_flow_config`, :func:`flows.registry.preflight`): the same config, so the same
versions.
"""

from __future__ import annotations

from typing import Any

import yaml

from flows.registry import load_flow_config, preflight
from flows.runtime import PrefectReporter
from storage.urls import public_url

CONFIG_ARTIFACT = "run-config"

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
