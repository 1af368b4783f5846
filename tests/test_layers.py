"""The layers hold at run time: storage loads no Prefect and nothing of lexiflow above it; importing ``flows``
installs nothing (no hook, no module-level run state); what storage needs of a run (the owner its records name, the
Dask clients that get its options) is handed to it by the run's runtime."""

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


def test_run_identity_is_the_owner_given_else_the_pid():
    assert lease.run_identity() == f"pid-{os.getpid()}"
    assert lease.run_identity("flow-run-0b5e") == "flow-run-0b5e"


# module-level names that once carried a run's state or an installed hook: none may come back
_GONE = {"storage.lease": ["_run_id_source", "set_run_id_source"], "storage.options": ["_client_source",
         "set_client_source"], "storage.fingerprints": ["_CACHE", "configure", "current", "using"],
         "tasks.common.ui": ["_reporter", "install", "in_run"], "tasks.common.stage": ["_OPTIONS", "_shards",
         "install_shards", "configure_run", "run_map", "run_task", "in_run", "logger"],
         "flows.stage": ["_SHARD_RUNNER", "use_shard_runner"]}


def test_importing_flows_installs_nothing_and_leaves_no_run_state_in_modules():
    """In a fresh process: import every flow, then look at every module of tasks/ and storage/: no Prefect object
    is held at module level, no Prefect handler sits on the ``lexiflow`` loggers, and the run-state names are gone."""
    code = """
import importlib, logging, pkgutil, sys, types
import flows, flows.pipeline, flows.ner, flows.label, flows.serve
import tasks, storage
for pkg in (tasks, storage):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
bad = []
for name, mod in list(sys.modules.items()):
    if not name.startswith(("tasks.", "storage.")):
        continue
    for attr, value in vars(mod).items():
        if isinstance(value, (types.ModuleType, type, types.FunctionType)):
            continue
        if type(value).__module__.startswith(("prefect", "flows")):
            bad.append(f"{name}.{attr}: {type(value).__module__}.{type(value).__name__}")
handlers = [h for n in ("lexiflow", "lexiflow.progress", "lexiflow.monitor") for h in logging.getLogger(n).handlers]
print(bad, [type(h).__name__ for h in handlers])
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []"
    import importlib

    for module, names in _GONE.items():
        mod = importlib.import_module(module)
        assert [n for n in names if hasattr(mod, n)] == [], module


def test_a_log_line_outside_a_run_leaves_the_root_handlers_alone():
    """The run-log handler asks whether a Prefect run is active without importing Prefect: importing it inside a
    log call ran Prefect's logging set-up, which swapped the root handlers while the record was on its way to them
    (the line reached Prefect's console, not the handler a test or an application had put there)."""
    code = """
import logging
import prefect.settings  # Prefect partly loaded, as a process that read its settings has it
from flows.logs import attach
attach()
got = []
class Keep(logging.Handler):
    def emit(self, record):
        got.append(record.getMessage())
root = logging.getLogger()
root.addHandler(Keep())
logging.getLogger("lexiflow").setLevel(logging.INFO)
logging.getLogger("lexiflow").info("one line")
print(got, any(isinstance(h, Keep) for h in root.handlers))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['one line'] True"


class _Client:
    """What :func:`storage.options.configure` uses of a Dask client: ``register_plugin``."""

    def __init__(self):
        self.plugins = []

    def register_plugin(self, plugin):
        self.plugins.append(plugin)


def test_configure_shares_the_options_with_the_clients_it_is_given(monkeypatch):
    monkeypatch.setattr(fsspec.config, "conf", {})
    monkeypatch.setattr(options, "_configured", set())
    monkeypatch.setenv(options.env_name("s3", "endpoint_url"), "unset")  # restored after the test
    client = _Client()
    options.configure({"s3": {"endpoint_url": "http://127.0.0.1:9"}})
    assert client.plugins == []  # not given: not shared
    options.configure({"s3": {"endpoint_url": "http://127.0.0.1:9"}}, clients=[client])
    (plugin,) = client.plugins
    assert plugin.options == {"s3": {"endpoint_url": "http://127.0.0.1:9"}}
    assert os.environ[options.env_name("s3", "endpoint_url")] == '"http://127.0.0.1:9"'


@pytest.mark.flow
def test_inside_a_flow_run_the_runtime_names_the_flow_run(prefect_server):
    from prefect import flow
    from prefect.context import FlowRunContext

    from flows.runtime import PrefectRuntime

    @flow
    def who() -> tuple[str, str]:
        return PrefectRuntime().owner, str(FlowRunContext.get().flow_run.id)

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
