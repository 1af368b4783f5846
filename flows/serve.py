"""The lighter option to a work pool: serve the flows from one long-running process.

    LEXIFLOW_CONFIG=configs/demo.yaml python -m flows.serve

Serves ``pipeline`` weekly and ``label`` nightly (same crons as prefect.yaml); runs execute
in this process. Parameters come from a YAML profile plus ``LEXIFLOW_LABEL_*`` variables.
"""

from __future__ import annotations

import os

from prefect import serve

from flows.label import label_flow
from flows.pipeline import pipeline_flow
from tasks.common.config import PipelineConfig, load_config


def main() -> None:
    cfg = load_config(PipelineConfig, os.environ.get("LEXIFLOW_CONFIG", "configs/demo.yaml"))
    pipeline = pipeline_flow.to_deployment(
        name="pipeline-weekly", cron="0 2 * * 1", parameters={"config": cfg.model_dump(mode="json")}
    )
    deployments = [pipeline]
    bundle_uri = os.environ.get("LEXIFLOW_LABEL_BUNDLE")
    if bundle_uri:
        deployments.append(
            label_flow.to_deployment(
                name="label-nightly",
                cron="30 3 * * *",
                parameters={
                    "bundle_uri": bundle_uri,
                    "input_uri": os.environ["LEXIFLOW_LABEL_INPUT"],
                    "output_uri": os.environ["LEXIFLOW_LABEL_OUTPUT"],
                    "options": {"text_column": os.environ.get("LEXIFLOW_LABEL_TEXT_COLUMN", "review")},
                },
            )
        )
    serve(*deployments)


if __name__ == "__main__":
    main()
