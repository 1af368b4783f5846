"""Shard runner selection (a thread pool or a Dask cluster, local or remote) and the per-run task options."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from flows.dask_shards import DaskShards
from flows.stage import use_shard_runner
from storage.fingerprints import configure as configure_fingerprints
from storage.lease import LeaseSettings
from storage.options import configure as configure_storage
from storage.options import share_with
from tasks.common.config import RunnerConfig
from tasks.common.stage import RunOptions, configure_run


def task_runner(cfg: RunnerConfig) -> Any:
    """What runs the shard maps that ``cfg`` names: Prefect's thread pool (each shard a Prefect task in this
    process), or, for ``kind: dask``, a :class:`flows.dask_shards.DaskShards` client (each shard a plain function
    on a Dask worker, no Prefect there: see that module)."""
    if cfg.kind == "dask":
        return DaskShards(cfg.dask_address, cfg.dask_workers, cfg.dask_threads_per_worker)
    return ThreadPoolTaskRunner(max_workers=cfg.max_workers)


def run_options(cfg: RunnerConfig) -> RunOptions:
    """The retries, timeouts and staging lease that ``cfg`` sets, as :class:`tasks.common.stage.RunOptions`."""
    lease = LeaseSettings(heartbeat_s=cfg.lease_heartbeat_s, stale_after_s=cfg.lease_stale_after_s,
                          poll_s=cfg.lease_poll_s)
    return RunOptions(shard_retries=cfg.shard_retries, stage_retries=cfg.stage_retries,
                      retry_delay_s=cfg.retry_delay_s, shard_timeout_s=cfg.shard_timeout_s,
                      stage_timeout_s=cfg.stage_timeout_s, lease=lease)


def start_run(config: Any) -> None:
    """What every flow does first: install the storage options, this run's task options and the input
    fingerprint cache beside the store (``runner.rehash_inputs`` hashes every input again)."""
    configure_storage(config.storage_options)
    configure_run(run_options(config.runner))
    configure_fingerprints(config.store_uri, rehash=config.runner.rehash_inputs)


@contextlib.contextmanager
def shard_runner(cfg: RunnerConfig) -> Iterator[Any]:
    """The configured shard runner, started for the shard maps inside this block (whatever task runner the
    enclosing flow has: a deployment or a parent flow cannot forget it) and shut down after it."""
    with task_runner(cfg) as runner, use_shard_runner(runner):
        if cfg.kind == "dask":  # its workers open the store too: give them this run's storage options
            share_with(runner.client)
        yield runner
