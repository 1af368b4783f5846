"""``lexiflow sample | run | label | ner-label | lineage | export-hf | explain``: build, run, label, explain, trace."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from flows.registry import FLOWS, load_flow_config, run_flow
from lexiflow.cli import reaper
from lexiflow.cli.base import ALERT_EXIT, StorageOptions, stop_line, storage_options
from storage.artifacts import lineage as artifact_lineage
from storage.urls import public_url
from tasks.common.config import THREADS
from tasks.label.config import LabelOptions, MonitorConfig


def sample(
    out: Annotated[Path, typer.Option("--out", help="directory for the embedded sample inputs")] = Path(".demo/inputs"),
) -> None:
    """Write the embedded sample (People's Daily corpus, Tencent-format vectors, sentiment CSV, NER BIO)."""
    from tasks.prepare.sample import build_sample  # noqa: PLC0415  (gensim, jieba: only for this command)

    info = build_sample(out)
    typer.echo(json.dumps(info, ensure_ascii=False, indent=1, default=str))


def run_settings(overrides: list[str] | None, store: str | None, rehash: bool) -> list[str]:
    """``run``'s ``--set`` overrides plus what its own options set."""
    sets = list(overrides or [])
    if store:
        sets.append(f"store_uri={store}")
    if rehash:
        sets.append("runner.rehash_inputs=true")
    return sets


def run(
    flow_name: Annotated[str, typer.Argument(metavar="FLOW", help="flow to run: " + ", ".join(sorted(FLOWS)))],
    config: Annotated[
        Optional[str], typer.Option("--config", "-c", help="YAML profile, a path or any fsspec URL, e.g. "
                                    "configs/demo.yaml")
    ] = None,
    store: Annotated[Optional[str], typer.Option("--store", help="artifact store URI (overrides store_uri)")] = None,
    overrides: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a config key: section.key=value")
    ] = None,
    storage_opts: StorageOptions = None,
    rehash: Annotated[bool, typer.Option("--rehash", help="hash every input file again (ignore the fingerprint "
                                         "cache in <store>/_fingerprints)")] = False,
) -> None:
    """Run a flow; the last line printed is the final ArtifactRef as JSON."""
    sets = run_settings(overrides, store, rehash)
    if flow_name not in FLOWS:
        raise typer.BadParameter(f"unknown flow {flow_name!r}; choose from {sorted(FLOWS)}", param_hint="FLOW")
    try:
        cfg = load_flow_config(flow_name, config, sets)
    except Exception as e:  # name the profile; _Commands makes a config mistake one `error:` line, exit 2
        e.add_note(f"config {config}" if config else "config (no --config)")
        raise
    for protocol, opts in storage_options(storage_opts, apply=False).items():  # wins over the profile's
        cfg.storage_options.setdefault(protocol, {}).update(opts)
    reaper.start()  # the temporary Prefect server, a Dask cluster, torchrun, loader workers: ended with this process
    try:
        ref = run_flow(flow_name, cfg)
    except SystemExit as e:  # a training stage stopped on a signal (tasks.training.preempt.Preempted; no torch here)
        if getattr(e, "line", None):  # Prefect logged its "Crash detected!" lines after ours: ours comes last
            exit_stopped(stop_line(e) or e.line, e.code)
        raise
    if flow_name == "pipeline":
        from tasks.evaluate.summary import summary_lines  # noqa: PLC0415  (the training stack: after a pipeline run only)

        for line in summary_lines(cfg, ref):
            typer.echo(line)
    sys.stdout.flush()
    typer.echo(ref.to_json())



def exit_stopped(line: str, code: int) -> None:
    """End the process after a training stage stopped on a signal, with ``line`` (how to go on) as the last thing it
    prints on stderr (a terminal or a log file): the exit handlers first (Prefect's log shipping among them), then
    the line, then the exit with ``code``, without the interpreter's teardown (seconds of it: a preemption notice
    leaves 15 s in all)."""
    import atexit  # noqa: PLC0415  (only when a stage stopped)

    atexit._run_exitfuncs()  # logging.shutdown among them: every handler flushed
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(code)


Output = Annotated[Optional[str], typer.Option("--output", help="output directory URI (Parquet shards)")]
OutputRoot = Annotated[
    Optional[str],
    typer.Option("--output-root", help="write to <root>/<label version> instead: one directory per bundle version "
                 "+ input + settings (nightly runs)"),
]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="replace another label run's files in --output")]
Input = Annotated[str, typer.Option("--input", help="CSV/TSV/JSONL/Parquet, any fsspec URL or glob (.gz ok)")]
IdColumn = Annotated[Optional[str], typer.Option("--id-column", help="row ids from this column; default file:row")]
ShardRows = Annotated[int, typer.Option("--shard-rows", help="input rows per output shard (the resume unit)")]
Monitor = Annotated[bool, typer.Option("--monitor/--no-monitor", help="write the monitoring report monitor.json "
                                       "beside the output (drift against the bundle's reference, estimated "
                                       "accuracy); not part of the label version: the same part files either way")]
