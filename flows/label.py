"""The ``label`` flow: a committed bundle + a table of texts -> labelled Parquet shards (resumable).

Thin: loads the bundle (checksum-verified), runs the ``label`` task (``tasks.label.run``), and
publishes a Prefect table artifact under the key ``label`` with the stats and the output URI.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from prefect import artifacts, flow, task
from prefect.cache_policies import NONE
from pydantic import BaseModel, ConfigDict, Field

from flows.runner import shard_runner
from storage.artifacts import artifact_in_store
from storage.urls import public_url
from tasks.bundle.bundle import load_bundle
from tasks.common.config import RunnerConfig
from tasks.common.stage import logger
from tasks.common.ui import bars, publish_link
from tasks.label.config import LabelOptions
from tasks.label.run import label_stream
from tasks.label.scale import label_scaled


@task(name="label", task_run_name="label", cache_policy=NONE)
def label_task(
    bundle, input_uri: str | list[str], output_uri: str | None, options: LabelOptions | None = None,
    overwrite: bool = False, progress: bool = True, threads: int | None = None, output_root: str | None = None,
) -> dict[str, Any]:
    """:func:`tasks.label.run.label_stream` as a Prefect task (no result caching: the output directory is the cache)."""
    return label_stream(bundle, input_uri, output_uri, options, output_root=output_root, overwrite=overwrite,
                        progress=progress, threads=threads)


def _table(res: dict[str, Any]) -> list[dict[str, Any]]:
    st, m = res["stats"], res["metrics"]
    rows = [{"key": "output_uri", "value": res["uri"]}, {"key": "version", "value": res["version"]}]
    rows += [{"key": "in", "value": st.get("in")}, {"key": "out", "value": st.get("out")}]
    rows += [{"key": f"rejected.{k}", "value": v} for k, v in sorted(st.get("rejected", {}).items())]
    keys = ("positive", "threshold", "bundle_version", "model_version", "shards", "input_files")
    rows += [{"key": k, "value": m.get(k)} for k in keys if k in m]
    rows += [{"key": "resumed_shards", "value": res.get("skipped_shards", 0)}]
    rows += [{"key": "cached", "value": res.get("cached", False)}]
    return rows


def publish_label(res: dict[str, Any]) -> None:
    """Prefect UI: the label run's stats and output URI as the table artifact ``label``."""
    res = {**res, "uri": public_url(res["uri"])}
    desc = f"**label** `{res['version']}` {'(already complete)' if res.get('cached') else '(built)'}\n\n`{res['uri']}`"
    try:
        artifacts.create_table_artifact(key="label", table=_table(res), description=desc)
    except Exception as e:  # the UI artifact is a convenience; the output is already committed
        logger().warning("could not publish the label artifact: %s", e)


@flow(name="label", log_prints=True)
def label_flow(bundle_uri: str, input_uri: str, output_uri: str | None = None, options: LabelOptions = LabelOptions(),
               output_root: str | None = None, overwrite: bool = False, shares: int = 1,
               runner: RunnerConfig | None = None, threads: int | None = None) -> dict:
    """Label every row of ``input_uri`` (CSV/TSV/JSON lines/Parquet, globs allowed) into ``output_uri``, or into
    ``output_root/<label version>`` (one directory per bundle version + input + settings: a nightly schedule);
    ``bundle_uri`` may be ``<store>/bundle@<alias>``; ``options``: text/id column, rows per shard, batch size;
    ``overwrite`` replaces another label run's output in ``output_uri``. ``shares > 1`` spreads the shards over
    that many tasks on ``runner`` (e.g. ``{kind: dask, dask_workers: 4}`` or a ``dask_address``); the committed
    bytes are the same for any ``shares`` with the same ``threads`` (torch threads per task)."""
    # shares load the model on CPU where they run (tasks.label.scale), so the coordinator does too: the device is
    # part of the label version's numerics, and every share must compute the coordinator's version
    bundle = load_bundle(bundle_uri, "cuda" if torch.cuda.is_available() and shares <= 1 else "cpu")
    if shares > 1:
        with shard_runner(runner or RunnerConfig()):
            res = label_scaled("label", bundle_uri, input_uri, output_uri, options, shares=shares,
                               output_root=output_root, overwrite=overwrite, threads=threads, scorer=bundle)
    else:
        res = label_task(bundle, input_uri, output_uri, options, overwrite=overwrite, output_root=output_root,
                         progress=bars(True), threads=threads)
    publish_label(res)
    publish_link("labelled-link", res["uri"], f"labelled output {res['version']}", "this run's labelled shards")
    shown = {**res, "uri": public_url(res["uri"])}
    print(json.dumps({"labelled": {k: shown[k] for k in ("uri", "version", "stats")}}, ensure_ascii=False))
    return res


