"""Prefect's side of a run's work: a stage as one Prefect task, a training step as one, shard maps on the flow's
shard runner, and the crash report of a hard exit. :class:`flows.runtime.PrefectRuntime` calls these; the stage logic
itself is plain Python (:func:`tasks.common.stage.run_stage`).

The run graph shows every stage as a task (a cache hit a Completed state named ``Cached``), with the flow's retries
and timeouts; shards run as Prefect tasks on a thread pool, or as plain functions on a Dask cluster
(:mod:`flows.dask_shards`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
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
from tasks.common.context import RunOptions, pause_point
from tasks.common.ui import Reporter
from tasks.training.preempt import on_hard_exit


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


def run_stage_task(name: str, tags: Sequence[str], options: RunOptions, body: Callable[[], tuple[Any, bool]]) -> Any:
    """A stage's ``body`` (returns ``(ref, cached)``) as one Prefect task named after the stage, with the run's
    retries, timeout and ``tags`` (e.g. ``gpu`` for a tag concurrency limit); a cache hit ends in a Completed state
    named ``Cached`` whose message is the artifact's URI. Returns the ref."""
    stage_task = _stage_task.with_options(
        name=name,
        task_run_name=name,
        retries=options.stage_retries,
        retry_delay_seconds=options.retry_delay_s,
        timeout_seconds=options.stage_timeout_s,
        tags=list(tags),
    )
    return stage_task(body, return_state=True).result()


def _stage_body(body: Callable[[], tuple[Any, bool]]) -> Any:
    """The stage task's body: a cache hit returns a Completed state named ``Cached`` (shown as such in the UI)."""
    ref, cached = body()
    if cached:
        return Completed(name="Cached", message=f"cache hit: {ref.uri}", data=ref)
    return ref


# no result caching: the artifact store is the cache
_stage_task = task(_stage_body, cache_policy=NONE, persist_result=False)


def run_step(fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
    """A training stage's step ``fn(**kwargs)`` as the Prefect task ``name`` (no result caching); while it runs, a
    stop watchdog's hard exit is reported as Crashed (:func:`crash_reported`)."""
    with crash_reported():
        return prefect_task(fn, name)(**kwargs)


@functools.cache
def prefect_task(fn: Callable[..., Any], name: str) -> Task:
    """``fn`` as a Prefect task named ``name`` (no result caching), made once per function and name."""
    return task(fn, name=name, cache_policy=NONE)


def map_shards(runner: Any, options: RunOptions, reporter: Reporter, log: Any, fn: Callable[..., Any],
               items: Sequence[dict[str, Any]], name: str, stage: str, fold: Callable[[Any], Any] | None,
               shared: dict[str, Any]) -> list[Any]:
    """A shard map inside a run: on ``runner`` (a started Prefect task runner or :class:`DaskShards`; None: the
    flow's own task runner); results in item order, folded as they complete.

    On a thread runner each shard is a Prefect task ``name`` of this flow run (with the run's shard retries and
    timeout); on Dask (:mod:`flows.dask_shards`) it is the plain function on a worker, retried from here."""
    if isinstance(runner, DaskShards):
        return _map_dask(runner, options, reporter, log, fn, items, stage, fold, shared)
    opts = options
    shard = prefect_task(fn, name).with_options(retries=opts.shard_retries, retry_delay_seconds=opts.retry_delay_s,
                                        timeout_seconds=opts.shard_timeout_s)
    items = [{**item, **shared} for item in items]
    futures = [shard.submit(**item) if runner is None else runner.submit(shard, item) for item in items]
    index = {id(f): i for i, f in enumerate(futures)}
    kept: list[Any] = [None] * len(futures)
    progress = reporter.progress_bar(f"{stage}-progress", len(futures), f"{stage}: shards done")
    for fut in as_completed(futures):
        res = fut.result()
        kept[index[id(fut)]] = fold(res) if fold else res
        progress.step()
        pause_point(stage)
    return kept


def _map_dask(runner: DaskShards, options: RunOptions, reporter: Reporter, log: logging.Logger | Any,
              fn: Callable[..., Any], items: Sequence[dict[str, Any]], stage: str, fold: Callable[[Any], Any] | None,
              shared: dict[str, Any]) -> list[Any]:
    """:func:`map_shards` on a :class:`DaskShards`: plain ``fn`` on the workers, results recorded here as they
    complete; a failed shard is submitted again ``shard_retries`` times."""
    from distributed import as_completed as dask_completed  # noqa: PLC0415  (distributed loads for Dask runs only)

    opts = options
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
    progress = reporter.progress_bar(f"{stage}-progress", len(items), f"{stage}: shards done")
    t0, n_workers = time.perf_counter(), len(runner.client.scheduler_info().get("workers", {}))
    for fut in done:
        i, attempt, _ = pending.pop(fut.key)
        try:
            res = fut.result()
        except Exception as e:
            where = f"{stage}: shard {i + 1}/{len(items)} ({fn.__name__}, attempt {attempt + 1})"
            if attempt < opts.shard_retries:
                log.warning("%s failed, retrying in %s s: %s: %s", where, opts.retry_delay_s,
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
    log.info("%s: %d shards of %s on %d Dask workers in %.1f s", stage, len(items), fn.__name__, n_workers,
                  time.perf_counter() - t0)
    return kept


def _describe(item: dict[str, Any]) -> str:
    """An item's string-valued arguments (URIs, paths), for an error message."""
    return ", ".join(f"{k}={v}" for k, v in item.items() if isinstance(v, str)) or "(no string arguments)"
