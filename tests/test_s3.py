"""Object stores for real: the prepare flow and the labeller against an S3-compatible server (moto, loopback).

Storage options (endpoint, credentials) reach every filesystem only through ``storage_options`` /
``--storage-options``; any S3 client that misses them is pointed at a dead loopback port
(``AWS_ENDPOINT_URL``), so nothing here can reach a real cloud endpoint.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import fsspec.config
import pytest

from storage.artifacts import MANIFEST, TMP_MARK, ArtifactStore, is_object_store, open_artifact
from storage.options import configure, env_name
from tests.conftest import abandon, free_port, tiny_config
from tests.staging import begin

pytest.importorskip("s3fs")
pytest.importorskip("moto")

pytestmark = pytest.mark.flow
REPO = Path(__file__).resolve().parents[1]
BUCKET = "lexiflow-test"
KEY, SECRET = "AKIDLEXIFLOWTEST", "s3cr3t-that-must-never-be-written"
STAGES = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon"]


def _restore(saved_conf: dict, saved_env: dict) -> None:
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved_conf)
    for var in set(os.environ) - set(saved_env):
        del os.environ[var]
    os.environ.update(saved_env)


def _drop_s3_defaults() -> None:
    """Forget every s3 default (fsspec conf, FSSPEC_S3* variables, cached S3 filesystems)."""
    import s3fs

    for proto in ("s3", "s3a"):
        fsspec.config.conf.pop(proto, None)
    for var in [v for v in os.environ if v.startswith("FSSPEC_S3")]:
        del os.environ[var]
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3(moto_server):
    """The session's moto S3 server (loopback), this module's bucket; the fsspec/environment defaults restored."""
    import s3fs

    endpoint = moto_server
    saved_conf, saved_env = copy.deepcopy(fsspec.config.conf), dict(os.environ)
    try:
        # a client without the storage options fails fast on a dead loopback port, never reaches AWS
        os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_MAX_ATTEMPTS": "1", "AWS_CONFIG_FILE": os.devnull,
                           "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
        _drop_s3_defaults()
        opts = {"endpoint_url": endpoint, "key": KEY, "secret": SECRET}
        fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
        fs.mkdir(BUCKET)
        yield {"endpoint": endpoint, "options": {"s3": opts}, "fs": fs}
    finally:
        _restore(saved_conf, saved_env)


@pytest.fixture()
def no_s3_defaults(s3):
    """A test that must install the options itself; the module's earlier state is restored afterwards."""
    saved_conf, saved_env = copy.deepcopy(fsspec.config.conf), dict(os.environ)
    _drop_s3_defaults()
    yield s3
    _restore(saved_conf, saved_env)


def _objects(fs, prefix: str) -> dict[str, tuple]:
    fs.invalidate_cache()
    return {k: (v["ETag"], v["LastModified"], v["size"]) for k, v in fs.find(prefix, detail=True).items()}


def _run(cfg):
    from flows.prepare import prepare_flow

    return prepare_flow(cfg)


@pytest.fixture(scope="module")
def prepared(s3, prefect_server, tiny_inputs, tmp_path_factory):
    """The prepare flow into a local store (thread runner), and into ``s3://`` with its shard tasks on a
    running Dask cluster (``runner.dask_address``) whose workers started with no S3 option: the options are
    only in the config, and the flow must get them to this process and to every worker."""
    from distributed import LocalCluster

    local = str(tmp_path_factory.mktemp("local_store"))
    local_ref = _run(tiny_config(tiny_inputs, local))
    _drop_s3_defaults()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        uri = f"s3://{BUCKET}/store"
        dask = {"kind": "dask", "dask_address": cluster.scheduler_address}
        cfg = tiny_config(tiny_inputs, uri, storage_options=s3["options"], runner=dask)
        assert "storage_options" not in cfg.model_dump() and SECRET not in repr(cfg)
        yield {"local": local, "uri": uri, "cfg": cfg, "local_ref": local_ref, "ref": _run(cfg)}


# ----------------------------------------------------------------------------- storage options


def test_configure_reaches_fsspec_child_processes_and_dask_workers(no_s3_defaults):
    from distributed import Client, LocalCluster

    endpoint = no_s3_defaults["endpoint"]
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:  # a worker started before the options, and one after
        configure({"s3": {"endpoint_url": endpoint, "key": KEY, "secret": SECRET, "client_kwargs": {"verify": False}}})
        cluster.scale(2)
        client.wait_for_workers(2, timeout=30)
        workers = client.run(_s3_defaults)
    assert list(workers.values()) == [[endpoint, KEY, {"verify": False}]] * 2
    assert _s3_defaults() == [endpoint, KEY, {"verify": False}]
    assert os.environ[env_name("s3", "endpoint_url")] == json.dumps(endpoint)
    code = "import json, fsspec; fs = fsspec.filesystem('s3'); print(json.dumps([fs.endpoint_url, fs.key]))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(child.stdout) == [endpoint, KEY]
    assert fsspec.core.url_to_fs(f"s3://{BUCKET}")[0].exists(BUCKET)  # really talks to the server
    for bad in ({"S3": {}}, {"s3": {"Key": "x"}}, {"s3": {"key": object()}}, {"s3": "endpoint"}):
        with pytest.raises(ValueError):
            configure(bad)


