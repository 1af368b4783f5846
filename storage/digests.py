"""What identifies a file's bytes: an object store's own digest where it gives one, else a streamed sha256."""

from __future__ import annotations

import hashlib
from typing import Any

import fsspec

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})


def protocols(fs: fsspec.AbstractFileSystem) -> frozenset[str]:
    """The protocol names of ``fs`` (fsspec gives one string or a tuple)."""
    p = fs.protocol
    return frozenset((p,) if isinstance(p, str) else p)


def is_object_store(fs: fsspec.AbstractFileSystem) -> bool:
    """Keys, not directories; a move is a copy + delete."""
    return bool(OBJECT_STORES & protocols(fs))


def sha256_file(fs: fsspec.AbstractFileSystem, path: str, chunk: int = 1 << 22) -> tuple[str, int]:
    """The sha256 hex digest and the size of the file at ``path``, read in ``chunk``-byte blocks."""
    h = hashlib.sha256()
    n = 0
    with fs.open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            n += len(block)
    return h.hexdigest(), n


def content_fingerprint(fs: fsspec.AbstractFileSystem, path: str, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """An input's fingerprint without any cache: the object store's digest where it gives one, else read and
    hashed (``storage.artifacts.fingerprint`` adds the cache)."""
    if is_object_store(fs):
        info = fs.info(path) if info is None else info
        keep = {k: str(info[k]) for k in ("ETag", "etag", "md5Hash", "crc32c") if info.get(k)}
        if keep:
            return {"size": info.get("size"), **keep}
    digest, size = sha256_file(fs, path)
    return {"size": size, "sha256": digest}
