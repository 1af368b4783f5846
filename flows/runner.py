"""A flow run's start: its storage options, task options and fingerprint cache, as the runtime it hands down."""

from __future__ import annotations

from typing import Any

from flows.logs import attach as attach_logs
from flows.runtime import PrefectRuntime
from storage.fingerprints import FingerprintCache
from storage.lease import LeaseSettings
from storage.options import configure as configure_storage
from tasks.common.config import RunnerConfig
from tasks.common.context import RunOptions


def run_options(cfg: RunnerConfig) -> RunOptions:
    """The retries, timeouts and staging lease that ``cfg`` sets, as :class:`tasks.common.context.RunOptions`."""
    lease = LeaseSettings(heartbeat_s=cfg.lease_heartbeat_s, stale_after_s=cfg.lease_stale_after_s,
                          poll_s=cfg.lease_poll_s)
    return RunOptions(shard_retries=cfg.shard_retries, stage_retries=cfg.stage_retries,
                      retry_delay_s=cfg.retry_delay_s, shard_timeout_s=cfg.shard_timeout_s,
                      stage_timeout_s=cfg.stage_timeout_s, lease=lease)


def start_run(config: Any) -> PrefectRuntime:
    """What every flow does first: route the ``lexiflow`` logs to the run (idempotent), apply the storage options,
    and return this run's runtime: its task options, its owner (the flow run), the input fingerprint cache beside
    the store (``runner.rehash_inputs`` hashes every input again). Shard maps run on ``runtime.shards(cfg)``."""
    attach_logs()
    configure_storage(config.storage_options)
    cache = FingerprintCache(config.store_uri, config.runner.rehash_inputs) if config.store_uri else None
    return PrefectRuntime(run_options(config.runner), fingerprints=cache)


def label_runtime(fingerprint_store: str | None = None, rehash: bool = False) -> PrefectRuntime:
    """The runtime of a flow without a pipeline config (labelling): default task options; the input fingerprint
    cache beside ``fingerprint_store`` when given (a pipeline's store; ``rehash``: hash every input again), else
    none (every input is hashed)."""
    attach_logs()
    return PrefectRuntime(fingerprints=FingerprintCache(fingerprint_store, rehash) if fingerprint_store else None)