def _s3_defaults() -> list:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    return [fs.endpoint_url, fs.key, fs.client_kwargs]


def test_without_options_no_endpoint_is_reached(no_s3_defaults):
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.retries = 1
    with pytest.raises(Exception) as e:  # the dead loopback safety net: not AWS, not moto
        fs.ls(BUCKET)
    assert "127.0.0.1" in str(e.value)


# ----------------------------------------------------------------------------- commit protocol on S3


def test_commit_uses_no_directories_no_rename_and_survives_a_lagging_listing(s3, monkeypatch):
    configure(s3["options"])
    store = ArtifactStore(f"s3://{BUCKET}/unit")
    assert is_object_store(store.fs)
    w = begin(store, "x", "v1")

    def forbidden(*a, **k):
        raise AssertionError("object stores have no directories and no rename")

    monkeypatch.setattr(store.fs, "makedirs", forbidden)
    monkeypatch.setattr(store.fs, "mv", forbidden)
    w.write_bytes("a.bin", b"a" * 10)
    w.write_bytes("sub/b.bin", b"b" * 20)
    other = store.attach("x", "v1")  # a map task's writer (in a real run: another process)
    other.write_bytes("shards/part-00000.parquet", b"p")
    assert not store.is_committed("x", "v1") and store.versions("x") == []
    with pytest.raises(FileNotFoundError):
        open_artifact(store.artifact_uri("x", "v1"))
    monkeypatch.setattr(store.fs, "find", lambda *a, **k: [])  # the store's listing has not caught up
    art = w.commit(code_version="t", config={}, parents=[], stats={"in": 1, "out": 1, "rejected": {}},
                   rows={"shards/part-00000.parquet": 1})
    monkeypatch.undo()
    assert [f.path for f in art.manifest.files] == ["a.bin", "shards/part-00000.parquet", "sub/b.bin"]
    assert art.manifest.file("sub/b.bin").sha256 == hashlib.sha256(b"b" * 20).hexdigest()
    keys = sorted(_objects(store.fs, f"{BUCKET}/unit/x/v1"))
    assert not [k for k in keys if TMP_MARK in k] and keys[-1].endswith("sub/b.bin")
    assert store.versions("x") == ["v1"] and open_artifact(art.ref).read_verified("a.bin") == b"a" * 10


class Killed(BaseException):
    """The process dying mid-call."""


def _killed(*args, **kwargs):
    raise Killed()


def test_crash_between_copy_and_delete_then_rerun(s3, monkeypatch):
    configure(s3["options"])
    store = ArtifactStore(f"s3://{BUCKET}/crash")
    w = begin(store, "x", "v1")
    w.write_bytes("a.bin", b"first")
    with monkeypatch.context() as m:  # killed after the copy, before the temp object is deleted
        m.setattr(store.fs, "rm_file", _killed)
        with pytest.raises(Killed):
            w.write_bytes("b.bin", b"second")
    left = sorted(_objects(store.fs, f"{BUCKET}/crash/x/v1"))
    assert any(TMP_MARK in k for k in left) and any(k.endswith("/b.bin") for k in left)
    abandon(w)  # the process dies
    assert store.versions("x") == [] and store.garbage("x") == [f"{BUCKET}/crash/x/v1"]
    w = begin(store, "x", "v1")  # the re-run: crash leftovers removed first
    assert list(_objects(store.fs, f"{BUCKET}/crash/x")) == [f"{BUCKET}/crash/x/v1/_owner.json"]
    w.write_bytes("b.bin", b"second")
    art = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0, "rejected": {}})
    assert [f.path for f in art.manifest.files] == ["b.bin"]


def test_a_commit_by_another_process_is_seen_despite_cached_listings(s3):
    configure(s3["options"])
    store = ArtifactStore(f"s3://{BUCKET}/peer")
    w = begin(store, "x", "v1")
    w.write_bytes("a.bin", b"a")
    abandon(w)
    store.fs.ls(store.artifact_path("x", "v1"))  # this process has listed the uncommitted directory
    assert store.versions("x") == [] and store.garbage("x")

    peer = ArtifactStore(store.uri)  # another process: its own filesystem instance and listing cache
    peer.fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert peer.fs is not store.fs
    peer.attach("x", "v1").commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0, "rejected": {}})
    assert store.is_committed("x", "v1") and store.versions("x") == ["v1"] and store.garbage("x") == []
    assert store.open("x", "v1").manifest.file("a.bin").bytes == 1


# ----------------------------------------------------------------------------- the prepare flow on S3


