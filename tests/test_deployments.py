"""prefect.yaml as Prefect reads it: every deployment's entrypoint imports, its default parameters validate
against the flow's typed signature, and the operating settings (limits, aliases, output roots) are there. The
training deployments name a profile plus overrides, which a run resolves when it starts into exactly the config
``lexiflow run <flow> --config <profile> --set …`` runs, and publishes."""

from __future__ import annotations

import importlib
import inspect
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
    # what a run gets: the deployment's parameters, and a triggered run the trigger's (rendered: strings)
    rendered = {k: "rendered" for t in dep.get("triggers", []) for k in t["parameters"]}
    validated = flow.validate_parameters({**rendered, **dep.get("parameters", {})})  # unknown keys, bad values fail
    assert set(validated) <= set(flow.parameters.properties)
    assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
    assert dep.get("schedules") or dep.get("triggers")  # runs on a timer or on an event
    env = dep["work_pool"]["job_variables"]["env"]
    # INFO logs reach the run page even under a worker started with PREFECT_LOGGING_LEVEL=WARNING; the run is the
    # CLI's run (PYTHONHASHSEED=0, the pinned CPU kernels)
    assert env["PREFECT_LOGGING_LEVEL"] == "INFO" and env["PYTHONHASHSEED"] == "0"
    from models.numerics import PINS

    assert {k: env[k] for k in PINS} == PINS
    assert all(s["timezone"] == "UTC" for s in dep.get("schedules", []))
    for trigger in dep.get("triggers", []):  # what the trigger fills in: real parameters, templated as strings
        params = trigger["parameters"]
        assert set(params) <= set(flow.parameters.properties)
        assert all(isinstance(v, str) and v.startswith("{{ event.") for v in params.values()), params


def test_one_work_pool_and_its_job_variables_are_defined_once():
    """The pool name, its job variables and the shared settings live once under ``definitions:`` (YAML anchors):
    the file names the pool once, and every deployment's pool is that one object."""
    text = (REPO / "prefect.yaml").read_text(encoding="utf-8")
    lines = [line.split("#", 1)[0] for line in text.splitlines()]  # the YAML, less its comments
    assert sum("lexiflow-process" in line for line in lines) == 1
    pool = SPEC["definitions"]["work_pools"]["lexiflow"]
    assert all(d["work_pool"] is pool for d in SPEC["deployments"])
    assert sum("PYTHONHASHSEED" in line for line in lines) == 1 and text.count("collision_strategy") == 1


