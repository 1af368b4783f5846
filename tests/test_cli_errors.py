"""The real ``lexiflow`` CLI in a subprocess: a user mistake is one ``error:`` line and exit 2, ``--debug`` shows
the traceback, ``--version`` prints the installed version."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest

from tests.bundle_fixture import make_tiny_bundle

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "lexiflow"
LEXIFLOW = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "lexiflow"]
ENV = {"PYTHONHASHSEED": "0", "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def cli(*args: str, api: str | None = None, module: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, **({"PREFECT_API_URL": api} if api else {})}
    cmd = [sys.executable, "-m", "lexiflow"] if module else LEXIFLOW
    return subprocess.run([*cmd, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def one_error(res: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, exactly one ``error:`` line on stderr (its last line) naming every one of ``names``."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and res.stderr.splitlines()[-1] == lines[0], res.stderr  # the last word on stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture()
def profile(tmp_path):
    def write(body: str | bytes, name: str = "profile.yaml") -> Path:
        p = tmp_path / name
        p.write_bytes(body if isinstance(body, bytes) else body.encode())
        return p

    return write


OK = "prepare:\n  corpus_uri: x.jsonl\n  embeddings_uri: y.txt\n"


def test_version_prints_the_distribution_version():
    res = cli("--version")
    assert res.returncode == 0 and res.stdout == f"lexiflow {metadata.version('lexiflow')}\n"
    assert cli("--version", module=True).stdout == res.stdout


def test_missing_and_unreadable_config_files(profile, tmp_path):
    missing = tmp_path / "nope.yaml"
    line = one_error(cli("run", "prepare", "--config", str(missing)), str(missing), "expected an existing file")
    assert line == f"error: config {missing}: No such file or directory (expected an existing file)"
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    one_error(cli("run", "prepare", "--config", str(folder)), str(folder), "expected a file, not a directory")
    one_error(cli("run", "prepare", "--config", str(profile(b"\xff\xfe junk"))), "profile.yaml", "not UTF-8")
    one_error(cli("run", "prepare", "--config", str(profile("a: [1\n"))), "profile.yaml", "expected ',' or ']'")
    if os.geteuid() != 0:  # root reads anything
        locked = profile(OK, "locked.yaml")
        locked.chmod(0)
        one_error(cli("run", "prepare", "--config", str(locked)), "locked.yaml", "expected a readable file")


def test_unknown_keys_and_bad_values(profile):
    p = profile(OK + "fo: 1\n")
    one_error(cli("run", "prepare", "--config", str(p)), str(p), "unknown top-level key(s) ['fo']", "known:")
    p = profile(OK + "  clean: {min_chars: 0, colour: red}\n")
    line = one_error(cli("run", "prepare", "--config", str(p)), str(p))
    assert line.endswith("prepare.clean.min_chars: Input should be greater than or equal to 1 (got 0); "
                         "prepare.clean.colour: unknown key")
    line = one_error(cli("run", "prepare", "--config", str(profile(OK)), "--set", "runner.kind=spark"), "runner.kind")
    assert "Input should be 'thread' or 'dask' (got 'spark')" in line
    one_error(cli("run", "prepare", "--set", "seed=1"), "config (no --config)",
              "prepare.corpus_uri: required key missing")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> str:
    return make_tiny_bundle(str(tmp_path_factory.mktemp("store")))


@pytest.mark.flow
def test_label_mistakes_inside_the_flow(prefect_server, bundle, tmp_path):
    data = tmp_path / "reviews.csv"
    data.write_text("id,review\n1,这家酒店服务很好\n2,隔音太差了\n", encoding="utf-8")
    missing = tmp_path / "none.csv"
    # integrity: a committed file edited afterwards
    tampered = tmp_path / "tampered"
    shutil.copytree(bundle, tampered)
    info = tampered / "bundle.json"
    info.write_text(info.read_text().replace('"max_len": 48', '"max_len": 47'))
    calls = {  # independent runs (each its own output), two at a time: most of each is the interpreter starting
        "missing": ("label", "--bundle", bundle, "--input", str(missing)),
        "column": ("label", "--bundle", bundle, "--input", str(data), "--text-column", "text"),
        "tampered": ("label", "--bundle", str(tampered), "--input", str(data)),
        # the same mistake with --debug: the traceback is shown (flow logs included)
        "debug": ("--debug", "label", "--bundle", str(tampered), "--input", str(data)),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {k: pool.submit(cli, *args, "--output", str(tmp_path / f"out-{k}"), api=prefect_server)
                for k, args in calls.items()}
        res = {k: run.result() for k, run in runs.items()}
    one_error(res["missing"], f"input {str(missing)!r}: no such file")
    line = one_error(res["column"], "reviews.csv")
    assert "text column 'text' not found; the file has columns ['id', 'review']" in line
    one_error(res["tampered"], f"{tampered}/bundle.json", "does not match manifest")
    debug = res["debug"]
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "IntegrityError" in debug.stderr
    assert not [line for line in debug.stderr.splitlines() if line.startswith("error:")]


def test_lineage_of_a_missing_artifact_and_debug(tmp_path):
    gone = tmp_path / "store" / "bundle" / "0123456789abcdef"
    line = one_error(cli("lineage", str(gone)), str(gone), "no _manifest.json", "not a committed artifact")
    assert cli("lineage", str(gone), module=True).stderr.splitlines() == [line]
    res = cli("--debug", "lineage", str(gone))
    assert res.returncode == 1 and "Traceback" in res.stderr and "FileNotFoundError" in res.stderr


def test_error_line_leaves_bugs_to_the_traceback():
    from lexiflow.cli.base import error_line

    assert error_line(RuntimeError("a bug")) is None and error_line(KeyError("x")) is None
    assert error_line(FileNotFoundError(2, "No such file or directory", "a.csv")) == \
        "a.csv: No such file or directory (expected an existing file)"
    e = ValueError("bad\nvalue   here")
    e.add_note("config p.yaml")
    assert error_line(e) == "config p.yaml: bad value here"