def test_prepare_on_s3_commits_every_stage_byte_identical_to_local(prepared, s3):
    fs, local = s3["fs"], ArtifactStore(prepared["local"])
    store = ArtifactStore(prepared["uri"])
    assert prepared["ref"].version == prepared["local_ref"].version
    assert prepared["ref"].uri == f"s3://{BUCKET}/store/lexicon/{prepared['ref'].version}"
    for stage in STAGES:
        (version,) = store.versions(stage)
        assert local.versions(stage) == [version] and store.garbage(stage) == []
        art, ref = store.open(stage, version), local.open(stage, version)
        assert art.manifest.stats == ref.manifest.stats and art.manifest.stats["in"] >= 1
        assert [f.model_dump() for f in art.manifest.files] == [f.model_dump() for f in ref.manifest.files]
        for f in art.manifest.files:
            data = fs.cat_file(f"{art.path}/{f.path}")
            assert hashlib.sha256(data).hexdigest() == f.sha256 and len(data) == f.bytes
            assert data == Path(ref.file_path(f.path)).read_bytes(), f"{stage}/{f.path}"
        keys = {k[len(art.path) + 1:] for k in _objects(fs, art.path)}
        assert keys == {f.path for f in art.manifest.files} | {MANIFEST}  # nothing else: no temp objects


def test_rerun_on_s3_is_all_cache_hits(prepared, s3):
    before = _objects(s3["fs"], f"{BUCKET}/store")
    time.sleep(1.1)  # S3 LastModified has 1 s resolution: a rewrite would show
    assert _run(prepared["cfg"]).version == prepared["ref"].version
    assert _objects(s3["fs"], f"{BUCKET}/store") == before


def test_lineage_cli_reads_the_s3_store_with_storage_options(prepared, no_s3_defaults):
    from typer.testing import CliRunner

    from lexiflow.cli import app

    res = CliRunner().invoke(app, ["lineage", prepared["ref"].uri,
                                   "--storage-options", json.dumps(no_s3_defaults["options"])])
    assert res.exit_code == 0, res.output
    assert {line.split()[0] for line in res.output.splitlines()} == set(STAGES)


# ----------------------------------------------------------------------------- labelling on S3


def test_label_on_s3_reconciles_and_matches_local(prefect_server, prepared, s3, tmp_path):
    from tasks.inference.bundle import load_bundle
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream
    from tests.bundle_fixture import make_tiny_bundle
    from tests.test_label import csv_text, digests, many_rows

    fs = s3["fs"]
    local_bundle = make_tiny_bundle(str(tmp_path / "bstore"))
    version = local_bundle.rsplit("/", 1)[1]
    fs.put(local_bundle, f"{BUCKET}/bstore/bundle/{version}", recursive=True)
    inp = tmp_path / "reviews.csv"
    inp.write_text(csv_text(many_rows(23) + [("blank", " "), ("", "无编号")]), encoding="utf-8")
    fs.put_file(str(inp), f"{BUCKET}/in/reviews.csv")
    opts = dict(id_column="id", shard_rows=10, batch_size=4)
    ref = label_stream(load_bundle(local_bundle), str(inp), str(tmp_path / "out"), LabelOptions(**opts),
                       progress=False, threads=1)

    out = f"s3://{BUCKET}/labelled/run1"
    args = [sys.executable, "-m", "lexiflow", "label", "--bundle", f"s3://{BUCKET}/bstore/bundle/{version}",
            "--input", f"s3://{BUCKET}/in/*.csv", "--output", out, "--text-column", "review", "--id-column", "id",
            "--shard-rows", "10", "--batch-size", "4", "--storage-options", json.dumps(s3["options"])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSSPEC_")}  # options only on the command line
    env.update(PREFECT_API_URL=prefect_server, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stats"] == ref["stats"] == {"in": 25, "out": 23, "rejected": {"empty_text": 1, "missing_id": 1}}
    configure(s3["options"])
    m = open_artifact(out).manifest
    assert m.stats == ref["stats"] and m.parents[0].uri.startswith("s3://")
    for f in m.files:
        assert hashlib.sha256(fs.cat_file(f"{BUCKET}/labelled/run1/{f.path}")).hexdigest() == f.sha256
    theirs, ours = digests(out), digests(str(tmp_path / "out"))
    shards = {k for k in ours if k.endswith(".parquet")}
    assert shards == {"part-00000.parquet", "part-00001.parquet", "part-00002.parquet", "rejected-00002.parquet"}
    assert {k: theirs[k] for k in shards} == {k: ours[k] for k in shards}
    assert set(theirs) == set(ours)  # _run.json + shards; no temp objects left


# ----------------------------------------------------------------------------- credentials


def test_credentials_never_written_or_sent_to_prefect(prepared, s3):
    fs = s3["fs"]
    written = [k for k in _objects(fs, BUCKET)]
    assert any(k.endswith(MANIFEST) for k in written)
    for k in written:
        blob = fs.cat_file(k)
        assert SECRET.encode() not in blob and KEY.encode() not in blob, k

    async def from_prefect() -> str:
        from prefect.client.orchestration import get_client

        async with get_client() as c:
            runs = await c.read_flow_runs()
            arts = await c.read_artifacts()
            logs = await c.read_logs()
        return json.dumps([[r.parameters for r in runs], [a.model_dump(mode="json") for a in arts],
                           [g.message for g in logs]], default=str)

    seen = asyncio.run(from_prefect())
    assert f"s3://{BUCKET}/store" in seen  # the runs are there, with their parameters
    assert SECRET not in seen and KEY not in seen
