"""Prefect events lexiflow emits: a promotion (``lexiflow.bundle.promoted``), which a deployment trigger turns into
a relabelling run (``prefect.yaml``: ``relabel-on-promotion``); and a label run's monitoring alert
(``lexiflow.label.drift``: the estimated metric below its floor or a data-quality problem; drift only where
``monitor.alert_on`` names it), which the ``drift-alert`` deployment's
trigger turns into a run that publishes the report.

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
DRIFT = "lexiflow.label.drift"  # tasks.label.monitor.DRIFT_EVENT
OUTPUT_PREFIX = "lexiflow.labelled."
BUNDLE_PREFIX = "lexiflow.bundle."


def drift_payload(summary: dict[str, Any], bundle_uri: str) -> dict[str, Any]:
    """What a drift event carries: the output and the bundle (each spelled one way,
    ``storage.artifacts.canonical_store``), the label and bundle versions, what alerted, the estimate and the
    report's one-line summary (strings, numbers, lists: a trigger templates them into a run's parameters)."""
    rep = summary["monitor"]
    est = rep["estimate"]
    return {"output": canonical_store(summary["uri"]), "label_version": summary["version"],
            "bundle": canonical_store(bundle_uri), "bundle_version": rep["bundle_version"], "rows": rep["rows"],
            "alerts": rep["alerts"], "drift": rep["drift"], "metric": est["metric"], "estimate": est[est["metric"]],
            "interval": est[f"{est['metric']}_interval"], "reliable": est["reliable"], "summary": rep["summary"]}


def emit_drift(summary: dict[str, Any], bundle_uri: str) -> str | None:
    """Emit ``lexiflow.label.drift`` for a label run whose monitoring report alerts (resource: the labelled output;
    related: the bundle); the event id, or None when the run does not alert or no Prefect API is configured."""
    rep = summary.get("monitor")
    if not rep or not rep.get("alert"):
        return None
    from prefect.events import emit_event  # noqa: PLC0415 - as in emit_promotion
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

    if not PREFECT_API_URL.value() and not prefect_api_configured():  # a flow run's settings may name the API
        return None

    payload = drift_payload(summary, bundle_uri)
    resource = {"prefect.resource.id": f"{OUTPUT_PREFIX}{payload['output']}",
                "prefect.resource.name": f"labelled {payload['label_version']}", "lexiflow.output": payload["output"]}
    related = [{"prefect.resource.id": f"{BUNDLE_PREFIX}{payload['bundle']}", "prefect.resource.role": "bundle",
                "prefect.resource.name": f"bundle {payload['bundle_version']}", "lexiflow.bundle": payload["bundle"]}]
    event = emit_event(event=DRIFT, resource=resource, related=related, payload=payload)
    return str(event.id) if event is not None else None


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

    payload = promotion_payload(store_uri, record)
    resource = {"prefect.resource.id": f"{RESOURCE_PREFIX}{payload['store']}/{payload['stage']}@{payload['alias']}",
                "prefect.resource.name": f"{payload['stage']}@{payload['alias']}", "lexiflow.store": payload["store"]}
    event = emit_event(event=PROMOTED, resource=resource, payload=payload)
    if flush:
        flush_events(timeout_s)
    return str(event.id) if event is not None else None


def flush_events(timeout_s: float = 10.0) -> None:
    """Wait until the events emitted so far are sent (a process about to exit)."""
    from prefect.events.worker import EventsWorker  # noqa: PLC0415

    # draining, Prefect's worker warns "Still processing items: 1 items remaining..." about the event being
    # sent; the command waits for exactly that, so the line is dropped here (other warnings pass)
    worker_log = logging.getLogger("EventsWorker")
    quiet = _DropDrainNotice()
    worker_log.addFilter(quiet)
    try:
        EventsWorker.drain_all(timeout=timeout_s)
    finally:
        worker_log.removeFilter(quiet)


class _DropDrainNotice(logging.Filter):
    """Drops the events worker's "Still processing items" notice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Still processing items")
