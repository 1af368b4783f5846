"""Shared by bench_prepare_memory.py and bench_dask.py: a Prefect server for the whole run, and
one `lexiflow run prepare` per fresh child process with its exact peak RSS."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LEXIFLOW = str(Path(sys.executable).with_name("lexiflow"))
BASE_ENV = {
    "PYTHONHASHSEED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": "false",
}

# A small wrapper per run makes ru_maxrss exact: a child spawned (vfork+exec) straight from this
# process would inherit this process's own high-water RSS (e.g. after build_sample) as a floor.
WRAPPER = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(rc)"
)


@contextlib.contextmanager
def prefect_server(api_url: str | None, home: Path):
    """Yield an API URL: the given one, or a server started here (and stopped on exit)."""
    if api_url:
        yield api_url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **BASE_ENV, "PREFECT_HOME": str(home)}
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    try:
        for _ in range(240):
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"prefect server exited; see {home / 'server.log'}")
            time.sleep(0.5)
        else:
            raise RuntimeError("prefect server did not become healthy in 120 s")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)  # the server's own process group (started above)
        proc.wait(timeout=30)
        log.close()


def run_prepare(
    api_url: str, home: Path, store: Path, corpus_glob: str, embeddings: str, sets: list[str]
) -> tuple[float, int, str]:
    """One prepare run in a fresh child; returns (wall seconds, peak RSS bytes, last stdout line)."""
    cmd = [LEXIFLOW, "run", "prepare", "--config", str(ROOT / "configs" / "demo.yaml")]
    inputs = [f"store_uri={store}", f"prepare.corpus_uri={corpus_glob}", f"prepare.embeddings_uri={embeddings}",
              "progress=false"]
    for s in [*inputs, *sets]:
        cmd += ["--set", s]
    env = {**os.environ, **BASE_ENV, "PREFECT_HOME": str(home), "PREFECT_API_URL": api_url}
    out_path, rss_path = store.with_suffix(".log"), store.with_suffix(".maxrss")
    with open(out_path, "wb") as out:
        t0 = time.perf_counter()
        rc = subprocess.call(
            [sys.executable, "-c", WRAPPER, str(rss_path), *cmd],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        wall = time.perf_counter() - t0
    text = out_path.read_text(encoding="utf-8", errors="replace")
    if rc != 0:
        raise RuntimeError(f"prepare failed (rc={rc}):\n{text[-3000:]}")
    last = text.strip().splitlines()[-1]
    json.loads(last)  # the final ArtifactRef
    return wall, int(rss_path.read_text()) * 1024, last


def add_common_args(ap, repeats: int) -> None:
    """Arguments both prepare benchmarks take."""
    ap.add_argument("--sample", type=Path, help="existing `lexiflow sample` output dir (default: build one)")
    ap.add_argument("--api-url", help="use this Prefect API instead of starting a server")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (stores, logs)")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured runs first")


@contextlib.contextmanager
def bench_session(args, prefix: str) -> Iterator[tuple[Path, Path, Path, str]]:
    """``(work dir, sample dir, Prefect home, API URL)``: a temp dir holding the sample inputs and the
    stores, and one Prefect server for the whole benchmark; the dir is removed on exit unless --keep."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        sample = sample_dir(args.sample, work)
        home = work / "prefect_home"
        home.mkdir()
        with prefect_server(args.api_url, home) as api:
            yield work, sample, home, api
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def warm_up(args, api: str, home: Path, work: Path, corpus: str, embeddings: str, sets: list[str]) -> None:
    """``--warmup`` unmeasured runs: the first run after the server starts is slower."""
    for w in range(args.warmup):
        run_prepare(api, home, work / f"store_warmup_{w}", corpus, embeddings, sets)


def sample_dir(given: Path | None, work: Path) -> Path:
    """The sample inputs: the given directory, or a fresh build under ``work``."""
    if given is not None:
        return given
    from tasks.prepare.sample import build_sample

    build_sample(work / "sample", progress=False)
    return work / "sample"
