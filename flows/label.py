"""The ``label`` flow: a committed bundle + a table of texts -> labelled Parquet shards (resumable).

Thin: loads the bundle (checksum-verified), runs the ``label`` task (``tasks.label.run``), and
publishes a Prefect table artifact under the key ``label`` with the stats and the output URI; the run's monitoring
report (:mod:`tasks.label.monitor`) as the table ``label-monitor`` and the markdown ``label-monitor-report`` (with its
picture), and, when it alerts, the event ``lexiflow.label.drift`` (:func:`flows.events.emit_drift`), which the
``drift-alert`` deployment (:func:`drift_alert_flow`) answers.
"""

from __future__ import annotations

import json
import re
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NONE
from prefect.states import Completed, State
from pydantic import BaseModel, ConfigDict, Field

from flows.events import emit_drift
from flows.runner import label_runtime
from flows.runtime import PrefectRuntime
from flows.settings import apply_storage_secret, label_roots, standing_inputs, store_root
from storage.artifacts import artifact_in_store
from storage.urls import public_url
from tasks.common.config import RunnerConfig
from tasks.common.ui import bars, png_markdown
from tasks.inference.bundle import load_bundle
from tasks.inference.runtime import default_device
from tasks.label.config import LabelOptions, MonitorConfig
from tasks.label.monitor import REPORT_FILE, report_markdown, report_png, report_table, verified_report
from tasks.label.output import OutputDir
from tasks.label.run import label_stream
from tasks.label.scale import label_scaled


@task(name="label", task_run_name="label", cache_policy=NONE)
def label_task(
    bundle, input_uri: str | list[str], output_uri: str | None, options: LabelOptions | None = None,
    overwrite: bool = False, progress: bool = True, threads: int | None = None, output_root: str | None = None,
    monitor: MonitorConfig | None = None, runtime: PrefectRuntime | None = None,
) -> dict[str, Any]:
    """:func:`tasks.label.run.label_stream` as a Prefect task (no result caching: the output directory is the cache),
    its logs and progress through ``runtime``."""
    return label_stream(bundle, input_uri, output_uri, options, output_root=output_root, overwrite=overwrite,
                        progress=progress, threads=threads, monitor=monitor, runtime=runtime)


def _table(res: dict[str, Any]) -> list[dict[str, Any]]:
    st, m = res["stats"], res["metrics"]
    rows = [{"key": "output_uri", "value": res["uri"]}, {"key": "version", "value": res["version"]}]
    rows += [{"key": "in", "value": st.get("in")}, {"key": "out", "value": st.get("out")}]
    rows += [{"key": f"rejected.{k}", "value": v} for k, v in sorted(st.get("rejected", {}).items())]
    keys = ("positive", "threshold", "bundle_version", "model_version", "shards", "input_files")
    rows += [{"key": k, "value": m.get(k)} for k in keys if k in m]
    rows += [{"key": "resumed_shards", "value": res.get("skipped_shards", 0)}]
    rows += [{"key": "cached", "value": res.get("cached", False)}]
    if res.get("monitor"):
        rows += [{"key": "monitor", "value": res["monitor"]["summary"]}]
    return rows


def publish_label(rt: PrefectRuntime, res: dict[str, Any], bundle_uri: str | None = None) -> str | None:
    """Prefect UI: the label run's stats and output URI as the table artifact ``label``; its monitoring report as
    the table ``label-monitor`` and the markdown ``label-monitor-report`` (with the picture); when the report
    alerts, the ``lexiflow.label.drift`` event (resource: the output; related: the bundle at ``bundle_uri``).
    Returns the event's id (None: no alert, or no API)."""
    shown = {**res, "uri": public_url(res["uri"])}
    desc = (f"**label** `{shown['version']}` {'(already complete)' if res.get('cached') else '(built)'}\n\n"
            f"`{shown['uri']}`")
    rt.reporter.publish_table("label", _table(shown), None, desc)
    rep = res.get("monitor")
    if not rep:
        return None
    publish_monitor(rt, rep, cached=bool(res.get("cached")))
    if not rep.get("alert") or bundle_uri is None:
        return None
    if res.get("cached"):  # one event per label version: the run that built it sent it
        rt.log.info("monitor %s: already complete; its alert was sent when it was built, no second event",
                    res["version"])  # pragma: no mutate
        return None
    try:
        event = emit_drift(res, bundle_uri)
    except Exception as e:  # the alert is in the report and the log line either way
        rt.log.warning("could not emit the drift event: %s", e)
        return None
    if event:
        rt.log.warning("monitor %s: alert sent as event %s (%s)", res["version"], event,  # pragma: no mutate
                         "; ".join(rep["alerts"]))
    return event


