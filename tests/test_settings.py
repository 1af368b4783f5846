"""A deployed run's settings from Prefect's places (flows/settings.py): roots from Prefect Variables and credentials
from a Secret block, read when the run starts; and the install pull step (flows/worker_env.py): one install per
dependency set, never raced by a second run."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

import flows.settings
import flows.worker_env

REPO = Path(__file__).resolve().parents[1]


def _variables(monkeypatch, values: dict) -> None:
    monkeypatch.setattr(flows.settings, "variable", lambda name, default=None: values.get(name, default))


def test_a_profile_run_puts_the_variables_roots_before_its_own_overrides(monkeypatch):
    _variables(monkeypatch, {})
    assert flows.settings.profile_overrides("configs/full.yaml", ["promote.alias=production"]) == [
        "promote.alias=production"]
    _variables(monkeypatch, {"lexiflow_data_root": "/mnt/big", "lexiflow_store": "s3://b/store"})
    got = flows.settings.profile_overrides("configs/full.yaml", ["promote.alias=production", "store_uri=/x"])
    assert got == ["data_dir=/mnt/big", "store_uri=s3://b/store", "promote.alias=production", "store_uri=/x"]
    assert flows.settings.profile_overrides(None, []) == []  # a whole config: nothing added

    from flows.registry import load_flow_config

    cfg = load_flow_config("pipeline", REPO / "configs" / "full.yaml", got[:3])
    assert cfg.store_uri == "s3://b/store" and cfg.prepare.corpus_uri.startswith("/mnt/big/zhwiki/")


def test_outside_a_run_the_defaults_hold():
    assert flows.settings.variable("lexiflow_store", "d") == "d"
    assert flows.settings.data_root() == "/data" and flows.settings.store_root() == "/data/lexiflow/store"
    assert flows.settings.demo_root().endswith("/.lexiflow/demo") and not flows.settings.demo_root().startswith("~")


class _FakeSecret:
    saved: dict = {}

    def __init__(self, value):
        self.value = value

    @classmethod
    def load(cls, name):
        return cls(cls.saved[name])

    def get(self):
        return self.value


def test_a_secret_blocks_storage_options_are_installed_and_never_logged(monkeypatch, caplog):
    installed = []
    monkeypatch.setattr(flows.settings, "Secret", _FakeSecret)
    monkeypatch.setattr(flows.settings, "configure", installed.append)
    _FakeSecret.saved = {"s3-creds": {"s3": {"key": "AKIAEXAMPLE", "secret": "hunter2"}},
                         "as-text": json.dumps({"gcs": {"token": "tok-123"}}), "not-json": "hunter2",
                         "flat": {"key": "AKIAEXAMPLE"}}
    _variables(monkeypatch, {})
    assert flows.settings.apply_storage_secret() == [] and installed == []  # no variable: nothing
    _variables(monkeypatch, {"lexiflow_storage_secret": "s3-creds"})
    with caplog.at_level(logging.INFO, logger="lexiflow"):
        assert flows.settings.apply_storage_secret() == ["s3"]
    assert installed == [{"s3": {"key": "AKIAEXAMPLE", "secret": "hunter2"}}]
    assert "s3-creds" in caplog.text and "hunter2" not in caplog.text and "AKIA" not in caplog.text
    assert flows.settings.storage_secret_options("as-text") == {"gcs": {"token": "tok-123"}}
    for bad in ("not-json", "flat"):
        with pytest.raises(ValueError, match=f"Secret block '{bad}': expected JSON storage options") as e:
            flows.settings.storage_secret_options(bad)
        assert "hunter2" not in str(e.value) and "AKIA" not in str(e.value)


@pytest.mark.flow
def test_a_run_reads_real_variables_and_a_real_secret_block_when_it_starts(prefect_server, monkeypatch):
    from prefect import flow
    from prefect.blocks.system import Secret
    from prefect.variables import Variable

    installed = []
    monkeypatch.setattr(flows.settings, "configure", installed.append)
    Secret(value={"s3": {"key": "k", "secret": "s"}}).save("lexiflow-test-creds", overwrite=True)
    for name, value in (("lexiflow_data_root", "/srv/d"), ("lexiflow_storage_secret", "lexiflow-test-creds"),
                        ("lexiflow_standing_inputs", '[{"input_uri": "/srv/in.csv", "output_root": "/srv/out"}]')):
        Variable.set(name, value, overwrite=True)
    try:
        @flow
        def starts() -> dict:
            return {"roots": flows.settings.label_roots(None, None, None, None),
                    "standing": flows.settings.standing_inputs(), "secret": flows.settings.apply_storage_secret()}

        got = starts()
    finally:
        for name in ("lexiflow_data_root", "lexiflow_storage_secret", "lexiflow_standing_inputs"):
            Variable.unset(name)
    assert got["roots"] == ("/srv/d/lexiflow/store/bundle@production", "/srv/d/incoming/*.csv",
                            "/srv/d/labelled/nightly")
    assert got["standing"] == [{"input_uri": "/srv/in.csv", "output_root": "/srv/out"}]
    assert got["secret"] == ["s3"] and installed == [{"s3": {"key": "k", "secret": "s"}}]


def test_the_install_step_names_the_dependencies_and_keys_them(tmp_path):
    reqs = flows.worker_env.requirements(REPO / "pyproject.toml", ["sample"])
    assert "prefect==3.8.8" in reqs and any(r.startswith("torch") for r in reqs) and "jieba==0.42.1" in reqs
    assert not any(r.startswith("lexiflow") for r in reqs)  # the run's own code is the checkout
    with pytest.raises(ValueError, match="unknown extras"):
        flows.worker_env.requirements(REPO / "pyproject.toml", ["nope"])
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in ("pyproject.toml", "constraints.txt"):
        (copy / name).write_bytes((REPO / name).read_bytes())
    key = flows.worker_env.env_key(copy, ["sample"])
    assert key == flows.worker_env.env_key(REPO, ["sample"]) != flows.worker_env.env_key(copy, [])
    (copy / "constraints.txt").write_text("torch==2.13.0\n")
    assert flows.worker_env.env_key(copy, ["sample"]) != key  # a dependency change: a new directory


def _install_in_child(checkout: str, root: str, out: str) -> None:
    """One run's install step in its own process (as two flow runs on one worker), pip replaced by a slow fake."""
    import subprocess as sp
    import time

    def fake_pip(cmd, check):
        target = Path(cmd[cmd.index("--target") + 1])
        target.mkdir(parents=True)
        with open(Path(root) / "pip-calls.txt", "a") as f:
            f.write(f"{target.name}\n")
        time.sleep(1.0)  # a second run arrives while this one installs
        (target / "marker.py").write_text("VALUE = 1\n")

    sp.run = fake_pip
    res = flows.worker_env.install(checkout, extras="sample", root=root)
    import marker  # noqa: F401  (importable from the installed directory)

    Path(out).write_text(json.dumps(res))


def test_two_runs_on_one_worker_install_once_and_both_see_the_whole_directory(tmp_path, monkeypatch):
    ctx = multiprocessing.get_context("spawn")  # a fresh process each, as two flow runs are
    root = tmp_path / "envs"
    runs = [ctx.Process(target=_install_in_child, args=(str(REPO), str(root), str(tmp_path / f"out{i}.json")))
            for i in range(2)]
    for p in runs:
        p.start()
    for p in runs:
        p.join(60)
        assert p.exitcode == 0
    got = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert got[0] == got[1] and Path(got[0]["python_env"]).name == flows.worker_env.env_key(REPO, ["sample"])
    calls = (root / "pip-calls.txt").read_text().split()
    assert len(calls) == 1 and ".tmp-" in calls[0]  # one install, into a private directory, then renamed
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [got[0]["python_env"].rsplit("/", 1)[1]]
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    flows.worker_env.install(str(REPO), extras="sample", root=str(root))  # a third run: nothing to install
    assert (root / "pip-calls.txt").read_text().split() == calls
    assert got[0]["python_env"] in sys.path and str(REPO) in sys.path
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(REPO), got[0]["python_env"], "/elsewhere"]
