"""The Prefect-backed runtime a flow builds at its start and hands to every stage it runs.

:class:`PrefectRuntime` is :class:`tasks.common.context.Runtime` inside a flow run: a stage is one Prefect task, a
training step another, shards run on the flow's shard runner (:meth:`PrefectRuntime.shards`: Prefect tasks on a thread
pool, or plain functions on :class:`flows.dask_shards.DaskShards`), UI artifacts are Prefect artifacts, the logger is
the run's, and owner records name the flow run. :func:`flows.runner.start_run` makes it; nothing is installed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prefect import artifacts, get_run_logger
from prefect.context import FlowRunContext, TaskRunContext
from prefect.task_runners import ThreadPoolTaskRunner

from flows.dask_shards import DaskShards
from flows.stage import map_shards, prefect_task, run_stage_task, run_step
from storage.fingerprints import FingerprintCache
from storage.options import share_with
from tasks.common.config import RunnerConfig
from tasks.common.context import RunOptions, Runtime
from tasks.common.ui import Reporter

log = logging.getLogger("lexiflow")


def in_prefect_run() -> bool:
    """Whether a Prefect flow or task run is active in this thread."""
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class PrefectReporter(Reporter):
    """UI artifacts as Prefect artifacts of the current flow or task run (active only inside one)."""

    @property
    def active(self) -> bool:
        """Whether a run is active here to attach artifacts to."""
        return in_prefect_run()

    def table(self, key: str, table: list[dict[str, Any]], description: str) -> None:
        """A Prefect table artifact."""
        artifacts.create_table_artifact(key=key, table=table, description=description)

    def markdown(self, key: str, markdown: str, description: str) -> None:
        """A Prefect markdown artifact."""
        artifacts.create_markdown_artifact(key=key, markdown=markdown, description=description)

    def link(self, key: str, link: str, text: str, description: str) -> None:
        """A Prefect link artifact."""
        artifacts.create_link_artifact(key=key, link=link, link_text=text, description=description)

    def progress(self, key: str, description: str) -> Any:
        """A Prefect progress artifact at 0 %; its id."""
        return artifacts.create_progress_artifact(progress=0.0, key=key, description=description)

    def update_progress(self, handle: Any, percent: float) -> None:
        """Move the progress artifact ``handle``."""
        artifacts.update_progress_artifact(artifact_id=handle, progress=percent)


def flow_run_owner() -> str | None:
    """``flow-run-<id>`` of the running flow run (what its staging owner records name); None outside one."""
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        return f"flow-run-{ctx.flow_run.id}"
    return None


class PrefectRuntime(Runtime):
    """A flow run's runtime: stages, steps and shards as Prefect tasks, artifacts to the UI, the run's logger."""

    def __init__(self, options: RunOptions = RunOptions(), *, owner: str | None = None,
                 fingerprints: FingerprintCache | None = None):
        super().__init__(options, owner=owner if owner is not None else flow_run_owner(), fingerprints=fingerprints,
                         reporter=PrefectReporter())
        self.runner: Any = None  # the started shard runner (:meth:`shards`); None: the flow's own task runner

    @property
    def log(self) -> logging.Logger | logging.LoggerAdapter:
        """Prefect's run logger inside a run (its lines show in the UI), the ``lexiflow`` logger outside."""
        if not in_prefect_run():
            return log
        return get_run_logger()

    @contextlib.contextmanager
    def shards(self, cfg: RunnerConfig) -> Iterator[Any]:
        """The shard runner ``cfg`` names, started for the shard maps inside this block (whatever task runner the
        enclosing flow has) and shut down after it: Prefect's thread pool, or a :class:`DaskShards` client (whose
        workers get this run's storage options)."""
        runner = DaskShards(cfg.dask_address, cfg.dask_workers, cfg.dask_threads_per_worker) if cfg.kind == "dask" \
            else ThreadPoolTaskRunner(max_workers=cfg.max_workers)
        outer = self.runner
        with runner as started:
            if isinstance(started, DaskShards):  # its workers open the store too
                share_with(started.client)
            self.runner = started
            try:
                yield started
            finally:
                self.runner = outer

    def map(self, fn: Callable[..., Any], items: Sequence[dict[str, Any]], *, name: str, stage: str,
            fold: Callable[[Any], Any] | None = None, shared: dict[str, Any] | None = None) -> list[Any]:
        """:func:`flows.stage.map_shards` on this run's shard runner."""
        return map_shards(self.runner, self.options, self.reporter, self.log, fn, list(items), name, stage, fold,
                          dict(shared or {}))

    def call(self, fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
        """``fn`` as a Prefect task named ``name``, called here."""
        return prefect_task(fn, name)(**kwargs)

    def step(self, fn: Callable[..., Any], name: str, **kwargs: Any) -> Any:
        """A training step as the Prefect task ``name``, its hard exit reported (:func:`flows.stage.run_step`)."""
        return run_step(fn, name, **kwargs)

    def run_stage(self, name: str, tags: Sequence[str], body: Callable[[], tuple[Any, bool]]) -> Any:
        """A stage run as one Prefect task named after it (:func:`flows.stage.run_stage_task`)."""
        return run_stage_task(name, tags, self.options, body)
