"""Shared stage mechanics: content-addressed skip, commit, Prefect UI artifacts, shard mapping.

A stage module exposes ``build(writer, version, **inputs) -> StageResult``; :func:`run_stage` is the
one way it runs (skip when committed, else build, reconcile, commit, publish).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import sys
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.artifacts import (
    Artifact,
    ArtifactRef,
    ArtifactStore,
    ArtifactWriter,
    compute_version,
    open_artifact,
)
from storage.fingerprints import fingerprint_input
from storage.lease import LeaseSettings
from tasks.common.ui import publish_pictures

log = logging.getLogger("lexiflow")


def logger():
    """The Prefect run logger inside a run (shows in the UI), the module logger outside."""
    if "prefect" not in sys.modules:  # no run can be active; and importing Prefect costs a second
        return log
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # no active flow/task run context
        return log


def in_run() -> bool:
    """Whether a Prefect flow or task run is active (UI artifacts are only made inside one)."""
    if "prefect" not in sys.modules:
        return False
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


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
_SHARD_RUNNER: ContextVar[Any] = ContextVar("lexiflow_shard_runner", default=None)


@contextlib.contextmanager
def use_shard_runner(runner: Any):
    """Inside this block :func:`run_map` submits shard tasks to ``runner`` (a started Prefect task runner)."""
    token = _SHARD_RUNNER.set(runner)
    try:
        yield runner
    finally:
        _SHARD_RUNNER.reset(token)


def configure_run(options: RunOptions) -> None:
    """Set the options every :func:`run_stage` and :func:`run_map` of this flow run uses (call at flow start)."""
    _OPTIONS.set(options)


def run_options() -> RunOptions:
    return _OPTIONS.get()


class StageRun:
    """One stage execution: decides skip vs. build, owns the staging directory (a lease), commits."""

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

    def writer(self, lease: LeaseSettings | None = None) -> ArtifactWriter | None:
        """The staging writer, under this run's lease; None when another run committed the version while this
        one waited for it (the caller adopts it: :meth:`cache_hit`)."""
        if self._writer is None:
            self._writer = self.store.begin(self.stage, self.version, lease or run_options().lease)
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
        self, stats: dict[str, Any], metrics: dict[str, Any] | None = None, rows: dict[str, int] | None = None,
        run: dict[str, Any] | None = None,
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
            run=run,
        )

    def release(self) -> None:
        """Give up the lease (after a failure: the next attempt or run takes the directory over)."""
        if self._writer is not None and self._writer.lease is not None:
            self._writer.lease.release()


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


def run_stage(
    store: ArtifactStore,
    stage: str,
    code_version: str,
    config: dict[str, Any],
    parents: Sequence[ArtifactRef],
    build: Callable[[ArtifactWriter, str], StageResult],
    *,
    tags: Sequence[str] = (),
) -> ArtifactRef:
    """The one way a stage runs: skip when its version is committed, else ``build(writer, version)``
    into the staging directory, commit (counts must reconcile), publish to the UI, return the ref.

    Inside a flow run it runs as one Prefect task named ``stage`` (with the flow's retries, timeout and
    ``tags``, e.g. ``gpu`` for a tag concurrency limit), so every stage shows in the run graph, and a cache
    hit ends in a Completed state named ``Cached`` whose message is the artifact's URI."""
    if not in_run():
        return _run_stage(store, stage, code_version, config, parents, build)[0]
    opts = run_options()
    stage_task = _stage_task().with_options(
        name=stage,
        task_run_name=stage,
        retries=opts.stage_retries,
        retry_delay_seconds=opts.retry_delay_s,
        timeout_seconds=opts.stage_timeout_s,
        tags=list(tags),
    )
    state = stage_task(store, stage, code_version, config, parents, build, return_state=True)
    return state.result()


