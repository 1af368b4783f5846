"""The layers hold at run time: storage loads no Prefect and nothing of lexiflow above it, and what it asks of a
running flow (the flow run's id, the flow's Dask clients) comes through the hooks flows installs."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import fsspec.config
import pytest

from storage import lease, options

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"storage", "models", "tasks", "flows", "lexiflow"}


def test_storage_loads_no_prefect_and_nothing_above_it():
    code = ("import sys, storage.aliases, storage.artifacts, storage.fingerprints, storage.lifecycle, "
            "storage.options, storage.parquet, storage.lease, storage.urls\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'prefect_dask', 'models', 'tasks', "
            "'flows', 'lexiflow'}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture()
def no_hooks(monkeypatch):
    """Storage as a plain process sees it: no run-id source and no Dask client source installed."""
    monkeypatch.setattr(lease, "_run_id_source", None)
    monkeypatch.setattr(options, "_client_source", None)


def test_run_identity_without_a_source_is_the_pid(no_hooks):
    assert lease.run_identity() == f"pid-{os.getpid()}"


def test_run_identity_names_the_run_the_source_gives(no_hooks):
    lease.set_run_id_source(lambda: "0b5e")
    assert lease.run_identity() == "flow-run-0b5e"
    lease.set_run_id_source(lambda: None)  # a source outside any run
    assert lease.run_identity() == f"pid-{os.getpid()}"


def test_importing_flows_installs_the_prefect_sources():
    import flows  # noqa: F401
    from flows.storage_hooks import flow_dask_clients, flow_run_id

    assert lease._run_id_source is flow_run_id and options._client_source is flow_dask_clients
    assert flow_run_id() is None and flow_dask_clients() == []  # no flow is running here


class _Client:
    """What :func:`storage.options.configure` uses of a Dask client: ``register_plugin``."""

    def __init__(self):
        self.plugins = []

    def register_plugin(self, plugin):
        self.plugins.append(plugin)


def test_configure_shares_the_options_with_the_clients_the_source_names(no_hooks, monkeypatch):
    monkeypatch.setattr(fsspec.config, "conf", {})
    monkeypatch.setattr(options, "_configured", set())
    monkeypatch.setenv(options.env_name("s3", "endpoint_url"), "unset")  # restored after the test
    client = _Client()
    options.configure({"s3": {"endpoint_url": "http://127.0.0.1:9"}})
    assert client.plugins == []  # no source: no client
    options.set_client_source(lambda: [client])
    options.configure({"s3": {"endpoint_url": "http://127.0.0.1:9"}})
    (plugin,) = client.plugins
    assert plugin.options == {"s3": {"endpoint_url": "http://127.0.0.1:9"}}
    assert os.environ[options.env_name("s3", "endpoint_url")] == '"http://127.0.0.1:9"'


@pytest.mark.flow
def test_inside_a_flow_run_the_owner_names_the_flow_run(prefect_server):
    from prefect import flow
    from prefect.context import FlowRunContext

    import flows  # noqa: F401  (installs the sources)

    @flow
    def who() -> tuple[str, str]:
        return lease.run_identity(), str(FlowRunContext.get().flow_run.id)

    seen, run_id = who()
    assert seen == f"flow-run-{run_id}"


def test_the_contract_names_the_five_packages_and_the_rooms_of_tasks():
    with open(ROOT / "pyproject.toml", "rb") as f:
        contract = tomllib.load(f)["tool"]["importlinter"]
    assert set(contract["root_packages"]) == PACKAGES and contract["include_external_packages"] is True
    kinds = {c["id"]: c for c in contract["contracts"]}
    assert kinds["layers"]["layers"] == ["lexiflow", "flows", "tasks", "models | storage"]
    assert "ignore_imports" not in kinds["layers"]  # no import up out of flows/ (nor anywhere else) is excused
    assert kinds["cli"]["containers"] == ["lexiflow"] and kinds["cli"]["exhaustive"] is True
    assert kinds["cli"]["layers"][:2] == ["__main__", "cli"]  # the Python API below the CLI, never importing it
    rooms = kinds["rooms"]["layers"]
    assert rooms[::-1] == ["common", "text", "inference", "prepare | training", "pretrain", "finetune | ner", "bundle",
                           "label", "evaluate"]  # by role: finetune and ner, prepare and training are siblings
    inference = kinds["inference"]  # inference (bundle loading, scorers, explain, runtime) imports no trainer
    assert inference["source_modules"] == ["tasks.inference"]
    assert inference.get("allow_indirect_imports", False) is False
    assert {"tasks.training", "tasks.finetune", "tasks.ner", "tasks.pretrain"} <= set(inference["forbidden_modules"])
    names = {r.strip() for layer in rooms for r in layer.split("|")}
    assert {p.parent.name for p in (ROOT / "tasks").glob("*/__init__.py")} == names  # every room is placed
    assert kinds["rooms"]["exhaustive"] is True and not list((ROOT / "tasks").glob("[!_]*.py"))  # no module outside
    label = kinds["label-scorers"]
    assert label["source_modules"] == ["tasks.label"]  # labelling scores through the inference room, never a trainer
    assert {"tasks.training", "tasks.finetune", "tasks.ner", "tasks.pretrain"} <= set(label["forbidden_modules"])
    assert kinds["plain"]["forbidden_modules"] == ["prefect", "prefect_dask"]
    assert set(kinds["plain"]["source_modules"]) == {"tasks", "models", "storage"}
    assert set(kinds["acyclic"]["ancestors"]) == PACKAGES
