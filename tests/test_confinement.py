"""What the store owns and nothing else: paths read from manifests, aliases and owner records are never followed
outside their stage directory; files lexiflow did not write are listed, never touched, never a traceback; a
paused writer keeps its staging; promotion events name the store one way; relabelling loads bundles from its
store only and escapes what it shows."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lexiflow.cli import app
from storage import aliases
from storage.artifacts import ArtifactStore, CorruptArtifact, artifact_in_store, canonical_store, open_artifact
from storage.lease import OWNER, LeaseSettings, process_start, read_owner
from storage.lifecycle import gc, listing, stages
from tests.conftest import abandon
from tests.staging import begin

FAST = LeaseSettings(heartbeat_s=0.05, stale_after_s=0.5, poll_s=0.02)
OK = {"in": 1, "out": 1, "rejected": {}}
REPO = Path(__file__).resolve().parents[1]


def _commit(store, stage, version, parents=(), ordered=False):
    w = begin(store, stage, version, FAST)
    w.write_bytes("data.bin", b"x" * 10)
    art = w.commit(code_version="c", config={}, parents=list(parents), stats=OK)
    if ordered:
        time.sleep(1.05)  # created_at has one-second resolution: keep the order unambiguous
    return art


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


def _victim(tmp_path: Path) -> Path:
    """A directory beside the store that looks like an artifact (so following a path into it would "work")."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("not the store's")
    (victim / "_manifest.json").write_text(json.dumps({
        "stage": "bundle", "version": "victim", "code_version": "c", "created_at": "2000-01-01T00:00:00+00:00"}))
    return victim


def _rewrite_manifest(store: ArtifactStore, in_stage: str, in_version: str, **changes) -> None:
    path = f"{store.artifact_path(in_stage, in_version)}/_manifest.json"
    with store.fs.open(path, "rb") as f:
        m = json.loads(f.read())
    with store.fs.open(path, "wb") as f:
        f.write(json.dumps({**m, **changes}).encode())


# ----------------------------------------------------------------------------- manifests that point outside


@pytest.mark.parametrize("bad", ["../../victim", "ABSOLUTE"])
def test_gc_never_removes_what_a_manifest_version_points_at(tmp_path, bad):
    """A manifest in ``foo/v1`` naming version ``../../victim`` (or an absolute path) made ``gc --keep 1`` delete
    that directory. Now the version is corrupt: listed with the reason, not counted, never removed."""
    victim = _victim(tmp_path)
    bad = str(victim) if bad == "ABSOLUTE" else bad
    store = ArtifactStore(str(tmp_path / "store"))
    _commit(store, "foo", "v1", ordered=True)
    _commit(store, "foo", "v2", ordered=True)
    _commit(store, "foo", "v3")
    _rewrite_manifest(store, "foo", "v1", version=bad)
    before = _snapshot(victim)

    assert store.versions("foo") == ["v2", "v3"]  # lookups skip it
    [row] = [r for r in listing(store) if r["version"] == "v1"]
    assert row["state"] == "corrupt" and bad in row["reason"]
    report = gc(store, keep=1)
    assert _snapshot(victim) == before
    assert [u.removeprefix(store.uri + "/") for u, _ in report.removed] == ["foo/v2"]  # v3 newest; v1 not counted
    assert (tmp_path / "store/foo/v1/data.bin").exists()  # corrupt: never removed
    with pytest.raises(CorruptArtifact, match="manifest names"):
        store.open("foo", "v1")


def test_a_manifest_naming_another_stage_is_corrupt_not_a_stage(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    _commit(store, "clean", "c1")
    _rewrite_manifest(store, "clean", "c1", stage="../../victim")
    rows = listing(store, "clean")
    assert [(r["version"], r["state"]) for r in rows] == [("c1", "corrupt")]
    assert "stage" in rows[0]["reason"]
    assert stages(store) == []  # no manifest names "clean" any more
    assert gc(store, keep=1).removed == []


def test_an_alias_pointing_outside_is_refused_and_protects_nothing(tmp_path):
    victim = _victim(tmp_path)
    store = ArtifactStore(str(tmp_path / "store"))
    _commit(store, "bundle", "b1")
    aliases.promote(store.uri, "bundle", "b1", "production")
    path = tmp_path / "store/_aliases/bundle/production.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": "../../victim"}))
    before = _snapshot(victim)

    with pytest.raises(aliases.AliasError, match="not a plain version name"):
        open_artifact(f"{store.uri}/bundle@production")
    assert aliases.list_aliases(store.uri) == {}
    gc(store, keep=1)
    assert _snapshot(victim) == before
    with pytest.raises(aliases.AliasError):
        aliases.promote(store.uri, "bundle", "../../victim", "production")
    with pytest.raises(ValueError, match="not a plain name"):
        store.artifact_path("bundle", "../../victim")


# ----------------------------------------------------------------------------- files lexiflow did not write


