"""``with store.stage(...) as st:``: lease on entry, a reconciled commit, release and clean-up on the way out, a
committed version adopted, staging another run leads attached to without touching its lease."""

from __future__ import annotations

import json
import posixpath
import threading
import time
import uuid

import pytest

from storage.artifacts import ArtifactRef, ArtifactStore, Stats, open_artifact
from storage.lease import LeaseSettings, owner_live, read_owner
from storage.names import MANIFEST
from tests.staging import begin

OK = {"in": 3, "out": 2, "rejected": {"too_short": 1}}
PARENT = ArtifactRef(stage="clean", version="c1", uri="memory://elsewhere/clean/c1")
FAST = LeaseSettings(poll_s=0.02)


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "file":
        return ArtifactStore(str(tmp_path / "store"))
    return ArtifactStore(f"memory://st-{uuid.uuid4().hex}/store")


def _stage(store: ArtifactStore, version: str = "v1", **kw):
    return store.stage("demo", version, code_version="demo-1", config={"k": 1}, parents=[PARENT], lease=FAST, **kw)


def _write(st) -> None:
    st.write_bytes("out.txt", b"a\nb\n")
    with st.open("sub/data.bin") as f:
        f.write(b"\x00\x01\x02")


def _manifest_bytes(store: ArtifactStore, version: str = "v1") -> dict:
    """The manifest as written, but for the build's timestamp (the only field that differs between builds)."""
    with store.fs.open(posixpath.join(store.artifact_path("demo", version), MANIFEST), "rb") as f:
        m = json.loads(f.read())
    m.pop("created_at")
    return m


def _reference(tmp_path) -> dict:
    """The same build through the writer the store hands out (``begin``, ``commit``): what every byte must match."""
    ref = ArtifactStore(str(tmp_path / "reference"))
    w = begin(ref, "demo", "v1")
    _write(w)
    w.commit(code_version="demo-1", config={"k": 1}, parents=[PARENT], stats=OK, metrics={"lines": 2},
             rows={"out.txt": 2}, run={"wall_s": 0.1})
    return _manifest_bytes(ref)


def test_commits_on_success_with_the_manifest_of_the_build(store, tmp_path):
    with _stage(store) as st:
        assert not st.cached and st.ref == store.ref("demo", "v1")
        assert owner_live(read_owner(store.fs, st.writer.path), FAST)  # the lease is held while the body runs
        _write(st)
        assert st.exists("out.txt") and st.file_path("out.txt") == posixpath.join(st.writer.path, "out.txt")
        assert not store.is_committed("demo", "v1")  # nothing is visible before the commit
        art = st.commit(OK, metrics={"lines": 2}, rows={"out.txt": 2}, run={"wall_s": 0.1})
        assert st.committed and st.artifact is art
    assert store.versions("demo") == ["v1"]
    m = open_artifact(store.ref("demo", "v1")).manifest
    assert (m.stage, m.version, m.code_version, m.config) == ("demo", "v1", "demo-1", {"k": 1})
    assert [(p.stage, p.version) for p in m.parents] == [("clean", "c1")]
    assert [(f.path, f.bytes, f.rows) for f in m.files] == [("out.txt", 4, 2), ("sub/data.bin", 3, None)]
    assert (m.stats, m.metrics, m.run) == (OK, {"lines": 2}, {"wall_s": 0.1})
    assert read_owner(store.fs, art.path) is None  # the owner record went with the commit
    assert _manifest_bytes(store) == _reference(tmp_path)  # byte for byte what the plain writer commits


def test_an_exception_commits_nothing_releases_the_lease_and_the_next_run_takes_over(store, tmp_path):
    with pytest.raises(ValueError, match="build failed"):
        with _stage(store) as st:
            st.write_bytes("out.txt", b"half")
            st.write_bytes("stale.txt", b"only the failed run wrote this")
            path = st.writer.path
            raise ValueError("build failed")
    assert not store.is_committed("demo", "v1") and store.versions("demo") == []
    owner = read_owner(store.fs, path)
    assert owner is not None and owner["released"] is True  # given up, not removed: still lexiflow's staging
    assert not owner_live(owner, FAST) and store.garbage("demo", FAST) == [path.rstrip("/")]
    with _stage(store) as st:  # the next run takes the staging over
        assert not st.cached
        _write(st)
        st.commit(OK, metrics={"lines": 2}, rows={"out.txt": 2}, run={"wall_s": 0.1})
    assert store.versions("demo") == ["v1"] and store.garbage("demo", FAST) == []
    assert _manifest_bytes(store) == _reference(tmp_path)  # the failed run left nothing in: same files, same bytes
    assert store.open("demo", "v1").read_verified("out.txt") == b"a\nb\n"


