"""Prefect behind :mod:`tasks.common.ui` and the shard maps of :mod:`tasks.common.stage`: installed when ``flows``
is imported, so a stage's progress, tables, pictures and links reach the Prefect UI inside a run.

Prefect is imported only when a run is active or an artifact is made: the CLI labels without a Prefect API and
must not pay Prefect's import (about a second) for a module it never uses.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from tasks.common import stage, ui


class PrefectReporter(ui.Reporter):
    """UI artifacts as Prefect artifacts of the current flow or task run."""

    def in_run(self) -> bool:
        """Whether a Prefect flow or task run is active in this thread."""
        if "prefect" not in sys.modules:  # nothing imported Prefect: no run can be active
            return False
        from prefect.context import FlowRunContext, TaskRunContext  # noqa: PLC0415  (loaded with Prefect above)

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None

    def run_logger(self) -> logging.Logger | logging.LoggerAdapter:
        """Prefect's run logger inside a run (shows in the UI), the ``lexiflow`` logger outside."""
        if "prefect" not in sys.modules:
            return ui.log
        from prefect import get_run_logger  # noqa: PLC0415  (loaded with Prefect above)

        try:
            return get_run_logger()
        except Exception:  # no active flow/task run context
            return ui.log

    def table(self, key: str, table: list[dict[str, Any]], description: str) -> None:
        """A Prefect table artifact."""
        from prefect import artifacts  # noqa: PLC0415  (Prefect's import cost: only when publishing)

        artifacts.create_table_artifact(key=key, table=table, description=description)

    def markdown(self, key: str, markdown: str, description: str) -> None:
        """A Prefect markdown artifact."""
        from prefect import artifacts  # noqa: PLC0415  (Prefect's import cost: only when publishing)

        artifacts.create_markdown_artifact(key=key, markdown=markdown, description=description)

    def link(self, key: str, link: str, text: str, description: str) -> None:
        """A Prefect link artifact."""
        from prefect import artifacts  # noqa: PLC0415  (Prefect's import cost: only when publishing)

        artifacts.create_link_artifact(key=key, link=link, link_text=text, description=description)

    def progress(self, key: str, description: str) -> Any:
        """A Prefect progress artifact at 0 %; its id."""
        from prefect import artifacts  # noqa: PLC0415  (Prefect's import cost: only when publishing)

        return artifacts.create_progress_artifact(progress=0.0, key=key, description=description)

    def update_progress(self, handle: Any, percent: float) -> None:
        """Move the progress artifact ``handle``."""
        from prefect import artifacts  # noqa: PLC0415  (Prefect's import cost: only when publishing)

        artifacts.update_progress_artifact(artifact_id=handle, progress=percent)


class PrefectShards(stage.Shards):
    """Shard maps and named steps inside a run: Prefect tasks on the thread runner, plain functions on Dask."""

    def map(self, task: Any, items: list[dict[str, Any]], stage_name: str, fold: Any, shared: dict[str, Any]
            ) -> list[Any]:
        """:func:`flows.stage.map_shards`."""
        from flows.stage import map_shards  # noqa: PLC0415  (imports Prefect: a run is active, it is loaded)

        return map_shards(task, items, stage_name, fold, shared)

    def call(self, fn: Any, name: str, kwargs: dict[str, Any]) -> Any:
        """``fn`` as a Prefect task named ``name``, called here."""
        from flows.stage import prefect_task  # noqa: PLC0415  (imports Prefect: a run is active, it is loaded)

        return prefect_task(stage.shard_task(fn, name))(**kwargs)


def install() -> None:
    """Route :mod:`tasks.common.ui` and the shard maps through Prefect (idempotent)."""
    ui.install(PrefectReporter())
    stage.install_shards(PrefectShards())
