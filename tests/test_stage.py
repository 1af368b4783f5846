"""tasks.common.stage.run_stage: build once, skip a committed version, refuse counts that do not reconcile."""

from __future__ import annotations

import pytest

from storage.artifacts import ArtifactStore, open_artifact
from tasks.common.context import Runtime, StageContext
from tasks.common.stage import Stage, StageResult, run_stage
from tasks.common.ui import Reporter


def _stage(build, code_version: str = "demo-1", parents: tuple[str, ...] = ()) -> Stage:
    """A demo stage whose versioned config is its config section as given (a dict)."""
    return Stage("demo", code_version, None, parents, build, version_config=lambda cfg, cache=None: cfg or {})


def _builder(calls: list[str], stats: dict | None = None):
    def build(ctx: StageContext, **parents):
        calls.append(ctx.version)
        ctx.writer.write_bytes("out.txt", b"a\nb\n")
        return StageResult(
            stats=stats or {"in": 3, "out": 2, "rejected": {"too_short": 1}},
            metrics={"lines": 2},
            rows={"out.txt": 2},
        )

    return build


def test_builds_commits_then_skips_without_calling_build(tmp_path):
    store = ArtifactStore(str(tmp_path))
    calls: list[str] = []
    ref = run_stage(None, store, _stage(_builder(calls)), {"a": 1})
    assert calls == [ref.version] and ref.stage == "demo"
    m = open_artifact(ref).manifest
    assert m.stats == {"in": 3, "out": 2, "rejected": {"too_short": 1}} and m.metrics == {"lines": 2}
    assert [(f.path, f.rows) for f in m.files] == [("out.txt", 2)]

    def must_not_build(ctx):
        raise AssertionError("a committed version must be skipped")

    assert run_stage(None, store, _stage(must_not_build), {"a": 1}) == ref


def test_the_build_gets_its_context_and_its_parents_by_name(tmp_path):
    store = ArtifactStore(str(tmp_path))
    base = run_stage(None, store, _stage(_builder([])), {})
    seen = {}

    def build(ctx, base_ref):
        seen.update(stage=ctx.stage, version=ctx.version, cfg=ctx.cfg, parent=base_ref, handle=ctx.staging)
        ctx.staging.writer().write_bytes("via-handle.txt", b"x")  # what a shard worker does
        return StageResult({"in": 0, "out": 0, "rejected": {}})

    ref = run_stage(None, store, _stage(build, "demo-2", ("base_ref",)), {"b": 2}, base_ref=base)
    assert seen["stage"] == "demo" and seen["version"] == ref.version and seen["cfg"] == {"b": 2}
    assert seen["parent"] == base and open_artifact(ref).manifest.parents[0].version == base.version
    assert (seen["handle"].store_uri, seen["handle"].stage, seen["handle"].version) == (store.uri, "demo", ref.version)
    assert open_artifact(ref).files() == ["via-handle.txt"]
    with pytest.raises(TypeError, match="not given"):
        run_stage(None, store, _stage(build, "demo-2", ("base_ref",)), {"b": 2})


def test_new_config_code_or_parent_is_a_new_version(tmp_path):
    store = ArtifactStore(str(tmp_path))
    calls: list[str] = []
    base = run_stage(None, store, _stage(_builder(calls)), {"a": 1})
    others = [
        run_stage(None, store, _stage(_builder(calls)), {"a": 2}),
        run_stage(None, store, _stage(_builder(calls), "demo-2"), {"a": 1}),
        run_stage(None, store, _stage(_builder(calls), parents=("p",)), {"a": 1}, p=base),
    ]
    assert len({base.version, *(r.version for r in others)}) == 4
    assert len(calls) == 4
    assert store.versions("demo") == sorted(calls)


def test_refuses_counts_that_do_not_reconcile_and_commits_nothing(tmp_path):
    store = ArtifactStore(str(tmp_path))
    bad = {"in": 5, "out": 2, "rejected": {"too_short": 1}}
    with pytest.raises(RuntimeError, match="do not reconcile"):
        run_stage(None, store, _stage(_builder([], bad)), {})
    assert store.versions("demo") == []
    assert len(store.garbage("demo")) == 1  # the staging directory, cleared by the next run of the stage
    ref = run_stage(None, store, _stage(_builder([])), {})
    assert store.garbage("demo") == [] and store.versions("demo") == [ref.version]


def test_refuses_a_build_that_returns_no_stage_result(tmp_path):
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(TypeError, match="expected a StageResult"):
        run_stage(None, store, _stage(lambda ctx: {"in": 0, "out": 0, "rejected": {}}), {})
    assert store.versions("demo") == []


class _Recording(Reporter):
    """A reporter that reaches a UI: it keeps what is published."""

    active = True

    def __init__(self):
        self.tables: list[str] = []

    def table(self, key, table, description):
        self.tables.append(key)


def test_publish_hook_sees_the_committed_artifact_and_the_runtimes_reporter(tmp_path):
    store = ArtifactStore(str(tmp_path))
    seen, reporter = [], _Recording()

    def build(ctx):
        return StageResult(stats={"in": 0, "out": 0, "rejected": {}},
                           publish=lambda art, rep: seen.append((art.manifest.version, rep)))

    ref = run_stage(Runtime(reporter=reporter), store, _stage(build), {})
    assert seen == [(ref.version, reporter)] and reporter.tables == ["demo"]  # the stage's stats table too


def test_owner_records_name_the_runtimes_owner(tmp_path):
    from storage.lease import read_owner

    store = ArtifactStore(str(tmp_path))
    owners = []

    def build(ctx):
        owners.append(read_owner(store.fs, ctx.writer.path)["run"])
        return StageResult(stats={"in": 0, "out": 0, "rejected": {}})

    run_stage(Runtime(owner="flow-run-0b5e"), store, _stage(build), {})
    assert owners == ["flow-run-0b5e"]


def test_stage_result_run_goes_to_the_manifest_run_section(tmp_path):
    store = ArtifactStore(str(tmp_path))

    def build(ctx):
        ctx.writer.write_bytes("out.txt", b"a\n")
        return StageResult(stats={"in": 1, "out": 1, "rejected": {}}, metrics={"lines": 1}, run={"wall_s": 0.2})

    m = open_artifact(run_stage(None, store, _stage(build), {})).manifest
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
