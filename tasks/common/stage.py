"""Shared stage mechanics: content-addressed skip, commit, Prefect UI artifacts, shard mapping.

A stage module exposes ``build(writer, version, **inputs) -> StageResult``; :func:`run_stage` is the
one way it runs (skip when committed, else build, reconcile, commit, publish).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.artifacts import (
    Artifact,
    ArtifactRef,
    ArtifactStore,
    ArtifactWriter,
    compute_version,
    fingerprint_uri,
    open_artifact,
)

log = logging.getLogger("lexiflow")


def logger():
    """The Prefect run logger inside a run (shows in the UI), the module logger outside."""
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # no active flow/task run context
        return log


def in_run() -> bool:
    """Whether a Prefect flow or task run is active (UI artifacts are only made inside one)."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class StageRun:
    """One stage execution: decides skip vs. build, hands out the staging writer, commits."""

    def __init__(
        self,
        store: ArtifactStore,
        stage: str,
        code_version: str,
        config: dict[str, Any],
        parents: Sequence[ArtifactRef],
    ):
        self.store, self.stage, self.code_version = store, stage, code_version
        self.config = config
        self.parents = list(parents)
        self.version = compute_version(stage, code_version, config, self.parents)
        self.ref = store.ref(stage, self.version)
        self._writer: ArtifactWriter | None = None

    @property
    def cached(self) -> bool:
        return self.store.is_committed(self.stage, self.version)

    def writer(self) -> ArtifactWriter:
        if self._writer is None:
            self._writer = self.store.begin(self.stage, self.version)
        return self._writer

    def cache_hit(self) -> ArtifactRef | None:
        """The committed ref when this version already exists (logged and published), else None."""
        if not self.cached:
            return None
        logger().info("%s %s: cache hit, skipped", self.stage, self.version)
        art = open_artifact(self.ref)
        publish(art, cached=True)
        return art.ref

    def finish(self, art: Artifact) -> ArtifactRef:
        """Log and publish a freshly committed artifact."""
        st = art.manifest.stats
        logger().info(
            "%s %s: built in=%s out=%s rejected=%s -> %s",
            self.stage,
            self.version,
            st["in"],
            st["out"],
            st["rejected"],
            art.uri,
        )
        publish(art, cached=False)
        return art.ref

    def commit(
        self, stats: dict[str, Any], metrics: dict[str, Any] | None = None, rows: dict[str, int] | None = None
    ) -> Artifact:
        if sum(stats.get("rejected", {}).values()) + stats["out"] != stats["in"]:
            raise RuntimeError(f"{self.stage}: counts do not reconcile: {stats}")
        return self.writer().commit(
            code_version=self.code_version,
            config=self.config,
            parents=self.parents,
            stats=stats,
            metrics=metrics,
            rows=rows,
        )


@dataclass
class StageResult:
    """What a stage's build function returns: the reconciled counts, the metrics and the rows per file.

    ``stats`` is ``{"in": n, "out": m, "rejected": {reason: k}}`` with ``in == out + sum(rejected)``;
    ``publish`` (optional) adds stage-specific Prefect UI artifacts once the artifact is committed."""

    stats: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    publish: Callable[[Artifact], None] | None = None


def run_stage(
    store: ArtifactStore,
    stage: str,
    code_version: str,
    config: dict[str, Any],
    parents: Sequence[ArtifactRef],
    build: Callable[[ArtifactWriter, str], StageResult],
    *,
    as_task: bool = False,
) -> ArtifactRef:
    """The one way a stage runs: skip when its version is committed, else ``build(writer, version)``
    into the staging directory, commit (counts must reconcile), publish to the UI, return the ref.

    ``as_task=True`` runs all of that as one Prefect task named ``stage``, so a stage that maps no
    shard tasks still shows in the run graph (cache hits included)."""
    if as_task:
        return _stage_task().with_options(name=stage)(store, stage, code_version, config, parents, build)
    run = StageRun(store, stage, code_version, config, parents)
    if hit := run.cache_hit():
        return hit
    res = build(run.writer(), run.version)
    if not isinstance(res, StageResult):
        raise TypeError(f"{stage}: build returned {type(res).__name__}, expected a StageResult")
    art = run.commit(res.stats, res.metrics, res.rows)
    if res.publish is not None:
        res.publish(art)
    return run.finish(art)


