"""Prefect events lexiflow emits: a promotion (``lexiflow.bundle.promoted``), which a deployment trigger turns into
a relabelling run (``prefect.yaml``: ``relabel-on-promotion``).

Emitted only when a Prefect API is configured (a server to receive it); without one, promoting stays a file
operation and prints no error.
"""

from __future__ import annotations

import logging
from typing import Any

from flows.direct import prefect_api_configured
from storage.artifacts import canonical_store

PROMOTED = "lexiflow.bundle.promoted"
RESOURCE_PREFIX = "lexiflow.alias."


def promotion_payload(store_uri: str, record: dict[str, Any]) -> dict[str, Any]:
    """What the event carries: the store, stage, alias, new and previous version, the new version's URI, who and
    why (all strings or None: a trigger templates them into a run's parameters). The store is spelled one way
    (``storage.artifacts.canonical_store``), however it was typed, so a trigger's ``lexiflow.store`` matches."""
    store_uri = canonical_store(store_uri)
    stage, version = record["stage"], record["version"]
    return {"store": store_uri, "stage": stage, "alias": record["alias"], "version": version,
            "uri": f"{store_uri.rstrip('/')}/{stage}/{version}", "previous": record.get("previous"),
            "promoted_at": record.get("promoted_at"), "promoted_by": record.get("promoted_by"),
            "reason": record.get("reason")}


def emit_promotion(store_uri: str, record: dict[str, Any], flush: bool = False, timeout_s: float = 10.0) -> str | None:
    """Emit the promotion event (``flush``: and wait until it is sent, for a process about to exit); the event id,
    or None when no Prefect API is configured (nothing to send it to)."""
    if not prefect_api_configured():
        return None
    # Prefect loads only when there is an API to send to: `lexiflow promote` without one stays a file operation
    from prefect.events import emit_event  # noqa: PLC0415
    from prefect.events.worker import EventsWorker  # noqa: PLC0415

    payload = promotion_payload(store_uri, record)
    resource = {"prefect.resource.id": f"{RESOURCE_PREFIX}{payload['store']}/{payload['stage']}@{payload['alias']}",
                "prefect.resource.name": f"{payload['stage']}@{payload['alias']}", "lexiflow.store": payload["store"]}
    event = emit_event(event=PROMOTED, resource=resource, payload=payload)
    if flush:
        # draining, Prefect's worker warns "Still processing items: 1 items remaining..." about the event being
        # sent; the command waits for exactly that, so the line is dropped here (other warnings pass)
        worker_log = logging.getLogger("EventsWorker")
        quiet = _DropDrainNotice()
        worker_log.addFilter(quiet)
        try:
            EventsWorker.drain_all(timeout=timeout_s)
        finally:
            worker_log.removeFilter(quiet)
    return str(event.id) if event is not None else None


class _DropDrainNotice(logging.Filter):
    """Drops the events worker's "Still processing items" notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Still processing items")
