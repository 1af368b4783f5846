"""The pipeline's promotion gate: move an alias to a new bundle only when its metric is at least the current one's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from storage.aliases import promote, read_alias
from storage.artifacts import ArtifactRef, open_artifact
from tasks.bundle.config import PromoteConfig


def decide(new: float | None, current: float | None, cfg: PromoteConfig) -> tuple[bool, str]:
    """(promote?, why) for a new bundle's metric against the aliased bundle's (None: no bundle aliased yet)."""
    name = cfg.metric
    if new is None:
        return False, f"the new bundle has no metric {name!r}"
    if cfg.min_value is not None and new < cfg.min_value:
        return False, f"{name}={new:.4f} is below min_value {cfg.min_value}"
    if current is None:
        return True, f"{name}={new:.4f}; no bundle held the alias yet"
    if new >= current + cfg.min_delta:
        return True, f"{name}={new:.4f} >= current {current:.4f} + min_delta {cfg.min_delta}"
    return False, f"{name}={new:.4f} < current {current:.4f} + min_delta {cfg.min_delta}"


def verdict(store_uri: str, bundle_ref: ArtifactRef, cfg: PromoteConfig,
            record: dict[str, Any] | None) -> tuple[bool, str]:
    """(promote?, why) for ``bundle_ref`` against ``record``, the alias's current holder (None: nobody), without
    moving anything. A holder that lacks the metric is not compared (that would skip ``min_delta``): refused."""
    new = _metric(bundle_ref, cfg.metric)
    held = open_artifact(f"{store_uri}/{bundle_ref.stage}/{record['version']}") if record else None
    current = _metric(held, cfg.metric) if held is not None else None
    if new is not None and held is not None and current is None:
        return False, (f"{cfg.metric}={new:.4f}, but the bundle holding {cfg.alias} ({record['version']}) has no "
                       f"{cfg.metric!r} to compare with: not promoted; move the alias by hand (`lexiflow promote`) "
                       "if this bundle should replace it")
    ok, why = decide(new, current, cfg)
    if new is None:  # e.g. test_auc of a K > 2 class bundle: say which metrics it has
        why += metric_hint(open_artifact(bundle_ref))
    return ok, why


def gate(store_uri: str, bundle_ref: ArtifactRef, cfg: PromoteConfig,
         on_promoted: Callable[[str, dict[str, Any]], str | None] | None = None) -> dict[str, Any]:
    """Apply the gate for ``bundle_ref``: promote it (atomically, with history) or leave the alias alone.
    ``on_promoted(store_uri, alias record)`` runs after a promotion (the flow emits its event there); what it
    returns is the result's ``event``."""
    if cfg.alias is None:
        return {"promoted": False, "reason": "promote.alias is not set"}
    record = read_alias(store_uri, bundle_ref.stage, cfg.alias)
    if record is not None and record["version"] == bundle_ref.version:
        return {"promoted": False, "reason": f"already {cfg.alias}", "alias": cfg.alias, "version": record["version"]}
    ok, why = verdict(store_uri, bundle_ref, cfg, record)
    out = {"promoted": ok, "reason": why, "alias": cfg.alias, "previous": record["version"] if record else None}
    if ok:
        record = promote(store_uri, bundle_ref.stage, bundle_ref.version, cfg.alias, by="pipeline", reason=why)
        out["version"] = bundle_ref.version
        out["event"] = on_promoted(store_uri, record) if on_promoted is not None else None
    return out


def _metric(art_or_ref, name: str) -> float | None:
    art = open_artifact(art_or_ref) if isinstance(art_or_ref, ArtifactRef) else art_or_ref
    value = art.manifest.metrics.get(name)
    return float(value) if isinstance(value, (int, float)) else None


def metric_hint(art) -> str:
    """The test metrics a bundle does have, as the end of a gate's reason: ``(it has test_a, test_b; set
    promote.metric to one of them)``."""
    have = sorted(k for k, v in art.manifest.metrics.items() if k.startswith("test_") and isinstance(v, (int, float)))
    return f" (it has {', '.join(have) or 'no test metric'}; set promote.metric to one of them)"
