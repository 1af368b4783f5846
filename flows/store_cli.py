"""``lexiflow promote | ls | gc``: see what a store holds, name the bundle in production, prune old versions."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from flows.cli import StorageOptions, app, storage_options


def split_artifact_uri(uri: str) -> tuple[str, str, str]:
    """``{store}/{stage}/{version}`` or ``{store}/{stage}@{alias}`` -> (store, stage, version), checked to be a
    committed artifact (aliases resolved)."""
    from storage.artifacts import open_artifact

    art = open_artifact(uri)
    store = art.uri.rstrip("/").rsplit("/", 2)[0]
    return store, art.manifest.stage, art.manifest.version


@app.command()
def promote(
    uri: Annotated[str, typer.Argument(help="a committed artifact, e.g. .demo/store/bundle/<version>")],
    alias: Annotated[str, typer.Option("--alias", help="the name to point at it")] = "production",
    reason: Annotated[Optional[str], typer.Option("--reason", help="recorded in the alias history")] = None,
    storage_opts: StorageOptions = None,
) -> None:
    """Point ``<store>/<stage>@<alias>`` at this artifact (atomic; who, when and the previous version are kept in
    the alias history). With a Prefect API configured it also emits ``lexiflow.bundle.promoted`` (the
    ``relabel-on-promotion`` deployment's trigger). The last stdout line is the alias record as JSON."""
    storage_options(storage_opts)
    from storage.aliases import promote as do_promote
    from tasks.common.events import emit_promotion

    store, stage, version = split_artifact_uri(uri)
    record = do_promote(store, stage, version, alias, reason=reason)
    event = emit_promotion(store, record, flush=True)  # a trigger may relabel the standing inputs (prefect.yaml)
    typer.echo(f"{store}/{stage}@{alias} -> {version} (was {record['previous'] or 'unset'})"
               + (f"; event {event}" if event else ""))
    sys.stdout.flush()
    typer.echo(json.dumps({k: v for k, v in record.items() if k != "history"}, ensure_ascii=False))


@app.command("ls")
def ls(
    store: Annotated[str, typer.Argument(help="artifact store URI")],
    stage: Annotated[Optional[str], typer.Option("--stage", help="only this stage")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
    storage_opts: StorageOptions = None,
) -> None:
    """List committed versions (oldest first per stage) with created time, counts, key metrics and aliases, then
    everything else in each stage directory: staging (``building`` when its run is alive, else ``dead staging``),
    ``abandoned``, ``corrupt`` and ``foreign`` entries, with the reason."""
    storage_options(storage_opts)
    from storage.artifacts import ArtifactStore
    from storage.lifecycle import listing

    st = ArtifactStore(store)
    if not st.fs.exists(st.root):
        raise FileNotFoundError(2, "No such store", store)
    for row in listing(st, stage):
        if as_json:
            typer.echo(json.dumps(row, ensure_ascii=False, default=str))
            continue
        metrics = " ".join(f"{k}={_short(v)}" for k, v in row["metrics"].items() if k in KEY_METRICS)
        alias = f"  @{','.join(row['aliases'])}" if row["aliases"] else ""
        counts = f"in={row['in']} out={row['out']} rejected={row['rejected']}" if row["in"] is not None else ""
        reason = f"({row['reason']})" if row.get("reason") else ""
        typer.echo(f"{row['stage']:<11}{_printable(row['version'])}  {row['created_at'] or row['state']:<25} "
                   f"{counts} {metrics}{alias}{_printable(reason)}".rstrip())


def _printable(text: str) -> str:
    """A name as found in a store, control characters escaped (a foreign entry's name is anyone's)."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(text))


KEY_METRICS = ("test_auc", "baseline_test_auc", "threshold", "last_mlm_loss", "test_f1", "words", "steps",
               "test_macro_f1", "baseline_test_macro_f1")  # the last two: K > 2 class finetunes and bundles


def _short(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


@app.command()
def gc(
    store: Annotated[str, typer.Argument(help="artifact store URI")],
    keep: Annotated[int, typer.Option("--keep", help="newest versions kept per stage")] = 3,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would go; remove nothing")] = False,
    storage_opts: StorageOptions = None,
) -> None:
    """Remove old versions except the newest ``--keep`` per stage, aliased ones and every ancestor of a kept one;
    also dead runs' staging and committed stages' checkpoints (never a live run's staging). Says what it removed
    and how many bytes; the last stdout line is a JSON summary."""
    storage_options(storage_opts)
    from storage.artifacts import ArtifactStore
    from storage.lifecycle import gc as collect

    st = ArtifactStore(store)
    if not st.fs.exists(st.root):
        raise FileNotFoundError(2, "No such store", store)
    report = collect(st, keep, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for uri, size in report.removed:
        typer.echo(f"{verb} {uri}  ({size:,} bytes)")
    typer.echo(f"{verb} {len(report.removed)} entries, {report.bytes:,} bytes; kept {len(report.kept)} versions")
    sys.stdout.flush()
    typer.echo(json.dumps({"removed": len(report.removed), "bytes": report.bytes, "kept": len(report.kept),
                           "dry_run": dry_run}))
