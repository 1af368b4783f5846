"""A real ``prefect server start`` on loopback for end-to-end tests (no ephemeral shortcut)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prefect_server(home: Path, timeout: float = 120.0, port: int | None = None, ui: bool = False,
                   settings: dict[str, str] | None = None):
    """Start a server with its own PREFECT_HOME (SQLite), yield its env, stop it on exit. ``ui=True`` serves
    the UI too, pointed at this server's API (``PREFECT_UI_API_URL``); ``settings``: more of the server's
    environment (e.g. ``PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED=false``)."""
    port = port or _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "true" if ui else "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        **(settings or {}),
    }
    if ui:
        env["PREFECT_UI_API_URL"] = api
    bin_dir = Path(sys.executable).parent
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the environment's console scripts: prefect, lexiflow


def run_ok(env: dict, *cmd: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``cmd`` run in the checkout with ``env``; the test fails, with its output, unless it exits 0."""
    res = subprocess.run(list(cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def local_prefect_file(tmp_path: Path, spec: dict | None = None) -> Path:
    """``spec`` (default: prefect.yaml) written under ``tmp_path`` with the documented alternative pull step
    (:func:`flows.local_deploy.local_spec`: the worker's own checkout at ``$LEXIFLOW_HOME``) in place of the clone
    and install steps: the tests' workers run this checkout."""
    import yaml  # noqa: PLC0415  (only the deployment tests)

    from flows.local_deploy import local_spec  # noqa: PLC0415

    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(yaml.safe_dump(local_spec(spec), allow_unicode=True), encoding="utf-8")
    return prefect_file


@contextlib.contextmanager
def deployed(tmp_path: Path, spec: dict):
    """A fresh server (:func:`prefect_server`, its home under ``tmp_path``) with ``spec``, a prefect.yaml as a dict,
    deployed on it as ``prefect deploy --all`` does (its process work pool made first) with the local pull step
    (:func:`local_prefect_file`); yields the environment to run commands against it (``LEXIFLOW_HOME`` the
    checkout)."""
    prefect_file = local_prefect_file(tmp_path, spec)
    home = tmp_path / "prefect_home"
    home.mkdir()
    with prefect_server(home) as env:
        env = {**env, "LEXIFLOW_HOME": str(REPO), "PYTHONHASHSEED": "0"}
        run_ok(env, str(BIN / "prefect"), "work-pool", "create", "lexiflow-process", "--type", "process")
        run_ok(env, str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file))
        yield env


def triggered_runs(api_url: str, deployment: str, within_s: float = 90.0) -> list:
    """The flow runs of ``deployment`` once an automation has created at least one (polled every second), failing
    the test when none appears within ``within_s``."""
    from prefect.client.orchestration import SyncPrefectClient  # noqa: PLC0415  (Prefect: end-to-end tests only)
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName  # noqa: PLC0415

    named = DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
    deadline = time.monotonic() + within_s
    with SyncPrefectClient(api_url) as client:
        while not (runs := client.read_flow_runs(deployment_filter=named)):
            assert time.monotonic() < deadline, f"no {deployment} run was created for the event"
            time.sleep(1)
    return runs
