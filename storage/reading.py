"""Reading committed artifacts: open one by URI (aliases resolved), verify its files, follow its lineage."""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any

import fsspec

from storage.aliases import resolve, split_alias_uri
from storage.digests import protocols
from storage.manifest import ArtifactRef, CorruptArtifact, IntegrityError, Manifest
from storage.names import MANIFEST, plain_name


def fresh(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` after dropping ``fs``'s cached listings of it and its parents (s3fs/gcsfs answer
    ``exists``/``ls``/``open`` from listings cached earlier in this process, blind to other writers)."""
    fs.invalidate_cache(path)
    return path


class Artifact:
    """A committed artifact opened for reading."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, manifest: Manifest, uri: str):
        self.fs, self.path, self.manifest, self.uri = fs, path, manifest, uri

    @property
    def ref(self) -> ArtifactRef:
        """Where this artifact is, as tasks pass it on."""
        return ArtifactRef(stage=self.manifest.stage, version=self.manifest.version, uri=self.uri)

    def file_path(self, rel: str) -> str:
        """Where ``rel`` is on the filesystem: ``{artifact directory}/{rel}``."""
        return posixpath.join(self.path, rel)

    def files(self, prefix: str = "") -> list[str]:
        """The manifest's files whose path starts with ``prefix``."""
        return [f.path for f in self.manifest.files if f.path.startswith(prefix)]

    def open(self, rel: str, mode: str = "rb"):
        """Open one of the artifact's files (unverified; :meth:`read_verified` checks the sha256)."""
        return self.fs.open(self.file_path(rel), mode)

    def read_verified(self, rel: str) -> bytes:
        """Read a file whole, refusing it unless its sha256 matches the manifest."""
        entry = self.manifest.file(rel)
        with self.open(rel) as f:
            data = f.read()
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise IntegrityError(
                f"{self.file_path(rel)}: sha256 {digest[:12]}… does not match manifest {entry.sha256[:12]}…; "
                "the artifact was modified after it was committed"
            )
        return data

    def read_json(self, rel: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
        """A JSON object file, verified (:meth:`read_verified`); ValueError naming the file when it is not a JSON
        object or lacks one of the ``required`` keys (written by another version, or edited and re-hashed)."""
        try:
            data = json.loads(self.read_verified(rel))
        except ValueError as e:
            raise ValueError(f"{self.file_path(rel)}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise ValueError(f"{self.file_path(rel)}: expected a JSON object, got {type(data).__name__}")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(
                f"{self.file_path(rel)}: required key(s) {missing} missing; this {self.manifest.stage} artifact was "
                "written by another lexiflow version or edited: rebuild it"
            )
        return data

    def is_local(self) -> bool:
        """Whether the artifact is on a local disk."""
        return "file" in protocols(self.fs)


def open_artifact(uri: str | ArtifactRef) -> Artifact:
    """Open a committed artifact by URI; refuses directories with no manifest, a manifest whose stage or version is
    not a plain name, and (through an alias) one that does not name the version the alias points at."""
    if isinstance(uri, ArtifactRef):
        uri = uri.uri
    uri = uri.rstrip("/")
    expect = None
    if split_alias_uri(uri) is not None:
        uri = resolve(uri)  # {store}/{stage}@{alias} -> the promoted version
        expect = tuple(uri.rsplit("/", 2)[1:])
    return open_checked(uri, expect)


def open_checked(uri: str, expect: tuple[str, str] | None) -> Artifact:
    """The committed artifact at ``uri``; with ``expect`` (stage, version), :class:`CorruptArtifact` when its manifest
    names another (a store's own directory, or the version an alias points at)."""
    fs, path = fsspec.core.url_to_fs(uri)
    try:
        with fs.open(fresh(fs, posixpath.join(path, MANIFEST)), "rb") as f:
            raw = f.read()
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{uri}: no {MANIFEST}; not a committed artifact (crashed or missing run)") from None
    try:
        manifest = Manifest.model_validate(json.loads(raw))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptArtifact(f"{uri}: {MANIFEST} is not a readable manifest ({type(e).__name__})") from None
    if not (plain_name(manifest.stage) and plain_name(manifest.version)):
        raise CorruptArtifact(f"{uri}: its manifest names {manifest.stage!r}/{manifest.version!r}, not plain names")
    if expect is not None and (manifest.stage, manifest.version) != tuple(expect):
        raise CorruptArtifact(f"{uri}: its manifest names {manifest.stage}/{manifest.version}; the directory is "
                              f"{expect[0]}/{expect[1]}")
    return Artifact(fs, path, manifest, uri)


def parent_uri(child: Artifact, parent: ArtifactRef) -> str:
    """Where ``parent`` of ``child`` is. A recorded URI that is relative (the store was given as a relative path)
    names the parent beside ``child`` in its store, wherever the reader's working directory is; an absolute path
    or a URL is used as recorded."""
    uri = parent.uri
    if "://" in uri or posixpath.isabs(uri):
        return uri
    names = (parent.stage, parent.version)
    if not all(n and n not in (".", "..") and "/" not in n and "\\" not in n for n in names):
        return uri  # not a stage/version pair: nothing to put beside the child
    store = posixpath.dirname(posixpath.dirname(child.uri.rstrip("/")))
    return posixpath.join(store, *names) if store else posixpath.join(*names)


def lineage(uri: str | ArtifactRef) -> dict[str, Any]:
    """The parent tree of an artifact, read from manifests."""
    art = open_artifact(uri)
    m = art.manifest
    return {
        "stage": m.stage,
        "version": m.version,
        "uri": art.uri,
        "stats": m.stats,
        "parents": [lineage(parent_uri(art, p)) for p in m.parents],
    }
