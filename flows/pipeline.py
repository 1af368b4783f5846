"""The ``pipeline`` flow: prepare -> pretrain -> finetune -> threshold -> bundle -> label.

Every stage is content-addressed and skipped when its artifact version already exists, so a
scheduled re-run with unchanged inputs and config does no work.
"""

from __future__ import annotations

import json

from prefect import flow, task
from prefect.cache_policies import NONE

from flows.finetune import finetune_task
from flows.pretrain import prepare_and_pretrain, stage_on_pretrained
from storage.artifacts import ArtifactRef, ArtifactStore, open_artifact
from storage.urls import public_url
from tasks.bundle import bundle, promote
from tasks.common.config import PipelineConfig
from tasks.common.runner import start_run
from tasks.common.stage import logger, run_stage
from tasks.common.ui import publish_link
from tasks.finetune import threshold
from tasks.finetune import train as finetune
from tasks.finetune.baseline import clean_test_line, vs_baseline


def stage_finetune(store: ArtifactStore, cfg: PipelineConfig, pretrain_ref: ArtifactRef,
                   lexicon_ref: ArtifactRef) -> ArtifactRef:
    return stage_on_pretrained(store, "finetune", finetune.code_version(cfg.finetune), finetune_task,
                               cfg.finetune, pretrain_ref, lexicon_ref, cfg.progress)


def stage_threshold(store: ArtifactStore, cfg: PipelineConfig, finetune_ref: ArtifactRef) -> ArtifactRef:
    return run_stage(store, "threshold", threshold.CODE_VERSION, {}, [finetune_ref],
                     lambda writer, version: threshold.build(writer, open_artifact(finetune_ref)))


def stage_bundle(store: ArtifactStore, finetune_ref: ArtifactRef, threshold_ref: ArtifactRef,
                 lexicon_ref: ArtifactRef) -> ArtifactRef:
    parents = [finetune_ref, threshold_ref, lexicon_ref]
    return run_stage(store, "bundle", bundle.CODE_VERSION, {}, parents,
                     lambda writer, version: bundle.build(writer, *map(open_artifact, parents)))