class StandingInput(BaseModel):
    """An input relabelled whenever a bundle is promoted, each time into a new label version under ``output_root``
    (``<output_root>/<label version>``: nothing is overwritten; old outputs stay until ``lexiflow gc``)."""

    model_config = ConfigDict(extra="forbid")
    input_uri: str = Field(description="CSV/TSV/JSON lines/Parquet, globs allowed")
    output_root: str
    options: LabelOptions = LabelOptions()


def _given(value: str | None) -> str | None:
    """A templated event field: a missing value arrives as "None" or "" (templates render to strings)."""
    return None if value in (None, "", "None", "null") else value


@flow(name="relabel", log_prints=True)
def relabel_flow(bundle_uri: str, inputs: list[StandingInput], store_uri: str, event_id: str | None = None,
                 alias: str | None = None, previous: str | None = None, promoted_by: str | None = None) -> dict:
    """Label every standing input with ``bundle_uri`` (the ``relabel-on-promotion`` deployment: its trigger passes
    the promoted version's URI and the promotion event's id, alias, previous version and author). ``bundle_uri`` must
    name a bundle version (or alias) directly inside ``store_uri`` (the deployment's store, however either is
    spelled); any other is refused before anything is loaded. Each input gets its own label version under its
    output root. The run records what caused it (``relabel-cause`` artifact, the log, the result)."""
    cause = {"event_id": _given(event_id), "alias": _given(alias), "previous": _given(previous),
             "promoted_by": _given(promoted_by), "bundle_uri": bundle_uri}
    logger().info("relabel: %s", json.dumps(cause, ensure_ascii=False))
    bundle = load_bundle(artifact_in_store(bundle_uri, store_uri, "bundle"), "cpu")
    cause["bundle_version"] = bundle.version
    outputs = []
    for inp in inputs:
        res = label_task(bundle, inp.input_uri, None, inp.options, output_root=inp.output_root, progress=bars(True))
        publish_label(res)
        outputs.append({"input_uri": inp.input_uri, "uri": res["uri"], "version": res["version"],
                        "stats": res["stats"]})
    _publish_cause(cause, outputs)
    done = {"cause": cause, "outputs": outputs}
    print(json.dumps(done, ensure_ascii=False))
    return done


def _publish_cause(cause: dict, outputs: list[dict]) -> None:
    """Prefect UI: what caused a relabelling run and what it wrote, as the markdown artifact ``relabel-cause``."""
    lines = cause_markdown(cause, outputs)
    try:
        artifacts.create_markdown_artifact(key="relabel-cause", markdown="\n".join(lines),
                                           description="what caused this run")
    except Exception as e:  # the UI artifact is a convenience; the outputs are committed and the log has the cause
        logger().warning("could not publish the relabel-cause artifact: %s", e)


def md_text(value: Any) -> str:
    """``value`` as literal text in a Markdown table cell: every character that can start markup backslash-escaped
    (no link, autolink, image, HTML, entity, emphasis, code span or cell break can come from it; ``-``, ``/`` and
    ``@`` stay, so ids and paths read as typed), line breaks as spaces."""
    text = " ".join(str(value).splitlines())
    return _MD_SPECIAL.sub(r"\\\1", text)


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>!|&#~(){}:+=$.^])")


def cause_markdown(cause: dict, outputs: list[dict]) -> list[str]:
    """The ``relabel-cause`` artifact's lines; every value from the event or the inputs is :func:`md_text`."""
    lines = ["**relabel** after a promotion", "", "| | |", "|---|---|"]
    lines += [f"| {md_text(k)} | {md_text(v)} |" for k, v in cause.items()]
    lines += ["", "| input | output | in | out | rejected |", "|---|---|---|---|---|"]
    lines += [f"| {md_text(o['input_uri'])} | {md_text(o['uri'])} | {md_text(o['stats']['in'])} | "
              f"{md_text(o['stats']['out'])} | {md_text(sum(o['stats']['rejected'].values()))} |" for o in outputs]
    return lines
