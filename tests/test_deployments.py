"""prefect.yaml as Prefect reads it: every deployment's entrypoint imports, its default parameters validate
against the flow's typed signature, and the operating settings (limits, aliases, output roots) are there. The
training deployments name a profile plus overrides, which a run resolves when it starts into exactly the config
``lexiflow run <flow> --config <profile> --set …`` runs, and publishes."""

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


PROFILE_RUNS = {"pipeline-weekly": "pipeline", "prepare-weekly": "prepare", "ner-weekly": "ner"}


def _resolved(name: str):
    """The config a run of deployment ``name`` resolves (its profile and overrides, as the CLI loads them)."""
    from flows.registry import load_flow_config

    params = DEPLOYMENTS[name]["parameters"]
    return load_flow_config(PROFILE_RUNS[name], REPO / params["profile"], params["overrides"])


def test_nightly_labels_the_promoted_bundle_into_a_root_and_the_pipeline_promotes():
    nightly = DEPLOYMENTS["label-nightly"]["parameters"]
    assert nightly["bundle_uri"].endswith("/bundle@production") and "output_root" in nightly
    assert "output_uri" not in nightly  # a fixed directory would refuse the second night's input
    assert _resolved("pipeline-weekly").promote.alias == "production"
    assert nightly["bundle_uri"] == f"{_resolved('pipeline-weekly').store_uri}/bundle@production"


@pytest.mark.parametrize("name", sorted(PROFILE_RUNS))
def test_training_deployments_name_a_shipped_profile_and_no_inline_config(name):
    params = DEPLOYMENTS[name]["parameters"]
    assert set(params) == {"profile", "overrides"}, params  # input paths live in the profile, not here
    assert params["profile"] == "configs/full.yaml"
    assert all(isinstance(o, str) and "=" in o for o in params["overrides"])
    # every path an override sets is under the profile's data_dir: one place says where the data is
    assert all("${data_dir}/" in o for o in params["overrides"] if o.split("=", 1)[0].endswith("_uri"))
    cfg = _resolved(name)
    assert cfg.corpus_uri.startswith("/data/") and cfg.embeddings_uri.endswith("::/data/tencent/"
                                                                                "tencent-ailab-embedding-zh-d200"
                                                                                "-v0.2.0.tar.gz")
    if name == "ner-weekly":
        assert cfg.ner.train_uri == "/data/ner/resume/train.char.bmes"


@pytest.mark.parametrize("name", sorted(PROFILE_RUNS))
def test_the_flow_runs_what_the_cli_loads_for_the_same_profile_and_overrides(name, monkeypatch):
    """The flow itself, given the deployment's parameters, resolves them when it runs (inputs checked first) into the
    config that ``lexiflow run`` loads: the same config, so every stage's version config is the same."""
    import flows.profiles
    from flows.registry import flow_named, load_flow_config
    from tasks.common.stage import section_dump

    flow_name = PROFILE_RUNS[name]
    params = {**DEPLOYMENTS[name]["parameters"], "profile": str(REPO / "configs" / "full.yaml")}
    checked, ran = [], []

    class Started(Exception):
        pass

    def start_run(cfg):  # the flow's first step after resolving: stop there, with what it would run
        ran.append(cfg)
        raise Started

    monkeypatch.setattr(flows.profiles, "preflight", lambda flow, cfg: checked.append((flow, cfg)))
    flow = flow_named(flow_name)
    monkeypatch.setitem(flow.fn.__globals__, "start_run", start_run)
    with pytest.raises(Started):
        flow.fn(**flow.validate_parameters(params))  # what Prefect calls with the deployment's parameters
    cli = load_flow_config(flow_name, REPO / "configs" / "full.yaml", params["overrides"])
    [cfg] = ran
    assert type(cfg) is type(cli) and cfg.model_dump() == cli.model_dump()
    assert cfg.storage_options == cli.storage_options
    assert checked == [(flow_name, cfg)]  # every input checked before any stage, as `lexiflow run` does
    sections = [n for n in type(cfg).model_fields if hasattr(getattr(cfg, n), "model_dump")]
    assert all(section_dump(getattr(cfg, n)) == section_dump(getattr(cli, n)) for n in sections)


