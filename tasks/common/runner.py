"""Task runner selection: bind a thread pool or a Dask cluster (local or remote) to a flow."""

from __future__ import annotations

from typing import Any

from tasks.common.config import RunnerConfig


def task_runner(cfg: RunnerConfig) -> Any:
    """The Prefect task runner that ``cfg`` names (shard tasks are mapped on it)."""
    if cfg.kind == "dask":
        from prefect_dask import DaskTaskRunner

        if cfg.dask_address:
            return DaskTaskRunner(address=cfg.dask_address)
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": cfg.dask_workers,
                "threads_per_worker": cfg.dask_threads_per_worker,
                "dashboard_address": None,
            }
        )
    from prefect.task_runners import ThreadPoolTaskRunner

    return ThreadPoolTaskRunner(max_workers=cfg.max_workers)


def with_runner(flow: Any, cfg: RunnerConfig) -> Any:
    """``flow`` with the task runner ``cfg`` names (a copy; the flow object itself is unchanged)."""
    return flow.with_options(task_runner=task_runner(cfg))
