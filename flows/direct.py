"""Labelling without a flow run and without importing Prefect: the CLI's path when no Prefect API is configured.

A flow run with no API configured would first start a temporary Prefect server (about 20 s); this path runs
the same labeller (:func:`tasks.label.run.label_stream`), so it writes the same bytes, in a few seconds.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from tasks.common.ui import bars
from tasks.label.config import LabelOptions, MonitorConfig


def prefect_api_configured(env=os.environ) -> bool:
    """``PREFECT_API_URL`` set in the environment or in the active Prefect profile (read from
    ``$PREFECT_HOME/profiles.toml`` without importing Prefect)."""
    if env.get("PREFECT_API_URL"):
        return True
    home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect")
    path = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml")
    try:
        profiles = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    active = env.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    return bool(profiles.get("profiles", {}).get(active, {}).get("PREFECT_API_URL"))


def label_direct(kind: str, model_uri: str, input_uri: str, output_uri: str | None, options: LabelOptions,
                 output_root: str | None = None, overwrite: bool = False, monitor: MonitorConfig | None = None) -> dict:
    """What the ``label`` (``kind="label"``) or ``ner-label`` flow does, without the flow run (the monitoring report
    is written the same; with no API there is no event to send an alert to: the report and its line say it)."""
    # torch and the labeller load only to label: every CLI command imports this module to ask for the API
    from tasks.inference.interface import load_scorer  # noqa: PLC0415
    from tasks.inference.runtime import default_device  # noqa: PLC0415
    from tasks.label.run import label_stream  # noqa: PLC0415

    scorer = load_scorer(kind, model_uri, options.batch_size, default_device())
    return label_stream(scorer, input_uri, output_uri, options, output_root=output_root, overwrite=overwrite,
                        progress=bars(True), monitor=monitor)
