"""What a store holds and what it can drop: listing (`lexiflow ls`) and garbage collection (`lexiflow gc`).

A *stage directory* is a top-level directory (not a link) that holds a manifest naming it as its stage
(``_aliases``, ``_checkpoints``, ``_fingerprints`` and label outputs such as ``labelled/`` are not stages).
Its children are classified by ``ArtifactStore.entries``: committed, corrupt, staging, abandoned or foreign.
``gc`` keeps, per stage, the newest ``keep`` committed versions, every aliased version, every ancestor of a kept
version and every live run's staging directory; it removes the other committed versions (manifest first, so a
version disappears whole), dead runs' staging, abandoned directories, and the checkpoints of committed versions
(an uncommitted one's are a resume point). A path it removes is always one it listed as a direct child of a stage
directory (or of ``_checkpoints/<stage>``), never one read from a manifest or an alias; corrupt and foreign
entries are listed and never touched, and do not count toward ``keep``.
"""

from __future__ import annotations

import contextlib
import posixpath
from dataclasses import dataclass, field
from typing import Any

from storage.aliases import ALIAS_DIR, list_aliases
from storage.lease import LeaseSettings, owner_live, read_owner
from storage.manifest import Manifest
from storage.names import MANIFEST, plain_name
from storage.reading import fresh
from storage.store import ArtifactStore, Entry

NOT_STAGES = {ALIAS_DIR, "_checkpoints", "_fingerprints"}


def stages(store: ArtifactStore) -> list[str]:
    """Top-level directories holding a manifest that names them as its stage (a committed or a corrupt one)."""
    out = []
    for info in _ls_detail(store, store.root):
        name = posixpath.basename(info["name"].rstrip("/"))
        if name in NOT_STAGES or not plain_name(name) or info.get("islink") or info.get("type") != "directory":
            continue
        if any(e.claims == name for e in store.entries(name)):
            out.append(name)
    return sorted(out)


def manifests(store: ArtifactStore, stage: str) -> list[Manifest]:
    """Committed manifests of ``stage``, oldest first (created_at, then version); corrupt ones are left out."""
    return _committed(store, stage, store.entries(stage))


def listing(store: ArtifactStore, stage: str | None = None,
            settings: LeaseSettings = LeaseSettings()) -> list[dict[str, Any]]:
    """One row per committed version (oldest first per stage): stage, version, created_at, in/out/rejected,
    scalar metrics and the aliases pointing at it; then one row per other entry of the stage directory: its
    ``state`` (``building``, ``dead staging``, ``abandoned``, ``corrupt``, ``foreign``) and ``reason``."""
    aliases = list_aliases(store.uri)
    rows = []
    for st in [stage] if stage else stages(store):
        named: dict[str, list[str]] = {}
        for alias, version in aliases.get(st, {}).items():
            named.setdefault(version, []).append(alias)
        entries = store.entries(st, settings)
        for m in _committed(store, st, entries):
            rejected = m.stats.get("rejected") or {}
            rows.append({
                "stage": st, "version": m.version, "created_at": m.created_at, "state": "committed",
                "in": m.stats.get("in"), "out": m.stats.get("out"),
                "rejected": sum(rejected.values()) if isinstance(rejected, dict) else rejected,
                "aliases": sorted(named.get(m.version, [])),
                "metrics": {k: v for k, v in m.metrics.items() if isinstance(v, (int, float, str, bool))},
                "reason": None,
            })
        for e in entries:
            if e.kind == "committed":
                continue
            state = e.kind
            if e.kind == "staging":
                state = "building" if owner_live(read_owner(store.fs, e.path), settings) else "dead staging"
            rows.append({"stage": st, "version": e.name, "created_at": None, "state": state,
                         "in": None, "out": None, "rejected": None, "aliases": [], "metrics": {},
                         "reason": e.reason})
    return rows


def _committed(store: ArtifactStore, stage: str, entries: list[Entry]) -> list[Manifest]:
    """The manifests of ``entries``' committed versions, oldest first (created_at, then version)."""
    found = [store.open(stage, e.name).manifest for e in entries if e.kind == "committed"]
    return sorted(found, key=lambda m: (m.created_at, m.version))


@dataclass
class GcReport:
    """What ``gc`` removed (URI and bytes) and which versions it kept."""

    removed: list[tuple[str, int]] = field(default_factory=list)  # (uri, bytes)
    kept: list[str] = field(default_factory=list)  # stage/version

    @property
    def bytes(self) -> int:
        """The bytes removed in all."""
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
    for st in by_stage:
        for e in store.entries(st, settings):
            # a version committed after the plan was made is neither planned nor removed
            if e.kind == "committed" and (st, e.name) in committed and (st, e.name) not in protected:
                _remove(store, e.path, report, dry_run, manifest_first=True)
            elif e.kind == "abandoned" or (e.kind == "staging"
                                           and not owner_live(read_owner(store.fs, e.path), settings)):
                _remove(store, e.path, report, dry_run)
    ckpt_root = posixpath.join(store.root, "_checkpoints")
    for st_info in _ls_detail(store, ckpt_root):
        st_dir = st_info["name"].rstrip("/")
        st = posixpath.basename(st_dir)
        if not _plain_dir(st_info):
            continue
        for v_info in _ls_detail(store, st_dir):
            vdir = v_info["name"].rstrip("/")
            # only a version directory of a committed version; an uncommitted one is a crashed run's resume point
            if _plain_dir(v_info) and (st, posixpath.basename(vdir)) in committed:
                _remove(store, vdir, report, dry_run)
    return report


def _plain_dir(info: dict[str, Any]) -> bool:
    """A directory (not a link) with a plain name: the only kind of entry gc removes."""
    name = posixpath.basename(info["name"].rstrip("/"))
    return plain_name(name) and not info.get("islink") and info.get("type") == "directory"


def _ls_detail(store: ArtifactStore, path: str) -> list[dict[str, Any]]:
    try:
        found = store.fs.ls(fresh(store.fs, path), detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted((e for e in found if isinstance(e, dict)), key=lambda e: e["name"])


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
