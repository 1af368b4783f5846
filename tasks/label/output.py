"""The labeller's output directory: where shard files go, which files are its own, and whether a run starts
fresh, resumes, is already complete, or must refuse (another label version's files are never mixed in)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import posixpath
import re
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from models.numerics import numerics_difference
from storage.artifacts import MANIFEST, TMP_MARK, ArtifactWriter, Manifest
from storage.parquet import table_bytes
from tasks.common.rejects import reject_schema
from tasks.label.monitor import REPORT_FILE, REPORT_SCHEMA, SKETCH_SCHEMA

RUN_FILE = "_run.json"
SHARD_DIGESTS = b"lexiflow.shard_digests"  # part file metadata: content digests of the shard's part and rejects


class OutputDir:
    """A label run's output directory (chosen by the caller, not ``{store}/{stage}/{version}``): it holds a writer
    onto that directory (:meth:`storage.artifacts.ArtifactWriter.into`: the same tmp-then-move writes and the same
    manifest commit as a stage) and adds what the labeller asks of the directory's files."""

    def __init__(self, uri: str, version: str):  # noqa: D107
        self.writer = ArtifactWriter.into(uri, "label", version)
        self.uri, self.fs, self.path, self.version = self.writer.uri, self.writer.fs, self.writer.path, version

    def file_path(self, rel: str) -> str:
        """Where ``rel`` is on the filesystem."""
        return self.writer.file_path(rel)

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is in the directory now."""
        return self.writer.exists(rel)

    def open(self, rel: str, mode: str = "wb"):
        """Write ``rel`` under a temporary name, moved into place when the block ends (a context manager)."""
        return self.writer.open(rel, mode)

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` to ``rel`` (staged, then moved into place)."""
        self.writer.write_bytes(rel, data)

    def commit(self, **kwargs: Any) -> Any:
        """Commit the directory with its manifest (:meth:`storage.artifacts.ArtifactWriter.commit`)."""
        return self.writer.commit(**kwargs)

    def rels(self) -> list[str]:
        """Every file under the directory, as paths relative to it, sorted."""
        if not self.fs.exists(self.path):
            return []
        return sorted(posixpath.relpath(full.rstrip("/"), self.path) for full in self.fs.find(self.path))

    def read_json(self, rel: str) -> dict[str, Any] | None:
        """The JSON file ``rel``, or None when it does not exist."""
        if not self.exists(rel):
            return None
        with self.fs.open(self.file_path(rel), "rb") as f:
            return json.loads(f.read())

    def remove(self, rel: str) -> None:
        """Delete the file ``rel`` (already gone is fine)."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.file_path(rel))


def part_name(i: int) -> str:
    """The name of the ``i``-th shard's labelled rows."""
    return f"part-{i:05d}.parquet"


def rejected_name(i: int) -> str:
    """The name of the ``i``-th shard's rejected rows."""
    return f"rejected-{i:05d}.parquet"


# exactly the names part_name / rejected_name / tasks.label.monitor.sketch_name give
_SHARD = re.compile(r"(part|rejected)-\d{5}\.parquet|monitor-\d{5}\.json")


def _ours(rel: str) -> bool:
    """Whether ``rel`` has a name the labeller gives its files: the run and commit records, the monitoring report, a
    shard (its part, rejects, monitoring sketch), or one of those under a temporary name; top level only (the
    labeller never writes below its directory)."""
    if "/" in rel:
        return False
    name = rel.split(TMP_MARK, 1)[0]
    return name in (MANIFEST, RUN_FILE, REPORT_FILE) or bool(_SHARD.fullmatch(name))


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
        for rel in owned_files(out, rels):
            out.remove(rel)
        return None
    manifest = out.read_json(MANIFEST)
    run = out.read_json(RUN_FILE)
    theirs = (manifest or {}).get("version") or (run or {}).get("version")
    if theirs is None:
        raise OutputConflict(
            f"{out.uri} is not empty ({len(rels)} files, e.g. {rels[:3]}) and holds no label run; "
            "refusing to write into it: choose an empty output (--output), or one directory per version under "
            "--output-root"
        )
    if theirs != out.version:
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


