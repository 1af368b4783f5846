"""Versioned, immutable artifacts on any fsspec URL (the contract in DESIGN.md).

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
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import logging
import os
import posixpath
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
from pydantic import BaseModel, Field

from storage.aliases import resolve, split_alias_uri
from storage.digests import content_fingerprint, is_object_store, protocols, sha256_file
from storage.fingerprints import current as current_fingerprints
from storage.lease import OWNER, Lease, LeaseSettings, describe, owner_live, read_owner
from storage.names import MANIFEST, check_name, plain_name
from storage.urls import public_url, scrub

TMP_MARK = ".tmp-"
VERSION_LEN = 16
log = logging.getLogger("lexiflow")
# what compute_version gives: the only names an owner-less directory may be removed under (see ArtifactStore.entries)
_COMPUTED_RE = re.compile(rf"[0-9a-f]{{{VERSION_LEN}}}")


class CorruptArtifact(RuntimeError):
    """A manifest that does not describe the directory it is in (another stage or version, or unreadable)."""


class ArtifactRef(BaseModel):
    """What tasks pass to each other: where an artifact is, never its data."""

    stage: str
    version: str
    uri: str

    def to_json(self) -> str:
        """This reference as one JSON object (the CLI prints it as its last line)."""
        return json.dumps(self.model_dump(), ensure_ascii=False)


class FileEntry(BaseModel):
    """One file of an artifact as its manifest lists it: path, size, sha256 and, for a table, its rows."""

    path: str
    bytes: int
    sha256: str
    rows: int | None = None


class Stats(BaseModel):
    """Row reconciliation of a stage: ``in == out + sum(rejected.values())``."""

    model_config = {"populate_by_name": True}

    in_: int = Field(0, alias="in", ge=0)
    out: int = Field(0, ge=0)
    rejected: dict[str, int] = Field(default_factory=dict)

    def reconciles(self) -> bool:
        """Whether every row that came in went out or was rejected with a reason."""
        return self.in_ == self.out + sum(self.rejected.values())

    def dump(self) -> dict[str, Any]:
        """The counts as the manifest stores them (``in``, ``out``, ``rejected`` by reason, sorted)."""
        return {"in": self.in_, "out": self.out, "rejected": dict(sorted(self.rejected.items()))}


class Manifest(BaseModel):
    """``_manifest.json``: what an artifact is, what made it and what it holds; written last, as the commit marker."""

    stage: str
    version: str
    code_version: str
    parents: list[ArtifactRef] = Field(default_factory=list)
    config: dict[str, Any] = Field(default_factory=dict)
    created_at: str
    files: list[FileEntry] = Field(default_factory=list)
    stats: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    # how this build went, measured (wall time, throughput): never in a data file, never in the version,
    # different on every build of the same version (empty on a manifest written before it existed)
    run: dict[str, Any] = Field(default_factory=dict)

    def file(self, path: str) -> FileEntry:
        """The entry of ``path``; KeyError naming the artifact when it has no such file."""
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(f"{self.stage}/{self.version} has no file {path!r}")


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


def fingerprint(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any]:
    """Identify an input's bytes for versioning: an object store's content digest (ETag/MD5/CRC: no download),
    else ``size`` + a streamed ``sha256`` of the content (local and memory files, HTTP, archive members: never
    the size alone). Inside a run that configured a fingerprint cache (:mod:`storage.fingerprints`) a digest
    computed earlier for the same unchanged file is reused."""
    cache = current_fingerprints()
    if cache is not None:
        return cache.fingerprint_path(fs, path)
    return content_fingerprint(fs, path)


def fingerprint_uri(uri: str) -> dict[str, Any]:
    """:func:`fingerprint` of the file at ``uri``. For an fsspec chain (``tar://<member>::<archive URL>``) that is
    the file as stored, the archive (the last link: the bytes downloaded, hashed without decompressing them; the
    fingerprint of an archive's member would mean decompressing all of it once more), plus ``member``: the rest of
    the chain, so another member of the same archive is another input."""
    inner, sep, outer = uri.rpartition("::")
    if sep:
        fs, path = fsspec.core.url_to_fs(outer)
        return {**fingerprint(fs, path), "member": inner}
    fs, path = fsspec.core.url_to_fs(uri)
    return fingerprint(fs, path)


class IntegrityError(RuntimeError):
    """A file's bytes do not match the sha256 recorded in its manifest."""


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


def _fresh(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """``path`` after dropping ``fs``'s cached listings of it and its parents (s3fs/gcsfs answer
    ``exists``/``ls``/``open`` from listings cached earlier in this process, blind to other writers)."""
    fs.invalidate_cache(path)
    return path


def _move(fs: fsspec.AbstractFileSystem, src: str, dst: str) -> None:
    """Local: an atomic rename. Object store: server-side copy (the copy appears whole) then delete
    (a crash in between leaves only a ``.tmp-`` object, which readers and commit skip)."""
    if is_object_store(fs):
        fs.cp_file(src, dst)
        fs.rm_file(src)
    else:
        fs.mv(src, dst)


class ArtifactWriter:
    """Stages files into ``{store}/{stage}/{version}/`` and commits with the manifest.

    Each data file is written as ``name.tmp-<uuid>`` and moved into place once
    complete; the manifest is written the same way, last. ``written`` remembers what this
    writer moved into place, so the manifest has it even if the store's listing lags.
    """

    lease: Lease | None = None  # set by ArtifactStore.begin: commit checks this run still owns the staging

    def __init__(self, store: "ArtifactStore", stage: str, version: str):
        self.store, self.stage, self.version = store, stage, version
        self.fs = store.fs
        self.path = store.artifact_path(stage, version)
        self.uri = store.artifact_uri(stage, version)

    @property
    def written(self) -> set[str]:
        """Files this writer moved into place (made on first use: a subclass may set up its own paths)."""
        return self.__dict__.setdefault("_written", set())

    def file_path(self, rel: str) -> str:
        """Where ``rel`` is on the filesystem: ``{artifact directory}/{rel}``."""
        return posixpath.join(self.path, rel)

    @contextlib.contextmanager
    def open(self, rel: str, mode: str = "wb") -> Iterator[Any]:
        """Write ``rel`` under a temporary name, moved into place when the block ends (removed if it raises)."""
        final = self.file_path(rel)
        tmp = f"{final}{TMP_MARK}{uuid.uuid4().hex[:8]}"
        if not is_object_store(self.fs):  # no directories there; s3fs makedirs would probe or create the bucket
            self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        try:
            with self.fs.open(tmp, mode) as f:
                yield f
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(tmp)
            raise
        _move(self.fs, tmp, final)
        if rel != MANIFEST:
            self.written.add(rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` (staged, then moved into place)."""
        with self.open(rel, "wb") as f:
            f.write(data)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is in the staging directory now (cached listings dropped first)."""
        return self.fs.exists(_fresh(self.fs, self.file_path(rel)))

    def commit(
        self,
        *,
        code_version: str,
        config: dict[str, Any],
        parents: list[ArtifactRef],
        stats: dict[str, Any] | Stats,
        metrics: dict[str, Any] | None = None,
        rows: dict[str, int] | None = None,
        files: list[str] | None = None,
        run: dict[str, Any] | None = None,
    ) -> Artifact:
        """Hash every file, write the manifest last, return the committed artifact.

        ``run``: what was measured while building (wall time, throughput), kept in the manifest's ``run``
        section, apart from the data files and the metrics, which are the same on every build.

        Files: ``files`` when given, else what is under the directory plus what this writer wrote
        and the files ``rows`` counts (map tasks' shards), so a lagging listing cannot drop one."""
        # reconciliation is enforced here, whatever type the stats come in (a plain dict included)
        checked = stats if isinstance(stats, Stats) else Stats.model_validate(stats)
        if not checked.reconciles():
            raise RuntimeError(f"{self.stage}: counts do not reconcile (in != out + rejected): {checked.dump()}")
        stats = checked.dump() if isinstance(stats, Stats) else stats
        if self.lease is not None:
            self.lease.check()  # never commit over a directory another run has taken over
        rows = rows or {}
        rels = sorted(files) if files is not None else sorted({*self._list_files(), *self.written, *rows})
        entries = []
        for rel in rels:
            digest, size = sha256_file(self.fs, self.file_path(rel))
            entries.append(FileEntry(path=rel, bytes=size, sha256=digest, rows=rows.get(rel)))
        manifest = Manifest(  # no credential at rest: URLs without userinfo or query string
            stage=self.stage,
            version=self.version,
            code_version=code_version,
            parents=[p.model_copy(update={"uri": public_url(p.uri)}) for p in parents],
            config=scrub(config),
            created_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            files=entries,
            stats=stats,
            metrics=metrics or {},
            run=run or {},
        )
        self.write_bytes(MANIFEST, json.dumps(manifest.model_dump(), indent=2, ensure_ascii=False).encode())
        if self.lease is not None:
            self.lease.release(committed=True)  # the staging directory is nobody's any more
        return Artifact(self.fs, self.path, manifest, self.uri)

    def _list_files(self) -> list[str]:
        out = []
        for full in self.fs.find(_fresh(self.fs, self.path)):
            rel = posixpath.relpath(_strip(full), _strip(self.path))
            if TMP_MARK in rel or rel in (MANIFEST, OWNER):
                continue
            out.append(rel)
        return sorted(out)


def _strip(p: str) -> str:
    return p.rstrip("/")


@dataclass(frozen=True)
class Entry:
    """One child of a stage directory, classified (:meth:`ArtifactStore.entries`).

    ``kind``: ``committed`` (its manifest names this stage and this version), ``corrupt`` (a manifest that names
    another stage or version, or cannot be read: shown, never followed or removed), ``staging`` (a version-named
    directory holding an owner record: a run's work in progress, removable once its owner is gone),
    ``abandoned`` (a directory named like a computed version, with neither manifest nor owner record, unchanged
    for longer than the stale window: a run that died between creating it and writing its owner record),
    ``foreign`` (anything else: a file, a link, a name lexiflow never gives, a recent owner-less directory)."""

    name: str
    path: str
    kind: str
    reason: str | None = None
    claims: str | None = None  # the stage a manifest here names (committed or corrupt), None without one


class ArtifactStore:
    """An fsspec URL under which artifacts live as ``{stage}/{version}/``."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)
        self.root = self.root.rstrip("/")

    def artifact_path(self, stage: str, version: str) -> str:
        """``{root}/{stage}/{version}``; refuses a stage or version that is not a plain name (never outside)."""
        return posixpath.join(self.root, check_name("stage", stage), check_name("version", version))

    def artifact_uri(self, stage: str, version: str) -> str:
        """``{store}/{stage}/{version}`` as a URI; refuses a name that is not plain."""
        return f"{self.uri}/{check_name('stage', stage)}/{check_name('version', version)}"

    def ref(self, stage: str, version: str) -> ArtifactRef:
        """The reference of ``stage/version`` in this store (committed or not)."""
        return ArtifactRef(stage=stage, version=version, uri=self.artifact_uri(stage, version))

    def is_committed(self, stage: str, version: str) -> bool:
        """Whether ``stage/version`` has its manifest (listings dropped first: another process may have committed)."""
        return self.fs.exists(_fresh(self.fs, posixpath.join(self.artifact_path(stage, version), MANIFEST)))

    def _entries(self, stage: str) -> list[dict[str, Any]]:
        """What is under ``{store}/{stage}/``, with details (a key prefix on object stores; none there: [])."""
        try:
            found = self.fs.ls(_fresh(self.fs, posixpath.join(self.root, check_name("stage", stage))), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [e for e in found if isinstance(e, dict)]

    def entries(self, stage: str, settings: LeaseSettings = LeaseSettings()) -> list[Entry]:
        """Every child of ``{store}/{stage}/``, classified (:class:`Entry`), sorted by name. Only a directory with a
        plain version name, not a link, can be anything but foreign; a committed one's manifest names exactly this
        stage and this version (a version read from a manifest is never used as a path)."""
        out = []
        for info in self._entries(stage):
            path = _strip(info["name"])
            name = posixpath.basename(path)
            if info.get("islink") or info.get("type") != "directory":
                out.append(Entry(name, path, "foreign", "a link" if info.get("islink") else "not a directory"))
            elif not plain_name(name):
                out.append(Entry(name, path, "foreign", "not a version name"))
            else:
                out.append(self._classify(stage, name, path, settings))
        return sorted(out, key=lambda e: e.name)

    def _classify(self, stage: str, name: str, path: str, settings: LeaseSettings) -> Entry:
        try:
            with self.fs.open(_fresh(self.fs, posixpath.join(path, MANIFEST)), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raw = None
        except (IsADirectoryError, NotADirectoryError, PermissionError) as e:
            return Entry(name, path, "corrupt", f"{MANIFEST} unreadable ({type(e).__name__})")
        if raw is not None:
            try:
                m = Manifest.model_validate(json.loads(raw))
            except (ValueError, UnicodeDecodeError) as e:  # JSON or schema (pydantic's errors are ValueErrors)
                return Entry(name, path, "corrupt", f"{MANIFEST} unreadable ({type(e).__name__})")
            if m.stage != stage:
                return Entry(name, path, "corrupt", f"manifest names stage {m.stage!r}", claims=m.stage)
            if m.version != name:
                return Entry(name, path, "corrupt", f"manifest names version {m.version!r}", claims=m.stage)
            return Entry(name, path, "committed", claims=m.stage)
        if self.fs.exists(_fresh(self.fs, posixpath.join(path, OWNER))):
            return Entry(name, path, "staging")
        age = _age(self.fs, path)
        if _COMPUTED_RE.fullmatch(name) and age is not None and age > settings.stale_after_s:
            return Entry(name, path, "abandoned", "no manifest and no owner record")
        return Entry(name, path, "foreign", "no manifest and no owner record (recent, or not a computed version)")

    def versions(self, stage: str) -> list[str]:
        """Committed versions of a stage (uncommitted, corrupt and foreign entries are invisible)."""
        return [e.name for e in self.entries(stage) if e.kind == "committed"]

    def garbage(self, stage: str, settings: LeaseSettings = LeaseSettings()) -> list[str]:
        """Paths of ``stage``'s staging directories whose writer is gone (a dead owner process on this host, a
        stale heartbeat from another) and of abandoned directories. A live run's staging is never garbage; corrupt
        and foreign entries never are."""
        out = []
        for e in self.entries(stage, settings):
            if e.kind == "abandoned" or (e.kind == "staging" and not owner_live(read_owner(self.fs, e.path), settings)):
                out.append(e.path)
        return sorted(out)

    def collect_garbage(self, stage: str, settings: LeaseSettings = LeaseSettings()) -> list[str]:
        """Remove directories of ``stage`` that a crashed run left without a manifest (never a live run's)."""
        removed = self.garbage(stage, settings)
        for path in removed:
            with contextlib.suppress(FileNotFoundError):  # another run's clean-up got there first
                self.fs.rm(path, recursive=True)
        return removed

    def acquire(self, stage: str, version: str, settings: LeaseSettings = LeaseSettings()) -> Lease | None:
        """Own the staging directory of ``stage/version``, or None once that version is committed.

        While another live run owns it, wait (it will commit, and the caller adopts its artifact). A dead
        owner's leftovers are removed first. Taking the lease is exclusive (``O_EXCL`` on local disks)."""
        directory = self.artifact_path(stage, version)
        waiting_for = None
        while True:
            if self.is_committed(stage, version):
                return None
            owner = read_owner(self.fs, directory)
            if owner_live(owner, settings):
                if waiting_for != owner.get("token"):
                    log.info("%s/%s is being built by %s; waiting for it", stage, version, describe(owner))
                    waiting_for = owner.get("token")
                time.sleep(settings.poll_s)
                continue
            if owner is not None or self.fs.exists(_fresh(self.fs, directory)):
                _refuse_foreign(self.fs, directory)
                if (read_owner(self.fs, directory) or {}).get("token") != (owner or {}).get("token"):
                    continue  # someone took it over since we looked
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(directory, recursive=True)  # a crashed run's leftovers of this very version
            lease = Lease(self.fs, directory, settings)
            if lease.try_take():
                return lease.start()

    def begin(self, stage: str, version: str, settings: LeaseSettings = LeaseSettings()) -> ArtifactWriter | None:
        """Start writing ``stage/version`` under a lease (None: another run committed it meanwhile: adopt it);
        clears this stage's dead staging directories first."""
        if self.is_committed(stage, version):
            raise FileExistsError(f"{self.artifact_uri(stage, version)} is already committed")
        lease = self.acquire(stage, version, settings)
        if lease is None:
            return None
        self.collect_garbage(stage, settings)
        writer = ArtifactWriter(self, stage, version)
        writer.lease = lease
        return writer

    def checkpoint_path(self, stage: str, version: str) -> str:
        """Where a stage keeps its resume state (outside the artifact: crash clean-up leaves it alone)."""
        return posixpath.join(self.root, "_checkpoints", stage, version)

    def remove_checkpoints(self, stage: str, version: str) -> bool:
        """Drop a committed stage's resume state; True when there was some."""
        path = self.checkpoint_path(stage, version)
        if not self.fs.exists(_fresh(self.fs, path)):
            return False
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        return True

    def attach(self, stage: str, version: str) -> ArtifactWriter:
        """A writer onto a staging directory that ``begin`` already prepared (for map tasks)."""
        return ArtifactWriter(self, stage, version)

    def open(self, stage: str, version: str) -> Artifact:
        """The committed artifact ``stage/version``; :class:`CorruptArtifact` when its manifest names another."""
        return _open(self.artifact_uri(stage, version), expect=(stage, version))


def _refuse_foreign(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Raise unless ``path`` is a plain directory (a file or a link there is not lexiflow's to remove)."""
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return
    if info.get("islink") or info.get("type") != "directory":
        raise FileExistsError(f"{fs.unstrip_protocol(path)} exists and is not a directory lexiflow made "
                              "(a file or a link); lexiflow will not remove it: move it away")


def _age(fs: fsspec.AbstractFileSystem, path: str) -> float | None:
    """Seconds since anything under ``path`` last changed (None: the filesystem gives no times)."""
    newest = None
    try:
        found = fs.find(_fresh(fs, path), detail=True, withdirs=True)
    except (FileNotFoundError, NotADirectoryError):
        return None
    with contextlib.suppress(OSError):  # the directory itself (an empty one has nothing else)
        found = {**found, path: fs.info(path)}
    for info in found.values():
        t = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
        if isinstance(t, _dt.datetime):
            t = t.timestamp()
        if isinstance(t, (int, float)):
            newest = t if newest is None else max(newest, float(t))
    return None if newest is None else time.time() - newest


def canonical_store(uri: str) -> str:
    """One spelling of a store (what promotion events carry and triggers match): a local store as an absolute
    path with symbolic links resolved, no ``file://`` and no trailing slash; any other as ``proto://bucket/key``
    (the filesystem's first protocol name, no trailing slash). ``./store``, ``/data/store/``,
    ``file:///data/store`` and a link to ``/data/store`` give the same string."""
    proto, path = fsspec.core.split_protocol(uri.strip())
    proto = (proto or "file").lower()
    if proto in ("file", "local"):
        return os.path.realpath(os.path.expanduser(path)).rstrip("/") or "/"
    proto = _PROTOCOL_NAMES.get(proto, proto)
    return f"{proto}://{re.sub('/+', '/', path).strip('/')}"


_PROTOCOL_NAMES = {"s3a": "s3", "gcs": "gs", "abfss": "abfs"}  # one name per filesystem


def artifact_in_store(uri: str, store_uri: str, stage: str) -> str:
    """``{store}/{stage}/{version}`` in ``store_uri`` for ``uri`` (``{store}/{stage}/{version}`` or
    ``{store}/{stage}@{alias}``, aliases resolved), checked to name a version of ``stage`` directly inside
    ``store_uri`` (compared as :func:`canonical_store` spellings); ValueError otherwise."""
    uri = uri.strip().rstrip("/")
    parts = split_alias_uri(uri)
    if parts is not None:
        head = parts[0]
        if canonical_store(head) != canonical_store(store_uri):
            raise ValueError(f"{uri}: not in the store {store_uri}; refusing to load it")
        uri = resolve(f"{store_uri.rstrip('/')}/{parts[1]}@{parts[2]}")
    split = uri.rsplit("/", 2)
    head, given_stage, version = split if len(split) == 3 else ("", "", "")
    if not head or canonical_store(head) != canonical_store(store_uri):
        raise ValueError(f"{uri}: not in the store {store_uri}; refusing to load it")
    if given_stage != stage or not plain_name(version):
        raise ValueError(f"{uri}: not a {stage} version of {store_uri} ({{store}}/{stage}/<version>)")
    return f"{store_uri.rstrip('/')}/{stage}/{version}"


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
    return _open(uri, expect)


def _open(uri: str, expect: tuple[str, str] | None) -> Artifact:
    fs, path = fsspec.core.url_to_fs(uri)
    try:
        with fs.open(_fresh(fs, posixpath.join(path, MANIFEST)), "rb") as f:
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