def test_no_data_path_in_prefect_yaml_and_the_pull_steps_fetch_and_install_the_code():
    """No ``/data/`` path: the roots come from Prefect Variables when a run starts. The pull steps clone the
    repository at the branch or commit the Variables name, change into it and install the dependencies; the local
    form (a worker with its own checkout) is kept as a documented alternative."""
    text = (REPO / "prefect.yaml").read_text(encoding="utf-8")
    assert "/data/" not in text and "/data" not in yaml.safe_dump(SPEC["deployments"])
    clone, cd, install = SPEC["pull"]
    git = clone["prefect.deployments.steps.git_clone"]
    assert git["repository"] == "{{ prefect.variables.lexiflow_repository }}"
    assert {git["branch"], git["commit_sha"]} == {"{{ prefect.variables.lexiflow_git_branch }}",
                                                  "{{ prefect.variables.lexiflow_git_commit }}"}
    assert cd["prefect.deployments.steps.set_working_directory"]["directory"] == f"{{{{ {git['id']}.directory }}}}"
    [(step, args)] = install.items()
    path, func = step.split(":")
    assert (REPO / path).is_file() and func == "install" and args["directory"] == "."
    import flows.worker_env

    assert set(args) <= set(inspect.signature(getattr(flows.worker_env, func)).parameters)
    [local] = SPEC["definitions"]["pull_local"]
    assert local["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $LEXIFLOW_HOME }}"


def test_the_demo_deployments_run_the_sample_on_a_cpu_and_the_gpu_ones_say_so():
    from flows.config import PipelineConfig, load_config
    from flows.demo import DEMO_PROFILE, demo_overrides

    demo = DEPLOYMENTS["pipeline-demo"]
    assert demo["entrypoint"] == "flows/demo.py:demo_pipeline_flow" and DEPLOYMENTS["label-demo"]["schedules"]
    cfg = load_config(PipelineConfig, REPO / DEMO_PROFILE, [*demo_overrides("/tmp/demo"),
                                                            *demo["parameters"]["overrides"]])
    assert "cuda" not in (cfg.pretrain.device, cfg.finetune.device) and not cfg.pretrain.compile
    assert cfg.store_uri == "/tmp/demo/store"
    assert cfg.promote.alias == "demo"  # a demo never moves bundle@production
    for name in ("pipeline-weekly", "ner-weekly"):
        assert "needs-gpu" in DEPLOYMENTS[name]["tags"] and "needs a GPU" in DEPLOYMENTS[name]["description"]
        assert _resolved(name).pretrain.device == "cuda"


PROFILE_RUNS = {"pipeline-weekly": "pipeline", "prepare-weekly": "prepare", "ner-weekly": "ner"}


def _resolved(name: str):
    """The config a run of deployment ``name`` resolves (its profile and overrides, as the CLI loads them)."""
    from flows.registry import load_flow_config

    params = DEPLOYMENTS[name]["parameters"]
    return load_flow_config(PROFILE_RUNS[name], REPO / params["profile"], params["overrides"])


def test_nightly_labels_the_promoted_bundle_into_a_root_and_the_pipeline_promotes(monkeypatch):
    """label-nightly names no path: at run start its bundle is ``<store>/bundle@production`` of the store the
    Variables name (by default the full profile's), its input and output root from the Variables too."""
    import flows.settings

    nightly = DEPLOYMENTS["label-nightly"]["parameters"]
    assert not {"bundle_uri", "input_uri", "output_root", "output_uri"} & set(nightly)
    assert _resolved("pipeline-weekly").promote.alias == "production"
    variables = {}
    monkeypatch.setattr(flows.settings, "variable", lambda name, default=None: variables.get(name, default))
    bundle, inp, root = flows.settings.label_roots(None, None, None, None)
    assert bundle == f"{_resolved('pipeline-weekly').store_uri}/bundle@production"
    assert (inp, root) == ("/data/incoming/*.csv", "/data/labelled/nightly")
    variables.update({"lexiflow_data_root": "s3://b/d/", "lexiflow_store": "s3://b/store"})
    assert flows.settings.label_roots(None, None, None, None) == (
        "s3://b/store/bundle@production", "s3://b/d/incoming/*.csv", "s3://b/d/labelled/nightly")
    assert flows.settings.label_roots("x@y", "in.csv", "out", None) == ("x@y", "in.csv", None)  # given: kept


@pytest.mark.parametrize("name", sorted(PROFILE_RUNS))
def test_training_deployments_name_a_shipped_profile_and_no_inline_config(name):
    params = DEPLOYMENTS[name]["parameters"]
    assert set(params) == {"profile", "overrides"}, params  # input paths live in the profile, not here
    assert params["profile"] == "configs/full.yaml"
    assert all(isinstance(o, str) and "=" in o for o in params["overrides"])
    # every path an override sets is under the profile's data_dir: one place says where the data is
    assert all("${data_dir}/" in o for o in params["overrides"] if o.split("=", 1)[0].endswith("_uri"))
    cfg = _resolved(name)
    assert cfg.prepare.corpus_uri.startswith("/data/") and cfg.prepare.embeddings_uri.endswith("::/data/tencent/"
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
    assert cfg.prepare.corpus_uri.startswith("/mnt/big/zhwiki/")
    assert cfg.storage_options == {"s3": {"secret": "hunter2"}}
    with pytest.raises(ValueError, match="either config, or profile"):
        flows.profiles.flow_config("pipeline", cfg, "configs/full.yaml", [])


def test_data_dir_is_the_one_place_that_says_where_the_inputs_are(tmp_path):
    from flows.registry import load_flow_config

    full = REPO / "configs" / "full.yaml"
    default, moved = (load_flow_config("pipeline", full, sets) for sets in ([], ["data_dir=s3://bucket/data/"]))
    inputs = lambda c: [c.prepare.corpus_uri, c.prepare.embeddings_uri, *c.finetune.input_uris().values()]  # noqa: E731
    assert all("/data/" in u for u in inputs(default))
    assert [u.replace("s3://bucket/data/", "/data/") for u in inputs(moved)] == inputs(default)
    outside = {"prepare": {"corpus_uri", "embeddings_uri"}, "finetune": True, "store_uri": True}
    assert moved.model_dump(exclude=outside) == default.model_dump(exclude=outside)
    assert (default.store_uri, moved.store_uri) == ("/data/lexiflow/store", "s3://bucket/data/lexiflow/store")
    # an override may use it too; without a data_dir the error says how to set one
    profile = tmp_path / "p.yaml"
    profile.write_text("prepare: {corpus_uri: '${data_dir}/c/*.jsonl', embeddings_uri: e.txt}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"prepare\.corpus_uri use \$\{data_dir\}, but no data_dir is set"):
        load_flow_config("prepare", profile, [])
    got = load_flow_config("prepare", profile, ["data_dir=/d", "prepare.embeddings_uri=${data_dir}/e.txt"])
    assert (got.prepare.corpus_uri, got.prepare.embeddings_uri) == ("/d/c/*.jsonl", "/d/e.txt")


def test_a_profile_may_be_any_fsspec_url(tmp_path):
    import fsspec

    from flows.registry import load_flow_config

    url = f"memory://profiles-{tmp_path.name}/full.yaml"
    with fsspec.open(url, "w", encoding="utf-8") as f:
        f.write((REPO / "configs" / "full.yaml").read_text(encoding="utf-8"))
    assert load_flow_config("pipeline", url, []) == load_flow_config("pipeline", REPO / "configs" / "full.yaml", [])


def test_no_profile_sets_the_deprecated_seed_and_dropping_it_moves_nothing():
    from flows.config import RunConfig

    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert "seed" not in yaml.safe_load(path.read_text(encoding="utf-8")), path.name
    assert RunConfig.model_fields["seed"].default == 42  # what every profile set: the dumps did not change


def test_a_promotion_relabels_the_standing_inputs(monkeypatch):
    import flows.settings
    from flows.label import StandingInput

    dep = DEPLOYMENTS["relabel-on-promotion"]
    [trigger] = dep["triggers"]
    assert trigger["expect"] == ["lexiflow.bundle.promoted"] and trigger["match"]["prefect.resource.name"] == \
        "bundle@production"
    assert trigger["parameters"]["bundle_uri"] == "{{ event.payload.uri }}"  # the version, not the moving alias
    assert not {"store_uri", "inputs"} & set(dep["parameters"])  # from the Variables, at run start
    monkeypatch.setattr(flows.settings, "variable", lambda name, default=None: default)
    assert flows.settings.store_root() == _resolved("pipeline-weekly").store_uri
    [standing] = [StandingInput.model_validate(i) for i in flows.settings.standing_inputs()]
    assert standing.output_root == "/data/labelled/standing/reviews"
    given = '[{"input_uri": "s3://b/in.csv", "output_root": "s3://b/out"}]'
    monkeypatch.setattr(flows.settings, "variable", lambda name, default=None: given if "standing" in name else default)
    assert flows.settings.standing_inputs() == [{"input_uri": "s3://b/in.csv", "output_root": "s3://b/out"}]


def test_a_label_runs_drift_alert_runs_the_drift_alert_deployment():
    from fnmatch import fnmatch

    dep = DEPLOYMENTS["drift-alert"]
    [trigger] = dep["triggers"]
    assert trigger["expect"] == ["lexiflow.label.drift"] and dep["entrypoint"].endswith(":drift_alert_flow")
    assert trigger["parameters"]["output_uri"] == "{{ event.payload.output }}"  # the alerting output's directory
    # every label output's alert (events name outputs canonically): the nightly's and the demo's
    for root in ("/data/labelled/nightly", "/home/u/.lexiflow/demo/labelled"):
        assert fnmatch(f"lexiflow.labelled.{root}/0123456789abcdef", trigger["match"]["prefect.resource.id"])


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