def test_a_run_publishes_the_config_it_resolved(monkeypatch):
    """The ``run-config`` artifact: where the config came from, the overrides (a storage option's value hidden) and
    the whole resolved config, which loads back to the same config."""
    import yaml as _yaml

    import flows.profiles
    from flows.config import PipelineConfig
    from tests.reporting import Recording

    rec = Recording()  # as inside a flow run: the run's reporter reaches the UI
    monkeypatch.setattr(flows.profiles, "preflight", lambda flow, cfg: None)
    monkeypatch.setattr(flows.profiles, "PrefectReporter", lambda: rec)
    overrides = ["promote.alias=production", "storage_options.s3.secret=hunter2", "data_dir=/mnt/big"]
    cfg = flows.profiles.flow_config("pipeline", None, str(REPO / "configs" / "full.yaml"), overrides)
    published = {kw["key"]: kw["markdown"] for kind, kw in rec.made if kind == "md"}
    md = published["run-config"]
    assert "`promote.alias=production`" in md and "hunter2" not in md and "storage_options.s3.secret=***" in md
    dumped = _yaml.safe_load(md.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert PipelineConfig.model_validate(dumped).model_dump() == cfg.model_dump()  # storage options never dumped
    assert cfg.corpus_uri.startswith("/mnt/big/zhwiki/") and cfg.storage_options == {"s3": {"secret": "hunter2"}}
    with pytest.raises(ValueError, match="either config, or profile"):
        flows.profiles.flow_config("pipeline", cfg, "configs/full.yaml", [])


def test_data_dir_is_the_one_place_that_says_where_the_inputs_are(tmp_path):
    from flows.registry import load_flow_config

    full = REPO / "configs" / "full.yaml"
    default, moved = (load_flow_config("pipeline", full, sets) for sets in ([], ["data_dir=s3://bucket/data/"]))
    inputs = lambda c: [c.corpus_uri, c.embeddings_uri, *c.finetune.input_uris().values()]  # noqa: E731
    assert all("/data/" in u for u in inputs(default))
    assert [u.replace("s3://bucket/data/", "/data/") for u in inputs(moved)] == inputs(default)
    assert moved.model_dump(exclude={"corpus_uri", "embeddings_uri", "finetune"}) == default.model_dump(
        exclude={"corpus_uri", "embeddings_uri", "finetune"})
    # an override may use it too; without a data_dir the error says how to set one
    profile = tmp_path / "p.yaml"
    profile.write_text("corpus_uri: ${data_dir}/c/*.jsonl\nembeddings_uri: e.txt\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"corpus_uri use \$\{data_dir\}, but no data_dir is set"):
        load_flow_config("prepare", profile, [])
    got = load_flow_config("prepare", profile, ["data_dir=/d", "embeddings_uri=${data_dir}/e.txt"])
    assert (got.corpus_uri, got.embeddings_uri) == ("/d/c/*.jsonl", "/d/e.txt")


def test_a_profile_may_be_any_fsspec_url(tmp_path):
    import fsspec

    from flows.registry import load_flow_config

    url = f"memory://profiles-{tmp_path.name}/full.yaml"
    with fsspec.open(url, "w", encoding="utf-8") as f:
        f.write((REPO / "configs" / "full.yaml").read_text(encoding="utf-8"))
    assert load_flow_config("pipeline", url, []) == load_flow_config("pipeline", REPO / "configs" / "full.yaml", [])


def test_no_profile_sets_the_deprecated_seed_and_dropping_it_moves_nothing():
    from tasks.prepare.config import PrepareConfig

    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert "seed" not in yaml.safe_load(path.read_text(encoding="utf-8")), path.name
    assert PrepareConfig.model_fields["seed"].default == 42  # what every profile set: the dumps did not change


def test_a_promotion_relabels_the_standing_inputs():
    dep = DEPLOYMENTS["relabel-on-promotion"]
    [trigger] = dep["triggers"]
    assert trigger["expect"] == ["lexiflow.bundle.promoted"] and trigger["match"]["prefect.resource.name"] == \
        "bundle@production"
    assert trigger["match"]["lexiflow.store"] == _resolved("pipeline-weekly").store_uri
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

    from flows.profiles import flow_config

    flow = _flow(DEPLOYMENTS["pipeline-weekly"]["entrypoint"])
    bad = {"config": {**_resolved("pipeline-weekly").model_dump(mode="json"), "runner": {"kind": "spark"}}}
    with pytest.raises(ParameterTypeError):
        flow.validate_parameters(bad)
    with pytest.raises(ParameterTypeError):
        flow.validate_parameters({"overrides": "promote.alias=production"})  # a list, not a string
    with pytest.raises(ValueError, match="runner.kind"):  # a bad override fails the run before any work
        flow_config("pipeline", None, str(REPO / "configs" / "full.yaml"), ["runner.kind=spark"])


def test_serve_builds_the_same_nightly_shape_from_a_profile(tmp_path):
    """``python -m flows.serve``: the weekly run names the profile (read when each run starts, as the shipped
    deployments do), not a copy of the config made when serving started; the nightly run's store is the profile's."""
    from flows.config import PipelineConfig, load_config
    from flows.pipeline import pipeline_flow
    from flows.profiles import load_flow_config
    from flows.serve import deployments

    profile, store = tmp_path / "profile.yaml", f"store_uri={tmp_path}/store"
    profile.write_text((REPO / "configs" / "demo.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    assert [d.name for d in deployments(str(profile), {}, [store])] == ["pipeline-weekly"]
    pipeline, nightly = deployments(str(profile), {"LEXIFLOW_LABEL_INPUT": "/data/in/*.csv"}, [store])
    assert nightly.parameters["bundle_uri"] == f"{tmp_path}/store/bundle@production"
    assert nightly.parameters["output_root"] == f"{tmp_path}/store/labelled-nightly"
    assert pipeline.parameters == {"profile": str(profile), "overrides": [store]}
    pipeline_flow.validate_parameters(pipeline.parameters)
    expected = load_config(PipelineConfig, profile, [store])

    def at_run_start():  # what the run reads (flows.profiles.flow_config, less its input checks)
        return load_flow_config("pipeline", pipeline.parameters["profile"], pipeline.parameters["overrides"])

    assert at_run_start() == expected
    # an edit to the profile after serving started reaches the next run
    profile.write_text(profile.read_text(encoding="utf-8").replace("alias: production", "alias: canary"),
                       encoding="utf-8")
    assert at_run_start().promote.alias == "canary" != expected.promote.alias
    profile.write_text("store_uri: [", encoding="utf-8")
    with pytest.raises(Exception) as e:  # a broken profile fails when serving starts, naming the file
        deployments(str(profile), {})
    assert e.value.__notes__ == [f"profile {profile}"]
