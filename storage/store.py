"""The store: where artifacts live, what a stage directory holds, who may stage a version, and store URIs."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import posixpath
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from storage.aliases import resolve, split_alias_uri
from storage.lease import OWNER, Lease, LeaseSettings, describe, owner_live, read_owner
from storage.manifest import ArtifactRef, Manifest
from storage.names import MANIFEST, check_name, plain_name
from storage.reading import Artifact, fresh, open_checked
from storage.staging import Staging
from storage.versions import VERSION_LEN
from storage.writing import ArtifactWriter

log = logging.getLogger("lexiflow")
# what compute_version gives: the only names an owner-less directory may be removed under (see ArtifactStore.entries)
_COMPUTED_RE = re.compile(rf"[0-9a-f]{{{VERSION_LEN}}}")


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
        return self.fs.exists(fresh(self.fs, posixpath.join(self.artifact_path(stage, version), MANIFEST)))

    def _entries(self, stage: str) -> list[dict[str, Any]]:
        """What is under ``{store}/{stage}/``, with details (a key prefix on object stores; none there: [])."""
        try:
            found = self.fs.ls(fresh(self.fs, posixpath.join(self.root, check_name("stage", stage))), detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [e for e in found if isinstance(e, dict)]

    def entries(self, stage: str, settings: LeaseSettings = LeaseSettings()) -> list[Entry]:
        """Every child of ``{store}/{stage}/``, classified (:class:`Entry`), sorted by name. Only a directory with a
        plain version name, not a link, can be anything but foreign; a committed one's manifest names exactly this
        stage and this version (a version read from a manifest is never used as a path)."""
        out = []
        for info in self._entries(stage):
            path = info["name"].rstrip("/")
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
            with self.fs.open(fresh(self.fs, posixpath.join(path, MANIFEST)), "rb") as f:
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
        if self.fs.exists(fresh(self.fs, posixpath.join(path, OWNER))):
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

    def acquire(self, stage: str, version: str, settings: LeaseSettings = LeaseSettings(),
                run: str | None = None) -> Lease | None:
        """Own the staging directory of ``stage/version``, or None once that version is committed; ``run`` is
        what this run's owner record names (:func:`storage.lease.run_identity`).

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
            if owner is not None or self.fs.exists(fresh(self.fs, directory)):
                _refuse_foreign(self.fs, directory)
                if (read_owner(self.fs, directory) or {}).get("token") != (owner or {}).get("token"):
                    continue  # someone took it over since we looked
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm(directory, recursive=True)  # a crashed run's leftovers of this very version
            lease = Lease(self.fs, directory, settings, run)
            if lease.try_take():
                return lease.start()

    def _leased_writer(self, stage: str, version: str, settings: LeaseSettings,
                       owner: str | None = None) -> ArtifactWriter | None:
        """The staging writer of ``stage/version`` under this run's lease, after clearing the stage's dead staging;
        None when the version got committed (by another run) while this one waited for the lease."""
        lease = self.acquire(stage, version, settings, owner)
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
        if not self.fs.exists(fresh(self.fs, path)):
            return False
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        return True

    def attach(self, stage: str, version: str) -> ArtifactWriter:
        """A writer onto the staging directory of ``stage/version`` that a running :meth:`stage` leads (its shard
        workers and torchrun ranks write files there; the leading run commits them): FileExistsError when the
        version is already committed. Reached through :class:`StagingHandle`."""
        if self.is_committed(stage, version):
            raise FileExistsError(f"{self.artifact_uri(stage, version)} is already committed; there is no staging "
                                  "to attach to")
        return ArtifactWriter(self, stage, version)

    @contextlib.contextmanager
    def stage(self, name: str, version: str, *, code_version: str | None = None,
              config: dict[str, Any] | None = None, parents: Sequence[ArtifactRef] = (),
              lease: LeaseSettings | None = None, owner: str | None = None) -> Iterator[Staging]:
        """Run stage ``name`` at ``version`` in this store: ``with store.stage(...) as st:``, the one way a stage
        writes (:class:`~storage.staging.Staging` is what the body gets).

        * Already committed: ``st.cached``, ``st.artifact`` is the committed artifact; the body writes nothing.
        * Else, on entry, the staging lease is taken (``lease``: its timings), waiting while another live run holds
          it; the stage's dead staging directories are cleared. When the run it waited for commits this version,
          ``st.cached`` as above (adopt its artifact).
        * The body writes through ``st`` (``st.writer`` for the build) and ends with ``st.commit(stats, ...)``
          (``code_version``, ``config`` and ``parents`` go into the manifest; the counts must reconcile).
        * Leaving the block: the lease is released. After a commit the stage's checkpoints are removed (resume state
          is useless once committed). On an exception nothing is committed and the staging stays, released, for the
          next run to take over. Leaving without an exception and without a commit is an error (RuntimeError).
        * ``owner``: the run the staging's owner record names (the flow run; default: this process).
        * Other processes write into the staging this block leads through a picklable :class:`StagingHandle`
          (shard workers and torchrun ranks: :meth:`attach`); this block commits.
        """
        ref = self.ref(name, version)
        if code_version is None or config is None:
            raise TypeError(f"stage {name}: code_version and config are required")
        writer = None if self.is_committed(name, version) else self._leased_writer(
            name, version, lease or LeaseSettings(), owner)
        if writer is None:  # committed before this run, or by the run it waited for: adopt it
            yield Staging(ref, artifact=self.open(name, version))
            return
        st = Staging(ref, writer=writer, code_version=code_version, config=config, parents=parents)
        try:
            yield st
        finally:
            # after a commit a no-op (the commit gave the directory up); else the staging stays, released, for the
            # next run to take over
            writer.lease.release()
            if st.committed:
                self.remove_checkpoints(name, version)
        if not st.committed:
            raise RuntimeError(f"{name}/{version}: the stage's block ended without a commit; nothing is committed "
                               "(call commit, or raise)")

    def open(self, stage: str, version: str) -> Artifact:
        """The committed artifact ``stage/version``; :class:`CorruptArtifact` when its manifest names another."""
        return open_checked(self.artifact_uri(stage, version), expect=(stage, version))


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
        found = fs.find(fresh(fs, path), detail=True, withdirs=True)
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


@dataclass(frozen=True)
class StagingHandle:
    """Where a running stage stages its files, small enough to send to another process: the store's URI, the stage
    and the version (no credentials: a worker has the storage options from its environment or the Dask plugin).

    A shard worker or a torchrun rank calls :meth:`writer` to write into the staging the leading run's
    ``store.stage(...)`` block holds (under its lease); that run commits. Nothing else attaches to staging."""

    store_uri: str
    stage: str
    version: str

    def store(self) -> ArtifactStore:
        """The store."""
        return ArtifactStore(self.store_uri)

    def writer(self) -> ArtifactWriter:
        """A writer onto this staging directory (FileExistsError when the version is already committed)."""
        return self.store().attach(self.stage, self.version)
