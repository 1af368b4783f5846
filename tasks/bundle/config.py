"""Promotion's configuration: which alias moves to a new bundle, and the metric gate it must pass."""

from __future__ import annotations

from pydantic import Field

from tasks.common.config import SectionConfig


class PromoteConfig(SectionConfig):
    """After the pipeline: move ``alias`` to the new bundle when its ``metric`` is at least the current aliased
    bundle's plus ``min_delta`` (and at least ``min_value``); the first bundle is promoted when it passes
    ``min_value``. ``alias: null`` never promotes."""

    alias: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="e.g. production")
    metric: str = Field("test_auc", description="a bundle metric, higher is better")
    min_delta: float = Field(0.0, description="the new metric must be at least the aliased bundle's plus this "
                             "(0: a tie promotes)")
    min_value: float | None = Field(None, description="the new metric must be at least this, the first bundle's "
                                    "too; None: no floor")