MonitorSet = Annotated[Optional[list[str]], typer.Option(
    "--monitor-set", help="a monitor setting key=value, e.g. psi_threshold=0.25, margin=0.1, metric_floor=0.85, "
    "max_reject_share=0.05, alert_on=[metric,data_quality,drift]")]
FailOnAlert = Annotated[bool, typer.Option("--fail-on-alert", help=f"exit {ALERT_EXIT} (after committing the output "
                                           "and printing its summary) when the monitoring report alerts")]


def label(
    bundle: Annotated[str, typer.Option("--bundle", help="bundle artifact URI, or <store>/bundle@<alias>")],
    input: Input, output: Output = None, output_root: OutputRoot = None, overwrite: Overwrite = False,
    text_column: Annotated[str, typer.Option("--text-column", help="the column that holds the text")] = "review",
    id_column: IdColumn = None, shard_rows: ShardRows = 50_000,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="texts scored per forward pass (memory, not "
                                            "results: a text's probability does not depend on its batch)")] = 32,
    precision: Annotated[str, typer.Option("--precision", help="fp32, or int8 (CPU; used only if it agrees with "
                                           "fp32 on >= 99.9% of the bundle's held-out labels)")] = "fp32",
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch CPU threads (on CPU: up to that many "
                                         "batches at once, one thread each, the same bits); part of the label version "
                                         "(same threads and numerics, same bytes), never the core count")] = THREADS,
    monitor: Monitor = True, monitor_set: MonitorSet = None, fail_on_alert: FailOnAlert = False,
    storage_opts: StorageOptions = None,
) -> None:
    """Label texts offline with a bundle; prints the output summary as JSON on the last line.

    With --monitor (the default) the run's monitoring report (monitor.json) is committed beside the output and
    summarised in one line on stderr; with a Prefect API configured an alert is also the event lexiflow.label.drift.
    An alert is an estimated metric below its floor or a data-quality problem (too many rejects, an empty or fully
    rejected run); drift alone is a warning unless --monitor-set alert_on=[...,drift]. With --fail-on-alert an
    alerting run exits 3 (the output is committed either way)."""
    storage_options(storage_opts)
    opts = dict(text_column=text_column, id_column=id_column, shard_rows=shard_rows, batch_size=batch_size,
                precision=precision, threads=threads)
    summary = _label_with("label", bundle, input, output, opts, output_root, overwrite,
                          monitor_config(monitor, monitor_set))
    if fail_on_alert and (summary.get("monitor") or {}).get("alert"):
        raise typer.Exit(ALERT_EXIT)


def monitor_config(enabled: bool, sets: list[str] | None) -> MonitorConfig:
    """``--monitor/--no-monitor`` and ``--monitor-set key=value`` as a :class:`MonitorConfig` (a bad key or value is
    one ``error:`` line, exit 2)."""
    from tasks.common.config import parse_override  # noqa: PLC0415

    values: dict = {"enabled": enabled}
    for item in sets or []:
        keys, value = parse_override(item)
        values[".".join(keys)] = value
    return MonitorConfig.model_validate(values)


def _label_with(kind: str, model_uri: str, input_uri: str, output_uri: str | None, options: dict,
                output_root: str | None, overwrite: bool, monitor: MonitorConfig | None = None) -> dict:
    """Run a labelling flow, or, when no Prefect API is configured, the same labeller directly (no temporary
    server to start: a one-row file answers in seconds; the bytes are the same). A bad input or option is one
    clear line and exit 2, not a traceback. The last stdout line is the output summary as JSON."""
    if (output_uri is None) == (output_root is None):
        raise typer.BadParameter("give exactly one of --output DIR and --output-root ROOT", param_hint="--output")
    from flows.direct import label_direct, prefect_api_configured  # noqa: PLC0415  (torch: only when labelling)

    opts = LabelOptions(**options)
    reaper.start()  # whatever labelling starts ends with this process, however it ends
    extra = {"monitor": monitor} if monitor is not None else {}
    if prefect_api_configured():  # a server records the run: a normal flow run
        flow_fn = _label_flow(kind)
        summary = flow_fn(model_uri, input_uri, output_uri, opts, output_root=output_root, overwrite=overwrite,
                          **extra)
    else:
        summary = label_direct(kind, model_uri, input_uri, output_uri, opts, output_root, overwrite, **extra)
    if (summary.get("monitor") or {}).get("alert") and prefect_api_configured():
        from flows.events import flush_events  # noqa: PLC0415  (Prefect: a flow run just ran)

        flush_events()  # the drift event is sent before the process exits
    sys.stdout.flush()
    shown = {**summary, "uri": public_url(summary.get("uri"))}
    typer.echo(json.dumps({k: shown.get(k) for k in ("uri", "version", "stats")}, ensure_ascii=False, default=str))
    return summary


