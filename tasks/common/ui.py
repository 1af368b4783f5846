"""What a person sees: progress bars only in a terminal; pictures, links, tables and live tables in the run's UI.

This module is the Prefect-free face of the UI. A :class:`Reporter` says where a run's artifacts go; this plain one
(a library call, a unit test, a torchrun rank, a Dask worker) publishes nothing. A run's runtime holds its reporter
(:class:`tasks.common.context.Runtime`; ``flows`` builds Prefect's at flow start) and every publishing call goes
through it: tables, markdown, links, pictures, progress bars and live tables. Nothing is installed here.
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
    """Where a run's UI artifacts go; this plain one publishes nothing (no run, no UI).

    The primitives (:meth:`table`, :meth:`markdown`, :meth:`link`, :meth:`progress`, :meth:`update_progress`) are
    what a UI implements; the ``publish_*`` helpers, :class:`Progress` and :class:`LiveTable` are built on them, skip
    all work when :attr:`active` is false, and log a failure instead of raising (an artifact is a convenience)."""

    active = False  # whether publishing reaches a UI

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

    # ------------------------------------------------------------------ helpers on the primitives
    def publish_table(self, key: str, rows: list[dict[str, Any]], columns: Sequence[str] | None, description: str,
                      markdown: tuple[str, str, str] | None = None) -> bool:
        """``rows`` (only ``columns``, when given) as the table ``key``, then the optional ``markdown = (key, text,
        description)``; True when published. A failure is logged, never raised."""
        if not self.active:
            return False
        try:
            self.table(key, [{k: r.get(k) for k in columns} for r in rows] if columns else rows, description)
            if markdown is not None:
                self.markdown(*markdown)
        except Exception as e:  # the UI artifact is a convenience; what it shows is committed already
            log.warning("could not publish %s: %s", key, e)
            return False
        return True

    def publish_markdown(self, key: str, markdown: str, description: str) -> bool:
        """``markdown`` under ``key``; True when published (a failure is logged)."""
        if not self.active:
            return False
        try:
            self.markdown(key, markdown, description)
        except Exception as e:  # the UI artifact is a convenience
            log.warning("could not publish %s: %s", key, e)
            return False
        return True

    def publish_link(self, key: str, uri: str, text: str, description: str = "") -> None:
        """A link artifact to ``uri`` (a local path becomes a ``file://`` URL, a URL loses its credentials)."""
        if not self.active:
            return
        try:
            self.link(key, link_target(uri), text, description or text)
        except Exception as e:
            log.warning("could not publish the link %s: %s", key, e)

    def publish_pictures(self, art) -> None:
        """Every committed ``*.png`` of an artifact as one markdown artifact ``<stage>-curves``."""
        if not self.active:
            return
        pngs = [p for p in art.files() if p.endswith(".png")]
        if not pngs:
            return
        m = art.manifest
        parts = [f"### {m.stage} `{m.version}`", f"`{art.uri}`"]
        for rel in pngs:
            parts += [f"**{rel}**", png_markdown(f"{m.stage} {rel}", art.read_verified(rel))]
        self.publish_markdown(f"{m.stage}-curves", "\n\n".join(parts), f"{m.stage}: curves ({', '.join(pngs)})")

    def progress_bar(self, key: str, total: float, description: str) -> "Progress":
        """A progress bar ``key`` out of ``total`` (:class:`Progress`)."""
        return Progress(self, key, total, description)

    def live_table(self, key: str, columns: Sequence[str], description: str, every_s: float = 20.0) -> "LiveTable":
        """A table republished while rows arrive (:class:`LiveTable`)."""
        return LiveTable(self, key, columns, description, every_s)


PLAIN = Reporter()  # publishes nothing: stateless, shared


class Progress:
    """A progress bar in the UI (a map over shards, a training stage's epochs); nothing where there is no UI."""

    def __init__(self, reporter: Reporter, key: str, total: float, description: str):
        self.reporter, self.total, self.done, self.id = reporter, max(total, 1), 0.0, None
        if not reporter.active:
            return
        try:
            self.id = reporter.progress(key, description)
        except Exception as e:
            log.debug("no progress artifact: %s", e)

    def step(self, n: float = 1) -> None:
        """``n`` more done."""
        self.done += n
        if self.id is None:
            return
        try:
            self.reporter.update_progress(self.id, 100.0 * self.done / self.total)
        except Exception as e:
            log.debug("progress update failed: %s", e)


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


def link_target(uri: str) -> str:
    """A clickable address: local paths become ``file://`` URLs; URLs are kept, without a credential."""
    if "://" in uri:
        return public_url(uri)
    return "file://" + os.path.abspath(uri)


class LiveTable:
    """A table artifact republished while rows arrive (every ``every_s`` seconds at most), so the UI shows a
    long-running log before the stage ends; :meth:`flush` publishes what is left."""

    def __init__(self, reporter: Reporter, key: str, columns: Sequence[str], description: str,
                 every_s: float = 20.0):
        self.reporter, self.key, self.columns = reporter, key, list(columns)
        self.description, self.every_s = description, every_s
        self.rows: list[dict[str, Any]] = []
        self.published = 0  # how many times the table went to the UI
        self._last = 0.0

    def add(self, row: dict[str, Any]) -> None:
        """Keep ``row``; republish the table when ``every_s`` has passed since the last time."""
        self.rows.append(row)
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Publish every row so far (where the reporter reaches a UI)."""
        self._last = time.monotonic()
        if not self.rows:
            return
        if self.reporter.publish_table(self.key, self.rows, self.columns,
                                       f"{self.description} (live: {len(self.rows)} rows so far)"):
            self.published += 1


def _writes_stderr(handler: logging.Handler) -> bool:
    """Whether ``handler`` writes to this process's stderr."""
    return getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__)


class StderrUnlessRoot(logging.StreamHandler):
    """stderr, unless a root handler writes there already (Prefect's console handler, once its logging is set
    up): a line is printed once either way. The stream is whatever ``sys.stderr`` is when a line is written (as
    :data:`logging.lastResort` does), not the one of the call that attached the handler: a test runner or a
    command that swapped stderr for a while must not leave the handler writing to a closed stream."""

    def __init__(self) -> None:  # noqa: D107
        logging.Handler.__init__(self)

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        """Write ``record`` to stderr unless a root handler does."""
        if not any(_writes_stderr(h) for h in logging.getLogger().handlers):
            super().emit(record)


def stderr_handler(fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s") -> StderrUnlessRoot:
    """A :class:`StderrUnlessRoot` at INFO with the progress lines' format."""
    handler = StderrUnlessRoot()
    handler.setFormatter(logging.Formatter(fmt))
    handler.setLevel(logging.INFO)
    return handler