def test_already_committed_is_cached_and_the_body_writes_nothing(store):
    with _stage(store) as st:
        _write(st)
        first = st.commit(OK)
    with _stage(store) as st:
        assert st.cached and not st.committed
        assert st.artifact.ref == first.ref and st.artifact.manifest == first.manifest
        with pytest.raises(RuntimeError, match="already committed"):
            st.writer
        with pytest.raises(RuntimeError, match="already committed"):
            st.commit(OK)
    assert store.versions("demo") == ["v1"] and _manifest_bytes(store)["stats"] == OK


@pytest.mark.timeout(60)  # waits on a live lease: a wrong wait must fail, not hang
def test_a_version_committed_by_the_run_it_waited_for_is_adopted(store):
    leader = begin(store, "demo", "v1", FAST)  # another run (here: another thread) holds the lease

    def finish() -> None:
        time.sleep(0.3)
        leader.write_bytes("out.txt", b"theirs\n")
        leader.commit(code_version="demo-1", config={"k": 1}, parents=[PARENT], stats=OK)

    t = threading.Thread(target=finish)
    t.start()
    try:
        with _stage(store) as st:  # waits for the live owner, then finds the version committed
            assert st.cached
            assert st.artifact.read_verified("out.txt") == b"theirs\n"
    finally:
        t.join()
    assert store.versions("demo") == ["v1"]


@pytest.mark.parametrize("stats", [{"in": 5, "out": 2, "rejected": {"too_short": 1}},
                                   Stats(**{"in": 4, "out": 2, "rejected": {"too_short": 1}})])
def test_counts_that_do_not_reconcile_commit_nothing(store, stats):
    with pytest.raises(RuntimeError, match="do not reconcile"):
        with _stage(store) as st:
            _write(st)
            path = st.writer.path
            st.commit(stats)
    assert not st.committed and store.versions("demo") == []
    assert not store.fs.exists(posixpath.join(path, MANIFEST))
    assert read_owner(store.fs, path)["released"] is True  # released for the next run
    with _stage(store) as st:
        st.commit(OK)
    assert store.versions("demo") == ["v1"]


def test_leaving_the_block_without_a_commit_is_an_error_and_commits_nothing(store):
    with pytest.raises(RuntimeError, match="without a commit"):
        with _stage(store) as st:
            _write(st)
            path = st.writer.path
    assert store.versions("demo") == [] and read_owner(store.fs, path)["released"] is True


@pytest.mark.timeout(60)  # waits on a live lease: a wrong wait must fail, not hang
def test_a_handle_attaches_without_taking_or_releasing_the_lease(store):
    import pickle

    from storage.artifacts import StagingHandle

    leader = begin(store, "demo", "v1", FAST)  # the run that began the stage (torchrun's launcher) holds the lease
    before = read_owner(store.fs, leader.path)
    handle = pickle.loads(pickle.dumps(StagingHandle(store.uri, "demo", "v1")))  # what a rank or a worker gets
    handle.writer().write_bytes("model.bin", b"weights")
    after = read_owner(store.fs, leader.path)
    assert after["token"] == before["token"] and not after.get("released") and leader.lease.holds()
    assert not store.is_committed("demo", "v1")  # attached: nothing committed
    art = leader.commit(code_version="demo-1", config={}, parents=[], stats={"in": 1, "out": 1, "rejected": {}})
    assert art.files() == ["model.bin"] and art.read_verified("model.bin") == b"weights"
    with pytest.raises(FileExistsError, match="already committed"):
        handle.writer()


def test_checkpoints_are_removed_after_a_commit_and_kept_after_a_failure(store):
    ckpt = store.checkpoint_path("demo", "v1")
    store.fs.makedirs(ckpt, exist_ok=True)
    with store.fs.open(posixpath.join(ckpt, "state.pt"), "wb") as f:
        f.write(b"resume here")
    with pytest.raises(ValueError):
        with _stage(store) as st:
            raise ValueError("preempted")
    assert store.fs.exists(posixpath.join(ckpt, "state.pt"))  # the resume point of the next run
    with _stage(store) as st:
        st.commit(OK)
    assert not store.fs.exists(posixpath.join(ckpt, "state.pt"))


def test_a_run_needs_what_its_manifest_records(store):
    with pytest.raises(TypeError, match="code_version and config"):
        with store.stage("demo", "v1"):
            pass
    assert store.entries("demo") == []  # refused before taking anything
