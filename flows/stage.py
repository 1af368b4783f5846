"""Stages and shard maps inside a Prefect run: a stage as one Prefect task, shards on the flow's shard runner.

The stage logic itself is plain Python (:func:`tasks.common.stage.build_stage`); this module adds the run graph
(every stage a task, a cache hit a Completed state named ``Cached``), the flow's retries and timeouts, and the
shard runner: Prefect tasks on a thread pool, or plain functions on a Dask cluster (:mod:`flows.dask_shards`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from prefect import Task, task
from prefect.cache_policies import NONE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    TaskRunFilter,
    TaskRunFilterState,
    TaskRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext
from prefect.futures import as_completed
from prefect.states import Completed, Crashed

from flows.dask_shards import DaskShards
from storage.artifacts import ArtifactRef, ArtifactStore, ArtifactWriter
from tasks.common.stage import (
    Progress,
    ShardTask,
    Stage,
    StageResult,
    build_stage,
    in_run,
    logger,
    pause_point,
    run_options,
)
from tasks.training.preempt import on_hard_exit

_SHARD_RUNNER: ContextVar[Any] = ContextVar("lexiflow_shard_runner", default=None)


@contextlib.contextmanager
def use_shard_runner(runner: Any) -> Iterator[Any]:
    """Inside this block the shard maps submit to ``runner`` (a started Prefect task runner or :class:`DaskShards`)."""
    token = _SHARD_RUNNER.set(runner)
    try:
        yield runner
    finally:
        _SHARD_RUNNER.reset(token)


def run_stage(store: ArtifactStore, stage: Stage, cfg: Any, **inputs: Any) -> ArtifactRef:
    """The one way a flow runs a stage: ``stage`` (a :class:`tasks.common.stage.Stage`) with its config section and
    its inputs (parent refs by name, input files, progress), as :func:`run_build` runs any build. A training
    stage's build runs as a task of its own named ``stage.step`` (e.g. ``pretrain-train``)."""
    plan = stage.plan(cfg, inputs)
    step = _step_task(stage.build, stage.step) if stage.step is not None and in_run() else None
    with crash_reported() if step is not None else contextlib.nullcontext():
        return run_build(store, stage.name, plan.code_version, plan.config, plan.parents,
                         stage.builder(store, cfg, inputs, step), tags=stage.tags)


@contextlib.contextmanager
def crash_reported() -> Iterator[None]:
    """While the block runs in a flow run: when a stop watchdog ends this process (a training stage that did not
    stop by itself in time, :mod:`tasks.training.preempt`), the flow run and its running task runs are set to
    Crashed with the stop line as their message. An exception would have told Prefect itself; a hard exit tells
    nobody, and the UI would show the run Running for good."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        yield
        return
    # the watchdog's thread has no Prefect context of its own: the report runs in a copy of this one (its settings
    # name the API, the temporary server's included)
    report = functools.partial(contextvars.copy_context().run, report_crash, ctx.flow_run.id)
    with on_hard_exit(report):
        yield


def report_crash(flow_run_id: UUID, message: str) -> None:
    """Set the flow run ``flow_run_id`` and its task runs still Running to Crashed with ``message``."""
    running = TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING])))
    with get_client(sync_client=True) as client:
        for run in client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         task_run_filter=running):
            client.set_task_run_state(run.id, Crashed(message=message), force=True)
        client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)


@functools.cache
def _step_task(fn: Callable[..., StageResult], name: str) -> Task:
    """A training stage's build as a Prefect task named ``name`` (no result caching), made once per stage."""
    return task(fn, name=name, cache_policy=NONE)