def publish_monitor(rt: PrefectRuntime, rep: dict[str, Any], key: str = "label-monitor", cached: bool = False) -> None:
    """A monitoring report as the table ``key`` and the markdown ``key-report`` with its picture; ``cached``: the
    report of an output an earlier run committed, marked so."""
    verdict = "ALERT" if rep.get("alert") else "ok"
    mark = " (cached: committed by an earlier run)" if cached else ""
    md = report_markdown(rep) + "\n\n" + png_markdown("monitoring", report_png(rep))
    rt.reporter.publish_table(key, report_table(rep), None, f"**monitoring** {verdict}{mark}: {rep['summary']}",
                              markdown=(f"{key}-report", md, f"monitoring {verdict}{mark}"))


def final_state(res: dict[str, Any]) -> State:
    """The label flow's final state: Completed (automations on Completed keep working), its message saying whether
    the monitoring report alerted."""
    rep = res.get("monitor") or {}
    if rep.get("alert"):
        msg = f"labelled {res['version']}; monitoring ALERT: {'; '.join(rep['alerts'])}"
    else:
        msg = f"labelled {res['version']}" + ("; monitoring ok" if rep else "")
    return Completed(message=msg[:500], data=res)


@flow(name="label", log_prints=True)
def label_flow(bundle_uri: str | None = None, input_uri: str | None = None, output_uri: str | None = None,
               options: LabelOptions = LabelOptions(), output_root: str | None = None, overwrite: bool = False,
               shares: int = 1, runner: RunnerConfig | None = None, threads: int | None = None,
               monitor: MonitorConfig = MonitorConfig(), fingerprint_store: str | None = None) -> dict:
    """Label every row of ``input_uri`` (CSV/TSV/JSON lines/Parquet, globs allowed) into ``output_uri``, or into
    ``output_root/<label version>`` (one directory per bundle version + input + settings: a nightly schedule);
    ``bundle_uri`` may be ``<store>/bundle@<alias>``; ``options``: text/id column, rows per shard, batch size;
    ``overwrite`` replaces another label run's output in ``output_uri``. ``shares > 1`` spreads the shards over
    that many tasks on ``runner`` (e.g. ``{kind: dask, dask_workers: 4}`` or a ``dask_address``); the committed
    bytes are the same for any ``shares`` with the same ``threads`` (torch threads per task). ``monitor``: the
    monitoring report beside the output (drift thresholds, margin, metric floor; not part of the label version);
    when it alerts, the run emits ``lexiflow.label.drift`` and still completes. Unset, ``bundle_uri``,
    ``input_uri`` and (with no ``output_uri``) ``output_root`` come from Prefect Variables when the run starts
    (:func:`flows.settings.label_roots`: the ``label-nightly`` deployment). ``fingerprint_store``: a store whose
    input fingerprint cache the inputs go through (the pipeline passes its own; ``runner.rehash_inputs`` hashes
    them again): an unchanged local input is not read again to compute the label version."""
    apply_storage_secret()
    bundle_uri, input_uri, output_root = label_roots(bundle_uri, input_uri, output_uri, output_root)
    # shares load the model on CPU where they run (tasks.label.scale), so the coordinator does too: the device is
    # part of the label version's numerics, and every share must compute the coordinator's version
    rt = label_runtime(fingerprint_store, (runner or RunnerConfig()).rehash_inputs)
    bundle = load_bundle(bundle_uri, default_device() if shares <= 1 else "cpu")
    if shares > 1:
        with rt.shards(runner or RunnerConfig()):
            res = label_scaled("label", bundle_uri, input_uri, output_uri, options, shares=shares,
                               output_root=output_root, overwrite=overwrite, threads=threads, scorer=bundle,
                               monitor=monitor, runtime=rt)
    else:
        res = label_task(bundle, input_uri, output_uri, options, overwrite=overwrite, output_root=output_root,
                         progress=bars(True), threads=threads, monitor=monitor, runtime=rt)
    publish_label(rt, res, bundle.uri)
    rt.reporter.publish_link("labelled-link", res["uri"], f"labelled output {res['version']}",
                             "this run's labelled shards")
    shown = {**res, "uri": public_url(res["uri"])}
    print(json.dumps({"labelled": {k: shown[k] for k in ("uri", "version", "stats")}}, ensure_ascii=False))
    return final_state(res)


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
def relabel_flow(bundle_uri: str | None = None, inputs: list[StandingInput] | None = None,
                 store_uri: str | None = None, event_id: str | None = None,
                 alias: str | None = None, previous: str | None = None, promoted_by: str | None = None,
                 monitor: MonitorConfig = MonitorConfig()) -> dict:
    """Label every standing input with ``bundle_uri`` (the ``relabel-on-promotion`` deployment: its trigger passes
    the promoted version's URI and the promotion event's id, alias, previous version and author). ``bundle_uri`` must
    name a bundle version (or alias) directly inside ``store_uri`` (the deployment's store, however either is
    spelled); any other is refused before anything is loaded. Each input gets its own label version under its
    output root. The run records what caused it (``relabel-cause`` artifact, the log, the result); each output gets
    its monitoring report against the promoted bundle (``monitor``), and an alerting one its drift event. Unset,
    ``store_uri`` and ``inputs`` come from Prefect Variables when the run starts (``lexiflow_store``,
    ``lexiflow_standing_inputs``: :mod:`flows.settings`), and ``bundle_uri`` is ``<store>/bundle@production``."""
    apply_storage_secret()
    store_uri = store_uri or store_root()
    bundle_uri = bundle_uri or f"{store_uri.rstrip('/')}/bundle@production"
    inputs = inputs if inputs is not None else [StandingInput.model_validate(i) for i in standing_inputs()]
    cause = {"event_id": _given(event_id), "alias": _given(alias), "previous": _given(previous),
             "promoted_by": _given(promoted_by), "bundle_uri": bundle_uri}
    rt = label_runtime()
    rt.log.info("relabel: %s", json.dumps(cause, ensure_ascii=False))
    bundle = load_bundle(artifact_in_store(bundle_uri, store_uri, "bundle"), "cpu")
    cause["bundle_version"] = bundle.version
    outputs = []
    for inp in inputs:
        res = label_task(bundle, inp.input_uri, None, inp.options, output_root=inp.output_root, progress=bars(True),
                         monitor=monitor, runtime=rt)
        publish_label(rt, res, bundle.uri)
        rep = res.get("monitor") or {}
        outputs.append({"input_uri": inp.input_uri, "uri": res["uri"], "version": res["version"],
                        "stats": res["stats"], "alert": rep.get("alert"), "drift": rep.get("drift")})
    _publish_cause(rt, cause, outputs)
    done = {"cause": cause, "outputs": outputs}
    print(json.dumps(done, ensure_ascii=False))
    return done


