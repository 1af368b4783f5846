"""Manifests and references: what an artifact is, what made it, what it holds, and the errors of a bad one."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field


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



class IntegrityError(RuntimeError):
    """A file's bytes do not match the sha256 recorded in its manifest."""
