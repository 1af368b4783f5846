"""Aliases: a name (``production``) that points at one committed version of a stage, with its history.

``{store}/_aliases/{stage}/{alias}.json`` holds the current version, who promoted it and when, the previous
version, and every earlier promotion. It is replaced atomically (written under a temporary name, then moved:
a rename on disks, a single object put on object stores), so a reader sees the old record or the new one.
``{store}/{stage}@{alias}`` is accepted wherever an artifact URI is (:func:`resolve`).

A record's version is used as a path only when it is a plain version name (``storage.names.plain_name``):
one that is not (``../../x``, an absolute path) is refused by :func:`resolve` and left out of
:func:`list_aliases` (so it protects nothing and points nowhere).
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import posixpath
import re
import socket
from typing import Any

import fsspec

from storage.digests import protocols
from storage.lease import read_json
from storage.names import MANIFEST, check_name, plain_name

ALIAS_DIR = "_aliases"
ALIAS_RE = re.compile(r"^(?P<stage>[A-Za-z0-9_-]+)@(?P<alias>[A-Za-z0-9_.-]+)$")


class AliasError(ValueError):
    """An alias that does not exist, or a promotion of something that is not a committed artifact."""


def split_alias_uri(uri: str) -> tuple[str, str, str] | None:
    """``{store}/{stage}@{alias}`` -> (store, stage, alias); None for any other URI."""
    head, _, last = uri.rstrip("/").rpartition("/")
    m = ALIAS_RE.match(last)
    if not head or not m:
        return None
    return head, m["stage"], m["alias"]


def _path(store_uri: str, stage: str, alias: str) -> tuple[fsspec.AbstractFileSystem, str]:
    check_name("stage", stage)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", alias) or ".." in alias or alias.startswith("."):
        raise AliasError(f"alias {alias!r}: expected letters, digits, '.', '_' or '-'")
    fs, root = fsspec.core.url_to_fs(store_uri.rstrip("/"))
    return fs, posixpath.join(root.rstrip("/"), ALIAS_DIR, stage, f"{alias}.json")


def read_alias(store_uri: str, stage: str, alias: str) -> dict[str, Any] | None:
    """The alias record, or None when the alias was never set."""
    return read_json(*_path(store_uri, stage, alias))


def resolve(uri: str) -> str:
    """``{store}/{stage}@{alias}`` -> ``{store}/{stage}/{version}`` (the promoted version); others unchanged."""
    parts = split_alias_uri(uri)
    if parts is None:
        return uri
    store_uri, stage, alias = parts
    record = _record(store_uri, stage, alias)
    if record is None:
        known = ", ".join(list_aliases(store_uri).get(stage, {})) or "none"
        raise AliasError(f"{uri}: no alias {alias!r} for stage {stage!r} in {store_uri} (aliases set: {known}); "
                         f"set one with `lexiflow promote {store_uri}/{stage}/<version> --alias {alias}`")
    if not plain_name(record.get("version")):
        raise AliasError(f"{uri}: the alias record names version {record.get('version')!r}, not a plain version "
                         "name; refusing to follow it (promote a committed version to repair it)")
    return f"{store_uri.rstrip('/')}/{stage}/{record['version']}"


def _record(store_uri: str, stage: str, alias: str) -> dict[str, Any] | None:
    """The alias record when it is a readable JSON object, else None (a foreign or torn file is no alias)."""
    try:
        record = read_alias(store_uri, stage, alias)
    except (ValueError, UnicodeDecodeError, IsADirectoryError, NotADirectoryError):
        return None
    return record if isinstance(record, dict) else None


def promote(store_uri: str, stage: str, version: str, alias: str, by: str | None = None,
            reason: str | None = None) -> dict[str, Any]:
    """Point ``alias`` at ``stage/version`` (which must be committed); returns the new record."""
    fs, path = _path(store_uri, stage, alias)
    if not plain_name(version):
        raise AliasError(f"version {version!r}: not a plain version name")
    root = posixpath.dirname(posixpath.dirname(posixpath.dirname(path)))
    manifest = posixpath.join(root, stage, version, MANIFEST)
    fs.invalidate_cache(manifest)
    if not fs.exists(manifest):
        raise AliasError(f"{store_uri}/{stage}/{version}: not a committed artifact; only committed versions "
                         "can be promoted")
    old = _record(store_uri, stage, alias)
    entry = {
        "version": version,
        "promoted_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "promoted_by": by or f"{_user()}@{socket.gethostname()}",
        "previous": old["version"] if old else None,
        "reason": reason,
    }
    history = (old.get("history", []) if old else []) + [entry]
    record = {"stage": stage, "alias": alias, **entry, "history": history}
    tmp = f"{path}.tmp-{entry['promoted_at'].replace(':', '')}-{socket.gethostname()}"
    if {"file", "local"} & protocols(fs):
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
    with fs.open(tmp, "wb") as f:
        f.write(json.dumps(record, indent=2, ensure_ascii=False).encode())
    if {"file", "local", "memory"} & protocols(fs):
        fs.mv(tmp, path)  # a rename: atomic on a disk
    else:
        fs.cp_file(tmp, path)  # one object put: a reader sees the old record or the new one
        fs.rm_file(tmp)
    return record


def list_aliases(store_uri: str) -> dict[str, dict[str, str]]:
    """{stage: {alias: version}} for every alias in the store whose record is readable and names a plain version
    (anything else under ``_aliases`` is skipped, never followed)."""
    fs, path = _path(store_uri, "x", "x")
    base = posixpath.dirname(posixpath.dirname(path))
    out: dict[str, dict[str, str]] = {}
    fs.invalidate_cache(base)
    try:
        stages = fs.ls(base, detail=False)
    except FileNotFoundError:
        return out
    for stage_dir in sorted(stages):
        stage = posixpath.basename(stage_dir.rstrip("/"))
        if not plain_name(stage) or not fs.isdir(stage_dir):
            continue
        for f in sorted(fs.ls(stage_dir, detail=False)):
            name = posixpath.basename(f)
            alias = name[: -len(".json")]
            if not name.endswith(".json") or ".tmp-" in name or not ALIAS_RE.fullmatch(f"{stage}@{alias}"):
                continue
            record = _record(store_uri, stage, alias)
            if record and record.get("alias") == alias and plain_name(record.get("version")):
                out.setdefault(stage, {})[alias] = record["version"]
    return out



def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return "unknown"
