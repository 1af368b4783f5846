"""Determinism across processes and crashes, through the CLI (``lexiflow run pipeline``, tiny config):

* two fresh interpreters with different hash seeds run prepare, a tiny pretrain and a tiny fine-tune; every
  data file and the model weights have the same sha256 (nothing depends on hash order; the CLI also pins
  PYTHONHASHSEED before the interpreter starts, for gensim in ``lexiflow sample``);
* the crash matrix: a third store is built by runs killed with SIGKILL inside every stage in turn (pretrain
  right after a mid-run checkpoint, so it resumes from it), each re-run picking up where the last died; the
  committed artifacts are byte-identical to the uninterrupted runs' (manifest timestamps aside)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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


TIMING = {"tokens_per_s", "mfu", "step_s", "elapsed_s", "wall_s"}  # measured speed, not what was learned


def _config(tiny_inputs, tmp_path) -> Path:
    from tests.test_e2e import _tiny_pipeline_config, _tiny_reviews

    reviews = tmp_path / "reviews.csv"
    _tiny_reviews(reviews)
    cfg = _tiny_pipeline_config(tiny_inputs, "unset", str(reviews))
    cfg["label"] = {}
    cfg.pop("promote", None)
    cfg["pretrain"]["checkpoint_every"] = 2  # 6 steps: the crash run is killed after step 2's checkpoint
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _pipeline(cfg: Path, store: str, api: str, seed: str = "0", **env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.cli", "run", "pipeline", "--config", str(cfg), "--set", f"store_uri={store}"]
    full_env = {**os.environ, "PYTHONHASHSEED": seed, "PREFECT_API_URL": api, **env}
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def seed_runs(tiny_inputs, tmp_path_factory, prefect_server):
    """Two uninterrupted runs of the tiny pipeline, in interpreters with hash seeds 1 and 2."""
    pytest.importorskip("snownlp")
    tmp = tmp_path_factory.mktemp("determinism")
    cfg = _config(tiny_inputs, tmp)
    stores = [str(tmp / f"store-{seed}") for seed in ("1", "2")]
    outs = [_finish(_pipeline(cfg, store, prefect_server, seed)) for seed, store in zip(("1", "2"), stores)]
    return cfg, stores, outs


def _assert_same_bytes(stores: list[str]) -> dict[str, str]:
    """Same versions, same files, same sha256 in every store (the pretraining log without its timing columns)."""
    import pyarrow.parquet as pq

    first, *rest = (_files(s) for s in stores)
    logs = [k for k in first if k.startswith("pretrain/") and k.endswith("log.parquet")]
    assert logs
    for store, other in zip(stores[1:], rest):
        assert other.keys() == first.keys(), sorted(set(other) ^ set(first))
        for key in logs:
            ta, tb = pq.read_table(Path(stores[0], key)), pq.read_table(Path(store, key))
            keep = [c for c in ta.column_names if c not in TIMING]
            assert keep and ta.select(keep).equals(tb.select(keep)), key
        diff = [k for k in first if k not in logs and first[k] != other[k]]
        assert not diff, f"{store}: files differ from {stores[0]}: {diff}"
    return first


def test_two_processes_with_different_hash_seeds_write_identical_bytes(seed_runs):
    _cfg, stores, outs = seed_runs
    files = _assert_same_bytes(stores)  # data stages, weights, thresholds, bundle
    assert any(k.startswith("pretrain/") and k.endswith("model.safetensors") for k in files)
    metrics = [ArtifactStore(s).open("finetune", ArtifactStore(s).versions("finetune")[0]).manifest.metrics
               for s in stores]
    assert metrics[0]["test_auc"] == metrics[1]["test_auc"]
    # the CLI contract: the last stdout line is the pipeline's ArtifactRef (the bundle) as JSON
    refs = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    for ref, store in zip(refs, stores):
        assert ref == {**ref, "stage": "bundle", "uri": f"{store}/bundle/{ref['version']}"}
        assert [ref["version"]] == ArtifactStore(store).versions("bundle")
    assert refs[0]["version"] == refs[1]["version"]


def _killed_in(stage: str, cfg: Path, store: str, api: str, tmp: Path) -> None:
    """Run the pipeline until it is inside ``stage`` (``tasks.common.stage.pause_point``), then SIGKILL it."""
    marker = tmp / f"paused-{stage}"
    proc = _pipeline(cfg, store, api, LEXIFLOW_PAUSE_IN=stage, LEXIFLOW_PAUSE_MARKER=str(marker))
    deadline = time.monotonic() + 600
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before pausing in {stage}: "
                                 f"{proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"never paused in {stage}"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def test_sigkill_inside_every_stage_then_rerun_is_byte_identical(seed_runs, prefect_server, tmp_path):
    cfg, stores, _outs = seed_runs
    crashed = str(tmp_path / "crashed")
    st = ArtifactStore(crashed)
    for i, stage in enumerate(STAGES):
        _killed_in(stage, cfg, crashed, prefect_server, tmp_path)
        assert all(st.versions(done) for done in STAGES[:i]), f"stages before {stage} were committed by earlier runs"
        assert not st.versions(stage), f"{stage} was committed although the run was killed inside it"
        if stage == "pretrain":  # killed right after a mid-run checkpoint: the re-run resumes from it
            (version,) = {p.name for p in Path(crashed, "_checkpoints", "pretrain").iterdir()}
            state = json.loads(Path(crashed, "_checkpoints", "pretrain", version, "state.json").read_text())
            assert state["step"] == 2
    _finish(_pipeline(cfg, crashed, prefect_server))
    _assert_same_bytes([stores[0], crashed])
    import pyarrow.parquet as pq

    (log,) = [k for k in _files(crashed) if k.startswith("pretrain/") and k.endswith("log.parquet")]
    # the resumed log is whole: the steps before the checkpoint too
    assert pq.read_table(Path(crashed, log)).column("step").to_pylist() == [2, 4, 6]
    assert not Path(crashed, "_checkpoints", "pretrain").exists() or not any(
        Path(crashed, "_checkpoints", "pretrain").iterdir()), "checkpoints are removed once pretrain commits"