@flow(name="pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig) -> ArtifactRef:
    """The whole pipeline; returns the bundle ref (labelled output is reported in the logs)."""
    start_run(config)
    lex_ref, pre_ref = prepare_and_pretrain(config, needs="finetune")
    store = ArtifactStore(config.store_uri)
    ft_ref = stage_finetune(store, config, pre_ref, lex_ref)
    th_ref = stage_threshold(store, config, ft_ref)
    b_ref = stage_bundle(store, ft_ref, th_ref, lex_ref)
    publish_link("bundle-link", b_ref.uri, f"bundle {b_ref.version}", "the bundle this run built or found")
    if config.promote.alias:
        decision = promote_task(store.uri, b_ref, config.promote)
        logger().info("promote %s@%s: %s", b_ref.stage, config.promote.alias, decision["reason"])
    lc = config.label
    if lc.input_uri:
        from flows.label import label_flow

        # "@heldout": the fine-tuning test split that the bundle never saw
        src = f"{ft_ref.uri}/heldout.parquet" if lc.input_uri == "@heldout" else lc.input_uri
        out = lc.output_uri or f"{store.uri}/labelled/{b_ref.version}"
        summary = label_flow(b_ref.uri, src, out, lc.options())
        publish_link("labelled-link", summary.get("uri", out), f"labelled output {summary.get('version')}")
        logger().info("labelled %s -> %s", public_url(lc.input_uri), public_url(out))
        done = {"labelled": summary.get("output_uri", out), "stats": summary.get("stats")}
        print(json.dumps(done, ensure_ascii=False, default=str))
    return b_ref


@task(name="promote", task_run_name="promote", cache_policy=NONE, persist_result=False)
def promote_task(store_uri: str, bundle_ref: ArtifactRef, cfg) -> dict:
    """Move ``cfg.alias`` to the new bundle when the metric gate passes (:mod:`tasks.bundle.promote`)."""
    return promote.gate(store_uri, bundle_ref, cfg)


def _figure_keys(m: dict) -> tuple[str, ...]:
    """The test figures a finetune's metrics hold: macro-F1 and accuracy for K > 2 classes, else AUC, accuracy, F1."""
    return ("macro_f1", "accuracy") if "test_macro_f1" in m else ("auc", "accuracy", "f1")


def _rule(threshold: float | None) -> str:
    return "arg-max over the classes" if threshold is None else f"threshold {threshold}"


def _baseline(m: dict) -> str:
    """The cheap baseline's test figures and the contamination counts, from finetune metrics."""
    keys = _figure_keys(m)
    if not isinstance(m.get(f"baseline_test_{keys[0]}"), (int, float)):
        return "not recorded"
    figs = ", ".join(f"{k}={m[f'baseline_test_{k}']:.4f}" for k in keys)
    contaminated = f"{m.get('contaminated_test_rows')} test / {m.get('contaminated_dev_rows')} dev rows"
    return f"TF-IDF char 1-2-gram LR {figs}  (contaminated: {contaminated})"


def summary_lines(config: PipelineConfig, bundle_ref: ArtifactRef) -> list[str]:
    """Where everything is, for the end of a run: bundle, test metrics, plots, labelled output."""
    b = open_artifact(bundle_ref)
    parents = {p.stage: p for p in b.manifest.parents}
    ft = open_artifact(parents["finetune"])
    pre = open_artifact(next(p for p in ft.manifest.parents if p.stage == "pretrain"))
    m = ft.manifest.metrics
    keys = (("test_macro_f1", "test_accuracy") if "test_macro_f1" in m else
            ("test_auc", "test_accuracy", "test_precision", "test_recall", "test_f1"))
    metrics = ", ".join(f"{k[5:]}={m[k]:.4f}" for k in keys if isinstance(m.get(k), (int, float)))
    pm = pre.manifest.metrics
    combined = f"; combine: {m.get('combine')} with the baseline" if m.get("blend") else ""
    lines = [
        f"bundle:          {b.uri}",
        f"bundle version:  {b.manifest.version}  (numerics: {numerics_line(ft.manifest.config.get('numerics'))})",
        f"test metrics:    {metrics}  ({_rule(b.manifest.metrics.get('threshold'))}, "
        f"best epoch {m.get('best_epoch')}{combined})",
    ]
    if m.get("combine") == "stack":
        enc = ", ".join(f"{k}={m[f'encoder_test_{k}']:.4f}" for k in _figure_keys(m)
                        if isinstance(m.get(f"encoder_test_{k}"), (int, float)))
        lines.append(f"encoder alone:   {enc}")
    lines.append(f"baseline (same rows): {_baseline(m)}")
    if isinstance(vs := m.get("test_auc_vs_baseline"), dict):
        lines.append(f"vs baseline:     {vs_baseline(vs)}")
    elif isinstance(vs := m.get("test_macro_f1_vs_baseline"), dict):  # K > 2 classes
        lines.append(f"vs baseline:     {vs_baseline(vs, 'test macro-F1')}")
    if clean := clean_test_line(m):
        lines.append(f"uncontaminated:  {clean}")
    lines += [
        f"pretrain plot:   {pre.file_path('loss.png')}  "
        f"(MLM loss {pm.get('first_mlm_loss')} -> {pm.get('last_mlm_loss')})",
        f"finetune plot:   {ft.file_path('curves.png')}",
    ]
    if config.promote.alias:
        from storage.aliases import read_alias

        store_uri = b.uri.rsplit("/", 2)[0]
        rec = read_alias(store_uri, "bundle", config.promote.alias)
        if rec is not None and rec.get("version") == b.manifest.version:
            lines.append(f"bundle@{config.promote.alias}: this bundle  ({rec.get('reason')})")
        else:  # not promoted: the gate's reason, recomputed against the current holder (nothing moves)
            why = promote.verdict(store_uri, bundle_ref, config.promote, rec)[1]
            lines.append(f"bundle@{config.promote.alias}: still {rec and rec.get('version')}  (gate not passed: {why})")
    if config.label.input_uri:
        out = config.label.output_uri or f"{ArtifactStore(config.store_uri).uri}/labelled/{bundle_ref.version}"
        lines.append(f"labelled output: {out}")
        lines.append(f"labelled sha256: {labelled_digest(out)}  (part and reject files; same on any machine "
                     "with the same numerics)")
    return lines


def numerics_line(record: dict | None) -> str:
    """The recorded CPU numerics in one line (``models.numerics.numerics_record``)."""
    if not record:
        return "not recorded"
    keys = ("cpu_capability", "mkl_cbwr", "mkl_cpu", "threads", "torch", "device")
    return ", ".join(f"{k}={record[k]}" for k in keys if record.get(k) is not None)


def labelled_digest(out_uri: str) -> str:
    """One sha256 over a committed label output's data files (name and sha256 of each part and reject file, from
    its manifest): what two machines compare to check they labelled the same bytes."""
    import hashlib
    import json

    import fsspec

    with fsspec.open(f"{out_uri.rstrip('/')}/_manifest.json", "rb") as f:
        files = json.load(f)["files"]
    listed = sorted(f"{e['path']} {e['sha256']}" for e in files if e["path"].startswith(("part-", "rejected-")))
    return hashlib.sha256("\n".join(listed).encode()).hexdigest()
