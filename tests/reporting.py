"""Tests' reporters: one that reaches a UI and records what it is given, so a test sees what a run would publish.

``Recording()`` is active (as the Prefect reporter inside a run) and keeps every artifact as ``(kind, fields)`` in
:attr:`Recording.made`, with the fields Prefect's artifact calls take (``key``, ``table``/``markdown``/``link``,
``description``); :attr:`Recording.artifacts` are the fields alone. ``Recording(fail=True)`` raises from every
primitive (a UI that is down): publishing must log that, never raise it. ``Recording(active=False)`` stands for
a run with no UI: whatever reaches its primitives anyway is recorded (and should not)."""

from __future__ import annotations

from typing import Any

from tasks.common.ui import Reporter


class Recording(Reporter):
    """An active reporter that records what is published (or, with ``fail``, raises as an unreachable UI does)."""

    active = True

    def __init__(self, fail: bool = False, active: bool = True):
        self.made: list[tuple[str, dict[str, Any]]] = []
        self.fail, self.active = fail, active

    def _keep(self, kind: str, **fields: Any) -> None:
        if self.fail:
            raise RuntimeError("no API")
        self.made.append((kind, fields))

    @property
    def artifacts(self) -> list[dict[str, Any]]:
        """The fields of every artifact published, in order."""
        return [fields for _, fields in self.made]

    @property
    def tables(self) -> list[str]:
        """The keys of the tables published, in order."""
        return [f["key"] for kind, f in self.made if kind == "table"]

    def table(self, key: str, table: list[dict[str, Any]], description: str) -> None:
        """Record a table."""
        self._keep("table", key=key, table=table, description=description)

    def markdown(self, key: str, markdown: str, description: str) -> None:
        """Record a markdown artifact."""
        self._keep("md", key=key, markdown=markdown, description=description)

    def link(self, key: str, link: str, text: str, description: str) -> None:
        """Record a link."""
        self._keep("link", key=key, link=link, link_text=text, description=description)

    def progress(self, key: str, description: str) -> Any:
        """Record a progress bar's start; its handle."""
        self._keep("progress", key=key, description=description)
        return len(self.made)

    def update_progress(self, handle: Any, percent: float) -> None:
        """Record a progress update."""
        self._keep("progress-update", handle=handle, progress=percent)
