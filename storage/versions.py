"""Versions: a stage run's content address, from its code, its config (inputs by their bytes) and its parents."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import fsspec

from storage.digests import content_fingerprint
from storage.manifest import ArtifactRef

VERSION_LEN = 16


def canonical_json(obj: Any) -> str:
    """One spelling of ``obj`` as JSON (sorted keys, no spaces, UTF-8 kept): what versions hash."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


# what identifies an input's bytes in a fingerprint (``fingerprint``); size alone does not
CONTENT_KEYS = ("sha256", "ETag", "etag", "md5Hash", "crc32c")


def _input_entry(node: Any) -> bool:
    """A fingerprinted input (``tasks.common.stage.input_source``): a ``uri`` plus a digest of its bytes."""
    return (isinstance(node, dict) and isinstance(node.get("uri"), str) and not node["uri"].startswith("@")
            and any(node.get(k) for k in CONTENT_KEYS))


def without_locations(config: Any) -> Any:
    """``config`` as a version hashes it: every input location replaced by the content it points at.

    An *input entry* is a dict with a string ``uri`` and a digest of the bytes there (``sha256``, or an
    object store's ``ETag``/``md5Hash``/``crc32c``: what :func:`fingerprint` gives and
    ``tasks.common.stage.input_source`` records). The entry loses its ``uri``; any other string of the
    payload equal to such a ``uri`` (``finetune``'s ``data_uri``, ``pretrain.extra_texts[].train_uri`` ...)
    becomes that entry without its ``uri``. So the same bytes under another directory, bucket or
    protocol give the same version, and which file fills which role still counts.

    Nothing else changes. No key is ever dropped (``{"inputs": {"data_uri": {...}}}`` keeps its keys); a
    location whose bytes are not fingerprinted in the same payload stays as it is, so a version still
    follows it; a symbolic value such as ``"@finetune"`` or ``"@heldout"`` is a value, never a location. A
    config without input entries comes back unchanged (its version is what it always was). The manifest
    keeps the config as given: where the inputs were read from is provenance, recorded there."""
    located: dict[str, dict[str, Any]] = {}

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if _input_entry(node):
                located.setdefault(node["uri"], {k: v for k, v in node.items() if k != "uri"})
            for v in node.values():
                collect(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                collect(v)

    def strip(node: Any) -> Any:
        if _input_entry(node):  # its other values are its name and fingerprint: kept as they are
            return {k: v for k, v in node.items() if k != "uri"}
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [strip(v) for v in node]
        if isinstance(node, str) and node in located:
            return dict(located[node])
        return node

    collect(config)
    return strip(config)


def compute_version(stage: str, code_version: str, config: dict[str, Any], parents: list[ArtifactRef]) -> str:
    """Content address of a stage run: same inputs -> same version, wherever the inputs were read from
    (``config`` is hashed :func:`without_locations`; parents by stage and version, never by URI)."""
    payload = canonical_json(
        {
            "stage": stage,
            "code_version": code_version,
            "config": without_locations(config),
            "parents": [[p.stage, p.version] for p in parents],
        }
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:VERSION_LEN]



def fingerprint(fs: fsspec.AbstractFileSystem, path: str, cache: Any = None) -> dict[str, Any]:
    """Identify an input's bytes for versioning: an object store's content digest (ETag/MD5/CRC: no download),
    else ``size`` + a streamed ``sha256`` of the content (local and memory files, HTTP, archive members: never
    the size alone). With ``cache`` (a run's :class:`storage.fingerprints.FingerprintCache`) a digest computed
    earlier for the same unchanged file is reused."""
    if cache is not None:
        return cache.fingerprint_path(fs, path)
    return content_fingerprint(fs, path)


def fingerprint_uri(uri: str, cache: Any = None) -> dict[str, Any]:
    """:func:`fingerprint` of the file at ``uri``. For an fsspec chain (``tar://<member>::<archive URL>``) that is
    the file as stored, the archive (the last link: the bytes downloaded, hashed without decompressing them; the
    fingerprint of an archive's member would mean decompressing all of it once more), plus ``member``: the rest of
    the chain, so another member of the same archive is another input."""
    inner, sep, outer = uri.rpartition("::")
    if sep:
        fs, path = fsspec.core.url_to_fs(outer)
        return {**fingerprint(fs, path, cache), "member": inner}
    fs, path = fsspec.core.url_to_fs(uri)
    return fingerprint(fs, path, cache)
