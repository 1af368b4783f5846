"""The prepare flow against a real Prefect server: reconciliation, determinism, crash safety, re-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from storage.artifacts import ArtifactStore, lineage, open_artifact
from tests.conftest import tiny_config

pytestmark = pytest.mark.flow
STAGES = ["clean", "numbers", "vocab", "embeddings", "trie", "lexicon"]


def _run(cfg):
    from flows.prepare import prepare_flow

    return prepare_flow(cfg)


def _file_digests(store_dir: str) -> dict[str, str]:
    store = ArtifactStore(store_dir)
    out = {}
    for stage in STAGES:
        for v in store.versions(stage):
            for f in store.open(stage, v).manifest.files:
                out[f"{stage}/{v}/{f.path}"] = f.sha256
    return out


@pytest.fixture(scope="module")
def first_run(prefect_server, tiny_inputs, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store_a"))
    ref = _run(tiny_config(tiny_inputs, store))
    return store, ref


def test_prepare_builds_every_stage_and_reconciles(first_run):
    store_dir, ref = first_run
    assert ref.stage == "lexicon"
    tree = lineage(ref.uri)
    seen = set()

    def walk(n):
        seen.add(n["stage"])
        st = n["stats"]
        assert st["in"] == st["out"] + sum(st["rejected"].values()), n
        for p in n["parents"]:
            walk(p)

    walk(tree)
    assert seen == set(STAGES)
    store = ArtifactStore(store_dir)
    clean = store.open("clean", store.versions("clean")[0])
    assert clean.manifest.stats["rejected"].get("invalid_json") == 1
    rejected = pq.read_table(clean.fs.open(clean.file_path("rejected/part-00000.parquet"))).to_pylist()
    bad = [r for r in rejected if r["reason"] == "invalid_json"]
    assert bad and bad[0]["source"].endswith("wiki_01.jsonl") and bad[0]["line"] == 31
    emb = store.open("embeddings", store.versions("embeddings")[0]).manifest
    assert emb.stats["rejected"]["short_line"] == 1 and emb.metrics["header_mismatch"] is True
    lex = open_artifact(ref)
    shards = lex.files("shards/")
    assert len(shards) >= 2
    rows = pq.read_table(lex.fs.open(lex.file_path(shards[0]))).to_pylist()
    k = lex.manifest.metrics["max_word_num"]
    for r in rows[:50]:
        assert len(r["char_ids"]) == r["n_tokens"] and len(r["word_ids"]) == r["n_tokens"] * k
        ends = [0] + r["group_ends"]
        assert all(s >= e for s, e in zip(r["group_starts"], ends))  # groups never overlap
    assert lex.manifest.metrics["char_coverage"] > 0.3


def test_same_inputs_same_versions_and_bytes(first_run, tiny_inputs, tmp_path):
    store_a, ref_a = first_run
    ref_b = _run(tiny_config(tiny_inputs, str(tmp_path / "store_b")))
    assert ref_b.version == ref_a.version
    assert _file_digests(store_a) == _file_digests(str(tmp_path / "store_b"))


def test_rerun_is_all_cache_hits(first_run, tiny_inputs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    store_a, ref_a = first_run
    def mtimes():  # artifacts only: _fingerprints/ is the input digest cache (a racy entry is rewritten)
        return {p: os.stat(p).st_mtime_ns for p in map(str, Path(store_a).rglob("*")) if "/_fingerprints" not in p}

    before = mtimes()
    from flows.prepare import prepare_flow

    state = prepare_flow(tiny_config(tiny_inputs, store_a), return_state=True)
    assert state.result().version == ref_a.version
    assert mtimes() == before  # nothing rewritten
    deadline = time.monotonic() + 60
    while True:  # task run states reach the server through its event stream: on a busy machine, a moment later
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )
        pending = [r.name for r in runs if r.name in STAGES and (r.state is None or not r.state.is_final())]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = {r.name.rsplit("-", 1)[0] for r in runs}
    assert not names & {
        "clean-file",
        "clean-dedup",
        "numbers-shard",
        "vocab-count",
        "lexicon-match",
        "lexicon-finalize",
    }, names
    stage_runs = {r.name: r for r in runs if r.name in STAGES}
    assert sorted(stage_runs) == sorted(STAGES)  # every stage is a task in the run graph, cache hits included
    for name, r in stage_runs.items():
        assert r.state.type.value == "COMPLETED" and r.state.name == "Cached", (name, r.state)
        assert r.state.message == f"cache hit: {store_a}/{name}/" + ArtifactStore(store_a).versions(name)[0]


def _copy_inputs(tiny_inputs, dest: Path) -> dict[str, str]:
    """The tiny inputs, byte for byte, under another directory."""
    import shutil

    root = Path(tiny_inputs["root"])
    shutil.copytree(root, dest)
    rel = Path(tiny_inputs["corpus"]).relative_to(root)
    return {"corpus": str(dest / rel), "embeddings": str(dest / "tencent.txt"), "root": str(dest)}


def test_same_data_in_another_directory_gets_the_same_versions_and_is_a_cache_hit(first_run, tiny_inputs, tmp_path):
    """Where the inputs lie is provenance, not content: the sample copied into two directories, prepared into one
    store, gives one version per stage; the second run builds nothing; and the bytes equal a build from a third."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.prepare import prepare_flow

    here, there = _copy_inputs(tiny_inputs, tmp_path / "here"), _copy_inputs(tiny_inputs, tmp_path / "there" / "x")
    store_dir = str(tmp_path / "store")
    ref = _run(tiny_config(here, store_dir))
    store = ArtifactStore(store_dir)
    versions = {s: store.versions(s) for s in STAGES}
    assert all(len(v) == 1 for v in versions.values()), versions
    def artifacts_mtimes():  # _fingerprints/ (the input digest cache) gains the new paths' entries: not artifacts
        return {p: os.stat(p).st_mtime_ns for p in map(str, Path(store_dir).rglob("*")) if "/_fingerprints" not in p}

    before = artifacts_mtimes()
    state = prepare_flow(tiny_config(there, store_dir), return_state=True)
    assert state.result().version == ref.version
    assert {s: store.versions(s) for s in STAGES} == versions  # no second version of any stage
    assert artifacts_mtimes() == before  # nothing rewritten
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    stage_runs = {r.name: r.state for r in runs if r.name in STAGES}
    assert sorted(stage_runs) == sorted(STAGES)
    assert all(st.name == "Cached" for st in stage_runs.values()), stage_runs
    # the same bytes as the build from the original directory (first_run): no path reached a data file ...
    assert _file_digests(store_dir) == _file_digests(first_run[0])
    clean = store.open("clean", versions["clean"][0])
    rejected = pq.read_table(clean.fs.open(clean.file_path("rejected/part-00000.parquet"))).to_pylist()
    assert {r["source"] for r in rejected} <= {"wiki_00.jsonl", "wiki_01.jsonl", "wiki_02.jsonl"}
    # ... while the manifest keeps where the committed build read them (provenance)
    assert [i["uri"] for i in clean.manifest.config["inputs"]] == [
        f"file://{here['root']}/corpus/wiki_0{i}.jsonl" for i in range(3)]
    emb = store.open("embeddings", versions["embeddings"][0]).manifest.config["source"]
    assert (emb["uri"], emb["name"]) == (here["embeddings"], "tencent.txt")


