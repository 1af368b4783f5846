"""``lexiflow promote | ls | gc``: see what a store holds, name the bundle in production, prune old versions."""

from __future__ import annotations

import json
import posixpath
import sys
import time
from typing import Annotated, Any, Optional

import typer

from flows.events import emit_promotion
from lexiflow.cli.base import StorageOptions, storage_options
from storage.aliases import promote as do_promote
from storage.artifacts import ArtifactStore, fresh, open_artifact
from storage.lease import LeaseSettings, describe, owner_live, read_json, read_owner
from storage.lifecycle import NOT_STAGES, listing, stages
from storage.lifecycle import gc as collect
from tasks.label.output import RUN_FILE


def split_artifact_uri(uri: str) -> tuple[str, str, str]:
    """``{store}/{stage}/{version}`` or ``{store}/{stage}@{alias}`` -> (store, stage, version), checked to be a
    committed artifact (aliases resolved)."""
    art = open_artifact(uri)
    store = art.uri.rstrip("/").rsplit("/", 2)[0]
    return store, art.manifest.stage, art.manifest.version


def promote(
    uri: Annotated[str, typer.Argument(help="a committed artifact, e.g. .demo/store/bundle/<version>")],
    alias: Annotated[str, typer.Option("--alias", help="the name to point at it")] = "production",
    reason: Annotated[Optional[str], typer.Option("--reason", help="recorded in the alias history")] = None,
    storage_opts: StorageOptions = None,
) -> None:
    """Point <store>/<stage>@<alias> at a committed artifact.

    Atomic; who, when and the previous version are kept in the alias history. With a Prefect API configured it also
    emits lexiflow.bundle.promoted (the relabel-on-promotion deployment's trigger). The last stdout line is the alias
    record as JSON."""
    storage_options(storage_opts)
    store, stage, version = split_artifact_uri(uri)
    record = do_promote(store, stage, version, alias, reason=reason)
    event = emit_promotion(store, record, flush=True)  # a trigger may relabel the standing inputs (prefect.yaml)
    typer.echo(f"{store}/{stage}@{alias} -> {version} (was {record['previous'] or 'unset'})"
               + (f"; event {event}" if event else ""))
    sys.stdout.flush()
    typer.echo(json.dumps({k: v for k, v in record.items() if k != "history"}, ensure_ascii=False))


StaleAfter = Annotated[float, typer.Option(
    "--stale-after", min=1.0, help="seconds after which a silent owner on another host counts as dead: the runs' "
    "runner.lease_stale_after_s (a staging directory younger than this is never removed)")]


def _lease(stale_after: float) -> LeaseSettings:
    """The lease settings of the runs that write the store, as far as gc and ls need them."""
    return LeaseSettings(stale_after_s=stale_after)