def owned_files(out: OutputDir, rels: list[str] | None = None) -> list[str]:
    """The files of ``out`` that the previous label run owns, in the order to remove them (the commit marker
    first); :class:`OutputConflict` when ``out`` holds anything else, so ``--overwrite`` removes nothing then.

    A committed run owns exactly what its ``_manifest.json`` lists (plus the manifest itself); an unfinished
    one (a ``_run.json``, no manifest) owns its shards: top-level ``part-NNNNN.parquet`` files carrying the
    labeller's shard digests, ``rejected-NNNNN.parquet`` files, ``monitor-NNNNN.json`` sketches, its ``monitor.json``
    and any of those under a temporary name. A manifest
    that is not a label run's, or that lists a path the labeller never writes, owns nothing."""
    rels = out.rels() if rels is None else rels
    manifest, run = _record(out, MANIFEST, rels), _record(out, RUN_FILE, rels)
    if manifest is not None:
        listed = [f.get("path") for f in manifest.get("files") or [] if isinstance(f, dict)]
        ok = manifest.get("stage") == "label" and all(isinstance(p, str) and _ours(p) and TMP_MARK not in p
                                                        for p in listed)
        owned = {MANIFEST, *listed} if ok else set()
    elif run is not None and run.get("stage") == "label":
        owned = {RUN_FILE} | {r for r in rels if _ours(r) and r != MANIFEST and _label_shard(out, r)}
    else:
        owned = set()
    foreign = [r for r in rels if r not in owned]
    if foreign:
        what = "holds no label run" if not owned else "holds files its label run did not write"
        raise OutputConflict(
            f"{out.uri} {what} ({len(foreign)} files, e.g. {foreign[:3]}); --overwrite removes a label run's own "
            "files only: choose an empty output (--output), or one directory per version under --output-root"
        )
    present = sorted(r for r in owned if r in rels)
    return sorted(present, key=lambda r: r != MANIFEST)  # the commit marker first: a half-done removal is unfinished


def _record(out: OutputDir, rel: str, rels: list[str]) -> dict | None:
    """A top-level JSON record (manifest, run file) as a dict; None when absent or not a JSON object."""
    if rel not in rels:
        return None
    try:
        data = out.read_json(rel)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _label_shard(out: OutputDir, rel: str) -> bool:
    """Whether ``rel`` (a shard name, maybe under a temporary name) is the labeller's: a temporary file is taken
    by its name; a part file must carry the labeller's shard digests in its metadata, a rejects file the
    labeller's reject columns."""
    if TMP_MARK in rel:
        return True
    if rel.endswith(".json"):  # a monitoring sketch or the run's report: the labeller's schema
        try:
            data = out.read_json(rel)
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and data.get("schema") in (SKETCH_SCHEMA, REPORT_SCHEMA)
    try:
        with out.fs.open(out.file_path(rel), "rb") as f:
            schema = pq.ParquetFile(f).schema_arrow
    except (OSError, ValueError, pa.ArrowException):
        return False
    if rel.startswith("rejected-"):
        return schema.names == reject_schema().names  # tasks.label.run.REJECT_SCHEMA
    return SHARD_DIGESTS in (schema.metadata or {})


# ----------------------------------------------------------------------------- a killed run's shards


def content_digest(table: pa.Table) -> str:
    """sha256 of a table's values (not its file bytes), so a part can carry its own digest."""
    data = json.dumps(table.to_pydict(), ensure_ascii=False, sort_keys=False, default=str)
    return hashlib.sha256(data.encode()).hexdigest()


def part_digest(table: pa.Table) -> str | None:
    """The content digest a part table carries (:func:`shard_digests_metadata`), None when it carries none."""
    try:
        return json.loads((table.schema.metadata or {}).get(SHARD_DIGESTS, b"null") or "null").get("part")
    except (ValueError, AttributeError):
        return None


def read_part_digest(out: OutputDir, i: int) -> str | None:
    """The content digest shard ``i``'s part file carries (its Parquet metadata only is read)."""
    try:
        with out.fs.open(out.file_path(part_name(i)), "rb") as f:
            schema = pq.ParquetFile(f).schema_arrow
    except (OSError, ValueError, pa.ArrowException):
        return None
    try:
        return json.loads((schema.metadata or {}).get(SHARD_DIGESTS, b"null") or "null").get("part")
    except (ValueError, AttributeError):
        return None


def shard_digests_metadata(part: pa.Table, rejected: pa.Table | None) -> pa.Table:
    """``part`` carrying the content digests of itself and of its shard's rejects (``SHARD_DIGESTS`` metadata)."""
    digests = {"part": content_digest(part), "rejected": content_digest(rejected) if rejected is not None else None}
    return part.replace_schema_metadata({**(part.schema.metadata or {}), SHARD_DIGESTS: json.dumps(digests)})


def shard_problem(out: OutputDir, i: int) -> str | None:
    """Why shard ``i``'s files (written by an earlier, killed run) cannot be reused, or None when they still hold
    what that run wrote: the part carries the digests of itself and of its rejects, and each file re-encodes to
    its own bytes. Anything else (edited, truncated, unreadable) is recomputed, never mixed in."""
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
