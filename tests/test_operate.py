"""Operated as users do, on a real Prefect server: two runs that overlap on one store, a run killed while
another waits for it, and the Dask runner configured for the pipeline (shard tasks really ran on the cluster)."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from storage.artifacts import ArtifactStore
from tests.conftest import tiny_config, tiny_config_data

pytestmark = pytest.mark.flow
REPO = Path(__file__).resolve().parents[1]
STAGES = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon"]
FAST_LEASE = {"lease_heartbeat_s": 0.5, "lease_stale_after_s": 30, "lease_poll_s": 0.2}


def _data_digests(store_dir: str) -> dict[str, str]:
    """sha256 of every committed data file, keyed stage/file (manifests aside: they carry created_at)."""
    st = ArtifactStore(store_dir)
    out = {}
    for stage in STAGES:
        for version in st.versions(stage):
            art = st.open(stage, version)
            for f in art.manifest.files:
                out[f"{stage}/{version}/{f.path}"] = f.sha256
                assert hashlib.sha256(art.read_verified(f.path)).hexdigest() == f.sha256
    return out


@pytest.fixture(scope="module")
def reference(prefect_server, tiny_inputs, tmp_path_factory):
    """One uninterrupted prepare run, alone on its store."""
    from flows.prepare import prepare_flow

    store = str(tmp_path_factory.mktemp("reference") / "store")
    ref = prepare_flow(tiny_config(tiny_inputs, store))
    return ref, _data_digests(store)


def _start(cfg_path: Path, env: dict, log: Path, **extra_env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lexiflow", "run", "prepare", "--config", str(cfg_path)],
        cwd=REPO, env={**env, **extra_env}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )


def _profile(tmp_path: Path, tiny_inputs, store: str) -> Path:
    path = tmp_path / "profile.yaml"
    data = tiny_config_data(tiny_inputs, store)
    data["runner"] = {**data["runner"], **FAST_LEASE}
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def _env(prefect_server: str) -> dict:
    return {**os.environ, "PREFECT_API_URL": prefect_server, "PYTHONHASHSEED": "0",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _stage_states(flow_run_ids: list[str]) -> dict[str, list[str]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids)))
    out: dict[str, list[str]] = {}
    for r in runs:
        if r.name in STAGES:
            out.setdefault(r.name, []).append(r.state.name)
    return {k: sorted(v) for k, v in out.items()}


def _prepare_runs_since(t0) -> list:
    """The ``prepare`` flow runs that started after ``t0`` (a datetime)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterStartTime

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["prepare"])),
                                     flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=t0)))


def test_two_runs_started_together_on_one_empty_store(reference, prefect_server, tiny_inputs, tmp_path):
    ref, digests = reference
    store = str(tmp_path / "shared")
    cfg = _profile(tmp_path, tiny_inputs, store)
    env = _env(prefect_server)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    t0 = datetime.datetime.now(datetime.timezone.utc)
    procs = [_start(cfg, env, log) for log in logs]
    codes = [p.wait(timeout=600) for p in procs]
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], texts
    for text in texts:
        assert json.loads(text.strip().splitlines()[-1]) == json.loads(ref.to_json()) | {
            "uri": f"{store}/lexicon/{ref.version}"}
        assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    assert _data_digests(store) == digests  # the same versions and the same bytes as a run alone
    assert ArtifactStore(store).garbage("lexicon") == []
    # every stage was built by one run and adopted by the other (which waited for it), never built twice
    runs = _prepare_runs_since(t0)
    assert len(runs) == 2 and all(r.state.is_completed() for r in runs), [(r.name, r.state) for r in runs]
    states = _stage_states([str(r.id) for r in runs])
    assert states == {s: ["Cached", "Completed"] for s in STAGES}, states


def test_a_killed_run_does_not_harm_the_run_waiting_for_it(reference, prefect_server, tiny_inputs, tmp_path):
    ref, digests = reference
    store = str(tmp_path / "shared")
    cfg = _profile(tmp_path, tiny_inputs, store)
    env = _env(prefect_server)
    marker = tmp_path / "paused"
    victim = _start(cfg, env, tmp_path / "victim.log", LEXIFLOW_PAUSE_IN="lexicon",
                    LEXIFLOW_PAUSE_MARKER=str(marker))
    deadline = time.time() + 300
    while not marker.exists():  # the victim holds the lexicon lease, mid-stage
        assert victim.poll() is None and time.time() < deadline, (tmp_path / "victim.log").read_text()[-3000:]
        time.sleep(0.2)
    waiter = _start(cfg, env, tmp_path / "waiter.log")
    time.sleep(8)  # the waiter reaches lexicon and waits for the live owner
    assert waiter.poll() is None
    lexicon_dir = Path(store, "lexicon", ref.version)
    owner = json.loads((lexicon_dir / "_owner.json").read_text())
    assert owner["pid"] == victim.pid  # still the victim's: nobody took a live run's staging
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert waiter.wait(timeout=600) == 0, (tmp_path / "waiter.log").read_text()[-3000:]
    assert _data_digests(store) == digests
    later = _start(cfg, env, tmp_path / "later.log")  # and a later run finds everything committed
    assert later.wait(timeout=600) == 0
    assert _data_digests(store) == digests