def _strays(store: ArtifactStore) -> dict[str, bytes]:
    """Another tool's files in a stage directory and in the store."""
    stage = Path(store.root, "clean")
    files = {"clean/NOTES.md": b"# my notes\n", "clean/.DS_Store": b"\x00\x01", "README.txt": b"hello",
             "clean/their-dir/data.parquet": b"PAR1", "clean/0123456789abcdef/x.bin": b"recent, no owner"}
    for rel, data in files.items():
        p = Path(store.root, rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (stage / "link").symlink_to(stage / "their-dir")
    return files


def test_stray_files_are_listed_and_never_touched_by_ls_gc_or_a_run(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    _commit(store, "clean", "c1")
    _commit(store, "clean", "c2", ordered=True)
    strays = _strays(store)
    dead = begin(store, "clean", "crashed", FAST)
    abandon(dead)

    kinds = {e.name: e.kind for e in store.entries("clean")}
    assert kinds == {"c1": "committed", "c2": "committed", "crashed": "staging", "NOTES.md": "foreign",
                     ".DS_Store": "foreign", "their-dir": "foreign", "link": "foreign",
                     "0123456789abcdef": "foreign"}
    res = CliRunner().invoke(app, ["ls", store.uri])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert "NOTES.md" in res.output and "foreign" in res.output and "dead staging" in res.output

    _commit(store, "clean", "c3")  # a run's lease check and clean-up of dead staging
    report = gc(store, keep=1)
    assert {u.removeprefix(store.uri + "/") for u, _ in report.removed} == {"clean/c1", "clean/c2"}
    for rel, data in strays.items():
        assert Path(store.root, rel).read_bytes() == data
    assert Path(store.root, "clean/link").is_symlink()
    assert store.versions("clean") == ["c3"] and not Path(store.root, "clean/crashed").exists()


def test_an_old_owner_less_directory_named_like_a_version_is_abandoned(tmp_path):
    """A crash between creating a staging directory and writing its owner record: removed once older than the
    stale window, and only under a name lexiflow computes (16 hex digits)."""
    store = ArtifactStore(str(tmp_path / "store"))
    _commit(store, "clean", "c1")
    old = Path(store.root, "clean/fedcba9876543210")
    kept = Path(store.root, "clean/my-version")
    for d in (old, kept):
        d.mkdir()
        (d / "half.bin").write_bytes(b"h")
        past = time.time() - 3600
        os.utime(d / "half.bin", (past, past))
        os.utime(d, (past, past))
    kinds = {e.name: e.kind for e in store.entries("clean", FAST)}
    assert kinds["fedcba9876543210"] == "abandoned" and kinds["my-version"] == "foreign"
    gc(store, keep=1, settings=FAST)
    assert not old.exists() and (kept / "half.bin").exists()


def test_memory_store_strays_are_foreign(tmp_path):
    store = ArtifactStore(f"memory://conf-{uuid.uuid4().hex[:8]}")
    _commit(store, "clean", "c1")
    store.fs.pipe(f"{store.root}/clean/NOTES.md", b"notes")
    store.fs.pipe(f"{store.root}/clean/.DS_Store", b"\x00")
    assert store.garbage("clean") == []
    begin(store, "clean", "c2", FAST).commit(code_version="c", config={}, parents=[], stats=OK)
    gc(store, keep=1)
    assert store.fs.cat(f"{store.root}/clean/NOTES.md") == b"notes"
    assert store.fs.cat(f"{store.root}/clean/.DS_Store") == b"\x00"


def test_a_foreign_file_where_a_version_goes_is_refused_not_removed(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    Path(store.root, "clean").mkdir(parents=True)
    Path(store.root, "clean/v1").write_text("someone's file")
    with pytest.raises(FileExistsError, match="not a directory lexiflow made"):
        begin(store, "clean", "v1", FAST)
    assert Path(store.root, "clean/v1").read_text() == "someone's file"
    assert read_owner(store.fs, f"{store.root}/clean/NOTES.md") is None  # a file is no directory: no owner


# ----------------------------------------------------------------------------- leases: pid + start time


_WRITER = """
import sys, time
from storage.artifacts import ArtifactStore
from storage.lease import LeaseSettings
from tests.staging import begin
w = begin(ArtifactStore(sys.argv[1]), "s", "v1", LeaseSettings(heartbeat_s=0.1, stale_after_s=0.5, poll_s=0.05))
w.write_bytes("half.bin", b"in progress")
print("ready", flush=True)
time.sleep(600)
"""


def test_a_paused_writer_keeps_its_staging(tmp_path):
    """SIGSTOP a writer past the stale window: its heartbeat is late, its process lives, its staging stays."""
    store = ArtifactStore(str(tmp_path / "store"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, store.uri], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.5)  # three stale windows without a heartbeat
        owner = read_owner(store.fs, store.artifact_path("s", "v1"))
        assert owner["pid"] == proc.pid and time.time() - owner["heartbeat"] > FAST.stale_after_s
        assert store.garbage("s", FAST) == []
        assert gc(store, keep=1, settings=FAST).removed == []
        assert store.collect_garbage("s", FAST) == []
        assert [r["state"] for r in listing(store, "s", FAST)] == ["building"]
        assert Path(store.root, "s/v1/half.bin").exists()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert store.garbage("s", FAST) == [store.artifact_path("s", "v1")]  # dead now: garbage at once


def _owner(store: ArtifactStore, pid: int, started: str | None) -> None:
    d = Path(store.artifact_path("s", "v1"))
    d.mkdir(parents=True)
    (d / OWNER).write_text(json.dumps({"run": "x", "host": socket.gethostname(), "pid": pid, "token": "t",
                                       "started_proc": started, "heartbeat": time.time()}))


def test_a_reused_pid_does_not_pin_garbage(tmp_path):
    """The recorded pid exists but started at another time: another process, the writer is gone (fresh heartbeat
    or not)."""
    store = ArtifactStore(str(tmp_path / "store"))
    mine = process_start(os.getpid())
    assert mine is not None
    _owner(store, os.getpid(), mine.split(":")[0] + ":1")
    assert store.garbage("s", FAST) == [store.artifact_path("s", "v1")]


def test_a_dead_pid_is_gone_however_fresh_its_heartbeat(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    done = subprocess.run([sys.executable, "-c", "pass"])
    _owner(store, 2**22 + 17 if done.returncode else os.getpid() + 10**6, None)
    assert store.garbage("s", FAST) == [store.artifact_path("s", "v1")]


def test_the_live_writer_s_own_record_names_its_start():
    assert process_start(os.getpid()) == process_start(os.getpid()) is not None
    assert process_start(2**22 + 17) is None


# ----------------------------------------------------------------------------- events and relabelling


def test_the_store_in_an_event_is_spelled_one_way(tmp_path, monkeypatch):
    from flows.events import promotion_payload

    real = tmp_path / "data" / "store"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path / "data")
    record = {"stage": "bundle", "alias": "production", "version": "b1"}
    spelled = ["./store", "store/", str(real) + "/", f"file://{real}", str(tmp_path / "link"),
               str(tmp_path / "link") + "//"]
    payloads = [promotion_payload(s, record) for s in spelled]
    assert {p["store"] for p in payloads} == {os.path.realpath(real)}
    assert {p["uri"] for p in payloads} == {f"{os.path.realpath(real)}/bundle/b1"}
    assert canonical_store("s3://bucket/key/") == canonical_store("s3a://bucket//key") == "s3://bucket/key"


def test_relabel_loads_bundles_from_its_store_only(tmp_path):
    from flows.label import relabel_flow

    store = ArtifactStore(str(tmp_path / "store"))
    _commit(store, "bundle", "b1")
    (tmp_path / "link").symlink_to(tmp_path / "store")
    assert artifact_in_store(f"{tmp_path}/link/bundle/b1/", store.uri, "bundle") == f"{store.uri}/bundle/b1"
    aliases.promote(store.uri, "bundle", "b1", "production")
    assert artifact_in_store(f"{store.uri}/bundle@production", str(tmp_path / "link"), "bundle") \
        == f"{tmp_path}/link/bundle/b1"
    for outside in (f"{tmp_path}/other/bundle/b1", f"{store.uri}/bundle/../../other/bundle/b1",
                    f"{store.uri}/clean/b1", "memory://elsewhere/bundle/b1", f"{tmp_path}/other/bundle@production"):
        with pytest.raises(ValueError, match="store|not a bundle"):
            artifact_in_store(outside, store.uri, "bundle")
        with pytest.raises(ValueError):
            relabel_flow.fn(bundle_uri=outside, inputs=[], store_uri=store.uri)


def test_the_relabel_cause_is_escaped_markdown():
    from flows.label import cause_markdown

    hostile = "x | y `z` [click](http://evil.example) <img src=x onerror=alert(1)> **b**\n| injected | row |"
    cause = {"event_id": "1234-abcd", "alias": hostile, "previous": None, "promoted_by": hostile,
             "bundle_uri": hostile}
    out = [{"input_uri": hostile, "uri": hostile, "stats": {"in": 1, "out": 1, "rejected": {}}}]
    lines = cause_markdown(cause, out)
    assert len(lines) == 2 + 2 + len(cause) + 1 + 2 + 1  # no line added by a value
    cells = {i: 3 for i in range(2, 4 + len(cause))} | {i: 6 for i in range(5 + len(cause), len(lines))}
    for i, line in enumerate(lines):
        unescaped = line.replace("\\\\", "").replace("\\|", "")
        assert unescaped.count("|") == cells.get(i, 0), line  # a value never opens or closes a cell
        if i >= 2:  # no markup can start from a value: every <, [, `, * and _ in them is escaped
            assert not re.search(r"(?<!\\)[<\[`*_]", unescaped), line
    assert "1234-abcd" in "\n".join(lines)  # ids read as typed
