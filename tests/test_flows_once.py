"""Issue 13: label resume edge cases (a part deleted after commit; a killed run's shard tampered before the
resume), each flow run once as a Prefect flow on the real server (pretrain, ner, ner-label), and the CLI's
exit codes and last-line JSON contract (`run prepare`, `label`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.artifacts import MANIFEST, ArtifactRef, open_artifact
from tests.conftest import tiny_config_data
from tests.test_label import csv_text, digests, label, manifest, many_rows

REPO = Path(__file__).resolve().parents[1]
ARGS = dict(shard_rows=11, batch_size=4)  # 31 rows -> shards of 11, 11, 9; the blank row lands in shard 2


@pytest.fixture(scope="module")
def bundle_uri(tmp_path_factory) -> str:
    from tests.bundle_fixture import make_tiny_bundle

    return make_tiny_bundle(str(tmp_path_factory.mktemp("bundle_store")))


@pytest.fixture(scope="module")
def bundle(bundle_uri):
    from tasks.inference.bundle import load_bundle

    return load_bundle(bundle_uri)


@pytest.fixture(scope="module")
def labelled(bundle, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(input csv, a committed reference output, its summary): three shards, rejects in the last."""
    root = tmp_path_factory.mktemp("labelled")
    inp = root / "in.csv"
    inp.write_text(csv_text(many_rows(30) + [("e", " ")]), encoding="utf-8")
    res = label(bundle, str(inp), str(root / "ref"), **ARGS)
    assert res["parts"] == [f"part-0000{i}.parquet" for i in range(3)]
    assert [f["path"] for f in res["files"]] == ["_run.json", "part-00000.parquet", "part-00001.parquet",
                                                 "part-00002.parquet", "rejected-00002.parquet"]
    return inp, root / "ref", res


def _snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir()) if p.name != MANIFEST}


# ----------------------------------------------------------------------------- 1a: a file deleted after commit


@pytest.mark.parametrize("deleted, recomputed", [("part-00001.parquet", "part-00001.parquet"),
                                                 ("rejected-00002.parquet", "part-00002.parquet")])
def test_file_deleted_after_commit_is_recomputed_alone(bundle, labelled, tmp_path, deleted, recomputed):
    inp, ref, first = labelled
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    before = _snapshot(out)
    (out / deleted).unlink()
    res = label(bundle, str(inp), str(out), **ARGS)
    assert not res["cached"] and res["skipped_shards"] == 2  # the other two shards were read back, not scored
    after = _snapshot(out)
    assert set(after) == set(before)
    rewritten = {deleted, recomputed, "rejected-00002.parquet" if recomputed == "part-00002.parquet" else deleted}
    for name, (mtime, data) in before.items():
        assert after[name][1] == data, name  # the recomputed files have the original bytes
        if name not in rewritten:
            assert after[name][0] == mtime, f"{name} was rewritten"
    assert res["stats"] == first["stats"] and res["files"] == first["files"]  # same sha256 for every file
    assert digests(str(out)) == digests(str(ref))


# ----------------------------------------------------------------------------- 1b: a killed run's shard tampered


def _changed_prob(data: bytes) -> bytes:
    """A valid Parquet file, same rows and metadata, one probability changed: the silent-mix danger."""
    from storage.parquet import table_bytes

    t = pq.read_table(pa.BufferReader(data))
    probs = t.column("prob").to_pylist()
    probs[0] = 1.0 - probs[0]
    return table_bytes(t.set_column(1, t.schema.field(1), pa.array(probs, pa.float32())))


def _changed_reason(data: bytes) -> bytes:
    from storage.parquet import table_bytes

    t = pq.read_table(pa.BufferReader(data))
    i = t.schema.get_field_index("reason")
    return table_bytes(t.set_column(i, t.schema.field(i), pa.array(["missing_text"] * t.num_rows)))


def _no_digest(data: bytes) -> bytes:
    from storage.parquet import table_bytes

    return table_bytes(pq.read_table(pa.BufferReader(data)).replace_schema_metadata({}))


