"""What storage asks of the running Prefect flow (its run id, its Dask clients), installed when ``flows`` loads."""

from __future__ import annotations

import sys
from typing import Any

from storage import lease, options


def flow_run_id() -> str | None:
    """The running Prefect flow run's id, or None outside one (a plain process never imports Prefect for it)."""
    if "prefect" not in sys.modules:  # no flow can be running: spare a plain process the import
        return None
    try:
        from prefect.context import FlowRunContext  # noqa: PLC0415  (only once Prefect is loaded, above)
    except ImportError:  # prefect is a dependency; this only guards import-light tools
        return None
    ctx = FlowRunContext.get()
    if ctx is not None and ctx.flow_run is not None:
        return str(ctx.flow_run.id)
    return None


def flow_dask_clients() -> list[Any]:
    """The client of the running flow's ``DaskTaskRunner`` (started now if it was not yet); none elsewhere."""
    if "prefect_dask" not in sys.modules:  # no Dask task runner can be running
        return []
    from prefect.context import FlowRunContext  # noqa: PLC0415  (only once prefect_dask is loaded, above)
    from prefect_dask import DaskTaskRunner  # noqa: PLC0415  (only once loaded, above)

    ctx = FlowRunContext.get()
    if ctx is not None and isinstance(ctx.task_runner, DaskTaskRunner):
        return [ctx.task_runner.client]
    return []


def install() -> None:
    """Give storage these two sources (owner records name the flow run; storage options reach its Dask workers)."""
    lease.set_run_id_source(flow_run_id)
    options.set_client_source(flow_dask_clients)