def _label_flow(kind: str):
    """The Prefect flow that labels for ``kind`` (``label`` or ``ner-label``)."""
    if kind == "label":
        from flows.label import label_flow  # noqa: PLC0415  (Prefect: only for a recorded flow run)

        return label_flow
    if kind == "ner-label":
        from flows.ner import ner_label_flow  # noqa: PLC0415  (Prefect: only for a recorded flow run)

        return ner_label_flow
    raise KeyError(kind)


def ner_label(
    model: Annotated[str, typer.Option("--model", help="ner artifact URI")],
    input: Input, output: Output = None, output_root: OutputRoot = None, overwrite: Overwrite = False,
    text_column: Annotated[str, typer.Option("--text-column", help="the column that holds the text")] = "text",
    id_column: IdColumn = None, shard_rows: ShardRows = 50_000,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch CPU threads (part of the version)")] = THREADS,
    storage_opts: StorageOptions = None,
) -> None:
    """Entities (type, start, end, text) for every row; same rejects and resume rules as `label`."""
    storage_options(storage_opts)
    opts = dict(text_column=text_column, id_column=id_column, shard_rows=shard_rows, threads=threads)
    _label_with("ner-label", model, input, output, opts, output_root, overwrite)


def lineage(
    uri: Annotated[str, typer.Argument(help="artifact URI, e.g. .demo/store/lexicon/<version>")],
    storage_opts: StorageOptions = None,
) -> None:
    """Print an artifact's parent tree (from manifests)."""
    storage_options(storage_opts)
    seen: set[str] = set()

    def show(node: dict, depth: int = 0) -> None:
        st = node["stats"]
        rej = sum(st.get("rejected", {}).values())
        pad = "  " * depth
        if node["uri"] in seen:  # a shared ancestor: printed once, referenced after
            typer.echo(f"{pad}{node['stage']} {node['version']}  (see above)")
            return
        seen.add(node["uri"])
        counts = f"in={st.get('in')} out={st.get('out')} rejected={rej}"
        typer.echo(f"{pad}{node['stage']} {node['version']}  {counts}  {node['uri']}")
        for p in node["parents"]:
            show(p, depth + 1)

    show(artifact_lineage(uri))


def export_hf(
    uri: Annotated[str, typer.Argument(help="pretrain, finetune or bundle artifact URI")],
    out: Annotated[Path, typer.Option("--out", help="directory for the Hugging Face files")],
    adapter: Annotated[
        str, typer.Option("--adapter", help="no-words: keep the adapter's word-free LayerNorm; drop: remove it")
    ] = "no-words",
) -> None:
    """Export an encoder as a Hugging Face BERT directory.

    Writes config.json, model.safetensors and the vocab + tokenizer files that transformers loads; the last stdout
    line is a JSON summary. The lexicon adapter has no HF equivalent and is dropped (warned)."""
    from tasks.bundle.export_hf import export_hf as export  # noqa: PLC0415  (torch, transformers: this command only)

    # a bad URI, stage, --adapter or a non-empty --out raises ValueError/FileExistsError: one `error:` line, exit 2
    res = export(uri, out, adapter, warn=lambda m: typer.echo(f"warning: {m}", err=True))
    sys.stdout.flush()
    typer.echo(json.dumps(res.summary(), ensure_ascii=False))


def explain(
    bundle: Annotated[str, typer.Option("--bundle", help="bundle artifact URI, or <store>/bundle@<alias>")],
    text: Annotated[str, typer.Option("--text", help="the text to explain")],
    out: Annotated[Path, typer.Option("--out", help="directory for the PNG heatmaps and CSV tables (created)")],
    dpi: Annotated[int, typer.Option("--dpi", min=30, max=600, help="resolution of the PNGs")] = 110,
    storage_opts: StorageOptions = None,
) -> None:
    """Show what the model looks at for one text.

    Attention heatmaps per layer, a per-character attribution for the predicted label and the lexicon words at each
    character (PNG + CSV in --out); the last stdout line is a JSON summary (prob equals what lexiflow label
    writes)."""
    storage_options(storage_opts)
    from tasks.inference.bundle import open_bundle  # noqa: PLC0415  (torch: this command only)
    from tasks.inference.explain_bundle import explain as explain_text  # noqa: PLC0415  (torch: this command only)

    ex = explain_text(open_bundle(bundle), text)  # an empty text or a bad URI: ValueError, one `error:` line, exit 2
    paths = ex.save(str(out), dpi=dpi)
    sys.stdout.flush()
    typer.echo(json.dumps({**ex.summary(), "out": str(out), "pngs": [Path(p).name for p in paths]},
                          ensure_ascii=False))
