"""``lexiflow ls``: committed versions, versions being built (owner and age, also of a stage with nothing committed
yet) and the labelled outputs under ``<store>/labelled/``, in one row format for the text and ``--json``."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lexiflow.cli import app
from lexiflow.cli.store import ls_rows, render_ls_row
from storage.artifacts import ArtifactStore
from storage.lease import LeaseSettings
from tests.conftest import abandon
from tests.staging import begin

FAST = LeaseSettings(heartbeat_s=0.05, stale_after_s=5.0, poll_s=0.02)


def _json(fs, path: str, record: dict) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "wb") as f:
        f.write(json.dumps(record).encode())


@pytest.fixture(params=["file", "memory"])
def st(request, tmp_path):
    if request.param == "memory":
        import uuid

        return ArtifactStore(f"memory://ls-{uuid.uuid4().hex[:8]}")
    return ArtifactStore(str(tmp_path / "store"))


def test_ls_shows_building_versions_with_owner_and_age_and_labelled_outputs(st):
    w = begin(st, "clean", "c1", FAST)
    w.write_bytes("data.bin", b"x")
    w.commit(code_version="c", config={}, parents=[], stats={"in": 3, "out": 2, "rejected": {"short": 1}})
    live = begin(st, "pretrain", "p1", FAST)  # a stage whose first version is still being built
    live.write_bytes("half.bin", b"h")
    dead = begin(st, "clean", "c2", FAST)
    abandon(dead)
    _json(st.fs, f"{st.root}/labelled/b1/_manifest.json", {
        "stage": "label", "version": "L1", "code_version": "label-5", "created_at": "2026-01-02T03:04:05+00:00",
        "stats": {"in": 5, "out": 4, "rejected": {"empty": 1}},
        "parents": [{"stage": "bundle", "version": "b1", "uri": "x"}]})
    _json(st.fs, f"{st.root}/labelled/b2/_run.json", {"stage": "label", "version": "L2",
                                                      "bundle": {"stage": "bundle", "version": "b2"}})
    _json(st.fs, f"{st.root}/labelled/notes/readme.json", {"a": 1})  # not a label run's: not described
    try:
        rows = ls_rows(st)
        by = {(r["stage"], r["version"]): r for r in rows}
        assert set(by) == {("clean", "c1"), ("clean", "c2"), ("pretrain", "p1"), ("labelled", "L1"),
                           ("labelled", "L2")}
        assert by["clean", "c1"]["state"] == "committed" and by["clean", "c1"]["rejected"] == 1
        p1 = by["pretrain", "p1"]
        assert p1["state"] == "building" and p1["owner"] and "pid" in p1["owner"]
        assert 0 <= p1["age_s"] < 60 and 0 <= p1["heartbeat_age_s"] < 60
        assert by["clean", "c2"]["state"] == "dead staging" and by["clean", "c2"]["heartbeat_age_s"] > 10 ** 6
        L1, L2 = by["labelled", "L1"], by["labelled", "L2"]
        assert (L1["state"], L1["in"], L1["out"], L1["rejected"], L1["bundle"], L1["path"]) == (
            "labelled", 5, 4, 1, "b1", "labelled/b1")
        assert (L2["state"], L2["bundle"], L2["in"]) == ("incomplete", "b2", None)

        text = {line.split()[1]: line for line in map(render_ls_row, rows)}
        assert "building" in text["p1"] and "owner " in text["p1"] and "started" in text["p1"]
        assert "dead staging" in text["c2"] and "heartbeat" in text["c2"]
        assert "in=5 out=4 rejected=1" in text["L1"] and "bundle=b1" in text["L1"] and "labelled/b1" in text["L1"]
        assert "incomplete" in text["L2"]

        runner = CliRunner()
        plain = runner.invoke(app, ["ls", st.uri])
        as_json = runner.invoke(app, ["ls", st.uri, "--json"])
        assert plain.exit_code == 0 and as_json.exit_code == 0, plain.output + as_json.output
        parsed = [json.loads(line) for line in as_json.output.splitlines()]
        assert [(r["stage"], r["version"], r["state"]) for r in parsed] == [
            (r["stage"], r["version"], r["state"]) for r in rows]
        assert len(plain.output.splitlines()) == len(parsed)
        only = runner.invoke(app, ["ls", st.uri, "--stage", "labelled", "--json"])
        assert [(json.loads(x)["version"], json.loads(x)["state"]) for x in only.output.splitlines()] == [
            ("L1", "labelled"), ("L2", "incomplete")]
        assert [r["version"] for r in ls_rows(st, "pretrain")] == ["p1"]  # nothing committed yet, still listed
    finally:
        live.lease.release()


def test_render_ls_row_takes_states_it_does_not_know():
    row = {"stage": "bundle", "version": "v9", "created_at": None, "state": "corrupt", "in": None, "out": None,
           "rejected": None, "aliases": [], "metrics": {}, "path": "bundle/v9"}
    assert render_ls_row(row).split()[:3] == ["bundle", "v9", "corrupt"]


def test_gc_and_ls_honour_the_runs_stale_window(tmp_path):
    """A run on another host whose heartbeat is 300 s old is alive under runs configured with a 600 s window
    (runner.lease_stale_after_s): gc --stale-after 600 keeps its staging and ls calls it building; under the
    default 120 s window it is a dead run's staging, which gc removes."""
    import time

    from storage.lease import OWNER

    st = ArtifactStore(str(tmp_path / "store"))
    fast = LeaseSettings(heartbeat_s=0.05, stale_after_s=5.0, poll_s=0.02)
    done = begin(st, "pretrain", "v0", fast)  # a committed version: gc only enters directories the store owns
    done.write_bytes("w.bin", b"weights")
    done.commit(code_version="c", config={}, parents=[], stats={"in": 1, "out": 1, "rejected": {}})
    w = begin(st, "pretrain", "v1", fast)
    w.write_bytes("part.bin", b"half a run")
    w.lease.release()
    with st.fs.open(f"{w.path}/{OWNER}", "wb") as f:  # its owner: another host, silent for 300 s
        f.write(json.dumps({"token": "t", "heartbeat": time.time() - 300, "started": time.time() - 900,
                            "host": "elsewhere", "pid": 1}).encode())
    runner = CliRunner()
    listed = runner.invoke(app, ["ls", st.uri, "--json", "--stale-after", "600"])
    assert [json.loads(x)["state"] for x in listed.output.splitlines()] == ["committed", "building"], listed.output
    kept = runner.invoke(app, ["gc", st.uri, "--stale-after", "600"])
    assert kept.exit_code == 0 and json.loads(kept.output.splitlines()[-1])["removed"] == 0, kept.output
    assert st.fs.exists(f"{w.path}/part.bin")
    listed = runner.invoke(app, ["ls", st.uri, "--json"])
    assert [json.loads(x)["state"] for x in listed.output.splitlines()] == ["committed", "dead staging"], listed.output
    gone = runner.invoke(app, ["gc", st.uri])
    assert json.loads(gone.output.splitlines()[-1])["removed"] == 1 and not st.fs.exists(w.path), gone.output
