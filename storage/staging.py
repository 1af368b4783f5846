"""One stage run in a store: what ``with store.stage(...) as st:`` gives its body (the writer, a reconciled commit).

:meth:`storage.store.ArtifactStore.stage` takes the staging lease on entry, releases it on the way out and removes the
stage's checkpoints once it has committed; the body sees a :class:`Staging`. The body commits explicitly
(:meth:`Staging.commit`): the counts, metrics and rows are what it computed, and whatever must happen between the
build and the commit (a crash test's pause) stays in the body, where it can be read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from storage.manifest import ArtifactRef, Stats
from storage.reading import Artifact
from storage.writing import ArtifactWriter


class Staging:
    """A stage version as its run's body sees it: already committed (:attr:`cached`), or staging to write and commit.

    * ``cached``: the version is committed, before this run began or by another run while this one waited for the
      lease; :attr:`artifact` is that artifact and the body writes nothing (:attr:`writer` refuses).
    * staging: :attr:`writer` is the staging directory's writer (``open``, ``write_bytes``, ``exists`` and
      ``file_path`` here go to it); the body ends with :meth:`commit`. Leaving the block without a commit commits
      nothing.
    * Other processes (shard workers, torchrun ranks) write into it through a picklable
      :class:`storage.store.StagingHandle`; this run commits what they wrote.
    """

    def __init__(self, ref: ArtifactRef, *, writer: ArtifactWriter | None = None, artifact: Artifact | None = None,
                 code_version: str | None = None, config: dict[str, Any] | None = None,
                 parents: Sequence[ArtifactRef] = ()):
        self.ref, self.stage, self.version = ref, ref.stage, ref.version
        self._writer = writer
        self.artifact = artifact  # the committed artifact: the one found (cached) or the one this run committed
        self.cached = artifact is not None
        self.committed = False  # whether this run committed (in this block)
        self.code_version, self.config, self.parents = code_version, config, list(parents)

    @property
    def writer(self) -> ArtifactWriter:
        """The staging directory's writer; RuntimeError when the version is already committed (nothing to write)."""
        if self._writer is None:
            raise RuntimeError(f"{self.stage}/{self.version} is already committed: there is nothing to write")
        return self._writer

    def file_path(self, rel: str) -> str:
        """Where ``rel`` is in the staging directory (:meth:`ArtifactWriter.file_path`)."""
        return self.writer.file_path(rel)

    @contextlib.contextmanager
    def open(self, rel: str, mode: str = "wb") -> Iterator[Any]:
        """Write ``rel``, moved into place when the block ends (:meth:`ArtifactWriter.open`)."""
        with self.writer.open(rel, mode) as f:
            yield f

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` (:meth:`ArtifactWriter.write_bytes`)."""
        self.writer.write_bytes(rel, data)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is in the staging directory now (:meth:`ArtifactWriter.exists`)."""
        return self.writer.exists(rel)

    def commit(self, stats: dict[str, Any] | Stats, metrics: dict[str, Any] | None = None,
               rows: dict[str, int] | None = None, run: dict[str, Any] | None = None) -> Artifact:
        """Commit the staging directory with these counts, which must reconcile (``in == out + sum(rejected)``;
        RuntimeError and nothing committed otherwise), and the metrics, rows per file and run record; the manifest
        is written last (:meth:`ArtifactWriter.commit`). Returns the committed artifact (also :attr:`artifact`)."""
        if self.cached:
            raise RuntimeError(f"{self.stage}/{self.version} is already committed: there is nothing to commit")
        if self.committed:
            raise RuntimeError(f"{self.stage}/{self.version}: this run has committed it already")
        reconciles = stats.reconciles() if isinstance(stats, Stats) else (
            sum(stats.get("rejected", {}).values()) + stats["out"] == stats["in"])
        if not reconciles:
            shown = stats.dump() if isinstance(stats, Stats) else stats
            raise RuntimeError(f"{self.stage}: counts do not reconcile: {shown}")
        self.artifact = self.writer.commit(code_version=self.code_version, config=self.config, parents=self.parents,
                                           stats=stats, metrics=metrics, rows=rows, run=run)
        self.committed = True
        return self.artifact

