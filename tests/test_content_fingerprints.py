"""An input is identified by its content, never by its size: a tar member, a file served over plain HTTP (no
digest, no ETag) and a memory:// file replaced by other bytes of the same size give a new version. HTTP digests
are cached in ``<store>/_fingerprints`` by URL + size + Last-Modified/ETag, and hashed again on every run when the
server says neither."""

from __future__ import annotations

import email.utils
import http.server
import io
import os
import tarfile
import threading
import time
import uuid
from functools import partial
from pathlib import Path

import fsspec
import pytest

from storage.artifacts import compute_version
from storage.fingerprints import FingerprintCache
from tasks.common.table import expand_inputs
from tasks.label.config import LabelOptions
from tasks.label.run import label_config

OLD = "id,review\n1,这家酒店很好\n"
NEW = "id,review\n1,这家酒店很差\n"  # the same number of bytes
assert len(OLD.encode()) == len(NEW.encode()) and OLD != NEW


def _version(uri: str, cache: FingerprintCache | None = None) -> str:
    """The label version's input part, as ``tasks.label.run.open_run`` computes it (bundle and numerics aside),
    the inputs fingerprinted through ``cache`` (a run's fingerprint cache) when given."""
    return compute_version("label", "t", label_config(expand_inputs(uri), LabelOptions(text_column="review"), cache),
                           [])


def _tar(path: Path, text: str) -> None:
    data = text.encode()
    with tarfile.open(path, "w") as t:
        member = tarfile.TarInfo("reviews.csv")
        member.size, member.mtime = len(data), 0  # the same header either time: only the bytes differ
        t.addfile(member, io.BytesIO(data))


def test_a_tar_member_replaced_by_same_size_content_is_a_new_version(tmp_path):
    archive = tmp_path / "in.tar"
    _tar(archive, OLD)
    uri = f"tar://reviews.csv::{archive}"
    before = _version(uri)
    _tar(archive, NEW)
    fsspec.AbstractFileSystem.clear_instance_cache()  # as a new process would
    assert _version(uri) != before
    _tar(archive, OLD)
    fsspec.AbstractFileSystem.clear_instance_cache()
    assert _version(uri) == before  # the same bytes, the same version


def test_a_memory_file_replaced_by_same_size_content_is_a_new_version():
    uri = f"memory://fp-{uuid.uuid4().hex[:8]}/reviews.csv"
    fs, path = fsspec.core.url_to_fs(uri)
    fs.pipe(path, OLD.encode())
    before = _version(uri)
    fs.pipe(path, NEW.encode())
    assert _version(uri) != before


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a directory; ``last_modified=False`` drops the Last-Modified header (a server that says nothing)."""

    last_modified = True

    def send_header(self, keyword, value):
        if keyword == "Last-Modified" and not self.last_modified:
            return
        super().send_header(keyword, value)

    def log_message(self, *args):
        pass


@pytest.fixture()
def served(tmp_path):
    """(directory, base URL, handler class) of a loopback HTTP server."""
    root = tmp_path / "www"
    root.mkdir()
    handler = type("H", (_Handler,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def _write(path: Path, text: str, age_s: float) -> None:
    path.write_text(text, encoding="utf-8")
    past = time.time() - age_s
    os.utime(path, (past, past))


def test_an_http_file_replaced_by_same_size_content_is_a_new_version(served, tmp_path):
    root, base, _ = served
    _write(root / "reviews.csv", OLD, age_s=3600)
    uri = f"{base}/reviews.csv"
    before = _version(uri)
    _write(root / "reviews.csv", NEW, age_s=1800)
    assert _version(uri) != before  # no cache: hashed


def test_http_digests_are_cached_by_url_size_and_last_modified(served, tmp_path):
    root, base, _ = served
    store = str(tmp_path / "store")
    _write(root / "reviews.csv", OLD, age_s=3600)
    uri = f"{base}/reviews.csv?X-Amz-Signature=SECRET123&token=SECRET456"
    cache = FingerprintCache(store)
    before = _version(uri, cache)
    assert cache.stats.hashed == 1 and cache.stats.hits == 0
    assert _version(uri, cache) == before and cache.stats.hits == 1  # unchanged: not downloaded again
    _write(root / "reviews.csv", NEW, age_s=1800)  # same size, another Last-Modified
    after = _version(uri, cache)
    assert after != before and cache.stats.hashed == 2
    [entry] = list(Path(store, "_fingerprints").iterdir())
    text = entry.read_text()
    assert "SECRET" not in text and f"{base}/reviews.csv" in text  # no query string at rest


def test_a_server_that_says_nothing_is_hashed_every_run(served, tmp_path):
    root, base, handler = served
    handler.last_modified = False
    store = tmp_path / "store"
    _write(root / "reviews.csv", OLD, age_s=3600)
    uri = f"{base}/reviews.csv"
    cache = FingerprintCache(str(store))
    before = _version(uri, cache)
    assert _version(uri, cache) == before
    _write(root / "reviews.csv", NEW, age_s=3600)
    assert _version(uri, cache) != before
    assert cache.stats.hashed == 3 and cache.stats.hits == 0
    assert not (store / "_fingerprints").exists() or not list((store / "_fingerprints").iterdir())


def test_a_fresh_last_modified_is_not_trusted(served, tmp_path):
    """Last-Modified has whole seconds: a same-size rewrite within the second would keep it, so an entry hashed
    less than ``RACY_S`` after it is never used."""
    root, base, _ = served
    (root / "reviews.csv").write_text(OLD, encoding="utf-8")
    now = email.utils.formatdate(time.time(), usegmt=True)
    cache = FingerprintCache(str(tmp_path / "store"))
    first = _version(f"{base}/reviews.csv", cache)
    (root / "reviews.csv").write_text(NEW, encoding="utf-8")
    os.utime(root / "reviews.csv", (email.utils.parsedate_to_datetime(now).timestamp(),) * 2)
    assert _version(f"{base}/reviews.csv", cache) != first
    assert cache.stats.hits == 0


def test_label_output_root_relabels_a_replaced_http_input(served, tmp_path):
    """The finding end to end: the next ``--output-root`` run over a same-size replacement served without a digest
    gave the old version and the old probabilities; it labels the new text into a new version."""
    import pyarrow.parquet as pq

    from tasks.inference.bundle import load_bundle
    from tasks.label.run import label_stream
    from tests.bundle_fixture import make_tiny_bundle

    bundle = load_bundle(make_tiny_bundle(str(tmp_path / "store")))
    root, base, _ = served
    options = LabelOptions(text_column="review", id_column="id")
    out_root = str(tmp_path / "labelled")
    runs = []
    for text in (OLD, NEW):
        _write(root / "reviews.csv", text, age_s=3600)
        res = label_stream(bundle, f"{base}/reviews.csv", None, options, output_root=out_root, progress=False)
        runs.append((res["version"], res["cached"], pq.read_table(f"{res['uri']}/{res['parts'][0]}").to_pylist()))
    (v_old, _, rows_old), (v_new, cached, rows_new) = runs
    assert v_new != v_old and not cached
    assert [r["prob"] for r in rows_new] != [r["prob"] for r in rows_old]
