"""No secret at rest: an input URL's userinfo and query string (a presigned URL's signature, a token) never reach
a file a run writes, its stdout/stderr, a manifest, a Prefect artifact or a log line; row ids of URLs with a query
string carry a digest of the whole URL instead, and plain paths keep theirs."""

from __future__ import annotations

import functools
import http.server
import json
import threading
import uuid
from pathlib import Path

import pytest

from storage.urls import public_url, scrub, url_digest
from tests.bundle_fixture import make_tiny_bundle
from tests.staging import begin
from tests.test_cli_errors import cli

SECRET = "SECRET123"
ROWS = "id,review\n1,这家酒店服务很好\n2,隔音太差了\n3,\n"  # row 3: an empty text, a reject (its source is shown)


def test_public_url_removes_userinfo_query_and_fragment_and_leaves_paths_alone():
    assert public_url(f"https://user:{SECRET}@h.example:8443/d/x.csv?X-Amz-Signature={SECRET}&token={SECRET}#f") \
        == "https://h.example:8443/d/x.csv"
    assert public_url(f"s3://bucket/k/x.parquet?versionId={SECRET}") == "s3://bucket/k/x.parquet"
    assert public_url(f"tar://a/b.txt::https://u:{SECRET}@h/x.tar.gz?sig={SECRET}") == "tar://a/b.txt::https://h/x.tar.gz"
    assert public_url(f"http://[::1]:8000/x.csv?t={SECRET}") == "http://[::1]:8000/x.csv"
    for same in ("/data/in?x.csv", "rel/a.csv", "file:///data/a?b.csv", "s3://bucket/k/x.csv", "memory://m/x.csv",
                 "https://h/x.csv", "C:/data/x.csv", "*.csv"):
        assert public_url(same) == same
    assert scrub({"a": [f"http://u:{SECRET}@h/x"], "n": 3, "t": (f"gs://b/x?{SECRET}",)}) == \
        {"a": ["http://h/x"], "n": 3, "t": ["gs://b/x"]}
    assert url_digest("x") == "2d711642b726" and url_digest("x") != url_digest("x?a")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A loopback HTTP server over a directory (it ignores credentials and query strings, as object stores'
    presigned URLs are served)."""
    root = tmp_path_factory.mktemp("www")
    (root / "reviews.csv").write_text(ROWS, encoding="utf-8")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # the server's own access log is not the run's output
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _secret_url(server: str, name: str = "reviews.csv") -> str:
    return f"http://user:{SECRET}@{server}/{name}?X-Amz-Signature={SECRET}&token={SECRET}"


def _scan(root: Path) -> list[str]:
    """Every file under ``root`` whose bytes hold the secret (Parquet included: its strings are stored plain)."""
    return [str(p) for p in root.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return make_tiny_bundle(str(tmp_path_factory.mktemp("store")))


def test_label_from_a_presigned_url_stores_no_secret(server, bundle, tmp_path):
    import pyarrow.parquet as pq

    url = _secret_url(server)
    out = tmp_path / "out"
    res = cli("label", "--bundle", bundle, "--input", url, "--output", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert SECRET not in res.stdout + res.stderr
    written = sorted(p.name for p in out.iterdir())
    assert {"_manifest.json", "_run.json", "part-00000.parquet", "rejected-00000.parquet"} <= set(written)
    assert _scan(out) == []
    name = f"reviews.csv#{url_digest(url)}"  # which URL it was: a digest of the whole URL, not its secret
    assert pq.read_table(out / "part-00000.parquet").column("row_id").to_pylist() == [f"{name}:0", f"{name}:1"]
    assert pq.read_table(out / "rejected-00000.parquet").column("source").to_pylist() == [name]
    # the same file by a plain URL keeps today's name (no digest); a mistake about a secret-bearing input names
    # the file without its secret
    from tasks.common.table import expand_inputs

    assert [s.name for s in expand_inputs(f"http://{server}/reviews.csv")] == ["reviews.csv"]
    with pytest.raises(FileNotFoundError) as e:
        expand_inputs(_secret_url(server, "gone.csv"))
    assert f"http://{server}/gone.csv" in str(e.value) and SECRET not in str(e.value)


def test_a_manifest_keeps_no_secret_and_the_version_is_unchanged(tmp_path):
    from storage.artifacts import ArtifactRef, ArtifactStore, compute_version

    url = f"https://user:{SECRET}@h.example/corpus.jsonl?token={SECRET}"
    config = {"corpus_uri": url, "inputs": [{"uri": url, "name": "corpus.jsonl", "size": 3, "sha256": "ab"}]}
    parent = ArtifactRef(stage="clean", version="v0", uri=f"s3://b/store/clean/v0?X-Amz-Signature={SECRET}")
    version = compute_version("numbers", "t", config, [parent])
    assert version == compute_version("numbers", "t", scrub(config), [parent])  # a digest, not the URL, counts
    store = ArtifactStore(str(tmp_path / "store"))
    w = begin(store, "numbers", version)
    w.write_bytes("x.txt", b"x")
    art = w.commit(code_version="t", config=config, parents=[parent], stats={"in": 1, "out": 1})
    assert _scan(tmp_path) == []
    m = json.loads((Path(art.path) / "_manifest.json").read_text())
    assert m["config"]["corpus_uri"] == "https://h.example/corpus.jsonl"
    assert m["parents"][0]["uri"] == "s3://b/store/clean/v0" and m["version"] == version


@pytest.mark.flow
def test_label_flow_artifacts_and_logs_hold_no_secret(prefect_server, server, bundle, tmp_path):
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId

    from flows.label import label_flow

    out = tmp_path / f"out-{uuid.uuid4().hex[:6]}"
    state = label_flow(bundle, _secret_url(server), str(out), return_state=True)
    assert state.is_completed() and _scan(tmp_path) == []
    run_id = state.state_details.flow_run_id

    async def read():
        async with get_client() as c:
            arts = await c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
                any_=[run_id])))
            logs = await c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            return arts, logs

    arts, logs = asyncio.run(read())
    assert "label" in {a.key for a in arts}
    for a in arts:
        assert SECRET not in json.dumps(a.data, default=str) + str(a.description), a.key
    for entry in logs:
        assert SECRET not in entry.message


def test_error_lines_and_failed_run_logs_show_urls_without_their_secret():
    import logging

    from lexiflow.cli.base import _quiet_user_errors, error_line

    url = f"https://user:{SECRET}@h.example/x.csv?token={SECRET}"
    assert error_line(ValueError(f"{url}: line 1: bad header")) == "https://h.example/x.csv: line 1: bad header"
    record = logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "failed: %s", (ValueError(url),), None)
    assert _quiet_user_errors(record) and record.getMessage() == "failed: https://h.example/x.csv"
