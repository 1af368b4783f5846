"""The Dask shard runner (flows.dask_shards): shards are plain functions on the workers (no Prefect task
run, no Prefect API, no server there), retried and recorded by the flow, with shared values sent once.
The whole ``prepare`` flow on 4 workers from a process without a Prefect API is in tests/test_operate.py."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from flows.dask_shards import WORKER_ENV, call_shard


def probe(i: int, marker: str, shared: np.ndarray) -> dict:
    """A shard that fails once (for shard 1), then reports what the worker process looks like."""
    if i == 1 and not Path(marker).exists():
        Path(marker).touch()
        raise OSError("transient: connection reset by peer")
    in_task_run = False
    if "prefect" in sys.modules:
        from prefect.context import TaskRunContext

        in_task_run = TaskRunContext.get() is not None
    api = None
    if i == 0 and not os.environ.get("PREFECT_API_URL"):  # what any Prefect API call on a worker would meet
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                client.hello()
            api = "reached"
        except Exception as e:
            api = f"{type(e).__name__}: {e}"
    return {"i": i, "pid": os.getpid(), "in_task_run": in_task_run, "shared": int(shared.sum()), "api": api,
            "allow_ephemeral": os.environ.get("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"),
            "server_modules": sorted(m for m in sys.modules if m.startswith("prefect.server"))}


def always_fails(path: str) -> None:
    raise OSError(f"{path}: no such object")


@pytest.mark.flow
def test_shards_run_as_plain_functions_on_the_workers_and_the_flow_retries_them(prefect_server, tmp_path):
    pytest.importorskip("distributed")
    from prefect import flow

    from flows.runner import run_options
    from flows.runtime import PrefectRuntime
    from tasks.common.config import RunnerConfig

    cfg = RunnerConfig(kind="dask", dask_workers=2, shard_retries=1, retry_delay_s=0)
    big = np.arange(100_000, dtype=np.int64)

    @flow
    def shards() -> tuple[list, str]:
        rt = PrefectRuntime(run_options(cfg))
        with rt.shards(cfg):
            folded = []
            got = rt.map(probe, [{"i": i, "marker": str(tmp_path / "failed")} for i in range(4)], name="probe",
                         stage="probe", fold=lambda r: folded.append(r["i"]) or r, shared={"shared": big})
            try:
                rt.map(always_fails, [{"path": "s3://b/part-1.parquet"}], name="doomed", stage="doomed")
            except OSError as e:
                return got, folded, str(e) + "\n".join(getattr(e, "__notes__", []))
        return got, folded, ""

    got, folded, error = shards()
    assert [r["i"] for r in got] == [0, 1, 2, 3] and sorted(folded) == [0, 1, 2, 3]  # item order; each folded
    assert (tmp_path / "failed").exists()  # shard 1 failed once and its retry succeeded
    assert all(r["shared"] == int(big.sum()) for r in got)
    assert len({r["pid"] for r in got} - {os.getpid()}) >= 1  # in worker processes, not here
    assert not any(r["in_task_run"] for r in got)  # a plain call: no Prefect task run on the worker
    assert all(r["server_modules"] == [] for r in got)  # no Prefect server code was even imported there
    assert all(r["allow_ephemeral"] == WORKER_ENV["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] for r in got)
    if not os.environ.get("PREFECT_API_URL"):  # a Prefect API call on a worker fails; it never starts a server
        assert got[0]["api"] is not None and got[0]["api"] != "reached", got[0]["api"]
        assert "No Prefect API URL provided" in got[0]["api"], got[0]["api"]
    assert "s3://b/part-1.parquet: no such object" in error and "doomed: shard 1/1 (always_fails" in error
    assert "path=s3://b/part-1.parquet" in error  # the note names the item


def test_a_shard_running_past_its_timeout_is_interrupted():
    def spin(n: int) -> int:
        for _ in range(n):
            time.sleep(0.01)
        return n

    assert call_shard(spin, {"n": 3}, timeout_s=5) == 3
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="spin ran longer than shard_timeout_s=0.2"):
        call_shard(spin, {"n": 1000}, timeout_s=0.2)
    assert time.perf_counter() - t0 < 5
    with pytest.raises(ValueError):  # the shard's own errors pass through unchanged
        call_shard(lambda x: int(x), {"x": "not a number"}, timeout_s=5)