def _publish_cause(rt: PrefectRuntime, cause: dict, outputs: list[dict]) -> None:
    """Prefect UI: what caused a relabelling run and what it wrote, as the markdown artifact ``relabel-cause``."""
    rt.reporter.publish_markdown("relabel-cause", "\n".join(cause_markdown(cause, outputs)), "what caused this run")


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


@flow(name="drift-alert", log_prints=True)
def drift_alert_flow(output_uri: str, label_version: str | None = None, bundle_version: str | None = None,
                     event_id: str | None = None, summary: str | None = None) -> dict:
    """Answer a ``lexiflow.label.drift`` event (the ``drift-alert`` deployment's trigger): read the committed
    monitoring report of the label output at ``output_uri`` (only a committed label run's own ``monitor.json``), and
    publish it as the markdown artifact ``drift-alert`` (what alerted, the table, the picture) and one WARNING log
    line, so the alert stands as a run in the UI (and any notification on this deployment's runs fires)."""
    apply_storage_secret()
    rt = label_runtime()
    out = OutputDir(output_uri, _given(label_version) or "")
    manifest = out.read_json("_manifest.json")
    if not isinstance(manifest, dict) or manifest.get("stage") != "label" or REPORT_FILE not in {
            f.get("path") for f in manifest.get("files") or [] if isinstance(f, dict)}:
        raise ValueError(f"{public_url(output_uri)} is not a committed label run with a monitoring report")
    if _given(label_version) and manifest.get("version") != label_version:
        raise ValueError(f"{public_url(output_uri)} holds label version {manifest.get('version')}, the event names "
                         f"{label_version}")
    listed = {f.get("path"): f for f in manifest.get("files") or [] if isinstance(f, dict)}
    rep = verified_report(out.fs, out.file_path(REPORT_FILE), listed[REPORT_FILE].get("sha256"),
                          public_url(f"{output_uri.rstrip('/')}/{REPORT_FILE}"))
    lines = [f"**drift alert** for `{public_url(output_uri)}`", "",
             f"event `{md_text(_given(event_id))}`, label `{md_text(rep['label_version'])}`, "
             f"bundle `{md_text(rep['bundle_version'])}`", "", report_markdown(rep), "",
             png_markdown("monitoring", report_png(rep))]
    rt.reporter.publish_markdown("drift-alert", "\n".join(lines), "; ".join(rep["alerts"]) or "no alert")
    rt.log.warning("drift alert: %s", rep["summary"])
    done = {"output_uri": public_url(output_uri), "label_version": rep["label_version"], "alert": rep["alert"],
            "alerts": rep["alerts"], "summary": rep["summary"]}
    print(json.dumps(done, ensure_ascii=False))
    return done
