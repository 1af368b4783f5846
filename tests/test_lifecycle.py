"""Operating a store: staging leases under overlap, aliases (promote/resolve/history), listing and gc."""

from __future__ import annotations

import json
import threading
import time

import pytest

from storage import aliases
from storage.artifacts import ArtifactStore, open_artifact
from storage.lease import OWNER, LeaseLost, LeaseSettings, read_owner
from storage.lifecycle import gc, listing, stages
from tests.conftest import abandon
from tests.staging import begin

FAST = LeaseSettings(heartbeat_s=0.05, stale_after_s=5.0, poll_s=0.02)
OK = {"in": 1, "out": 1, "rejected": {}}


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "memory":
        import uuid

        return ArtifactStore(f"memory://lifecycle-{uuid.uuid4().hex[:8]}")
    return ArtifactStore(str(tmp_path / "store"))


def _put(store, path: str, data: bytes) -> None:
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with store.fs.open(path, "wb") as f:
        f.write(data)


def _commit(store, stage, version, parents=(), data=b"x", metrics=None):
    w = begin(store, stage, version, FAST)
    w.write_bytes("data.bin", data)
    return w.commit(code_version="c", config={}, parents=list(parents), stats=OK, metrics=metrics)


# ----------------------------------------------------------------------------- leases


def test_second_run_waits_for_the_owner_then_adopts_its_commit(store):
    first = begin(store, "s", "v1", FAST)
    first.write_bytes("data.bin", b"built by the first run")
    got, took = [], []

    def second():
        t0 = time.monotonic()
        got.append(store.acquire("s", "v1", FAST))
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting: the first run is alive and has not committed
    assert store.garbage("s") == []  # and its staging is nobody's garbage
    first.commit(code_version="c", config={}, parents=[], stats=OK)
    t.join(5)
    assert got == [None] and took[0] >= 0.3  # None: committed meanwhile, adopt it
    assert store.open("s", "v1").read_verified("data.bin") == b"built by the first run"
    assert read_owner(store.fs, store.artifact_path("s", "v1")) is None  # commit released the lease


def test_a_waiting_run_says_once_whom_it_waits_for(store, caplog):
    """One INFO line per owner waited on (not one per poll), naming the stage, version and owner."""
    from storage.lease import describe

    first = begin(store, "s", "v1", FAST)
    owner = read_owner(store.fs, first.path)
    t = threading.Thread(target=store.acquire, args=("s", "v1", FAST))
    def waits():
        return [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]

    with caplog.at_level("INFO", logger="lexiflow"):
        t.start()
        deadline = time.monotonic() + 10
        while not waits() and time.monotonic() < deadline:  # a loaded machine may start the thread late
            time.sleep(0.01)
        time.sleep(0.3)  # about 15 more polls of the same owner
        first.commit(code_version="c", config={}, parents=[], stats=OK)
        t.join(5)
    assert waits() == [f"s/v1 is being built by {describe(owner)}; waiting for it"]


def test_staging_leftovers_without_an_owner_record_are_removed_before_building(store):
    """A run that died before its lease file landed leaves files but no owner: they never reach a manifest."""
    _put(store, f"{store.artifact_path('s', 'v1')}/stray.bin", b"from a run that died early")
    w = begin(store, "s", "v1", FAST)
    assert not w.exists("stray.bin")
    w.write_bytes("data.bin", b"x")
    art = w.commit(code_version="c", config={}, parents=[], stats=OK)
    assert [f.path for f in art.manifest.files] == ["data.bin"]


def test_starting_a_stage_never_removes_a_live_runs_staging(store):
    live = begin(store, "s", "building", FAST)
    live.write_bytes("half.bin", b"in progress")
    _commit(store, "s", "other")  # begin() of another version cleans only dead staging
    assert live.exists("half.bin")
    live.commit(code_version="c", config={}, parents=[], stats=OK)
    assert store.versions("s") == ["building", "other"]


def test_a_dead_owners_staging_is_taken_over_and_cleaned(store):
    dead = begin(store, "s", "v1", FAST)
    dead.write_bytes("stale.bin", b"from a crashed run")
    abandon(dead)
    assert store.garbage("s", FAST) == [store.artifact_path("s", "v1")]
    w = begin(store, "s", "v1", FAST)  # taken over: the leftovers are gone
    assert not w.exists("stale.bin")
    assert read_owner(store.fs, w.path)["token"] == w.lease.token
    art = w.commit(code_version="c", config={}, parents=[], stats=OK)
    assert [f.path for f in art.manifest.files] == []  # the owner record is never part of an artifact
    with pytest.raises(LeaseLost):  # and the crashed run can never commit over it
        dead.lease.check()


def test_a_run_whose_lease_was_taken_over_refuses_to_commit(store):
    w = begin(store, "s", "v1", FAST)
    w.write_bytes("a.bin", b"a")
    with store.fs.open(f"{w.path}/{OWNER}", "wb") as f:  # another run took the directory over
        f.write(json.dumps({"token": "someone-else", "heartbeat": time.time(), "host": "elsewhere", "pid": 1}).encode())
    with pytest.raises(LeaseLost, match="another run took over"):
        w.commit(code_version="c", config={}, parents=[], stats=OK)
    assert not store.is_committed("s", "v1")


