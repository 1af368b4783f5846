"""What a person sees: progress bars only in a terminal; pictures, links and live tables in the run's UI.

This module is the Prefect-free face of the UI. A :class:`Reporter` decides whether a run is active and where its
artifacts go; the default one knows of no run (a library call, a unit test, a torchrun rank), so nothing is
published and the run logger is the module logger. ``flows`` installs Prefect's (:mod:`flows.prefect_ui`) when it
is imported, which every Prefect run, Dask worker and deployment does.
"""

from __future__ import annotations

import base64
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from storage.urls import public_url

log = logging.getLogger("lexiflow")


class Reporter:
    """Where a run's UI artifacts go; this default is used outside any run and publishes nothing."""

    def in_run(self) -> bool:
        """Whether a flow or task run is active."""
        return False

    def run_logger(self) -> logging.Logger | logging.LoggerAdapter:
        """The logger whose lines reach the run's logs."""
        return log

    def table(self, key: str, table: list[dict[str, Any]], description: str) -> None:
        """Publish ``table`` (rows of column -> value) under ``key``."""

    def markdown(self, key: str, markdown: str, description: str) -> None:
        """Publish ``markdown`` under ``key``."""

    def link(self, key: str, link: str, text: str, description: str) -> None:
        """Publish a link to ``link`` under ``key``."""

    def progress(self, key: str, description: str) -> Any:
        """Start a progress bar under ``key`` at 0 %; its handle for :meth:`update_progress` (None: no bar)."""
        return None

    def update_progress(self, handle: Any, percent: float) -> None:
        """Move the bar ``handle`` to ``percent``."""


_reporter = Reporter()


def install(reporter: Reporter) -> None:
    """Make ``reporter`` the one every publishing function of this module uses (``flows`` installs Prefect's)."""
    global _reporter
    _reporter = reporter


def reporter() -> Reporter:
    """The installed reporter."""
    return _reporter


def in_run() -> bool:
    """Whether a flow or task run is active (UI artifacts are only made inside one)."""
    return _reporter.in_run()


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The run logger inside a run (its lines show in the UI), the module logger outside."""
    return _reporter.run_logger()


def table_artifact(key: str, table: list[dict[str, Any]], description: str) -> None:
    """Publish a table artifact; raises what the reporter raises (callers decide how loudly a failure is said)."""
    _reporter.table(key, table, description)


def markdown_artifact(key: str, markdown: str, description: str) -> None:
    """Publish a markdown artifact; raises what the reporter raises."""
    _reporter.markdown(key, markdown, description)


def progress_artifact(key: str, description: str) -> Any:
    """Start a progress artifact at 0 %; its handle, or None where there is no UI."""
    return _reporter.progress(key, description)


def update_progress(handle: Any, percent: float) -> None:
    """Move a progress artifact started by :func:`progress_artifact`."""
    _reporter.update_progress(handle, percent)


def interactive() -> bool:
    """A person is watching this process's stderr (a terminal), not a worker's log file."""
    if os.environ.get("LEXIFLOW_PROGRESS") in ("0", "1"):  # explicit override, e.g. for CI logs
        return os.environ["LEXIFLOW_PROGRESS"] == "1"
    return sys.stderr is not None and sys.stderr.isatty()


def bars(requested: bool) -> bool:
    """tqdm bars only when asked for and interactive: under a Prefect worker they would only fill its logs
    (the stages' progress artifacts show progress in the UI instead)."""
    return bool(requested) and interactive()


def png_markdown(title: str, png: bytes) -> str:
    """Markdown that shows ``png`` itself (a data URI), so the UI renders the picture, not a path."""
    return f"![{title}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def publish_pictures(art) -> None:
    """Every committed ``*.png`` of an artifact as one markdown artifact ``<stage>-curves`` (in a run only)."""
    pngs = [p for p in art.files() if p.endswith(".png")]
    if not pngs or not in_run():
        return
    m = art.manifest
    parts = [f"### {m.stage} `{m.version}`", f"`{art.uri}`"]
    for rel in pngs:
        parts += [f"**{rel}**", png_markdown(f"{m.stage} {rel}", art.read_verified(rel))]
    try:
        markdown_artifact(f"{m.stage}-curves", "\n\n".join(parts), f"{m.stage}: curves ({', '.join(pngs)})")
    except Exception as e:  # the UI artifact is a convenience; the artifact itself is committed
        log.warning("could not publish the %s curves: %s", m.stage, e)


def link_target(uri: str) -> str:
    """A clickable address: local paths become ``file://`` URLs; URLs are kept, without a credential."""
    if "://" in uri:
        return public_url(uri)
    return "file://" + os.path.abspath(uri)


def publish_link(key: str, uri: str, text: str, description: str = "") -> None:
    """A link artifact (in a run only)."""
    if not in_run():
        return
    try:
        _reporter.link(key, link_target(uri), text, description or text)
    except Exception as e:
        log.warning("could not publish the link %s: %s", key, e)


class LiveTable:
    """A table artifact republished while rows arrive (every ``every_s`` seconds at most), so the UI shows a
    long-running log before the stage ends; :meth:`flush` publishes what is left."""

    def __init__(self, key: str, columns: Sequence[str], description: str, every_s: float = 20.0):
        self.key, self.columns, self.description, self.every_s = key, list(columns), description, every_s
        self.rows: list[dict[str, Any]] = []
        self.published = 0  # how many times the table went to the UI
        self._last = 0.0

    def add(self, row: dict[str, Any]) -> None:
        """Keep ``row``; republish the table when ``every_s`` has passed since the last time."""
        self.rows.append(row)
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Publish every row so far (in a run only)."""
        self._last = time.monotonic()
        if not in_run() or not self.rows:
            return
        try:
            table_artifact(self.key, [{c: r.get(c) for c in self.columns} for r in self.rows],
                           f"{self.description} (live: {len(self.rows)} rows so far)")
            self.published += 1
        except Exception as e:
            log.warning("could not publish %s: %s", self.key, e)