@pytest.mark.heavy  # over a minute on 2 cores: make test-heavy and CI run it, make test does not
def test_dask_runner_runs_the_pipelines_shard_tasks_on_the_cluster(prefect_server, tiny_inputs, tmp_path):
    distributed = pytest.importorskip("distributed")
    pytest.importorskip("snownlp")
    from flows.config import PipelineConfig
    from flows.pipeline import pipeline_flow
    from tests.test_e2e import _tiny_pipeline_config, _tiny_reviews

    reviews = tmp_path / "reviews.csv"
    _tiny_reviews(reviews)
    store = str(tmp_path / "store")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None,
                                  processes=True) as cluster:
        data = _tiny_pipeline_config(tiny_inputs, store, str(reviews))
        data["runner"] = {"kind": "dask", "dask_address": cluster.scheduler_address}
        data["label"] = {}
        ref = pipeline_flow(PipelineConfig.model_validate(data))
        # what the scheduler itself computed (tasks that reached memory on a worker), by function name
        done = {name: tp.state_counts.get("memory", 0) for name, tp in cluster.scheduler.task_prefixes.items()}
    assert ArtifactStore(store).versions("bundle") == [ref.version]
    shard_fns = {"clean_file_task": 3, "number_shard_task": 1, "count_shard_task": 1, "match_shard_task": 1,
                 "finalize_shard_task": 1}  # at least: 3 input files; >= 1 shard for the others
    assert all(done.get(fn, 0) >= n for fn, n in shard_fns.items()), done


def test_transient_failures_are_retried_for_shards_and_stages(prefect_server, tmp_path):
    """A shard task and a stage that each fail once (a transient store error) complete on their retry."""
    from prefect import flow

    from flows.runtime import PrefectRuntime
    from tasks.common.context import RunOptions
    from tasks.common.stage import Stage, StageResult, run_stage

    failed = tmp_path / "failed"
    failed.mkdir()

    def shard(i: int) -> int:  # a Prefect task of the run (the runtime makes it one)
        if i == 1 and not (failed / "shard").exists():
            (failed / "shard").touch()
            raise OSError("transient: connection reset by peer")
        return i * 10

    def build(ctx):
        if not (failed / "stage").exists():
            (failed / "stage").touch()
            ctx.writer.write_bytes("half.bin", b"the first attempt dies here")
            raise OSError("transient: the object store went away")
        got = ctx.map(shard, [{"i": i} for i in range(3)], name="demo")
        ctx.writer.write_bytes("out.json", json.dumps(got).encode())
        return StageResult(stats={"in": 3, "out": 3, "rejected": {}})

    @flow
    def demo_flow(store_uri: str):
        rt = PrefectRuntime(RunOptions(shard_retries=1, stage_retries=1, retry_delay_s=0))
        return run_stage(rt, ArtifactStore(store_uri), Stage("demo", "d-1", None, (), build), None)

    store = str(tmp_path / "store")
    ref = demo_flow(store)
    art = ArtifactStore(store).open("demo", ref.version)
    assert json.loads(art.read_verified("out.json")) == [0, 10, 20]
    assert [f.path for f in art.manifest.files] == ["out.json"]  # the failed attempt's file did not survive
    assert (failed / "shard").exists() and (failed / "stage").exists()


@pytest.mark.slow
def test_dask_workers_start_no_prefect_server_of_their_own(reference, tiny_inputs, tmp_path, request):
    """``prepare`` on a 4-worker LocalCluster from a process with no Prefect API configured (no
    ``PREFECT_API_URL``, an empty ``PREFECT_HOME``): the flow starts its one temporary server and no worker
    starts another (each did with prefect-dask, and the run died); the bytes are the thread runner's.

    About 35-50 s on 2 cores (the temporary server, 4 worker processes), so it runs only when asked for
    (``-m slow``); tests/test_dask_runner.py checks the same property on the session server in seconds."""
    markexpr = request.config.option.markexpr or ""
    if "slow" not in markexpr or "not slow" in markexpr:
        pytest.skip("slow (a subprocess with its own temporary Prefect server): run with -m slow")
    pytest.importorskip("distributed")
    ref, digests = reference
    store = str(tmp_path / "store")
    path = tmp_path / "profile.yaml"
    data = tiny_config_data(tiny_inputs, store)
    data["runner"] = {"kind": "dask", "dask_workers": 4, "dask_threads_per_worker": 1}
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect_home"), PREFECT_LOGGING_LEVEL="INFO", PYTHONHASHSEED="0",
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "run.log"
    proc = _start(path, env, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert out.count("Starting temporary server") == 1, out[-3000:]  # the flow's own, in this process
    assert "on 4 Dask workers" in out  # the shard maps really ran on the cluster
    assert _data_digests(store) == digests
