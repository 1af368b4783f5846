"""The labeller's output directory: where shard files go, which files are its own, and whether a run starts
fresh, resumes, is already complete, or must refuse (another label version's files are never mixed in)."""

from __future__ import annotations

import contextlib
import json
import posixpath
from typing import Any

import fsspec

from storage.artifacts import MANIFEST, TMP_MARK, ArtifactWriter, Manifest

RUN_FILE = "_run.json"


class OutputDir(ArtifactWriter):
    """An ArtifactWriter onto a caller-chosen directory (not ``{store}/{stage}/{version}``):
    same tmp-then-move writes and the same manifest commit."""

    def __init__(self, uri: str, version: str):  # noqa: D107 - no store: the directory is given
        self.store = None
        self.stage, self.version = "label", version
        self.uri = uri.rstrip("/")
        self.fs, path = fsspec.core.url_to_fs(self.uri)
        self.path = path.rstrip("/")

    def rels(self) -> list[str]:
        if not self.fs.exists(self.path):
            return []
        return sorted(posixpath.relpath(full.rstrip("/"), self.path) for full in self.fs.find(self.path))

    def read_json(self, rel: str) -> dict[str, Any] | None:
        if not self.exists(rel):
            return None
        with self.fs.open(self.file_path(rel), "rb") as f:
            return json.loads(f.read())

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.file_path(rel))


def part_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


def rejected_name(i: int) -> str:
    return f"rejected-{i:05d}.parquet"


def _ours(rel: str) -> bool:
    shard = rel.startswith(("part-", "rejected-")) and rel.endswith(".parquet") and "/" not in rel
    return rel in (MANIFEST, RUN_FILE) or TMP_MARK in rel or shard


class OutputConflict(FileExistsError):
    """The output directory holds another label run's files."""


def claim_output(out: OutputDir, overwrite: bool) -> Manifest | None:
    """Decide fresh / resume / done for ``out``. Returns the manifest when this exact version is
    already committed (and complete); raises :class:`OutputConflict` rather than mix versions."""
    rels = out.rels()
    if not rels:
        return None
    if overwrite:
        for rel in rels:
            if _ours(rel):
                out.remove(rel)
        return None
    manifest = out.read_json(MANIFEST)
    run = out.read_json(RUN_FILE)
    theirs = (manifest or {}).get("version") or (run or {}).get("version")
    if theirs is None:
        raise OutputConflict(
            f"{out.uri} is not empty ({len(rels)} files, e.g. {rels[:3]}) and holds no label run; "
            "refusing to write into it: choose an empty output (--output) or replace it with --overwrite "
            "(overwrite=True from Python)"
        )
    if theirs != out.version:
        raise OutputConflict(
            f"{out.uri} holds label output version {theirs}; this run (other bundle, input or settings) "
            f"is version {out.version}. Refusing to mix them: choose another output (--output), write one directory "
            "per version under --output-root, or replace it with --overwrite (overwrite=True from Python)"
        )
    if manifest is not None:
        m = Manifest.model_validate(manifest)
        if all(out.exists(f.path) for f in m.files):
            return m
        out.remove(MANIFEST)  # files were deleted after the commit: recompute what is missing
    return None
