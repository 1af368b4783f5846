"""The lighter option to a work pool: serve the flows from one long-running process.

    LEXIFLOW_CONFIG=configs/demo.yaml python -m flows.serve

Serves ``pipeline`` weekly and ``label`` nightly (same crons as prefect.yaml); runs execute in this process. The
weekly run names the profile, as the shipped deployments do, and reads it when it starts: an edit to the profile
reaches the next run without restarting this process. The nightly run labels ``LEXIFLOW_LABEL_INPUT`` with
``LEXIFLOW_LABEL_BUNDLE`` (default ``<store>/bundle@production``, the store read from the profile when serving
starts) into ``LEXIFLOW_LABEL_OUTPUT_ROOT/<label version>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from prefect import serve

from flows.label import label_flow
from flows.pipeline import pipeline_flow
from flows.registry import load_flow_config
from storage.urls import public_url


def main() -> None:
    """Serve the deployments of the configured profile (``LEXIFLOW_CONFIG``) from this process."""
    serve(*deployments(os.environ.get("LEXIFLOW_CONFIG", "configs/demo.yaml"), os.environ))


def deployments(profile: str, env: Mapping[str, str], overrides: Sequence[str] = ()) -> list:
    """``pipeline-weekly`` (the ``profile`` path, relative to this process's working directory or any fsspec URL,
    with ``--set``-style ``overrides``) always; ``label-nightly`` when ``LEXIFLOW_LABEL_INPUT`` is set. The profile
    is loaded and checked now, so a broken one fails here rather than at the first scheduled run."""
    try:
        cfg = load_flow_config("pipeline", profile, list(overrides))
    except Exception as e:  # say which profile, as a run does (flows.profiles.flow_config)
        e.add_note(f"profile {public_url(str(profile))}")
        raise
    params = {"profile": str(profile), **({"overrides": list(overrides)} if overrides else {})}
    pipeline = pipeline_flow.to_deployment(name="pipeline-weekly", cron="0 2 * * 1", parameters=params,
                                           concurrency_limit=1)
    out = [pipeline]
    if env.get("LEXIFLOW_LABEL_INPUT"):
        store = cfg.store_uri.rstrip("/")
        bundle_uri = env.get("LEXIFLOW_LABEL_BUNDLE") or f"{store}/bundle@production"
        out.append(
            label_flow.to_deployment(
                name="label-nightly",
                cron="30 3 * * *",
                concurrency_limit=1,
                parameters={
                    "bundle_uri": bundle_uri,
                    "input_uri": env["LEXIFLOW_LABEL_INPUT"],
                    "output_root": env.get("LEXIFLOW_LABEL_OUTPUT_ROOT") or f"{store}/labelled-nightly",
                    "options": {"text_column": env.get("LEXIFLOW_LABEL_TEXT_COLUMN", "review")},
                },
            )
        )
    return out


if __name__ == "__main__":
    main()