def test_heartbeat_keeps_the_owner_record_fresh(store):
    w = begin(store, "s", "v1", FAST)
    first = read_owner(store.fs, w.path)["heartbeat"]
    time.sleep(0.3)
    assert read_owner(store.fs, w.path)["heartbeat"] > first
    w.lease.release()


def test_run_stage_removes_checkpoints_once_committed(store):
    from tasks.common.stage import StageResult
    from tests.staging import run_build

    def build(writer, version):
        ckpt = store.checkpoint_path("pretrain", version)
        _put(store, f"{ckpt}/step-1.pt", b"resume state")
        assert store.fs.exists(ckpt)
        return StageResult(stats=OK)

    ref = run_build(store, "pretrain", "p", {}, [], build)
    assert not store.fs.exists(store.checkpoint_path("pretrain", ref.version))


# ----------------------------------------------------------------------------- aliases


def test_promote_resolve_and_history(store):
    a = _commit(store, "bundle", "va")
    b = _commit(store, "bundle", "vb")
    with pytest.raises(aliases.AliasError, match="no alias 'production'.*lexiflow promote"):
        open_artifact(f"{store.uri}/bundle@production")
    aliases.promote(store.uri, "bundle", "va", "production", by="ci")
    assert open_artifact(f"{store.uri}/bundle@production").manifest.version == "va"
    rec = aliases.promote(store.uri, "bundle", "vb", "production", by="ana")
    assert open_artifact(f"{store.uri}/bundle@production").uri == b.uri
    assert (rec["version"], rec["previous"], rec["promoted_by"]) == ("vb", "va", "ana")
    assert [h["version"] for h in rec["history"]] == ["va", "vb"]
    assert aliases.list_aliases(store.uri) == {"bundle": {"production": "vb"}}
    assert a.uri != b.uri


def test_promote_refuses_what_is_not_committed(store):
    w = begin(store, "bundle", "half", FAST)
    w.write_bytes("x", b"x")
    with pytest.raises(aliases.AliasError, match="not a committed artifact"):
        aliases.promote(store.uri, "bundle", "half", "production")
    with pytest.raises(aliases.AliasError, match="expected letters"):
        aliases.promote(store.uri, "bundle", "half", "prod/../x")
    w.lease.release()


# ----------------------------------------------------------------------------- ls and gc


def _three_pipelines(store):
    """Three versions of a clean -> bundle chain; the second bundle is in production."""
    chains = []
    for i in range(3):
        c = _commit(store, "clean", f"c{i}", data=b"c" * 100)
        b = _commit(store, "bundle", f"b{i}", parents=[c.ref], data=b"b" * 1000, metrics={"test_auc": 0.8 + i / 100})
        chains.append((c, b))
        time.sleep(1.1)  # created_at has one-second resolution: keep the order unambiguous
    aliases.promote(store.uri, "bundle", "b1", "production")
    return chains


def test_ls_lists_versions_metrics_and_aliases(store):
    _three_pipelines(store)
    rows = listing(store)
    assert stages(store) == ["bundle", "clean"]
    bundles = [r for r in rows if r["stage"] == "bundle"]
    assert [r["version"] for r in bundles] == ["b0", "b1", "b2"]
    assert [r["aliases"] for r in bundles] == [[], ["production"], []]
    assert bundles[2]["metrics"]["test_auc"] == pytest.approx(0.82)
    assert {r["state"] for r in rows} == {"committed"}


def test_gc_keeps_newest_aliased_ancestors_and_live_staging(store):
    _three_pipelines(store)
    live = begin(store, "bundle", "building", FAST)
    live.write_bytes("half.bin", b"h")
    dead = begin(store, "clean", "crashed", FAST)
    dead.write_bytes("half.bin", b"d" * 10)
    abandon(dead)
    _put(store, store.checkpoint_path("bundle", "b0") + "/ckpt.pt", b"k" * 7)

    dry = gc(store, keep=1, dry_run=True)
    assert store.versions("bundle") == ["b0", "b1", "b2"]  # a dry run removes nothing
    report = gc(store, keep=1)
    assert [u for u, _ in report.removed] == [u for u, _ in dry.removed]
    assert store.versions("bundle") == ["b1", "b2"]  # b2 newest, b1 in production
    assert store.versions("clean") == ["c1", "c2"]  # ancestors of kept bundles (c0 only fed b0)
    removed = {u.removeprefix(store.uri + "/"): n for u, n in report.removed}
    assert set(removed) == {"bundle/b0", "clean/c0", "clean/crashed", "_checkpoints/bundle/b0"}
    assert removed["bundle/b0"] >= 1000 and removed["clean/crashed"] >= 10 and removed["_checkpoints/bundle/b0"] == 7
    assert report.bytes == sum(removed.values())
    assert live.exists("half.bin")  # a live run's staging is never touched
    assert open_artifact(f"{store.uri}/bundle@production").manifest.version == "b1"
    live.lease.release()


def test_gc_refuses_keep_zero(store):
    with pytest.raises(ValueError, match="at least 1"):
        gc(store, keep=0)