def ls(
    store: Annotated[str, typer.Argument(help="artifact store URI")],
    stage: Annotated[Optional[str], typer.Option("--stage", help="only this stage")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line, the rows of the text")] = False,
    stale_after: StaleAfter = LeaseSettings().stale_after_s,
    storage_opts: StorageOptions = None,
) -> None:
    """List what a store holds: committed versions, versions being built, labelled outputs and what it does not own.

    Committed versions (oldest first per stage) come with created time, counts, key metrics and aliases; a
    version being built with its owner and age (building while its run is alive, else dead staging, which gc
    removes); abandoned, corrupt and foreign entries with the reason (corrupt and foreign are never touched);
    labelled outputs under <store>/labelled/ with their label version, bundle and counts (incomplete while a label
    run has not finished). Every row has a state."""
    storage_options(storage_opts)
    st = ArtifactStore(store)
    if not st.fs.exists(st.root):
        raise FileNotFoundError(2, "No such store", store)
    for row in ls_rows(st, stage, settings=_lease(stale_after)):
        typer.echo(json.dumps(row, ensure_ascii=False, default=str) if as_json else render_ls_row(row))


KEY_METRICS = ("test_auc", "baseline_test_auc", "threshold", "last_mlm_loss", "test_f1", "words", "steps",
               "test_macro_f1", "baseline_test_macro_f1")  # the last two: K > 2 class finetunes and bundles


def _short(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


LABELLED = "labelled"  # where the pipeline writes its labelled output: <store>/labelled/<bundle version>/


def ls_rows(st, stage: str | None = None, now: float | None = None,
            settings: LeaseSettings = LeaseSettings()) -> list[dict[str, Any]]:
    """The rows of ``lexiflow ls``, one dict each with a ``state``: the store's listing (committed, building, dead
    staging) with the owner and age of every version being built, also for a stage with nothing committed yet,
    then the labelled outputs under ``<store>/labelled/`` (labelled, or incomplete while a run has not committed)."""
    now = time.time() if now is None else now
    if stage == LABELLED:  # not a stage: its directories are label outputs, not versions
        return _labelled_rows(st)
    rows = listing(st, stage, settings)
    known = set(stages(st)) | {r["stage"] for r in rows}
    for name in [stage] if stage else _top_dirs(st):  # a stage whose first version is still being built
        if name not in known and name not in NOT_STAGES and name != LABELLED:
            rows.extend(_unstarted_stage_rows(st, name, settings))
    for row in rows:
        if row["state"] in ("building", "dead staging"):
            row.update(_owner_fields(st, posixpath.join(st.root, row["stage"], row["version"]), now))
    if stage is None:
        rows.extend(_labelled_rows(st))
    return rows


def _children(st, path: str) -> list[str]:
    """The directories directly under ``path`` (listed fresh: another process may have just created one)."""
    try:
        entries = st.fs.ls(fresh(st.fs, path), detail=True)
    except FileNotFoundError:
        return []
    return sorted(e["name"].rstrip("/") for e in entries if e.get("type") == "directory")


def _top_dirs(st) -> list[str]:
    return [posixpath.basename(p) for p in _children(st, st.root)]


def _unstarted_stage_rows(st, name: str, settings: LeaseSettings) -> list[dict[str, Any]]:
    """Staging directories (an owner record, no manifest) of a directory that holds no committed version yet."""
    rows = []
    for path in _children(st, posixpath.join(st.root, name)):
        owner = read_owner(st.fs, path)
        if owner is None or st.is_committed(name, posixpath.basename(path)):
            continue
        rows.append({"stage": name, "version": posixpath.basename(path), "created_at": None,
                     "state": "building" if owner_live(owner, settings) else "dead staging",
                     "in": None, "out": None, "rejected": None, "aliases": [], "metrics": {}})
    return rows


def _owner_fields(st, path: str, now: float) -> dict[str, Any]:
    """Who builds a staging directory and for how long: from its owner record (none: a crashed run's leftovers)."""
    owner = read_owner(st.fs, path)
    if not owner:
        return {"owner": None, "age_s": None, "heartbeat_age_s": None}
    started, beat = owner.get("started"), owner.get("heartbeat")
    return {"owner": describe(owner), "age_s": None if started is None else round(now - float(started)),
            "heartbeat_age_s": None if beat is None else round(now - float(beat))}


def _labelled_rows(st) -> list[dict[str, Any]]:
    """One row per directory under ``<store>/labelled/`` that a label run wrote (its manifest, or its run record
    while it has not committed); other directories there are not ours to describe."""
    rows = []
    for path in _children(st, posixpath.join(st.root, LABELLED)):
        manifest = read_json(st.fs, posixpath.join(path, "_manifest.json"))
        run = manifest or read_json(st.fs, posixpath.join(path, RUN_FILE))
        if not isinstance(run, dict) or run.get("stage") != "label":
            continue
        stats = (manifest or {}).get("stats") or {}
        parents = (manifest or {}).get("parents") or [run.get("bundle") or {}]
        bundle = next((p.get("version") for p in parents if p.get("stage") in ("bundle", "ner")), None)
        rejected = sum((stats.get("rejected") or {}).values()) if stats else None
        rows.append({"stage": LABELLED, "version": run.get("version"), "created_at": (manifest or {}).get("created_at"),
                     "state": "labelled" if manifest else "incomplete", "in": stats.get("in"),
                     "out": stats.get("out"), "rejected": rejected,
                     "aliases": [], "metrics": {}, "path": f"{LABELLED}/{posixpath.basename(path)}", "bundle": bundle})
    return rows


def _age(seconds: int | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def render_ls_row(row: dict[str, Any]) -> str:
    """One text line of ``lexiflow ls`` for a row of :func:`ls_rows` (any state; unknown keys are ignored)."""
    when = row.get("created_at") or row["state"]
    parts = [f"{row['stage']:<11}{_printable(row['version'])}  {when:<25}"]
    if row.get("in") is not None:
        parts.append(f"in={row['in']} out={row['out']} rejected={row['rejected']}")
    if row["state"] in ("building", "dead staging"):
        parts.append(f"owner {row['owner']}, started {_age(row.get('age_s'))} ago, heartbeat "
                     f"{_age(row.get('heartbeat_age_s'))} ago" if row.get("owner") else "no owner record")
    if row.get("bundle"):
        parts.append(f"bundle={row['bundle']}")
    if row.get("path"):
        parts.append(row["path"])
    if row["state"] not in ("committed", "building", "dead staging") and row.get("created_at"):
        parts.append(row["state"])
    parts.append(" ".join(f"{k}={_short(v)}" for k, v in (row.get("metrics") or {}).items() if k in KEY_METRICS))
    if row.get("aliases"):
        parts.append(f" @{','.join(row['aliases'])}")
    if row.get("reason"):
        parts.append(_printable(f"({row['reason']})"))
    return " ".join(p for p in parts if p).rstrip()


def _printable(text: str) -> str:
    """A name as found in a store, control characters escaped (a foreign entry's name is anyone's)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))


def gc(
    store: Annotated[str, typer.Argument(help="artifact store URI")],
    keep: Annotated[int, typer.Option("--keep", help="newest versions kept per stage")] = 3,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would go; remove nothing")] = False,
    stale_after: StaleAfter = LeaseSettings().stale_after_s,
    storage_opts: StorageOptions = None,
) -> None:
    """Remove old versions, dead runs' staging and committed stages' checkpoints.

    Keeps the newest --keep versions per stage, aliased ones and every ancestor of a kept one, and never touches a
    live run's staging. Says what it removed and how many bytes; the last stdout line is a JSON summary."""
    storage_options(storage_opts)
    st = ArtifactStore(store)
    if not st.fs.exists(st.root):
        raise FileNotFoundError(2, "No such store", store)
    report = collect(st, keep, dry_run=dry_run, settings=_lease(stale_after))
    verb = "would remove" if dry_run else "removed"
    for uri, size in report.removed:
        typer.echo(f"{verb} {uri}  ({size:,} bytes)")
    typer.echo(f"{verb} {len(report.removed)} entries, {report.bytes:,} bytes; kept {len(report.kept)} versions")
    sys.stdout.flush()
    typer.echo(json.dumps({"removed": len(report.removed), "bytes": report.bytes, "kept": len(report.kept),
                           "dry_run": dry_run}))
