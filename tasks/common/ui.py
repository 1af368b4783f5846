"""What a person sees: progress bars only in a terminal; pictures, links and live tables in the Prefect UI."""

from __future__ import annotations

import base64
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("lexiflow")


def interactive() -> bool:
    """A person is watching this process's stderr (a terminal), not a worker's log file."""
    if os.environ.get("LEXIFLOW_PROGRESS") in ("0", "1"):  # explicit override, e.g. for CI logs
        return os.environ["LEXIFLOW_PROGRESS"] == "1"
    return sys.stderr is not None and sys.stderr.isatty()


def bars(requested: bool) -> bool:
    """tqdm bars only when asked for and interactive: under a Prefect worker they would only fill its logs
    (the stages' progress artifacts show progress in the UI instead)."""
    return bool(requested) and interactive()


def in_run() -> bool:
    if "prefect" not in sys.modules:  # nothing imported Prefect: no run is active
        return False
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def png_markdown(title: str, png: bytes) -> str:
    """Markdown that shows ``png`` itself (a data URI), so the Prefect UI renders the picture, not a path."""
    return f"![{title}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


def publish_pictures(art) -> None:
    """Every committed ``*.png`` of an artifact as one markdown artifact ``<stage>-curves`` (in a run only)."""
    pngs = [p for p in art.files() if p.endswith(".png")]
    if not pngs or not in_run():
        return
    from prefect.artifacts import create_markdown_artifact

    m = art.manifest
    parts = [f"### {m.stage} `{m.version}`", f"`{art.uri}`"]
    for rel in pngs:
        parts += [f"**{rel}**", png_markdown(f"{m.stage} {rel}", art.read_verified(rel))]
    try:
        create_markdown_artifact(key=f"{m.stage}-curves", markdown="\n\n".join(parts),
                                 description=f"{m.stage}: curves ({', '.join(pngs)})")
    except Exception as e:  # the UI artifact is a convenience; the artifact itself is committed
        log.warning("could not publish the %s curves: %s", m.stage, e)


def link_target(uri: str) -> str:
    """A clickable address: local paths become ``file://`` URLs; URLs are kept, without a credential."""
    if "://" in uri:
        from storage.urls import public_url

        return public_url(uri)
    return "file://" + os.path.abspath(uri)


def publish_link(key: str, uri: str, text: str, description: str = "") -> None:
    """A Prefect link artifact (in a run only)."""
    if not in_run():
        return
    from prefect.artifacts import create_link_artifact

    try:
        create_link_artifact(key=key, link=link_target(uri), link_text=text, description=description or text)
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
        self.rows.append(row)
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self._last = time.monotonic()
        if not in_run() or not self.rows:
            return
        from prefect.artifacts import create_table_artifact

        try:
            create_table_artifact(key=self.key, table=[{c: r.get(c) for c in self.columns} for r in self.rows],
                                  description=f"{self.description} (live: {len(self.rows)} rows so far)")
            self.published += 1
        except Exception as e:
            log.warning("could not publish %s: %s", self.key, e)
