"""The lighter option to a work pool: serve the flows from one long-running process.

    LEXIFLOW_CONFIG=configs/demo.yaml python -m flows.serve

Serves ``pipeline`` weekly and ``label`` nightly (same crons as prefect.yaml); runs execute
in this process. Parameters come from a YAML profile plus ``LEXIFLOW_LABEL_*`` variables: the nightly run
labels ``LEXIFLOW_LABEL_INPUT`` with ``LEXIFLOW_LABEL_BUNDLE`` (default ``<store>/bundle@production``) into
``LEXIFLOW_LABEL_OUTPUT_ROOT/<label version>``.
"""

from __future__ import annotations

import os

from prefect import serve

from flows.config import PipelineConfig, load_config
from flows.label import label_flow
from flows.pipeline import pipeline_flow


def main() -> None:
    """Serve the deployments of the configured profile (``LEXIFLOW_CONFIG``) from this process."""
    cfg = load_config(PipelineConfig, os.environ.get("LEXIFLOW_CONFIG", "configs/demo.yaml"))
    serve(*deployments(cfg, os.environ))


def deployments(cfg: PipelineConfig, env) -> list:
    """``pipeline-weekly`` always; ``label-nightly`` when ``LEXIFLOW_LABEL_INPUT`` is set."""
    pipeline = pipeline_flow.to_deployment(
        name="pipeline-weekly", cron="0 2 * * 1", parameters={"config": cfg.model_dump(mode="json")},
        concurrency_limit=1,
    )
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
