"""A stage as one record (:class:`Stage`) and the one function that runs it (:func:`run_stage`), as plain Python.

A stage module defines ``build(ctx, **parents_and_inputs) -> StageResult`` (``ctx``: a
:class:`tasks.common.context.StageContext`) and its ``STAGE``. :func:`run_stage` plans the version, skips it when
committed, else takes the staging (``store.stage``, with the runtime's lease and owner), builds, commits and
publishes; the runtime decides how (here, in this process; inside a flow run, as one Prefect task).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from storage.artifacts import Artifact, ArtifactRef, ArtifactStore, compute_version
from storage.fingerprints import FingerprintCache, fingerprint_input
from storage.urls import public_url
from tasks.common.context import PLAIN_RUNTIME, Runtime, StageContext, pause_point
from tasks.common.ui import Reporter


@dataclass
class StageResult:
    """What a stage's build function returns: the reconciled counts, the metrics and the rows per file.

    ``stats`` is ``{"in": n, "out": m, "rejected": {reason: k}}`` with ``in == out + sum(rejected)``;
    ``metrics`` are what the build computed (the same on every build of a version); ``run`` is what was
    measured while building (wall time, throughput), written to the manifest's ``run`` section and never
    into a data file; ``publish(art, reporter)`` (optional) adds stage-specific UI artifacts once committed."""

    stats: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    publish: Callable[[Artifact, Reporter], None] | None = None
    run: dict[str, Any] = field(default_factory=dict)


def section_dump(cfg: Any, cache: FingerprintCache | None = None) -> dict[str, Any]:
    """The default of what enters a stage's version besides its parents: its config section as dumped (nothing
    for a stage without one)."""
    return {} if cfg is None else cfg.model_dump()


@dataclass(frozen=True)
class Stage:
    """A stage as one record: its name, code version, config class, what enters its version, its parents, its build.
    Each stage module defines its ``STAGE``; a flow runs it with :func:`run_stage` and only wires artifacts from one
    stage to the next.

    - ``parents``: the names of ``build``'s parent refs (``clean_ref`` ...), in the order the version hashes them;
      :func:`run_stage` takes them by these names and hands them to ``build`` by the same names.
    - ``version_config(cfg, *, cache, **inputs)``: what enters the version besides the parents (default: the
      section's dump); it is given the inputs named in ``version_inputs`` (input files whose bytes are part of the
      version) and the run's fingerprint cache.
    - ``build(ctx, **parents, **inputs) -> StageResult`` fills ``ctx.writer``'s staging directory. A training stage
      runs its training through ``ctx.step(...)`` (inside a flow run: the task ``<stage>-train``).
    - ``code_version``: a constant, or ``code(cfg)`` where the code version depends on the config.
    - ``tags``: the stage task's tags inside a flow run (``gpu``: a tag concurrency limit keeps two off one GPU).
    """

    name: str
    code_version: str
    config: type | None
    parents: tuple[str, ...]
    build: Callable[..., StageResult]
    version_config: Callable[..., dict[str, Any]] = section_dump
    version_inputs: tuple[str, ...] = ()
    code: Callable[[Any], str] | None = None
    tags: tuple[str, ...] = ()

    def plan(self, cfg: Any, inputs: dict[str, Any], cache: FingerprintCache | None = None) -> "StagePlan":
        """The version this config and these inputs give: code version, versioned config, parents, version."""
        missing = [p for p in self.parents if p not in inputs]
        if missing:
            raise TypeError(f"stage {self.name}: parent ref(s) {missing} not given")
        code_version = self.code(cfg) if self.code is not None else self.code_version
        config = self.version_config(cfg, cache=cache, **{k: inputs[k] for k in self.version_inputs})
        parents = [inputs[p] for p in self.parents]
        return StagePlan(self.name, code_version, config, parents,
                         compute_version(self.name, code_version, config, parents))


@dataclass(frozen=True)
class StagePlan:
    """What a stage run will be: its name, code version, the config that enters its version, parents, version."""

    stage: str
    code_version: str
    config: dict[str, Any]
    parents: list[ArtifactRef]
    version: str


def run_stage(runtime: Runtime | None, store: ArtifactStore, stage: Stage, cfg: Any, **inputs: Any) -> ArtifactRef:
    """The one way a stage runs: plan its version; when committed, skip it (a cache hit); else take its staging in
    ``store`` (:meth:`storage.store.ArtifactStore.stage`, under the runtime's lease and owner), ``build(ctx,
    **inputs)``, commit (the counts must reconcile) and publish. ``inputs``: the parent refs by the names in
    ``stage.parents``, and the build's other inputs (input files, ``progress``). ``runtime`` (None: the plain one)
    decides how the whole runs: inside a flow run, as one Prefect task named after the stage."""
    runtime = runtime or PLAIN_RUNTIME
    plan = stage.plan(cfg, inputs, runtime.fingerprints)

    def body() -> tuple[ArtifactRef, bool]:
        with store.stage(stage.name, plan.version, code_version=plan.code_version, config=plan.config,
                         parents=plan.parents, lease=runtime.options.lease, owner=runtime.owner) as st:
            if st.cached:  # committed before, or by another run while this one waited for its lease: adopt it
                return _cache_hit(runtime, st.artifact), True
            res = stage.build(StageContext(stage.name, plan.version, cfg, st.writer, store, runtime), **inputs)
            if not isinstance(res, StageResult):
                raise TypeError(f"{stage.name}: build returned {type(res).__name__}, expected a StageResult")
            pause_point(stage.name)  # crash tests: everything is staged, nothing is committed
            art = st.commit(res.stats, res.metrics, res.rows, res.run)
            if res.publish is not None:
                res.publish(art, runtime.reporter)
        return _built(runtime, art), False

    return runtime.run_stage(stage.name, stage.tags, body)


def _cache_hit(runtime: Runtime, art: Artifact) -> ArtifactRef:
    """Log and publish a version found committed; its ref."""
    m = art.manifest
    runtime.log.info("%s %s: cache hit, skipped", m.stage, m.version)
    publish(runtime.reporter, art, cached=True)
    return art.ref


def _built(runtime: Runtime, art: Artifact) -> ArtifactRef:
    """Log and publish a freshly committed artifact; its ref."""
    m, st = art.manifest, art.manifest.stats
    runtime.log.info("%s %s: built in=%s out=%s rejected=%s -> %s", m.stage, m.version, st["in"], st["out"],
                     st["rejected"], art.uri)
    publish(runtime.reporter, art, cached=False)
    return art.ref


def input_source(uri: str, name: str | None = None, cache: FingerprintCache | None = None) -> dict[str, Any]:
    """An input file for a stage's config: its URI, its name and the fingerprint of its bytes.

    The version counts the name and the bytes (new bytes, new version) but not the URI
    (``storage.artifacts.without_locations``: the same file in another directory keeps its version); the
    manifest keeps the URI as provenance. ``name`` defaults to the file's base name; give the name the
    stage's data uses for the file (its format is inferred from it, rejects and row ids carry it). With ``cache``
    (the run's, :attr:`tasks.common.context.Runtime.fingerprints`) an unchanged local file is not read again: its
    sha256 comes from the store's fingerprint cache (:mod:`storage.fingerprints`)."""
    return {"uri": uri, "name": name or file_name(uri), **fingerprint_input(uri, cache)}


def file_name(uri: str) -> str:
    """The base name of a URI or path (no directory, no query string)."""
    return posixpath.basename(uri.split("?", 1)[0].rstrip("/"))


def input_names(uris: Sequence[str]) -> list[str]:
    """Names for a stage's input files that do not depend on where they are: base names, or paths relative
    to the files' common directory when two share a base name (``a/x.txt``, ``b/x.txt``)."""
    names = [file_name(u) for u in uris]
    if len(set(names)) == len(names):
        return names
    dirs = [u.split("?", 1)[0].split("/")[:-1] for u in uris]
    common = 0
    while all(len(d) > common for d in dirs) and len({d[common] for d in dirs}) == 1:
        common += 1
    return ["/".join(u.split("?", 1)[0].split("/")[common:]) for u in uris]


def stats_table(art: Artifact) -> list[dict[str, Any]]:
    """The UI table of an artifact: in, out, rejects by reason, scalar metrics and run figures."""
    m = art.manifest
    rows = [{"key": "in", "value": m.stats.get("in")}, {"key": "out", "value": m.stats.get("out")}]
    rows += [{"key": f"rejected.{k}", "value": v} for k, v in sorted(m.stats.get("rejected", {}).items())]
    rows += [
        {"key": f"metric.{k}", "value": v} for k, v in sorted(m.metrics.items()) if not isinstance(v, (dict, list))
    ]
    rows += [{"key": f"run.{k}", "value": v} for k, v in sorted(m.run.items()) if not isinstance(v, (dict, list))]
    return rows


def publish(reporter: Reporter, art: Artifact, cached: bool) -> None:
    """UI: a table artifact under the stable key ``<stage>`` with stats, metrics and the URI, and the artifact's
    pictures (where the reporter reaches a UI)."""
    if not reporter.active:
        return
    m = art.manifest
    desc = f"**{m.stage}** `{m.version}` {'(cache hit)' if cached else '(built)'}\n\n`{public_url(art.uri)}`"
    reporter.publish_table(m.stage, stats_table(art), None, desc)
    reporter.publish_pictures(art)  # curves (loss, AUC, F1) as pictures in the UI, not as file paths
