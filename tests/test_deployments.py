"""prefect.yaml as Prefect reads it: every deployment's entrypoint imports, its default parameters validate
against the flow's typed signature, and the operating settings (limits, aliases, output roots) are there."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SPEC = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
DEPLOYMENTS = {d["name"]: d for d in SPEC["deployments"]}


def _flow(entrypoint: str):
    path, attr = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), attr)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_default_parameters_validate_against_the_flow(name):
    dep = DEPLOYMENTS[name]
    flow = _flow(dep["entrypoint"])
    validated = flow.validate_parameters(dep.get("parameters", {}))  # pydantic: unknown keys and bad values fail
    assert set(validated) <= set(flow.parameters.properties)
    assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    assert dep.get("schedules") or dep.get("triggers")  # runs on a timer or on an event
    # INFO logs reach the run page even under a worker started with PREFECT_LOGGING_LEVEL=WARNING
    assert dep["work_pool"]["job_variables"]["env"]["PREFECT_LOGGING_LEVEL"] == "INFO"
    assert all(s["timezone"] == "UTC" for s in dep.get("schedules", []))
    for trigger in dep.get("triggers", []):  # what the trigger fills in: real parameters, templated as strings
        params = trigger["parameters"]
        assert set(params) <= set(flow.parameters.properties)
        assert all(isinstance(v, str) and v.startswith("{{ event.") for v in params.values()), params


def test_nightly_labels_the_promoted_bundle_into_a_root_and_the_pipeline_promotes():
    nightly = DEPLOYMENTS["label-nightly"]["parameters"]
    assert nightly["bundle_uri"].endswith("/bundle@production") and "output_root" in nightly
    assert "output_uri" not in nightly  # a fixed directory would refuse the second night's input
    promote = DEPLOYMENTS["pipeline-weekly"]["parameters"]["config"]["promote"]
    assert promote["alias"] == "production"


def test_a_promotion_relabels_the_standing_inputs():
    dep = DEPLOYMENTS["relabel-on-promotion"]
    [trigger] = dep["triggers"]
    assert trigger["expect"] == ["lexiflow.bundle.promoted"] and trigger["match"]["prefect.resource.name"] == \
        "bundle@production"
    assert trigger["match"]["lexiflow.store"] == DEPLOYMENTS["pipeline-weekly"]["parameters"]["config"]["store_uri"]
    assert trigger["parameters"]["bundle_uri"] == "{{ event.payload.uri }}"  # the version, not the moving alias
    assert dep["parameters"]["store_uri"] == trigger["match"]["lexiflow.store"]  # bundles from that store only
    assert all("output_root" in i and "output_uri" not in i for i in dep["parameters"]["inputs"])


def test_a_label_runs_drift_alert_runs_the_drift_alert_deployment():
    from fnmatch import fnmatch

    dep = DEPLOYMENTS["drift-alert"]
    [trigger] = dep["triggers"]
    assert trigger["expect"] == ["lexiflow.label.drift"] and dep["entrypoint"].endswith(":drift_alert_flow")
    assert trigger["parameters"]["output_uri"] == "{{ event.payload.output }}"  # the alerting output's directory
    # the nightly labelling's outputs (events name them canonically) are what it answers
    nightly_root = DEPLOYMENTS["label-nightly"]["parameters"]["output_root"]
    assert fnmatch(f"lexiflow.labelled.{nightly_root}/0123456789abcdef", trigger["match"]["prefect.resource.id"])


def test_a_bad_default_would_be_caught():
    from prefect.exceptions import ParameterTypeError

    flow = _flow(DEPLOYMENTS["pipeline-weekly"]["entrypoint"])
    bad = {"config": {**DEPLOYMENTS["pipeline-weekly"]["parameters"]["config"], "runner": {"kind": "spark"}}}
    with pytest.raises(ParameterTypeError):
        flow.validate_parameters(bad)


def test_serve_builds_the_same_nightly_shape_from_a_profile(tmp_path):
    from flows.config import PipelineConfig, load_config
    from flows.serve import deployments

    cfg = load_config(PipelineConfig, REPO / "configs" / "demo.yaml", [f"store_uri={tmp_path}/store"])
    assert [d.name for d in deployments(cfg, {})] == ["pipeline-weekly"]
    pipeline, nightly = deployments(cfg, {"LEXIFLOW_LABEL_INPUT": "/data/in/*.csv"})
    assert nightly.parameters["bundle_uri"] == f"{tmp_path}/store/bundle@production"
    assert nightly.parameters["output_root"] == f"{tmp_path}/store/labelled-nightly"
    assert PipelineConfig.model_validate(pipeline.parameters["config"]).store_uri == f"{tmp_path}/store"
