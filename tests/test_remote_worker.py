"""A worker as one on another machine runs it: a real ``prefect server start``, ``prefect deploy --all`` from the
shipped prefect.yaml, and a worker started in an empty directory from a fresh virtual environment that holds only
Prefect. Each run's pull steps clone the code from a bare git repository of this checkout's HEAD (a ``file://``
URL) and install lexiflow's dependencies for the worker's Python (flows/worker_env.py; torch from the CPU wheel the
constraints pin); ``pipeline-demo`` and ``label-demo`` complete, and their run pages hold the stages' logs and the
monitoring report. What it runs is the committed HEAD, not the working tree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.prefect_server import BIN, REPO, prefect_server, run_ok

# pipeline-demo at test size: a few pretraining steps, one epoch on a slice of the reviews (the deployment's own
# overrides come first; these go after them)
SHRINK = ["pretrain.steps=12", "pretrain.warmup_steps=2", "pretrain.eval_every=6", "pretrain.checkpoint_every=12",
          "pretrain.log_every=4", "finetune.max_epochs=1", "finetune.max_train_rows=600",
          "finetune.max_eval_rows=200"]


def _fresh_prefect_venv(path: Path) -> Path:
    """A virtual environment holding only Prefect (and the FastAPI it needs); its ``bin`` directory."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", "prefect==3.8.8", "fastapi<0.151"],
                   check=True, timeout=600, capture_output=True)
    return path / "bin"


def _bare_repository(path: Path) -> str:
    """A bare repository holding this checkout's HEAD as branch ``main``; its ``file://`` URL."""
    subprocess.run(["git", "init", "-q", "--bare", str(path)], check=True)
    subprocess.run(["git", "-C", str(REPO), "push", "-q", str(path), "HEAD:refs/heads/main"], check=True,
                   timeout=120)
    return f"file://{path}"


def _run_id(created: str) -> str:
    [run_id] = set(re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", created))
    return run_id


def _wait_final(client, run_id: str, within_s: float, worker_log: Path):
    """The flow run once its state is final (polled), failing with the worker's log when it is not in time."""
    deadline = time.monotonic() + within_s
    while True:
        run = client.read_flow_run(run_id)
        if run.state is not None and run.state.is_final():
            return run
        assert time.monotonic() < deadline, f"{run.name} not done: {run.state}\n{worker_log.read_text()[-4000:]}"
        time.sleep(2)


def _with_subflows(client, run_id) -> list:
    """The ids of a flow run and its subflow runs, at any depth."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    ids, todo = [], [run_id]
    while todo:
        ids += todo
        todo = [r.id for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=todo)))]
    return ids


def _run_page(client, run_id) -> tuple[list[str], set[str]]:
    """What the run's page and its subflows' pages hold: INFO log lines, artifact keys."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    ids = _with_subflows(client, run_id)
    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
    arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids)))
    return [e.message for e in logs if e.level == 20], {a.key for a in arts if a.key}


@pytest.mark.heavy  # minutes on 2 cores (a fresh venv, the dependencies installed, the demo at test size)
def test_a_worker_elsewhere_clones_installs_and_runs_the_demo_deployments(tmp_path):
    pytest.importorskip("snownlp")
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("needs a git checkout: the worker clones this checkout's HEAD")
    started = time.monotonic()
    home = tmp_path / "prefect_home"
    home.mkdir()
    with ThreadPoolExecutor(max_workers=1) as pool:
        worker_bin = pool.submit(_fresh_prefect_venv, tmp_path / "worker-venv")  # beside the server's start
        repository = _bare_repository(tmp_path / "lexiflow.git")
        # the scheduler off: only the runs this test starts (the demo deployments' crons would add their own)
        with prefect_server(home, settings={"PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false"}) as env:
            prefect = str(BIN / "prefect")
            demo_root = tmp_path / "demo"
            run_ok(env, prefect, "work-pool", "create", "lexiflow-process", "--type", "process")
            for name, value in (("lexiflow_repository", repository), ("lexiflow_git_branch", "main"),
                                ("lexiflow_demo_root", str(demo_root))):
                run_ok(env, prefect, "variable", "set", name, value)
            run_ok(env, prefect, "--no-prompt", "deploy", "--all")  # the shipped prefect.yaml, as it is

            worker_dir = tmp_path / "worker"  # empty: no checkout, no lexiflow, Prefect only on the PATH
            worker_dir.mkdir()
            keep = ("HOME", "LANG", "TMPDIR", "PIP_FIND_LINKS", "PIP_CERT", "PIP_DEFAULT_TIMEOUT")
            worker_env = {k: os.environ[k] for k in keep if k in os.environ}
            worker_env.update({
                "PATH": f"{worker_bin.result()}:/usr/bin:/bin", "PREFECT_API_URL": env["PREFECT_API_URL"],
                "PREFECT_HOME": str(tmp_path / "worker_home"), "PREFECT_LOGGING_LEVEL": "WARNING",
                "LEXIFLOW_ENVS": str(tmp_path / "envs"),
            })
            worker_log = tmp_path / "worker.log"
            with open(worker_log, "wb") as log:
                worker = subprocess.Popen([str(worker_bin.result() / "prefect"), "worker", "start", "--pool",
                                           "lexiflow-process"], cwd=worker_dir, env=worker_env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            try:
                from prefect.client.orchestration import SyncPrefectClient

                pipeline_id = _run_id(run_ok(env, prefect, "deployment", "run", "demo-pipeline/pipeline-demo",
                                             "--param", f"overrides={json.dumps(SHRINK)}").stdout)
                with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
                    pipeline = _wait_final(client, pipeline_id, 420, worker_log)
                    assert pipeline.state.is_completed(), f"{pipeline.state}\n{worker_log.read_text()[-4000:]}"
                label_id = _run_id(run_ok(env, prefect, "deployment", "run", "demo-label/label-demo").stdout)
                with SyncPrefectClient(env["PREFECT_API_URL"]) as client:
                    labelled = _wait_final(client, label_id, 240, worker_log)
                    assert labelled.state.is_completed(), f"{labelled.state}\n{worker_log.read_text()[-4000:]}"
                    pipeline_logs, pipeline_keys = _run_page(client, pipeline_id)
                    label_logs, label_keys = _run_page(client, label_id)
            finally:
                os.killpg(worker.pid, 15)
                worker.wait(timeout=30)

    # the code came from the bare repository and the dependencies from the install step, not from this process
    assert any("git_clone" in m for m in pipeline_logs) and any("install" in m for m in pipeline_logs)
    assert len([p for p in (tmp_path / "envs").iterdir() if p.is_dir()]) == 1  # one install, shared by both runs
    stages = ("clean", "vocab", "lexicon", "pretrain", "finetune", "bundle")
    assert all(any(s in m for m in pipeline_logs) for s in stages), pipeline_logs[:40]
    assert {"run-config", "pretrain", "finetune", "bundle", "label", "label-monitor",
            "label-monitor-report"} <= pipeline_keys, pipeline_keys
    assert {"label", "label-monitor", "label-monitor-report"} <= label_keys, label_keys
    assert any("sample" in m for m in pipeline_logs)
    assert list((demo_root / "labelled").iterdir()), "label-demo wrote its output under the demo root"
    print(f"remote worker test: {time.monotonic() - started:.0f} s")  # pragma: no mutate