def test_sigkill_mid_stage_then_rerun_matches(first_run, tiny_inputs, tmp_path, prefect_server):
    store_a, _ = first_run
    store_c = str(tmp_path / "store_c")
    marker = tmp_path / "paused"
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_server,
        "LEXIFLOW_PAUSE_IN": "lexicon",
        "LEXIFLOW_PAUSE_MARKER": str(marker),
    }
    cmd = [
        sys.executable,
        "-m",
        "lexiflow",
        "run",
        "prepare",
        "--store",
        store_c,
        "--set",
        f"prepare.corpus_uri={tiny_inputs['corpus']}",
        "--set",
        f"prepare.embeddings_uri={tiny_inputs['embeddings']}",
        "--set",
        "progress=false",
        "--set",
        "prepare.clean.shard_rows=500",
        "--set",
        "runner.max_workers=2",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        assert time.time() < deadline, "flow never reached the lexicon stage"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    store = ArtifactStore(store_c)
    assert store.garbage("lexicon"), "the kill should leave a half-written lexicon directory"
    assert store.versions("lexicon") == []
    ref = _run(tiny_config(tiny_inputs, store_c))
    assert all(store.garbage(s) == [] for s in STAGES)
    assert _file_digests(store_c) == _file_digests(store_a)
    assert ref.version == first_run[1].version


def test_featurizer_reproduces_the_matched_shards(first_run):
    """Fine-tuning and labelling featurise text exactly as the corpus was prepared."""
    from tasks.text.featurize import Featurizer

    _, ref = first_run
    lex = open_artifact(ref)
    feat = Featurizer.from_artifacts(lex, max_len=512)
    rows = pq.read_table(lex.fs.open(lex.file_path(lex.files("shards/")[0]))).to_pylist()[:200]
    enc = feat.encode([r["text"] for r in rows])
    for r, e in zip(rows, enc):
        assert e.input_ids[1:-1].tolist() == r["char_ids"]
        assert e.word_ids[1:-1].reshape(-1).tolist() == r["word_ids"]
    assert sum(int((e.word_ids > 0).any()) for e in enc) > 100  # words really are matched



def test_saved_featurizer_files_are_the_vocab_and_trie_stages_bytes(first_run, tmp_path):
    """A bundle saves its featurizer (``Featurizer.save``) where it used to copy the vocab and trie stages' files:
    the same bytes, so no bundle moves."""
    from tasks.text.featurize import Featurizer

    _, ref = first_run
    lex = open_artifact(ref)
    parents = {p.stage: p for p in lex.manifest.parents}
    Featurizer.from_artifacts(lex).save(tmp_path, settings_file=None)
    assert (tmp_path / "vocab.txt").read_bytes() == open_artifact(parents["vocab"]).read_verified("vocab.txt")
    assert (tmp_path / "compiled.npz").read_bytes() == open_artifact(parents["trie"]).read_verified("compiled.npz")