def _stage_task():
    """:func:`run_stage` as a Prefect task (no result caching: the artifact store is the cache)."""
    from prefect import task
    from prefect.cache_policies import NONE

    return task(run_stage, cache_policy=NONE)


def input_source(uri: str) -> dict[str, Any]:
    """An input file for a stage's version: its URI and the fingerprint of its bytes (new bytes, new version)."""
    return {"uri": uri, **fingerprint_uri(uri)}


def stats_table(art: Artifact) -> list[dict[str, Any]]:
    m = art.manifest
    rows = [{"key": "in", "value": m.stats.get("in")}, {"key": "out", "value": m.stats.get("out")}]
    rows += [{"key": f"rejected.{k}", "value": v} for k, v in sorted(m.stats.get("rejected", {}).items())]
    rows += [
        {"key": f"metric.{k}", "value": v} for k, v in sorted(m.metrics.items()) if not isinstance(v, (dict, list))
    ]
    return rows


def publish(art: Artifact, cached: bool) -> None:
    """Prefect UI: a table artifact under the stable key ``<stage>`` with stats, metrics and the URI
    (inside a run only: outside one there is no UI to show it, and Prefect would start a local API)."""
    if not in_run():
        return
    from prefect.artifacts import create_table_artifact

    m = art.manifest
    desc = f"**{m.stage}** `{m.version}` {'(cache hit)' if cached else '(built)'}\n\n`{art.uri}`"
    try:
        create_table_artifact(key=m.stage, table=stats_table(art), description=desc)
    except Exception as e:  # the UI artifact is a convenience; the stage output is already committed
        log.warning("could not publish Prefect artifact for %s: %s", m.stage, e)


class Progress:
    """A Prefect progress artifact for a map over shards (no-op outside a run)."""

    def __init__(self, stage: str, total: int):
        self.total, self.done, self.id = max(total, 1), 0, None
        if not in_run():
            return
        try:
            from prefect.artifacts import create_progress_artifact

            self.id = create_progress_artifact(
                progress=0.0, key=f"{stage}-progress", description=f"{stage}: shards done"
            )
        except Exception as e:
            log.debug("no progress artifact: %s", e)

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.id is None:
            return
        from prefect.artifacts import update_progress_artifact

        try:
            update_progress_artifact(artifact_id=self.id, progress=100.0 * self.done / self.total)
        except Exception as e:
            log.debug("progress update failed: %s", e)


def run_map(task, items: Sequence[dict[str, Any]], stage: str, fold: Callable[[Any], Any] | None = None) -> list[Any]:
    """Submit ``task(**item)`` for every item on the flow's task runner; results in item order.

    With ``fold``, each result is passed to ``fold`` as it completes and only ``fold``'s return
    value is kept, so a reduce does not hold every shard's full result at once.
    """
    from prefect.futures import as_completed

    futures = [task.submit(**item) for item in items]
    index = {id(f): i for i, f in enumerate(futures)}
    kept: list[Any] = [None] * len(futures)
    progress = Progress(stage, len(futures))
    for fut in as_completed(futures):
        res = fut.result()
        kept[index[id(fut)]] = fold(res) if fold else res
        progress.step()
        pause_point(stage)
    return kept


def pause_point(stage: str) -> None:
    """Test hook for crash-safety tests: with ``LEXIFLOW_PAUSE_IN=<stage>`` the process writes
    ``LEXIFLOW_PAUSE_MARKER`` and waits there (mid-stage) until it is killed."""
    if os.environ.get("LEXIFLOW_PAUSE_IN") != stage:
        return
    marker = os.environ.get("LEXIFLOW_PAUSE_MARKER")
    if marker:
        Path(marker).write_text(str(os.getpid()))
    while True:
        time.sleep(0.5)
