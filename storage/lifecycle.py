"""What a store holds and what it can drop: listing (`lexiflow ls`) and garbage collection (`lexiflow gc`).

A *stage directory* is a top-level directory whose committed versions' manifests name it as their stage
(``_aliases``, ``_checkpoints``, ``_fingerprints`` and label outputs such as ``labelled/`` are not stages).
``gc`` keeps, per stage, the newest ``keep`` versions, every aliased version, every ancestor of a kept version
and every live run's staging directory; it removes the other versions (manifest first, so a version disappears whole),
dead runs' staging, and the checkpoints of committed versions (an uncommitted one's are a resume point).
"""

from __future__ import annotations

import contextlib
import posixpath
from dataclasses import dataclass, field
from typing import Any

from storage.aliases import ALIAS_DIR, list_aliases
from storage.artifacts import MANIFEST, ArtifactStore, Manifest, _fresh
from storage.lease import LeaseSettings, owner_live, read_owner

NOT_STAGES = {ALIAS_DIR, "_checkpoints", "_fingerprints"}


def stages(store: ArtifactStore) -> list[str]:
    """Top-level directories holding at least one committed artifact of that stage name."""
    try:
        entries = store.fs.ls(_fresh(store.fs, store.root), detail=False)
    except FileNotFoundError:
        return []
    out = []
    for entry in sorted(entries):
        name = posixpath.basename(entry.rstrip("/"))
        if name in NOT_STAGES or name.startswith("."):
            continue
        committed = store.versions(name)
        if committed and store.open(name, committed[0]).manifest.stage == name:
            out.append(name)
    return out


def manifests(store: ArtifactStore, stage: str) -> list[Manifest]:
    """Committed manifests of ``stage``, oldest first (created_at, then version)."""
    found = [store.open(stage, v).manifest for v in store.versions(stage)]
    return sorted(found, key=lambda m: (m.created_at, m.version))


def listing(store: ArtifactStore, stage: str | None = None) -> list[dict[str, Any]]:
    """One row per committed version (oldest first per stage): stage, version, created_at, in/out/rejected,
    scalar metrics and the aliases pointing at it; plus one row per live or dead staging directory."""
    aliases = list_aliases(store.uri)
    rows = []
    for st in [stage] if stage else stages(store):
        named: dict[str, list[str]] = {}
        for alias, version in aliases.get(st, {}).items():
            named.setdefault(version, []).append(alias)
        for m in manifests(store, st):
            rejected = m.stats.get("rejected") or {}
            rows.append({
                "stage": st, "version": m.version, "created_at": m.created_at, "state": "committed",
                "in": m.stats.get("in"), "out": m.stats.get("out"), "rejected": sum(rejected.values()),
                "aliases": sorted(named.get(m.version, [])),
                "metrics": {k: v for k, v in m.metrics.items() if isinstance(v, (int, float, str, bool))},
            })
        for path in _staging(store, st):
            owner = read_owner(store.fs, path)
            rows.append({"stage": st, "version": posixpath.basename(path), "created_at": None,
                         "state": "building" if owner_live(owner, LeaseSettings()) else "dead staging",
                         "in": None, "out": None, "rejected": None, "aliases": [], "metrics": {}})
    return rows


@dataclass
class GcReport:
    removed: list[tuple[str, int]] = field(default_factory=list)  # (uri, bytes)
    kept: list[str] = field(default_factory=list)  # stage/version

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.removed)


def plan(store: ArtifactStore, keep: int) -> tuple[set[tuple[str, str]], dict[str, list[Manifest]]]:
    """(protected (stage, version) pairs, committed manifests per stage) for ``gc --keep keep``."""
    if keep < 1:
        raise ValueError(f"keep={keep}: expected at least 1 version per stage")
    by_stage = {st: manifests(store, st) for st in stages(store)}
    index = {(m.stage, m.version): m for ms in by_stage.values() for m in ms}
    roots = {(m.stage, m.version) for ms in by_stage.values() for m in ms[-keep:]}
    roots |= {(st, v) for st, named in list_aliases(store.uri).items() for v in named.values()}
    protected: set[tuple[str, str]] = set()
    todo = list(roots)
    while todo:  # every ancestor of a kept version is kept
        key = todo.pop()
        if key in protected:
            continue
        protected.add(key)
        m = index.get(key)
        if m is not None:
            todo.extend((p.stage, p.version) for p in m.parents)
    return protected, by_stage


def gc(store: ArtifactStore, keep: int, dry_run: bool = False,
       settings: LeaseSettings = LeaseSettings()) -> GcReport:
    """Remove what ``keep`` does not protect (see the module docstring); ``dry_run`` only reports."""
    protected, by_stage = plan(store, keep)
    committed = {(m.stage, m.version) for ms in by_stage.values() for m in ms}
    report = GcReport(kept=sorted(f"{s}/{v}" for s, v in protected & committed))
    for st, ms in by_stage.items():
        for m in ms:
            if (st, m.version) not in protected:
                _remove(store, store.artifact_path(st, m.version), report, dry_run, manifest_first=True)
        for path in _staging(store, st):
            if not owner_live(read_owner(store.fs, path), settings):
                _remove(store, path, report, dry_run)
    ckpt_root = posixpath.join(store.root, "_checkpoints")
    for st_dir in _ls(store, ckpt_root):
        st = posixpath.basename(st_dir)
        for vdir in _ls(store, st_dir):
            if (st, posixpath.basename(vdir)) in committed:  # uncommitted: a crashed run resumes from it
                _remove(store, vdir, report, dry_run)
    return report


def _staging(store: ArtifactStore, stage: str) -> list[str]:
    return [e for e in _ls(store, posixpath.join(store.root, stage))
            if not store.is_committed(stage, posixpath.basename(e))]


def _ls(store: ArtifactStore, path: str) -> list[str]:
    try:
        return sorted(e.rstrip("/") for e in store.fs.ls(_fresh(store.fs, path), detail=False))
    except FileNotFoundError:
        return []


def _remove(store: ArtifactStore, path: str, report: GcReport, dry_run: bool, manifest_first: bool = False) -> None:
    fs = store.fs
    size = sum(fs.du(path, total=False).values()) if fs.isdir(path) else fs.size(path)
    rel = posixpath.relpath(path, store.root)
    report.removed.append((f"{store.uri}/{rel}", int(size)))
    if dry_run:
        return
    with contextlib.suppress(FileNotFoundError):
        if manifest_first:  # the version stops being visible at once, then its files go
            fs.rm_file(posixpath.join(path, MANIFEST))
        fs.rm(path, recursive=True)
