"""flows.stage.run_stage: build once, skip a committed version, refuse counts that do not reconcile."""

from __future__ import annotations

import pytest

from flows.stage import run_build
from storage.artifacts import ArtifactStore, open_artifact
from tasks.common.stage import StageResult


def _builder(calls: list[str], stats: dict | None = None):
    def build(writer, version):
        calls.append(version)
        writer.write_bytes("out.txt", b"a\nb\n")
        return StageResult(
            stats=stats or {"in": 3, "out": 2, "rejected": {"too_short": 1}},
            metrics={"lines": 2},
            rows={"out.txt": 2},
        )

    return build


def test_builds_commits_then_skips_without_calling_build(tmp_path):
    store = ArtifactStore(str(tmp_path))
    calls: list[str] = []
    ref = run_build(store, "demo", "demo-1", {"a": 1}, [], _builder(calls))
    assert calls == [ref.version] and ref.stage == "demo"
    m = open_artifact(ref).manifest
    assert m.stats == {"in": 3, "out": 2, "rejected": {"too_short": 1}} and m.metrics == {"lines": 2}
    assert [(f.path, f.rows) for f in m.files] == [("out.txt", 2)]

    def must_not_build(writer, version):
        raise AssertionError("a committed version must be skipped")

    assert run_build(store, "demo", "demo-1", {"a": 1}, [], must_not_build) == ref


def test_new_config_code_or_parent_is_a_new_version(tmp_path):
    store = ArtifactStore(str(tmp_path))
    calls: list[str] = []
    base = run_build(store, "demo", "demo-1", {"a": 1}, [], _builder(calls))
    others = [
        run_build(store, "demo", "demo-1", {"a": 2}, [], _builder(calls)),
        run_build(store, "demo", "demo-2", {"a": 1}, [], _builder(calls)),
        run_build(store, "demo", "demo-1", {"a": 1}, [base], _builder(calls)),
    ]
    assert len({base.version, *(r.version for r in others)}) == 4
    assert len(calls) == 4
    assert store.versions("demo") == sorted(calls)


def test_refuses_counts_that_do_not_reconcile_and_commits_nothing(tmp_path):
    store = ArtifactStore(str(tmp_path))
    bad = {"in": 5, "out": 2, "rejected": {"too_short": 1}}
    with pytest.raises(RuntimeError, match="do not reconcile"):
        run_build(store, "demo", "demo-1", {}, [], _builder([], bad))
    assert store.versions("demo") == []
    assert len(store.garbage("demo")) == 1  # the staging directory, cleared by the next run of the stage
    ref = run_build(store, "demo", "demo-1", {}, [], _builder([]))
    assert store.garbage("demo") == [] and store.versions("demo") == [ref.version]


def test_refuses_a_build_that_returns_no_stage_result(tmp_path):
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(TypeError, match="expected a StageResult"):
        run_build(store, "demo", "demo-1", {}, [], lambda writer, version: {"in": 0, "out": 0, "rejected": {}})
    assert store.versions("demo") == []


def test_publish_hook_sees_the_committed_artifact(tmp_path):
    store = ArtifactStore(str(tmp_path))
    seen = []

    def build(writer, version):
        return StageResult(
            stats={"in": 0, "out": 0, "rejected": {}}, publish=lambda art: seen.append(art.manifest.version)
        )

    ref = run_build(store, "demo", "demo-1", {}, [], build)
    assert seen == [ref.version]


def test_stage_result_run_goes_to_the_manifest_run_section(tmp_path):
    store = ArtifactStore(str(tmp_path))

    def build(writer, version):
        writer.write_bytes("out.txt", b"a\n")
        return StageResult(stats={"in": 1, "out": 1, "rejected": {}}, metrics={"lines": 1}, run={"wall_s": 0.2})

    m = open_artifact(run_build(store, "demo", "demo-1", {}, [], build)).manifest
    assert (m.metrics, m.run) == ({"lines": 1}, {"wall_s": 0.2})
    from tasks.common.stage import stats_table

    assert {"key": "run.wall_s", "value": 0.2} in stats_table(open_artifact(store.ref("demo", m.version)))


def test_input_names_and_sources_do_not_depend_on_the_directory(tmp_path):
    from storage.artifacts import compute_version
    from tasks.common.stage import input_names, input_source

    assert input_names(["file:///a/x.jsonl", "file:///a/y.jsonl"]) == ["x.jsonl", "y.jsonl"]
    assert input_names(["s3://b/p/one/x.txt", "s3://b/p/two/x.txt"]) == ["one/x.txt", "two/x.txt"]
    assert input_names(["/d/x.txt", "/d/sub/x.txt"]) == ["x.txt", "sub/x.txt"]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "r.csv").write_text("label,review\n1,好\n", encoding="utf-8")
    a, b = (input_source(str(tmp_path / d / "r.csv")) for d in ("a", "b"))
    assert a["uri"] != b["uri"] and a["name"] == b["name"] == "r.csv"  # the URI is kept, as provenance
    assert compute_version("s", "c", {"inputs": [a]}, []) == compute_version("s", "c", {"inputs": [b]}, [])
