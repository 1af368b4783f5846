"""Input fingerprints cached beside the store, so a re-run does not read an unchanged input again.

A version counts the sha256 of every local input file (:func:`storage.artifacts.fingerprint`), which means
reading the whole file on every run: seconds per gigabyte before anything can be skipped. Here the digest is
kept in ``{store}/_fingerprints/<sha256 of the URL>.json`` together with what identified the file when it
was hashed: its full URL, size, modification time (ns), status-change time (ns) and inode. A later run
``stat``s the file; when all of these are unchanged it takes the digest from the entry and reads nothing.
Any change (a touch, a rewrite, a copy over it, another size) hashes the file again and replaces the entry.
The version is still a function of the bytes' sha256 alone (an entry holds the digest of the file it
describes), never of the path.

- *Racy entries.* A file written within ``RACY_S`` seconds before it was hashed may change again within the
  file system's timestamp granularity without its mtime moving, so such an entry is never trusted: the next
  run hashes the file again (and, the file being older by then, records a trusted entry). A file that
  changed while it was being hashed gets no entry.
- *Object stores* (``s3://``, ``gs://`` ...) are not read at all: their fingerprint is the ETag/MD5/CRC from
  one metadata call (:func:`storage.digests.content_fingerprint`), which this cache would not make cheaper.
  One that gives no digest is read and hashed like any remote file.
- *HTTP(S) files* are read and hashed; the digest is cached keyed by the URL, the size and what the server
  says identifies this revision of the file (``Last-Modified``, a strong ``ETag``). A server that gives
  neither gets no entry: its files are hashed again on every run. An entry whose ``Last-Modified`` (whole
  seconds) is within ``RACY_S`` of when it was hashed is not trusted either. The entry holds the URL without
  query string or userinfo; its name is a hash of the full URL. Other file systems that give no content
  digest (ftp, sftp ...) are hashed on every run.
- *Archive members and other chained URLs* (``tar://member::archive``) are hashed every time when opened as a
  file system of their own; as a stage input (:func:`fingerprint_input`) the archive itself is fingerprinted.
- *memory://* files have no modification time: they are hashed every time (in RAM; nothing is cached).
- ``rehash=True`` (``runner.rehash_inputs``, ``lexiflow run --rehash``) hashes every input again and
  rewrites its entry.
- Entries are written whole (a temporary file then an atomic rename on local stores, a single put
  elsewhere), so concurrent runs never see a torn entry; an unreadable entry is a miss, logged and replaced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec

from storage.digests import content_fingerprint, is_object_store, protocols, sha256_file

log = logging.getLogger("lexiflow")


CACHE_DIR = "_fingerprints"
RACY_S = 2.0  # an entry hashed less than this long after the file's mtime is not trusted
_KEY_FIELDS = ("url", "size", "mtime_ns", "ctime_ns", "ino")


@dataclass
class CacheStats:
    """What a run's fingerprint cache did: digests reused, files hashed, bytes read."""

    hits: int = 0  # digests taken from an entry (the file was not read)
    hashed: int = 0  # files read and hashed (no entry, a changed file, a racy entry, rehash, memory://)
    bytes_hashed: int = 0


