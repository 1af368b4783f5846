"""The labeller's output directory: where shard files go, which files are its own, and whether a run starts
fresh, resumes, is already complete, or must refuse (another label version's files are never mixed in)."""

from __future__ import annotations

import contextlib
import json
import posixpath
from typing import Any

import fsspec
import pyarrow as pa

from storage.artifacts import MANIFEST, TMP_MARK, ArtifactWriter, Manifest

RUN_FILE = "_run.json"
SHARD_DIGESTS = b"lexiflow.shard_digests"  # part file metadata: content digests of the shard's part and rejects


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


def claim_output(out: OutputDir, overwrite: bool, numerics: dict | None = None) -> Manifest | None:
    """Decide fresh / resume / done for ``out``. Returns the manifest when this exact version is
    already committed (and complete); raises :class:`OutputConflict` rather than mix versions (naming the
    numerics that differ, when ``numerics``, this run's, differ from the recorded run's)."""
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
        from models.numerics import numerics_difference

        recorded = ((run or manifest or {}).get("config") or {}).get("numerics")
        why = "other bundle, input or settings"
        if numerics is not None and recorded is not None and (diff := numerics_difference(recorded, numerics)):
            why += f"; other CPU numerics than the recorded run's: {diff}"
        raise OutputConflict(
            f"{out.uri} holds label output version {theirs}; this run ({why}) "
            f"is version {out.version}. Refusing to mix them: choose another output (--output), write one directory "
            "per version under --output-root, or replace it with --overwrite (overwrite=True from Python)"
        )
    if manifest is not None:
        m = Manifest.model_validate(manifest)
        if all(out.exists(f.path) for f in m.files):
            return m
        out.remove(MANIFEST)  # files were deleted after the commit: recompute what is missing
    return None


# ----------------------------------------------------------------------------- a killed run's shards


def content_digest(table: pa.Table) -> str:
    """sha256 of a table's values (not its file bytes), so a part can carry its own digest."""
    import hashlib

    data = json.dumps(table.to_pydict(), ensure_ascii=False, sort_keys=False, default=str)
    return hashlib.sha256(data.encode()).hexdigest()


def shard_digests_metadata(part: pa.Table, rejected: pa.Table | None) -> pa.Table:
    """``part`` carrying the content digests of itself and of its shard's rejects (``SHARD_DIGESTS`` metadata)."""
    digests = {"part": content_digest(part), "rejected": content_digest(rejected) if rejected is not None else None}
    return part.replace_schema_metadata({**(part.schema.metadata or {}), SHARD_DIGESTS: json.dumps(digests)})


def shard_problem(out: OutputDir, i: int) -> str | None:
    """Why shard ``i``'s files (written by an earlier, killed run) cannot be reused, or None when they still hold
    what that run wrote: the part carries the digests of itself and of its rejects, and each file re-encodes to
    its own bytes. Anything else (edited, truncated, unreadable) is recomputed, never mixed in."""
    import pyarrow.parquet as pq

    from storage.parquet import table_bytes

    part, rej = part_name(i), rejected_name(i)

    def read(rel: str) -> tuple[pa.Table, bool]:  # the table, and whether it re-encodes to the file's bytes
        data = out.fs.cat_file(out.file_path(rel))
        table = pq.read_table(pa.BufferReader(data))
        return table, table_bytes(table) == data

    try:
        table, exact = read(part)
        recorded = json.loads((table.schema.metadata or {}).get(SHARD_DIGESTS, b"null"))
        rejected, rej_exact = None, True
        if out.exists(rej):
            rej_table, rej_exact = read(rej)
            rejected = content_digest(rej_table)
    except (OSError, ValueError, pa.ArrowException) as e:  # unreadable: truncated, not Parquet, bad metadata
        return f"it cannot be read ({type(e).__name__}: {e})"
    if not isinstance(recorded, dict):
        return "it carries no shard digest"
    if recorded.get("part") != content_digest(table) or not exact:
        return "its bytes are not what was written (modified after it was written)"
    if recorded.get("rejected") != rejected or not rej_exact:
        return f"{rej} is missing or its bytes are not what was written with {part}"
    return None