# kind -> (file tampered with, the part the warning names, the tampering, what the warning says is wrong)
TAMPER = {
    "values": ("part-00000.parquet", "part-00000.parquet", _changed_prob,
               "its bytes are not what was written (modified after it was written)"),
    "truncated": ("part-00000.parquet", "part-00000.parquet", lambda b: b[: len(b) // 2], "it cannot be read (Arrow"),
    "byte_flip": ("part-00000.parquet", "part-00000.parquet", lambda b: b[:337] + bytes([b[337] ^ 0x55]) + b[338:],
                  "its bytes are not what was written"),
    "rejects": ("rejected-00002.parquet", "part-00002.parquet", _changed_reason,
                "rejected-00002.parquet is missing or its bytes are not what was written with part-00002.parquet"),
    "no_digest": ("part-00000.parquet", "part-00000.parquet", _no_digest, "it carries no shard digest"),
}


@pytest.mark.parametrize("kind", sorted(TAMPER))
def test_tampered_shard_of_a_killed_run_is_recomputed_never_mixed(bundle, labelled, tmp_path, caplog, kind):
    inp, ref, first = labelled
    target, part, tamper, reason = TAMPER[kind]
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    (out / MANIFEST).unlink()  # what a kill before the commit leaves: finished shards, no manifest
    (out / "part-00001.parquet").unlink()  # the shard that was being scored
    (out / target).write_bytes(tamper((out / target).read_bytes()))
    assert digests(str(out)) != {k: v for k, v in digests(str(ref)).items() if k != "part-00001.parquet"}
    with caplog.at_level(logging.WARNING, logger="lexiflow"):
        res = label(bundle, str(inp), str(out), **ARGS)
    assert res["skipped_shards"] == 1  # only the untouched shard was trusted
    warned = [r.getMessage() for r in caplog.records if "not used" in r.getMessage()]
    assert len(warned) == 1 and str(out / part) in warned[0] and "recomputing" in warned[0], warned
    assert f"is not used: {reason}" in warned[0], warned
    assert digests(str(out)) == digests(str(ref))  # the whole output is what an uninterrupted run writes
    assert res["stats"] == first["stats"] and res["files"] == first["files"]


# ----------------------------------------------------------------------------- 2: each flow once, on the server


def _write_ner(root: Path) -> dict[str, str]:
    from tests.test_ner import _write_bio

    for name, n, seed in (("train", 48, 0), ("dev", 16, 1), ("test", 16, 2)):
        _write_bio(root / f"{name}.bio", n, seed)
    return {f"{k}_uri": str(root / f"{k}.bio") for k in ("train", "dev", "test")}


@pytest.fixture(scope="module")
def flow_store(tiny_inputs, tmp_path_factory) -> dict:
    """One tiny store and config shared by the flow and CLI tests (prepare runs once, then is cached)."""
    root = tmp_path_factory.mktemp("flows")
    data = tiny_config_data(
        tiny_inputs, str(root / "store"),
        pretrain={
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "ffn_size": 64, "max_len": 64},
            "data": {"max_seq_len": 64, "batch_size": 8, "shuffle_buffer": 64, "bucket_batches": 4},
            "steps": 4, "warmup_steps": 1, "log_every": 2, "checkpoint_every": 100, "threads": 1,
        },
        ner={**_write_ner(root), "max_len": 32, "batch_size": 16, "lr": 3e-3, "max_epochs": 2, "patience": 2,
             "threads": 1, "device": "cpu"},
    )
    return {"root": root, "data": data, "refs": {}}


def _completed(state) -> ArtifactRef | dict:
    """The flow run's final state as the API records it: Completed; returns its result."""
    from prefect import get_client

    assert state.is_completed(), state
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
    assert run.state.type.value == "COMPLETED" and run.state.name == "Completed", run.state
    return state.result()


def _reconciled(ref: ArtifactRef, stage: str) -> dict:
    art = open_artifact(ref.uri)
    m = art.manifest
    assert (m.stage, m.version, ref.stage) == (stage, ref.version, stage)
    st = m.stats
    assert st["in"] == st["out"] + sum(st["rejected"].values()) and st["out"] > 0, st
    for f in m.files:  # every file there with the recorded checksum
        art.read_verified(f.path)
    return st


@pytest.mark.flow
def test_pretrain_ner_and_ner_label_flows_run_once(prefect_server, flow_store, tmp_path):
    from flows.config import PipelineConfig
    from flows.ner import ner_flow, ner_label_flow
    from flows.pretrain import pretrain_flow
    from tasks.label.config import LabelOptions

    cfg = PipelineConfig.model_validate(flow_store["data"])
    pre = _completed(pretrain_flow(cfg, return_state=True))
    _reconciled(pre, "pretrain")
    lex = next(p for p in open_artifact(pre.uri).manifest.parents if p.stage == "lexicon")
    flow_store["refs"]["lexicon"] = lex

    ner = _completed(ner_flow(cfg, return_state=True))
    st = _reconciled(ner, "ner")
    assert st["in"] == 48 + 16 + 16
    assert {p.version for p in open_artifact(ner.uri).manifest.parents} == {pre.version, lex.version}

    src = tmp_path / "texts.csv"
    src.write_text("id,text\na,我们今天去了上海看到张三\nb,   \nc,李四去了北京\n", encoding="utf-8")
    opts = LabelOptions(text_column="text", id_column="id")
    res = _completed(ner_label_flow(ner.uri, str(src), str(tmp_path / "ner_out"), opts, return_state=True))
    assert res["stats"] == {"in": 3, "out": 2, "rejected": {"empty_text": 1}}
    assert manifest(str(tmp_path / "ner_out"))["stats"] == res["stats"]
    rows = pq.read_table(tmp_path / "ner_out" / "part-00000.parquet").to_pylist()
    assert [r["row_id"] for r in rows] == ["a", "c"] and {r["model_version"] for r in rows} == {ner.version}
    assert all(r["n_entities"] == len(r["entities"]) for r in rows)


# ----------------------------------------------------------------------------- 3: CLI exit codes and last lines


def _cli(*args: str, api: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONHASHSEED="0", PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    if api:
        env["PREFECT_API_URL"] = api
    return subprocess.run([sys.executable, "-m", "lexiflow", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.flow
def test_cli_run_prepare_last_line_is_the_committed_ref(prefect_server, flow_store, tiny_inputs):
    import yaml

    profile = flow_store["root"] / "prepare.yaml"
    keys = ("store_uri", "progress", "runner", "prepare")
    profile.write_text(yaml.safe_dump({k: flow_store["data"][k] for k in keys}), encoding="utf-8")
    res = _cli("run", "prepare", "--config", str(profile), api=prefect_server)
    assert res.returncode == 0, res.stderr[-3000:]
    ref = ArtifactRef.model_validate(json.loads(res.stdout.splitlines()[-1]))
    assert set(json.loads(res.stdout.splitlines()[-1])) == {"stage", "version", "uri"}
    _reconciled(ref, "lexicon")
    if "lexicon" in flow_store["refs"]:  # the flows test ran first: the same committed lexicon
        assert ref == flow_store["refs"]["lexicon"]

    missing = Path(tiny_inputs["root"]) / "no-such-corpus.jsonl"
    res = _cli("run", "prepare", "--config", str(profile), "--set", f"prepare.corpus_uri={missing}",
               api=prefect_server)
    _one_error(res, str(missing))


def _one_error(res: subprocess.CompletedProcess, name: str) -> str:
    assert res.returncode != 0 and "Traceback" not in res.stderr, (res.returncode, res.stderr[-3000:])
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and res.stderr.splitlines()[-1] == lines[0] and name in lines[0], res.stderr[-3000:]
    return lines[0]


@pytest.mark.flow
def test_cli_label_bad_rows_exit_0_with_reconciling_summary(prefect_server, bundle_uri, tmp_path):
    inp = tmp_path / "reviews.csv"
    inp.write_bytes(csv_text(many_rows(6) + [("e", ""), ("", "没有编号"), ("x", "  ")]).encode()
                    + "b,好,多一列\n".encode() + b"u,\xff\xfe\n")
    out = tmp_path / "out"
    res = _cli("label", "--bundle", bundle_uri, "--input", str(inp), "--output", str(out), "--id-column", "id",
               "--shard-rows", "4", api=prefect_server)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout.splitlines()[-1])
    assert set(summary) == {"uri", "version", "stats"} and summary["uri"] == str(out)
    st = summary["stats"]
    assert st == {"in": 11, "out": 6, "rejected": {"bad_columns": 1, "empty_text": 2, "missing_id": 1,
                                                   "undecodable": 1}}
    assert st["in"] == st["out"] + sum(st["rejected"].values())
    m = manifest(str(out))
    assert m["stats"] == st and m["version"] == summary["version"]
    assert sum(f["rows"] or 0 for f in m["files"]) == st["in"]

    # a missing input without a Prefect API (the direct labeller): one error line naming it, no traceback
    missing = tmp_path / "none.csv"
    _one_error(_cli("label", "--bundle", bundle_uri, "--input", str(missing), "--output", str(tmp_path / "o2"),
                    api=None), str(missing))
