"""Shared stage mechanics: content-addressed skip, commit, UI reports, shard mapping, as plain Python.

A stage module exposes ``build(writer, version, **inputs) -> StageResult``; :func:`build_stage` runs it (skip
when committed, else build, reconcile, commit, publish). Inside a flow run :func:`flows.stage.run_stage` makes
that one Prefect task, and the shard maps (:func:`run_map`) run on the flow's shard runner (:mod:`flows.stage`).
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.artifacts import Artifact, ArtifactRef, ArtifactStore, ArtifactWriter, compute_version
from storage.fingerprints import fingerprint_input
from storage.lease import LeaseSettings
from storage.urls import public_url
from tasks.common import ui

log = logging.getLogger("lexiflow")


def logger() -> logging.Logger | logging.LoggerAdapter:
    """The run logger inside a run (shows in the UI), the module logger outside (:func:`tasks.common.ui.run_logger`)."""
    return ui.run_logger()


def in_run() -> bool:
    """Whether a flow or task run is active (UI artifacts are only made inside one)."""
    return ui.in_run()


@dataclass(frozen=True)
class RunOptions:
    """How stage and shard tasks run: retries, timeouts, tags, and the staging lease (from ``runner:``)."""

    shard_retries: int = 0
    stage_retries: int = 0
    retry_delay_s: float = 10.0
    shard_timeout_s: float | None = None
    stage_timeout_s: float | None = None
    lease: LeaseSettings = LeaseSettings()


_OPTIONS: ContextVar[RunOptions] = ContextVar("lexiflow_run_options", default=RunOptions())


def configure_run(options: RunOptions) -> None:
    """Set the options every stage and :func:`run_map` of this flow run uses (call at flow start)."""
    _OPTIONS.set(options)


def run_options() -> RunOptions:
    """The options :func:`configure_run` set for this flow run (the defaults outside one)."""
    return _OPTIONS.get()


@dataclass
class StageResult:
    """What a stage's build function returns: the reconciled counts, the metrics and the rows per file.

    ``stats`` is ``{"in": n, "out": m, "rejected": {reason: k}}`` with ``in == out + sum(rejected)``;
    ``metrics`` are what the build computed (the same on every build of a version); ``run`` is what was
    measured while building (wall time, throughput), written to the manifest's ``run`` section and never
    into a data file; ``publish`` (optional) adds stage-specific Prefect UI artifacts once committed."""

    stats: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    publish: Callable[[Artifact], None] | None = None
    run: dict[str, Any] = field(default_factory=dict)


def section_dump(cfg: Any) -> dict[str, Any]:
    """The default of what enters a stage's version besides its parents: its config section as dumped (nothing
    for a stage without one)."""
    return {} if cfg is None else cfg.model_dump()


@dataclass(frozen=True)
class Stage:
    """A stage as one object: its name, code version, config class, what enters its version, its parents and its
    build. Each stage module defines its ``STAGE``; a flow runs it with :func:`flows.stage.run_stage` and only
    wires artifacts from one stage to the next.

    - ``parents``: the keyword names of ``build``'s parent refs (``clean_ref`` ...), in the order the version
      hashes them.
    - ``version_config(cfg, **inputs)``: what enters the version besides the parents (default: the section's dump);
      it is given the inputs named in ``version_inputs`` (input files whose bytes are part of the version).
    - ``build(writer, version, *, cfg, **parents, **inputs) -> StageResult`` fills the staging directory. A
      training stage (``step`` set) instead has ``build(store_uri, version, *, cfg, **parents, **inputs)``: it
      attaches to the staging directory the stage run leads (so it can run as a step of its own: another task,
      or torchrun's ranks), and inside a flow run it shows as the task ``step``.
    - ``code_version``: a constant, or ``code(cfg)`` where the code version depends on the config.
    """

    name: str
    code_version: str
    config: type | None
    parents: tuple[str, ...]
    build: Callable[..., StageResult]
    version_config: Callable[..., dict[str, Any]] = section_dump
    version_inputs: tuple[str, ...] = ()
    code: Callable[[Any], str] | None = None
    step: str | None = None
    tags: tuple[str, ...] = ()

    def plan(self, cfg: Any, inputs: dict[str, Any]) -> "StagePlan":
        """The version this config and these inputs give: code version, versioned config, parents, version."""
        missing = [p for p in self.parents if p not in inputs]
        if missing:
            raise TypeError(f"stage {self.name}: parent ref(s) {missing} not given")
        code_version = self.code(cfg) if self.code is not None else self.code_version
        config = self.version_config(cfg, **{k: inputs[k] for k in self.version_inputs})
        parents = [inputs[p] for p in self.parents]
        return StagePlan(self.name, code_version, config, parents,
                         compute_version(self.name, code_version, config, parents))

    def builder(self, store: ArtifactStore, cfg: Any, inputs: dict[str, Any],
                step: Callable[..., StageResult] | None = None) -> Callable[[ArtifactWriter, str], StageResult]:
        """``build`` bound to this config and these inputs, as :func:`build_stage` calls it; a training stage's
        build runs through ``step`` (a Prefect task inside a flow run) with the store's URI."""
        if self.step is None:
            return lambda writer, version: self.build(writer, version, cfg=cfg, **inputs)
        call = step or self.build
        return lambda writer, version: call(store.uri, version, cfg=cfg, **inputs)


@dataclass(frozen=True)
class StagePlan:
    """What a stage run will be: its name, code version, the config that enters its version, parents, version."""

    stage: str
    code_version: str
    config: dict[str, Any]
    parents: list[ArtifactRef]
    version: str


def build_stage(store: ArtifactStore, stage: str, code_version: str, config: dict[str, Any],
                parents: Sequence[ArtifactRef], build: Callable[[ArtifactWriter, str], StageResult]
                ) -> tuple[ArtifactRef, bool]:
    """(ref, cached): skip when the version is committed, else ``build(writer, version)`` into the staging
    directory, commit (counts must reconcile), publish to the UI. A plain call: :func:`flows.stage.run_stage`
    runs it as the stage's Prefect task inside a flow run. The lease, the commit and the clean-up around the
    build are the store's (:meth:`storage.store.ArtifactStore.stage`)."""
    version = compute_version(stage, code_version, config, list(parents))
    with store.stage(stage, version, code_version=code_version, config=config, parents=parents,
                     lease=run_options().lease) as st:
        if st.cached:  # committed before, or by another run while this one waited for its lease: adopt it
            return _cache_hit(st.artifact), True
        res = build(st.writer, version)
        if not isinstance(res, StageResult):
            raise TypeError(f"{stage}: build returned {type(res).__name__}, expected a StageResult")
        pause_point(stage)  # crash tests: everything is staged, nothing is committed
        art = st.commit(res.stats, res.metrics, res.rows, res.run)
        if res.publish is not None:
            res.publish(art)
    return _built(art), False


def _cache_hit(art: Artifact) -> ArtifactRef:
    """Log and publish a version found committed; its ref."""
    m = art.manifest
    logger().info("%s %s: cache hit, skipped", m.stage, m.version)
    publish(art, cached=True)
    return art.ref


def _built(art: Artifact) -> ArtifactRef:
    """Log and publish a freshly committed artifact; its ref."""
    m, st = art.manifest, art.manifest.stats
    logger().info("%s %s: built in=%s out=%s rejected=%s -> %s", m.stage, m.version, st["in"], st["out"],
                  st["rejected"], art.uri)
    publish(art, cached=False)
    return art.ref


def input_source(uri: str, name: str | None = None) -> dict[str, Any]:
    """An input file for a stage's config: its URI, its name and the fingerprint of its bytes.

    The version counts the name and the bytes (new bytes, new version) but not the URI
    (``storage.artifacts.without_locations``: the same file in another directory keeps its version); the
    manifest keeps the URI as provenance. ``name`` defaults to the file's base name; give the name the
    stage's data uses for the file (its format is inferred from it, rejects and row ids carry it). Inside a
    flow run an unchanged local file is not read again: its sha256 comes from the store's fingerprint cache
    (:mod:`storage.fingerprints`)."""
    return {"uri": uri, "name": name or file_name(uri), **fingerprint_input(uri)}


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


def publish(art: Artifact, cached: bool) -> None:
    """UI: a table artifact under the stable key ``<stage>`` with stats, metrics and the URI, and the artifact's
    pictures (inside a run only: outside one there is no UI to show them)."""
    if not in_run():
        return
    m = art.manifest
    desc = f"**{m.stage}** `{m.version}` {'(cache hit)' if cached else '(built)'}\n\n`{public_url(art.uri)}`"
    try:
        ui.table_artifact(m.stage, stats_table(art), desc)
    except Exception as e:  # the UI artifact is a convenience; the stage output is already committed
        log.warning("could not publish Prefect artifact for %s: %s", m.stage, e)
    ui.publish_pictures(art)  # curves (loss, AUC, F1) as pictures in the UI, not as file paths


class Progress:
    """A progress artifact for a map over shards or a training stage's epochs (no-op outside a run)."""

    def __init__(self, stage: str, total: int):
        self.total, self.done, self.id = max(total, 1), 0, None
        if not in_run():
            return
        try:
            self.id = ui.progress_artifact(f"{stage}-progress", f"{stage}: shards done")
        except Exception as e:
            log.debug("no progress artifact: %s", e)

    def step(self, n: int = 1) -> None:
        """``n`` more items done."""
        self.done += n
        if self.id is None:
            return
        try:
            ui.update_progress(self.id, 100.0 * self.done / self.total)
        except Exception as e:
            log.debug("progress update failed: %s", e)


@dataclass(frozen=True)
class ShardTask:
    """A shard function and the name its runs show under (inside a Prefect run, the task's name)."""

    fn: Callable[..., Any]
    name: str

    def __call__(self, **kwargs: Any) -> Any:
        """``fn(**kwargs)``, here."""
        return self.fn(**kwargs)


def shard_task(fn: Callable[..., Any], name: str) -> ShardTask:
    """``fn`` as shard work named ``name``: a plain pair, so modules that define shard work stay importable and
    callable without a flow engine (:mod:`flows.stage` makes it a Prefect task inside a run)."""
    return ShardTask(fn, name)


class Shards:
    """How shard maps and named steps run: this default runs them here, in order (no run is active);
    ``flows`` installs the Prefect and Dask one (:class:`flows.prefect_ui.PrefectShards`)."""

    def map(self, task: Any, items: list[dict[str, Any]], stage: str, fold: Callable[[Any], Any] | None,
            shared: dict[str, Any]) -> list[Any]:
        """``task(**item, **shared)`` for every item, in order; ``fold`` applied to each result as it comes."""
        fn = getattr(task, "fn", task)
        kept = []
        for item in items:
            res = fn(**item, **shared)
            kept.append(fold(res) if fold else res)
            pause_point(stage)
        return kept

    def call(self, fn: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> Any:
        """``fn(**kwargs)``, here."""
        return fn(**kwargs)


_HERE = Shards()
_shards: Shards = _HERE


def install_shards(shards: Shards) -> None:
    """Make ``shards`` run the shard maps and steps of a flow run (``flows`` installs Prefect's)."""
    global _shards
    _shards = shards


def run_map(task: Any, items: Sequence[dict[str, Any]], stage: str, fold: Callable[[Any], Any] | None = None,
            shared: dict[str, Any] | None = None) -> list[Any]:
    """Run ``task(**item, **shared)`` for every item; results in item order.

    ``task`` is a :func:`shard_task` (a Prefect task or a plain function work too). With ``fold``, each result is
    passed to ``fold`` as it completes and only ``fold``'s return value is kept, so a reduce does not hold every
    shard's full result at once. ``shared`` holds values every item takes (sent to each Dask worker once, not with
    every shard). Outside a run (a stage's ``build`` called directly) the items run in this process, in order;
    inside one they run on the flow's shard runner (:func:`flows.stage.map_shards`), with the same results."""
    shared = dict(shared or {})
    return (_shards if in_run() else _HERE).map(task, list(items), stage, fold, shared)


def run_task(fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
    """``fn(**kwargs)`` in this process: as a task named ``name`` inside a run (so the step shows in the run
    graph), a plain call outside one."""
    return (_shards if in_run() else _HERE).call(fn, name, kwargs)


def pause_point(stage: str, until: Callable[[], bool] | None = None) -> None:
    """Test hook for crash-safety tests: with ``LEXIFLOW_PAUSE_IN=<stage>`` the process writes
    ``LEXIFLOW_PAUSE_MARKER`` and waits there (mid-stage) until it is killed, or until ``until()`` holds (a
    stop signal arrived: the stage then stops the way it would have)."""
    if os.environ.get("LEXIFLOW_PAUSE_IN") != stage:
        return
    marker = os.environ.get("LEXIFLOW_PAUSE_MARKER")
    if marker:
        Path(marker).write_text(str(os.getpid()))
    while until is None or not until():
        time.sleep(0.1)
