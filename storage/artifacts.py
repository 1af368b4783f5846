"""Versioned, immutable artifacts on any fsspec URL (the contract: docs/concepts.md and docs/reference/artifacts.md).

An artifact lives at ``{store}/{stage}/{version}/``. ``version`` is a short
sha256 of (stage, code version, canonical config JSON, parent versions), so the
same inputs always give the same version; where an input was read from is left
out of it (:func:`without_locations`): the same bytes elsewhere, the same version. ``_manifest.json`` is written last
and is the commit marker: a directory without one is invisible to readers; one holding a run's owner record is
that run's staging, removed once the run is gone (:meth:`ArtifactStore.entries` says what else a stage directory
may hold: corrupt and foreign entries, which nothing here follows or removes).

Object stores (S3, GCS, Azure) have no directories and no rename. Nothing here needs either: an
artifact "directory" is a key prefix, no directory is ever created or tested, a move is a
server-side copy then a delete (the copy appears whole or not at all; a leftover ``.tmp-`` object is
skipped by readers and by commit), the manifest lists the files this run wrote even when the store's
listing lags, and every commit check drops the filesystem's cached listings first, so a manifest
written by another process (a Dask worker, another run) is seen.

This module is the store's public face: every name below is defined in the module of its role and re-exported here,
so ``from storage.artifacts import X`` is how code outside ``storage`` imports it. The roles: manifests and refs
(:mod:`storage.manifest`), versions (:mod:`storage.versions`), reading (:mod:`storage.reading`), writing and commit
(:mod:`storage.writing`), the store and its stage runs (:mod:`storage.store`, :mod:`storage.staging`).
"""

from __future__ import annotations

from storage.digests import is_object_store
from storage.manifest import ArtifactRef, CorruptArtifact, FileEntry, IntegrityError, Manifest, Stats
from storage.names import MANIFEST, plain_name
from storage.reading import Artifact, fresh, lineage, open_artifact, open_checked, parent_uri
from storage.staging import Staging
from storage.store import ArtifactStore, Entry, StagingHandle, artifact_in_store, canonical_store
from storage.versions import (
    CONTENT_KEYS,
    VERSION_LEN,
    canonical_json,
    compute_version,
    fingerprint,
    fingerprint_uri,
    without_locations,
)
from storage.writing import TMP_MARK, ArtifactWriter

__all__ = [
    # manifests and refs
    "ArtifactRef", "FileEntry", "Stats", "Manifest", "CorruptArtifact", "IntegrityError", "MANIFEST", "plain_name",
    # versions
    "VERSION_LEN", "CONTENT_KEYS", "canonical_json", "without_locations", "compute_version", "fingerprint",
    "fingerprint_uri",
    # reading
    "Artifact", "open_artifact", "open_checked", "parent_uri", "lineage", "fresh",
    # writing and commit
    "ArtifactWriter", "TMP_MARK", "is_object_store",
    # the store and its stage runs
    "Entry", "ArtifactStore", "Staging", "StagingHandle", "canonical_store", "artifact_in_store",
]
