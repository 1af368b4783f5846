"""run: a flow from Python, exactly as ``lexiflow run`` runs it (same config loading, overrides, task runner)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def run(flow: str, config: str | Path | Mapping[str, Any] | None = None,
        overrides: Mapping[str, Any] | None = None, **kw: Any):
    """Run ``flow`` (``prepare``, ``pretrain``, ``pipeline``, ``ner``); returns the final ``ArtifactRef``.

    ``config``: a YAML profile path (``--config``), or the profile's data as a dict. ``overrides`` and
    keyword arguments are ``--set`` overrides with dotted keys (``__`` also separates sections):
    ``run("pipeline", "configs/demo.yaml", store_uri="/tmp/s", **{"finetune.max_epochs": 1})`` is
    ``lexiflow run pipeline -c configs/demo.yaml --set store_uri=/tmp/s --set finetune.max_epochs=1``."""
    from flows.registry import load_flow_config, run_flow  # noqa: PLC0415  (pydantic: `import lexiflow` stays light)

    path, sets = (None, _sets(config)) if isinstance(config, Mapping) else (config, [])
    sets += _sets({**(overrides or {}), **{k.replace("__", "."): v for k, v in kw.items()}})
    return run_flow(flow, load_flow_config(flow, path, sets))


def _sets(values: Mapping[str, Any]) -> list[str]:
    """``{"a.b": 1e-5}`` -> ``["a.b=1.0e-05"]``: each value as YAML, which ``--set`` parses back unchanged."""
    def dump(v: Any) -> str:
        v = os.fspath(v) if isinstance(v, os.PathLike) else v
        text = yaml.safe_dump(v, default_flow_style=True, width=float("inf"), allow_unicode=True)
        return text.removesuffix("\n").removesuffix("\n...")

    return [f"{key}={dump(value)}" for key, value in values.items()]
