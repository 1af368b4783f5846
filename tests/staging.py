"""Tests' shortcut to a stage version's staging writer, outside a ``store.stage(...)`` block.

``begin(store, stage, version)`` takes the staging lease and returns the writer (the test commits it with
``writer.commit(...)``), as a stage run's ``store.stage`` block would on entry; stages themselves only ever write
through ``store.stage``."""

from __future__ import annotations

from storage.artifacts import ArtifactStore, ArtifactWriter
from storage.lease import LeaseSettings


def begin(store: ArtifactStore, stage: str, version: str, settings: LeaseSettings = LeaseSettings()
          ) -> ArtifactWriter | None:
    """The leased staging writer of ``stage/version`` (None: another run committed it while this one waited);
    FileExistsError when it is already committed."""
    if store.is_committed(stage, version):
        raise FileExistsError(f"{store.artifact_uri(stage, version)} is already committed")
    return store._leased_writer(stage, version, settings)