def run_build(
    store: ArtifactStore,
    stage: str,
    code_version: str,
    config: dict[str, Any],
    parents: Sequence[ArtifactRef],
    build: Callable[[ArtifactWriter, str], StageResult],
    *,
    tags: Sequence[str] = (),
) -> ArtifactRef:
    """How any build runs as a stage: :func:`tasks.common.stage.build_stage` (skip when its version is committed,
    else build, commit, publish), returning the ref.

    Inside a flow run it runs as one Prefect task named after the stage (with the flow's retries, timeout and
    ``tags``, e.g. ``gpu`` for a tag concurrency limit), so every stage shows in the run graph, and a cache
    hit ends in a Completed state named ``Cached`` whose message is the artifact's URI."""
    if not in_run():
        return build_stage(store, stage, code_version, config, parents, build)[0]
    opts = run_options()
    stage_task = _stage_task.with_options(
        name=stage,
        task_run_name=stage,
        retries=opts.stage_retries,
        retry_delay_seconds=opts.retry_delay_s,
        timeout_seconds=opts.stage_timeout_s,
        tags=list(tags),
    )
    state = stage_task(store, stage, code_version, config, parents, build, return_state=True)
    return state.result()


def _stage_body(store, stage, code_version, config, parents, build):
    """The stage task's body: a cache hit returns a Completed state named ``Cached`` (shown as such in the UI)."""
    ref, cached = build_stage(store, stage, code_version, config, parents, build)
    if cached:
        return Completed(name="Cached", message=f"cache hit: {ref.uri}", data=ref)
    return ref


# no result caching: the artifact store is the cache
_stage_task = task(_stage_body, cache_policy=NONE, persist_result=False)


@functools.cache
def prefect_task(shard: ShardTask) -> Task:
    """``shard`` as a Prefect task named after it (no result caching), made once per shard function."""
    return task(shard.fn, name=shard.name, cache_policy=NONE)


def _as_task(work: Any) -> Task:
    """A Prefect task for shard work given as a :class:`ShardTask`, a Prefect task or a plain function."""
    if isinstance(work, Task):
        return work
    if isinstance(work, ShardTask):
        return prefect_task(work)
    return prefect_task(ShardTask(work, work.__name__))


def map_shards(work: Any, items: Sequence[dict[str, Any]], stage: str, fold: Callable[[Any], Any] | None,
               shared: dict[str, Any]) -> list[Any]:
    """:func:`tasks.common.stage.run_map` inside a run: on the configured shard runner (:func:`use_shard_runner`),
    else the flow's own task runner; results in item order, folded as they complete.

    On a thread runner each shard is a Prefect task of this flow run (with the run's shard retries and timeout);
    on Dask (:mod:`flows.dask_shards`) it is the plain function on a worker, retried from here."""
    runner = _SHARD_RUNNER.get()
    if isinstance(runner, DaskShards):
        return _map_dask(runner, getattr(work, "fn", work), items, stage, fold, shared)
    opts = run_options()
    shard = _as_task(work).with_options(retries=opts.shard_retries, retry_delay_seconds=opts.retry_delay_s,
                                        timeout_seconds=opts.shard_timeout_s)
    items = [{**item, **shared} for item in items]
    futures = [shard.submit(**item) if runner is None else runner.submit(shard, item) for item in items]
    index = {id(f): i for i, f in enumerate(futures)}
    kept: list[Any] = [None] * len(futures)
    progress = Progress(stage, len(futures))
    for fut in as_completed(futures):
        res = fut.result()
        kept[index[id(fut)]] = fold(res) if fold else res
        progress.step()
        pause_point(stage)
    return kept


def _map_dask(runner: DaskShards, fn: Callable[..., Any], items: Sequence[dict[str, Any]], stage: str,
              fold: Callable[[Any], Any] | None, shared: dict[str, Any]) -> list[Any]:
    """:func:`map_shards` on a :class:`DaskShards`: plain ``fn`` on the workers, results recorded here as they
    complete; a failed shard is submitted again ``shard_retries`` times."""
    from distributed import as_completed as dask_completed  # noqa: PLC0415  (distributed loads for Dask runs only)

    opts = run_options()
    on_workers = runner.share(shared) if shared else {}
    pending: dict[str, tuple[int, int, Any]] = {}  # future key -> (item index, attempt, future)
    done = dask_completed()

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
