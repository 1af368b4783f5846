"""Writing an artifact: stage its files under temporary names, move each into place, commit with the manifest last."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import posixpath
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec

from storage.digests import is_object_store, sha256_file
from storage.lease import OWNER, Lease
from storage.manifest import ArtifactRef, FileEntry, Manifest, Stats
from storage.names import MANIFEST
from storage.reading import Artifact, fresh
from storage.urls import public_url, scrub

TMP_MARK = ".tmp-"


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

    lease: Lease | None = None  # set when the store hands out a leased writer: commit checks this run still owns it

    def __init__(self, store: Any, stage: str, version: str):  # a storage.store.ArtifactStore (which imports this)
        self.store, self.stage, self.version = store, stage, version
        self.fs = store.fs
        self.path = store.artifact_path(stage, version)
        self.uri = store.artifact_uri(stage, version)

    @classmethod
    def into(cls, uri: str, stage: str, version: str) -> "ArtifactWriter":
        """A writer onto the directory ``uri`` that no store owns (a label output: ``{root}/{label version}``): the
        same tmp-then-move writes and the same manifest commit, with no store and no lease."""
        writer = cls.__new__(cls)
        writer.store, writer.stage, writer.version = None, stage, version
        writer.uri = uri.rstrip("/")
        writer.fs, path = fsspec.core.url_to_fs(writer.uri)
        writer.path = path.rstrip("/")
        return writer

    @property
    def written(self) -> set[str]:
        """Files this writer moved into place (made on first use)."""
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
        return self.fs.exists(fresh(self.fs, self.file_path(rel)))

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
        for full in self.fs.find(fresh(self.fs, self.path)):
            rel = posixpath.relpath(_strip(full), _strip(self.path))
            if TMP_MARK in rel or rel in (MANIFEST, OWNER):
                continue
            out.append(rel)
        return sorted(out)


def _strip(p: str) -> str:
    return p.rstrip("/")