def _run_stage(store, stage, code_version, config, parents, build) -> tuple[ArtifactRef, bool]:
    """(ref, cached): :func:`run_stage`'s body, outside any Prefect machinery."""
    run = StageRun(store, stage, code_version, config, parents)
    if hit := run.cache_hit():
        return hit, True
    writer = run.writer()
    if writer is None:  # another run built this version while we waited for its lease: adopt its artifact
        return run.cache_hit(), True
    try:
        res = build(writer, run.version)
        if not isinstance(res, StageResult):
            raise TypeError(f"{stage}: build returned {type(res).__name__}, expected a StageResult")
        pause_point(stage)  # crash tests: everything is staged, nothing is committed
        art = run.commit(res.stats, res.metrics, res.rows, res.run)
    finally:
        run.release()
    if res.publish is not None:
        res.publish(art)
    store.remove_checkpoints(stage, run.version)  # resume state is useless once the stage has committed
    return run.finish(art), False


def _stage_body(store, stage, code_version, config, parents, build):
    """The stage task's body: a cache hit returns a Completed state named ``Cached`` (shown as such in the UI)."""
    from prefect.states import Completed

    ref, cached = _run_stage(store, stage, code_version, config, parents, build)
    if cached:
        return Completed(name="Cached", message=f"cache hit: {ref.uri}", data=ref)
    return ref


def _stage_task():
    """:func:`run_stage` as a Prefect task (no result caching: the artifact store is the cache)."""
    from prefect import task
    from prefect.cache_policies import NONE

    return task(_stage_body, cache_policy=NONE, persist_result=False)


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
    m = art.manifest
    rows = [{"key": "in", "value": m.stats.get("in")}, {"key": "out", "value": m.stats.get("out")}]
    rows += [{"key": f"rejected.{k}", "value": v} for k, v in sorted(m.stats.get("rejected", {}).items())]
    rows += [
        {"key": f"metric.{k}", "value": v} for k, v in sorted(m.metrics.items()) if not isinstance(v, (dict, list))
    ]
    rows += [{"key": f"run.{k}", "value": v} for k, v in sorted(m.run.items()) if not isinstance(v, (dict, list))]
    return rows


def publish(art: Artifact, cached: bool) -> None:
    """Prefect UI: a table artifact under the stable key ``<stage>`` with stats, metrics and the URI
    (inside a run only: outside one there is no UI to show it, and Prefect would start a local API)."""
    if not in_run():
        return
    from prefect.artifacts import create_table_artifact

    m = art.manifest
    from storage.urls import public_url

    desc = f"**{m.stage}** `{m.version}` {'(cache hit)' if cached else '(built)'}\n\n`{public_url(art.uri)}`"
    try:
        create_table_artifact(key=m.stage, table=stats_table(art), description=desc)
    except Exception as e:  # the UI artifact is a convenience; the stage output is already committed
        log.warning("could not publish Prefect artifact for %s: %s", m.stage, e)
    publish_pictures(art)  # curves (loss, AUC, F1) as pictures in the UI, not as file paths


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


@functools.cache
def shard_task(fn: Callable[..., Any], name: str):
    """``fn`` as a Prefect task named ``name`` (no result caching), made on first use: modules that define
    shard work stay importable without Prefect (labelling from the CLI imports the vocabulary format, not a
    flow engine)."""
    from prefect import task
    from prefect.cache_policies import NONE

    return task(fn, name=name, cache_policy=NONE)


