"""Shard work on a Dask cluster without Prefect on the workers.

The flow process is the only Prefect client. Each shard is the stage's pure shard function (the ``.fn`` of a
shard task), submitted with ``dask.distributed``'s ``Client.submit``; the worker runs it and nothing else: no
task run, no state, no API call, so no worker ever needs a Prefect API, let alone starts a temporary server
of its own (what ``prefect_dask.DaskTaskRunner`` did on every worker of a flow with no ``PREFECT_API_URL``).
The flow's :func:`flows.stage.map_shards` records the results: it folds them as they complete, retries
a failed shard (``runner.shard_retries``, ``retry_delay_s``), reports progress, and fails naming the shard.

Workers read their shard and write their output themselves, by URL (the items carry URIs, never rows); only
small summaries come back. A value every shard needs (``shared=`` of :meth:`tasks.common.context.Runtime.map`) is sent
to each worker once (``scatter(broadcast=True)``), not once per shard. Workers started here (a ``LocalCluster``)
also get ``PREFECT_SERVER_ALLOW_EPHEMERAL_MODE=false``: should anything ever call the Prefect API on a worker it
fails loudly instead of starting a server.
"""

from __future__ import annotations

import ctypes
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from models.numerics import scheduling_threads

# what a LocalCluster's workers get on top of this process's environment
WORKER_ENV = {"PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false"}


class DaskShards:
    """A started Dask client (a LocalCluster of ``workers`` processes, or an existing cluster's scheduler
    ``address``) that runs plain shard functions. Use as a context manager; a LocalCluster started here is
    closed on exit, a remote cluster is only disconnected from."""

    def __init__(self, address: str | None = None, workers: int = 2, threads_per_worker: int = 1):
        self.address, self.workers, self.threads_per_worker = address, workers, threads_per_worker
        self.cluster: Any = None
        self.client: Any = None

    def __enter__(self) -> DaskShards:
        from distributed import Client, LocalCluster  # noqa: PLC0415  (loads for Dask runs only)

        if self.address:
            self.client = Client(self.address)
        else:
            # no more worker processes (and threads each) than this process may keep busy: shards give the same
            # bytes on any number of workers, and more busy workers than CPUs only fight for them
            workers = scheduling_threads(self.workers)
            self.cluster = LocalCluster(
                n_workers=workers, threads_per_worker=scheduling_threads(max(1, self.threads_per_worker)),
                processes=True,
                dashboard_address=None, env=dict(WORKER_ENV),
            )
            self.client = Client(self.cluster)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()
            self.client = self.cluster = None

    def share(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` placed on every worker once; the futures stand for them in submitted arguments."""
        return {k: self.client.scatter(v, broadcast=True, hash=False) for k, v in values.items()}

    def submit(self, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float | None = None) -> Any:
        """``fn(**kwargs)`` on a worker (a distributed Future). The key starts with ``fn``'s name, so the
        scheduler's records (and its dashboard) group shards by function."""
        key = f"{fn.__name__}-{uuid.uuid4().hex}"
        return self.client.submit(call_shard, fn, kwargs, timeout_s, key=key, pure=False)

    def cancel(self, futures: list[Any]) -> None:
        """Cancel ``futures`` (the shards still pending when one failed for good)."""
        if futures:
            self.client.cancel(futures)


def call_shard(fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float | None = None) -> Any:
    """What a worker runs: ``fn(**kwargs)``; with ``timeout_s``, a TimeoutError is raised in the running
    thread once it has run that long (as Prefect's thread timeouts do: at the next Python bytecode)."""
    if not timeout_s:
        return fn(**kwargs)
    tid = threading.get_ident()
    fired = threading.Event()

    def interrupt() -> None:
        fired.set()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(TimeoutError))

    timer = threading.Timer(timeout_s, interrupt)
    timer.start()
    try:
        return fn(**kwargs)
    except TimeoutError:
        if fired.is_set():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} ran longer than shard_timeout_s={timeout_s}") from None
        raise
    finally:
        timer.cancel()
        if fired.is_set():  # the exception may still be pending if fn returned just as the timer fired
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
