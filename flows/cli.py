"""``lexiflow`` command line: build the sample, run flows, show lineage."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="lexiflow: Chinese wiki + Tencent lexicon -> LEBERT pipeline (Prefect).",
)


@app.command()
def sample(
    out: Annotated[Path, typer.Option("--out", help="directory for the embedded sample inputs")] = Path(".demo/inputs"),
) -> None:
    """Write the embedded sample (People's Daily corpus, Tencent-format vectors, sentiment CSV, NER BIO)."""
    from tasks.sample import build_sample

    info = build_sample(out)
    typer.echo(json.dumps(info, ensure_ascii=False, indent=1, default=str))


# flow name -> (module, flow object, config model)
FLOWS = {
    "prepare": ("flows.prepare", "prepare_flow", "PrepareConfig"),
    "pretrain": ("flows.pretrain", "pretrain_flow", "PipelineConfig"),
    "pipeline": ("flows.pipeline", "pipeline_flow", "PipelineConfig"),
    "ner": ("flows.ner", "ner_flow", "PipelineConfig"),
}


@app.command()
def run(
    flow_name: Annotated[str, typer.Argument(metavar="FLOW", help="flow to run: " + ", ".join(sorted(FLOWS)))],
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", help="YAML profile, e.g. configs/demo.yaml")
    ] = None,
    store: Annotated[Optional[str], typer.Option("--store", help="artifact store URI (overrides store_uri)")] = None,
    overrides: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a config key: section.key=value")
    ] = None,
) -> None:
    """Run a flow; the last line printed is the final ArtifactRef as JSON."""
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sets = list(overrides or [])
    if store:
        sets.append(f"store_uri={store}")
    import importlib

    from tasks.common import config as config_mod

    if flow_name not in FLOWS:
        raise typer.BadParameter(f"unknown flow {flow_name!r}; choose from {sorted(FLOWS)}", param_hint="FLOW")
    module, flow_attr, model_name = FLOWS[flow_name]
    try:
        cfg = config_mod.load_config(getattr(config_mod, model_name), config, sets)
    except Exception as e:  # config errors: one clear message, no traceback
        typer.echo(f"config error ({config}): {e}", err=True)
        raise typer.Exit(2) from e
    from tasks.common.runner import with_runner

    ref = with_runner(getattr(importlib.import_module(module), flow_attr), cfg.runner)(cfg)
    if flow_name == "pipeline":
        from flows.pipeline import summary_lines

        for line in summary_lines(cfg, ref):
            typer.echo(line)
    sys.stdout.flush()
    typer.echo(ref.to_json())


@app.command()
def label(
    bundle: Annotated[str, typer.Option("--bundle", help="bundle artifact URI")],
    input: Annotated[str, typer.Option("--input", help="CSV/TSV/JSONL/Parquet, any fsspec URL or glob (.gz ok)")],
    output: Annotated[str, typer.Option("--output", help="output directory URI (Parquet shards)")],
    text_column: Annotated[str, typer.Option("--text-column")] = "review",
    id_column: Annotated[Optional[str], typer.Option("--id-column")] = None,
    shard_rows: Annotated[int, typer.Option("--shard-rows")] = 50_000,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 64,
) -> None:
    """Label texts offline with a bundle; prints the output summary as JSON on the last line."""
    from flows.label import label_flow

    opts = dict(text_column=text_column, id_column=id_column, shard_rows=shard_rows, batch_size=batch_size)
    _label_with(label_flow, bundle, input, output, opts)


def _label_with(flow_fn, model_uri: str, input_uri: str, output_uri: str, options: dict) -> None:
    """Run a labelling flow; a bad input or option is one clear line and exit 2, not a traceback.
    The last stdout line is the output summary as JSON."""
    os.environ.setdefault("PYTHONHASHSEED", "0")
    from tasks.common.config import LabelOptions

    try:
        summary = flow_fn(model_uri, input_uri, output_uri, LabelOptions(**options))
    except ValueError as e:  # e.g. a missing text column, or shard_rows=0
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    sys.stdout.flush()
    typer.echo(json.dumps({k: summary.get(k) for k in ("uri", "version", "stats")}, ensure_ascii=False, default=str))


@app.command("ner-label")
def ner_label(
    model: Annotated[str, typer.Option("--model", help="ner artifact URI")],
    input: Annotated[str, typer.Option("--input", help="CSV/TSV/JSONL/Parquet, any fsspec URL or glob (.gz ok)")],
    output: Annotated[str, typer.Option("--output", help="output directory URI (Parquet shards)")],
    text_column: Annotated[str, typer.Option("--text-column")] = "text",
    id_column: Annotated[Optional[str], typer.Option("--id-column")] = None,
    shard_rows: Annotated[int, typer.Option("--shard-rows")] = 50_000,
) -> None:
    """Entities (type, start, end, text) for every row; same rejects and resume rules as `label`."""
    from flows.ner import ner_label_flow

    opts = dict(text_column=text_column, id_column=id_column, shard_rows=shard_rows)
    _label_with(ner_label_flow, model, input, output, opts)


@app.command()
def lineage(uri: Annotated[str, typer.Argument(help="artifact URI, e.g. .demo/store/lexicon/<version>")]) -> None:
    """Print an artifact's parent tree (from manifests)."""
    from storage.artifacts import lineage as tree

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

    show(tree(uri))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
