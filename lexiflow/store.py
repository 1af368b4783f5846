"""versions: the committed versions of a stage in an artifact store, one row each, from their manifests."""

from __future__ import annotations

from typing import Any

import pandas as pd

COLUMNS = ["version", "created_at", "parents", "in", "out", "rejected", "uri"]


def versions(store: Any, stage: str) -> pd.DataFrame:
    """One row per committed version of ``stage`` in ``store`` (a URI or an ``ArtifactStore``), oldest first:
    ``version, created_at`` (UTC), ``parents`` (``["stage:version", …]``), ``in, out, rejected`` (total),
    ``uri`` and the manifest metrics as ``metric.<name>`` columns (nested ones as ``metric.<a>.<b>``).
    Uncommitted directories (crashed runs) are not listed."""
    from storage.artifacts import ArtifactStore  # noqa: PLC0415  (pydantic: `import lexiflow` stays light)

    st = store if isinstance(store, ArtifactStore) else ArtifactStore(str(store))
    rows = []
    for version in st.versions(stage):
        m = st.open(stage, version).manifest
        rejected = m.stats.get("rejected") or {}
        rows.append({
            "version": m.version,
            "created_at": m.created_at,
            "parents": [f"{p.stage}:{p.version}" for p in m.parents],
            "in": m.stats.get("in"),
            "out": m.stats.get("out"),
            "rejected": sum(rejected.values()) if isinstance(rejected, dict) else rejected,
            "uri": st.artifact_uri(stage, version),
            **_flat(m.metrics, "metric."),
        })
    frame = pd.DataFrame(rows, columns=None if rows else COLUMNS)
    frame["created_at"] = pd.to_datetime(frame["created_at"], utc=True)
    return frame.sort_values(["created_at", "version"], ignore_index=True)


def _flat(metrics: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out
