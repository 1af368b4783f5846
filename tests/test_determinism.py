"""Determinism across processes: two fresh interpreters with different hash seeds run prepare, a tiny
pretrain and a tiny fine-tune (the ``pipeline`` flow through the CLI); every data file and the model weights
have the same sha256 (nothing depends on hash order; the CLI also pins PYTHONHASHSEED before the
interpreter starts, for gensim in ``lexiflow sample``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from storage.artifacts import ArtifactStore

pytestmark = pytest.mark.flow
REPO = Path(__file__).resolve().parents[1]
STAGES = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon", "pretrain", "finetune", "threshold", "bundle"]


def _files(store: str) -> dict[str, str]:
    st = ArtifactStore(store)
    out = {}
    for stage in STAGES:
        (version,) = st.versions(stage)
        for f in st.open(stage, version).manifest.files:
            out[f"{stage}/{version}/{f.path}"] = f.sha256
    return out


def test_two_processes_with_different_hash_seeds_write_identical_bytes(tiny_inputs, tmp_path, prefect_server):
    pytest.importorskip("snownlp")
    from tests.test_e2e import _tiny_pipeline_config, _tiny_reviews

    reviews = tmp_path / "reviews.csv"
    _tiny_reviews(reviews)
    stores = []
    for seed in ("1", "2"):
        store = str(tmp_path / f"store-{seed}")
        cfg = _tiny_pipeline_config(tiny_inputs, store, str(reviews))
        cfg["label"] = {}
        cfg.pop("promote", None)
        path = tmp_path / f"cfg-{seed}.yaml"
        path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
        env = {**os.environ, "PYTHONHASHSEED": seed, "PREFECT_API_URL": prefect_server}
        res = subprocess.run([sys.executable, "-m", "flows.cli", "run", "pipeline", "--config", str(path)],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        stores.append(store)
    a, b = (_files(s) for s in stores)
    # the pretraining log also records measured speed (tokens/s, MFU, step time): compare what was learned
    logs = [k for k in a if k.startswith("pretrain/") and k.endswith("log.parquet")]
    assert logs and a.keys() == b.keys()
    import pyarrow.parquet as pq

    timing = {"tokens_per_s", "mfu", "step_s", "elapsed_s", "wall_s"}
    for key in logs:
        ta, tb = (pq.read_table(Path(s, key)) for s in stores)
        keep = [c for c in ta.column_names if c not in timing]
        assert keep and ta.select(keep).equals(tb.select(keep)), key
        del a[key], b[key]
    assert a == b  # same versions, same files, same sha256: data stages, weights, thresholds, bundle
    assert any(k.startswith("pretrain/") and k.endswith("model.safetensors") for k in a)
    metrics = [ArtifactStore(s).open("finetune", ArtifactStore(s).versions("finetune")[0]).manifest.metrics
               for s in stores]
    assert metrics[0]["test_auc"] == metrics[1]["test_auc"]