@dataclass
class FingerprintCache:
    """Fingerprints of input files, with sha256 digests of local files cached under ``{store_uri}/_fingerprints``."""

    store_uri: str
    rehash: bool = False
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.fs, root = fsspec.core.url_to_fs(self.store_uri)
        self.root = f"{root.rstrip('/')}/{CACHE_DIR}"
        self._local = bool({"file", "local"} & protocols(self.fs))

    def fingerprint(self, uri: str) -> dict[str, Any]:
        """``{"size", "sha256"}`` of a file, an object store's ``{"size", "ETag"...}`` where it gives a digest
        (what :func:`storage.digests.content_fingerprint` gives: the same dict, cached or not)."""
        fs, path = fsspec.core.url_to_fs(uri)
        return self.fingerprint_path(fs, path)

    def fingerprint_path(self, fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
        """:meth:`fingerprint` of ``path`` on ``fs``."""
        names = protocols(fs)
        if {"file", "local"} & names:
            return self._local_file(fs, path)
        if is_object_store(fs):
            info = fs.info(path)
            fp = content_fingerprint(fs, path, info)
            if "sha256" not in fp:
                return fp  # the store's digest: metadata only, nothing read
            self._count(fp)
            return fp
        if "memory" in names or not ({"http", "https"} & names):
            fp = content_fingerprint(fs, path)  # nothing that identifies a revision: read and hash it, every time
            self._count(fp)
            return fp
        return self._remote(fs, path)

    def _count(self, fp: dict[str, Any]) -> None:
        self.stats.hashed += 1
        self.stats.bytes_hashed += int(fp.get("size") or 0)

    def _remote(self, fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
        url = fs.unstrip_protocol(path)
        key = _remote_key(url, fs.info(path))
        entry_path = f"{self.root}/{hashlib.sha256(url.encode()).hexdigest()[:40]}.json"
        if key is not None and not self.rehash:
            entry = self._read(entry_path)
            if entry and all(entry.get(k) == v for k, v in key.items() if k != "url") and _trusted_remote(entry):
                self.stats.hits += 1
                return {"size": entry["size"], "sha256": entry["sha256"]}
        fp = content_fingerprint(fs, path)
        self._count(fp)
        if key is not None and fp["size"] == key["size"] and _remote_key(url, fs.info(path)) == key:
            self._write(entry_path, {**key, "sha256": fp["sha256"], "hashed_at_ns": time.time_ns()})
        return fp

    def _local_file(self, fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
        key = _local_key(fs.unstrip_protocol(path), path)
        entry_path = f"{self.root}/{hashlib.sha256(key['url'].encode()).hexdigest()[:40]}.json"
        if not self.rehash:
            entry = self._read(entry_path)
            if entry and all(entry.get(k) == key[k] for k in _KEY_FIELDS) and _trusted(entry):
                self.stats.hits += 1
                return {"size": entry["size"], "sha256": entry["sha256"]}
        digest, size = sha256_file(fs, path)
        self.stats.hashed += 1
        self.stats.bytes_hashed += size
        if _local_key(key["url"], path) == key and size == key["size"]:  # unchanged while it was read
            self._write(entry_path, {**key, "sha256": digest, "hashed_at_ns": time.time_ns()})
        return {"size": size, "sha256": digest}

    def _read(self, entry_path: str) -> dict[str, Any] | None:
        try:
            with self.fs.open(entry_path, "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # unreadable or not JSON: hash again and replace it
            log.warning("fingerprint cache entry %s unreadable (%s: %s); hashing the input again",
                        entry_path, type(e).__name__, e)
            return None

    def _write(self, entry_path: str, entry: dict[str, Any]) -> None:
        data = json.dumps(entry, ensure_ascii=False, sort_keys=True).encode()
        try:
            if self._local:
                os.makedirs(self.root, exist_ok=True)
                tmp = f"{entry_path}.tmp-{uuid.uuid4().hex}"
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, entry_path)  # atomic: a reader sees the old entry or the new one, whole
            else:
                self.fs.pipe_file(entry_path, data)  # one put: an object appears whole
        except OSError as e:  # a read-only store still runs; only the next run's saving is lost
            log.warning("could not write fingerprint cache entry %s: %s", entry_path, e)


def _local_key(url: str, path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"url": url, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino}


_REVISION = ("Last-Modified", "ETag")  # what an HTTP server says identifies a revision


def _remote_key(url: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """What identifies this revision of a remote file (None: the server says nothing that does)."""
    revision = {k: str(info[k]) for k in _REVISION if info.get(k) and not str(info[k]).startswith("W/")}
    if not revision or info.get("size") is None:
        return None
    return {"url": _without_secrets(url), "size": int(info["size"]), "revision": revision}


def _without_secrets(url: str) -> str:
    """``url`` without its query string, fragment and ``user:password@`` (an entry never holds a credential)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _trusted_remote(entry: dict[str, Any]) -> bool:
    """Not racy: a ``Last-Modified`` (whole seconds) at least ``RACY_S`` before the entry was hashed; an ETag
    alone is trusted (a strong ETag changes with the content)."""
    modified = entry.get("revision", {}).get("Last-Modified")
    if modified is None:
        return True
    try:
        changed = parsedate_to_datetime(modified).timestamp()
    except (TypeError, ValueError):
        return False
    return entry.get("hashed_at_ns", 0) / 1e9 - (changed + 1) >= RACY_S


def _trusted(entry: dict[str, Any]) -> bool:
    """Hashed long enough after the file's last change that a same-size rewrite would have moved its mtime."""
    changed = max(entry["mtime_ns"], entry["ctime_ns"])
    return entry.get("hashed_at_ns", 0) - changed >= RACY_S * 1e9


def fingerprint_input(uri: str, cache: FingerprintCache | None = None) -> dict[str, Any]:
    """An input's fingerprint: through ``cache`` (the run's, beside its store) when given, else read and hashed.
    For an fsspec chain (``tar://<member>::<archive URL>``) it is the archive's (the file as stored, cached like
    any file) plus ``member`` (:func:`storage.artifacts.fingerprint_uri`)."""
    inner, sep, outer = uri.rpartition("::")
    if sep:
        return {**fingerprint_input(outer, cache), "member": inner}
    if cache is None:
        fs, path = fsspec.core.url_to_fs(uri)
        return content_fingerprint(fs, path)
    return cache.fingerprint(uri)
