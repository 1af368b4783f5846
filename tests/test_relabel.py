"""Relabel on promotion, end to end against a real ``prefect server start`` with its services (events, triggers,
actions): ``lexiflow promote`` emits ``lexiflow.bundle.promoted``; the ``relabel-on-promotion`` deployment's
trigger (deployed from prefect.yaml with ``prefect deploy``) schedules a run with the promoted version's URI;
a process worker runs it; each standing input gets a new label version that reconciles, and the run records the
event that caused it."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from tests.bundle_fixture import make_tiny_bundle
from tests.prefect_server import BIN, REPO, deployed, run_ok, triggered_runs

pytestmark = pytest.mark.flow


@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
def test_promote_through_the_cli_relabels_the_standing_inputs(tmp_path):
    store = str(tmp_path / "store")
    bundle_uri = make_tiny_bundle(store)
    standing = tmp_path / "standing.csv"
    standing.write_text("id,review\na,这家酒店服务很好房间干净\nb,   \nc,前台态度冷淡隔音太差\n", encoding="utf-8")
    out_root = tmp_path / "labelled"

    # prefect.yaml's deployment, pointed at this test's store and standing input
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    [dep] = [d for d in spec["deployments"] if d["name"] == "relabel-on-promotion"]
    dep["parameters"] = {"bundle_uri": f"{store}/bundle@production", "store_uri": store,
                         "inputs": [{"input_uri": str(standing), "output_root": str(out_root),
                                     "options": {"text_column": "review", "id_column": "id"}}]}
    dep["triggers"][0]["match"]["lexiflow.store"] = os.path.realpath(store)  # events name the store canonically
    spec["deployments"] = [dep]
    with deployed(tmp_path, spec) as env:
        from prefect.client.orchestration import SyncPrefectClient
        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            # `prefect deploy` kept the event templates (they are rendered per event, not at deploy time)
            [auto] = [a for a in client.read_automations() if "relabel-on-promotion" in a.name]
            assert auto.actions[0].parameters["bundle_uri"] == "{{ event.payload.uri }}", auto.actions[0]

        promoted = run_ok(env, str(BIN / "lexiflow"), "promote", bundle_uri, "--alias", "production")
        out = promoted.stdout
        assert "Still processing items" not in promoted.stderr, promoted.stderr  # the drain's notice is not shown
        event_id = out.splitlines()[-2].rsplit("event ", 1)[1]
        version = json.loads(out.splitlines()[-1])["version"]

        runs = triggered_runs(env["PREFECT_API_URL"], "relabel-on-promotion")  # the trigger's run appears
        assert runs[0].parameters["bundle_uri"] == f"{os.path.realpath(store)}/bundle/{version}"
        assert runs[0].parameters["event_id"] == event_id
        run_ok(env, str(BIN / "prefect"), "worker", "start", "--pool", "lexiflow-process", "--run-once", timeout=600)

        with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
            [run] = triggered_runs(env["PREFECT_API_URL"], "relabel-on-promotion")
            assert run.state.is_completed(), run.state
            cause = client.read_artifacts()
            md = next(a.data for a in cause if a.key == "relabel-cause")
            assert event_id in md and version in md

    [out_dir] = [p for p in out_root.iterdir() if p.is_dir()]
    manifest = json.loads((out_dir / "_manifest.json").read_text())
    st = manifest["stats"]
    assert st == {"in": 3, "out": 2, "rejected": {"empty_text": 1}}
    assert manifest["parents"][0]["version"] == version