def run_map(task, items: Sequence[dict[str, Any]], stage: str, fold: Callable[[Any], Any] | None = None,
            shared: dict[str, Any] | None = None) -> list[Any]:
    """Run ``task(**item, **shared)`` for every item on the configured shard runner; results in item order.

    With ``fold``, each result is passed to ``fold`` as it completes and only ``fold``'s return
    value is kept, so a reduce does not hold every shard's full result at once. ``shared`` holds values every
    item takes (sent to each Dask worker once, not with every shard). Outside a Prefect run (a stage's
    ``build`` called directly) the items run in this process, in order, with the same results. On the thread
    runner each shard is a Prefect task of this flow run; on Dask (:mod:`tasks.common.dask_shards`) it is
    the task's plain function on a worker, retried from here."""
    shared = dict(shared or {})
    if not in_run():  # a stage called directly (a library call, a unit test): its shards run here, in order
        fn = getattr(task, "fn", task)
        kept = []
        for item in items:
            res = fn(**item, **shared)
            kept.append(fold(res) if fold else res)
            pause_point(stage)
        return kept
    runner = _SHARD_RUNNER.get()  # the configured runner (tasks.common.runner.shard_runner), else the flow's
    from tasks.common.dask_shards import DaskShards

    if isinstance(runner, DaskShards):
        return _run_map_dask(runner, getattr(task, "fn", task), items, stage, fold, shared)
    from prefect.futures import as_completed

    opts = run_options()
    task = task.with_options(retries=opts.shard_retries, retry_delay_seconds=opts.retry_delay_s,
                             timeout_seconds=opts.shard_timeout_s)
    items = [{**item, **shared} for item in items]
    futures = [task.submit(**item) if runner is None else runner.submit(task, item) for item in items]
    index = {id(f): i for i, f in enumerate(futures)}
    kept: list[Any] = [None] * len(futures)
    progress = Progress(stage, len(futures))
    for fut in as_completed(futures):
        res = fut.result()
        kept[index[id(fut)]] = fold(res) if fold else res
        progress.step()
        pause_point(stage)
    return kept


def _run_map_dask(runner, fn: Callable[..., Any], items: Sequence[dict[str, Any]], stage: str,
                  fold: Callable[[Any], Any] | None, shared: dict[str, Any]) -> list[Any]:
    """:func:`run_map` on a :class:`tasks.common.dask_shards.DaskShards`: plain ``fn`` on the workers, results
    recorded here as they complete; a failed shard is submitted again ``shard_retries`` times."""
    from distributed import as_completed

    opts = run_options()
    on_workers = runner.share(shared) if shared else {}
    pending: dict[str, tuple[int, int, Any]] = {}  # future key -> (item index, attempt, future)
    done = as_completed()

    def submit(i: int, attempt: int) -> None:
        fut = runner.submit(fn, {**items[i], **on_workers}, opts.shard_timeout_s)
        pending[fut.key] = (i, attempt, fut)
        done.add(fut)

    for i in range(len(items)):
        submit(i, 0)
    kept: list[Any] = [None] * len(items)
    progress = Progress(stage, len(items))
    t0, n_workers = time.perf_counter(), len(runner.client.scheduler_info().get("workers", {}))
    for fut in done:
        i, attempt, _ = pending.pop(fut.key)
        try:
            res = fut.result()
        except Exception as e:
            where = f"{stage}: shard {i + 1}/{len(items)} ({fn.__name__}, attempt {attempt + 1})"
            if attempt < opts.shard_retries:
                logger().warning("%s failed, retrying in %s s: %s: %s", where, opts.retry_delay_s,
                                 type(e).__name__, e)
                time.sleep(opts.retry_delay_s)
                submit(i, attempt + 1)
                continue
            runner.cancel([f for _, _, f in pending.values()])
            e.add_note(f"{where} on the Dask cluster; item: {_describe(items[i])}")
            raise
        kept[i] = fold(res) if fold else res
        progress.step()
        pause_point(stage)
    logger().info("%s: %d shards of %s on %d Dask workers in %.1f s", stage, len(items), fn.__name__, n_workers,
                  time.perf_counter() - t0)
    return kept


def _describe(item: dict[str, Any]) -> str:
    """An item's string-valued arguments (URIs, paths), for an error message."""
    return ", ".join(f"{k}={v}" for k, v in item.items() if isinstance(v, str)) or "(no string arguments)"


def run_task(fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
    """``fn(**kwargs)`` in this process: as a Prefect task named ``name`` inside a run (so the step shows in
    the run graph), a plain call outside one."""
    if not in_run():
        return fn(**kwargs)
    return shard_task(fn, name)(**kwargs)


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
