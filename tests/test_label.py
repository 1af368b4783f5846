"""Offline batch labelling: reconciliation, order and ids, reject rows, errors, crash resume (simulated
and a real SIGKILL), determinism, input formats — all against a real tiny bundle (reader: test_table)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.artifacts import MANIFEST
from tasks.inference.sentiment import PART_SCHEMA, score_texts
from tasks.label.config import LabelOptions
from tasks.label.run import REJECT_SCHEMA, OutputConflict, label_stream
from tests.bundle_fixture import make_tiny_bundle

REPO = Path(__file__).resolve().parents[1]
GOOD = [
    "这家酒店服务很好，房间干净",
    "隔音太差了",
    "前台态度冷淡，下次不会再来",
    "价格便宜，环境一般",
    "我们非常满意",
    "失望",
    "早餐不错，位置方便",
    "但是房间隔音太差",
    "服务一般，价格不便宜",
    "环境干净，下次还会再来",
]


@pytest.fixture(scope="module")
def bundle_uri(tmp_path_factory) -> str:
    return make_tiny_bundle(str(tmp_path_factory.mktemp("store")))


@pytest.fixture(scope="module")
def bundle(bundle_uri):
    from tasks.inference.bundle import load_bundle

    return load_bundle(bundle_uri)


def put(uri: str, data: bytes | str) -> str:
    with fsspec.open(uri, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return uri


def csv_text(rows: list[tuple], header=("id", "review"), sep=",") -> str:
    def q(v):
        v = str(v)
        return '"' + v.replace('"', '""') + '"' if any(c in v for c in (sep, '"', "\n")) else v

    return sep.join(header) + "\n" + "".join(sep.join(q(v) for v in r) + "\n" for r in rows)


def read(out: str, rel: str) -> list[dict]:
    with fsspec.open(f"{out}/{rel}", "rb") as f:
        return pq.read_table(f).to_pylist()


def all_rows(out: str, prefix: str) -> list[dict]:
    m = manifest(out)
    return [r for f in m["files"] if f["path"].startswith(prefix) for r in read(out, f["path"])]


def manifest(out: str) -> dict:
    with fsspec.open(f"{out}/{MANIFEST}", "rb") as f:
        return json.loads(f.read())


def digests(out: str) -> dict[str, str]:
    """sha256 of every file but the manifest (it carries a commit timestamp)."""
    fs, path = fsspec.core.url_to_fs(out)
    res = {}
    for full in sorted(fs.find(path)):
        rel = full[len(path.rstrip("/")) + 1 :]
        if rel != MANIFEST:
            res[rel] = hashlib.sha256(fs.cat_file(full)).hexdigest()
    return res


def many_rows(n: int) -> list[tuple]:
    return [(f"r{i}", GOOD[i % len(GOOD)] + "，" + GOOD[(i * 7) % len(GOOD)] * (i % 3)) for i in range(n)]


def label(bundle, inp, out, overwrite: bool = False, threads: int | None = None, **options) -> dict:
    """``label_stream`` with its options given as keywords (``shard_rows=4``)."""
    return label_stream(bundle, inp, out, LabelOptions(**options), overwrite=overwrite, progress=False, threads=threads)


# ----------------------------------------------------------------------------- reconciliation, ids, order


def test_reconciliation_across_csv_and_jsonl(bundle, mem):
    put(f"{mem}/in/a.csv", csv_text([(1, GOOD[0]), (2, ""), (3, "   "), (4, GOOD[1]), (5, "\u3000\t"), (6, GOOD[2])]))
    lines = [
        {"review": GOOD[3]},
        {"review": 123},
        {"other": "no review key"},
        {"review": None},
        {"review": ["列表"]},
        {"review": GOOD[4]},
    ]
    jsonl = "\n".join(json.dumps(x, ensure_ascii=False) for x in lines)
    put(f"{mem}/in/b.jsonl", jsonl + "\n\n{broken\n" + '"just a string"\n')
    res = label(bundle, f"{mem}/in/*", f"{mem}/out", shard_rows=4)
    st = res["stats"]
    assert st["in"] == 6 + 8  # the blank line is not a record; the broken ones are
    assert st["in"] == st["out"] + sum(st["rejected"].values())
    assert st["rejected"] == {"empty_text": 3, "invalid_json": 2, "missing_text": 2, "not_a_string": 2}
    labelled, rejected = all_rows(f"{mem}/out", "part-"), all_rows(f"{mem}/out", "rejected-")
    assert len(labelled) == st["out"] == 5 and len(rejected) == 9
    # id: the output row id (file:0-based record); line: 1-based line of the record (header = line 1)
    assert [(r["source"], r["line"], r["id"], r["reason"]) for r in rejected] == [
        ("a.csv", 3, "a.csv:1", "empty_text"), ("a.csv", 4, "a.csv:2", "empty_text"),
        ("a.csv", 6, "a.csv:4", "empty_text"),
        ("b.jsonl", 2, "b.jsonl:1", "not_a_string"), ("b.jsonl", 3, "b.jsonl:2", "missing_text"),
        ("b.jsonl", 4, "b.jsonl:3", "missing_text"), ("b.jsonl", 5, "b.jsonl:4", "not_a_string"),
        ("b.jsonl", 8, "b.jsonl:6", "invalid_json"), ("b.jsonl", 9, "b.jsonl:7", "invalid_json"),
    ]
    by_id = {r["id"]: r for r in rejected}
    assert by_id["b.jsonl:1"]["text"] == "123" and by_id["a.csv:2"]["text"] == "   "
    assert by_id["b.jsonl:2"]["text"] is None
    assert by_id["b.jsonl:4"]["text"] == '["列表"]' and by_id["b.jsonl:6"]["text"] == "{broken"
    m = manifest(f"{mem}/out")
    assert m["stats"] == st and m["stage"] == "label" and m["parents"][0]["version"] == bundle.version
    assert sum(f["rows"] or 0 for f in m["files"]) == st["in"]
    assert pq.read_schema(fsspec.open(f"{mem}/out/part-00000.parquet", "rb").open()).equals(PART_SCHEMA)
    assert pq.read_schema(fsspec.open(f"{mem}/out/rejected-00000.parquet", "rb").open()).equals(REJECT_SCHEMA)


def test_order_kept_and_ids(bundle, mem):
    rows = many_rows(23)
    put(f"{mem}/in/x.csv", csv_text(rows))
    label(bundle, f"{mem}/in/x.csv", f"{mem}/auto", shard_rows=5, batch_size=4)
    got = all_rows(f"{mem}/auto", "part-")
    assert [r["row_id"] for r in got] == [f"x.csv:{i}" for i in range(23)]  # input order across shards
    label(bundle, f"{mem}/in/x.csv", f"{mem}/ids", id_column="id", shard_rows=5, batch_size=4)
    given = all_rows(f"{mem}/ids", "part-")
    assert [r["row_id"] for r in given] == [r[0] for r in rows]
    # probabilities belong to their rows (sorting by length inside a window was undone), and the
    # shard/mini-batch layout does not change them beyond float noise
    ref = score_texts(bundle, [t for _, t in rows], batch_size=1)
    assert [r["prob"] for r in given] == pytest.approx(ref.tolist(), abs=1e-5)
    assert all(r["label"] == int(r["prob"] >= r["threshold"]) for r in given)
    assert {r["bundle_version"] for r in given} == {bundle.version}
    assert {r["threshold"] for r in given} == {bundle.threshold}
    assert 0 < sum(r["label"] for r in given) < len(given)  # the tiny bundle gives both labels


def test_missing_id_value_is_rejected(bundle, mem):
    put(f"{mem}/in/x.csv", csv_text([("a", GOOD[0]), ("", GOOD[1]), ("c", GOOD[2])]))
    res = label(bundle, f"{mem}/in/x.csv", f"{mem}/out", id_column="id")
    assert res["stats"]["rejected"] == {"missing_id": 1}
    assert [(r["id"], r["line"]) for r in all_rows(f"{mem}/out", "rejected-")] == [("x.csv:1", 3)]


def test_missing_column_is_one_clear_error_before_scoring(bundle, mem):
    put(f"{mem}/in/a.csv", csv_text([(1, GOOD[0])]))
    put(f"{mem}/in/b.csv", csv_text([(1, GOOD[0])], header=("id", "comment")))
    with pytest.raises(ValueError) as e:
        label(bundle, f"{mem}/in/*.csv", f"{mem}/out")
    msg = str(e.value)
    assert "b.csv" in msg and "'review'" in msg and "['id', 'comment']" in msg
    assert not fsspec.filesystem("memory").exists(f"{mem}/out".split("://")[1])  # nothing written
    with pytest.raises(ValueError, match=r"id column 'key' not found.*\['id', 'review'\]"):
        label(bundle, f"{mem}/in/a.csv", f"{mem}/out", id_column="key")
    put(f"{mem}/in/c.jsonl", json.dumps({"title": "x", "body": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"c\.jsonl: text column 'review' not found.*\['title', 'body'\]"):
        label(bundle, f"{mem}/in/c.jsonl", f"{mem}/out")


# ----------------------------------------------------------------------------- re-runs, resume, determinism


def test_rerun_is_noop_and_versions_never_mix(bundle, mem):
    put(f"{mem}/in/x.csv", csv_text(many_rows(12)))
    out = f"{mem}/out"
    first = label(bundle, f"{mem}/in/x.csv", out, shard_rows=5)
    fs = fsspec.filesystem("memory")
    before = {k: fs.info(k)["created"] for k in fs.find(out.split("://")[1])}
    again = label(bundle, f"{mem}/in/x.csv", out, shard_rows=5)
    assert again["cached"] and again["version"] == first["version"] and again["stats"] == first["stats"]
    assert {k: fs.info(k)["created"] for k in fs.find(out.split("://")[1])} == before  # nothing rewritten
    with pytest.raises(OutputConflict, match=first["version"]):
        label(bundle, f"{mem}/in/x.csv", out, shard_rows=4)
    new = label(bundle, f"{mem}/in/x.csv", out, shard_rows=4, overwrite=True)
    assert new["version"] != first["version"] and len(new["parts"]) == 3
    assert sorted(digests(out)) == sorted(["_run.json", *new["parts"]])  # no file of the old run is left
    put(f"{mem}/junk/notes.txt", "mine")
    with pytest.raises(OutputConflict, match="holds no label run"):
        label(bundle, f"{mem}/in/x.csv", f"{mem}/junk")


def test_a_runs_fingerprint_cache_spares_reading_an_unchanged_input_again(bundle, tmp_path):
    """Inside a run with a fingerprint cache (a pipeline's, beside its store), the label version's input
    fingerprints go through it: the next run takes an unchanged input's sha256 from the cache, reads nothing to
    version it, and computes the version a run without a cache computes."""
    from storage.fingerprints import FingerprintCache
    from tasks.common.context import Runtime
    from tests.test_fingerprints import _aged, _old_file

    inp = _old_file(tmp_path / "in.csv", csv_text(many_rows(6)).encode())
    store = tmp_path / "store"

    def run(cache, out):
        return label_stream(bundle, str(inp), str(tmp_path / out), LabelOptions(shard_rows=4), progress=False,
                            runtime=Runtime(fingerprints=cache))

    first_cache = FingerprintCache(str(store))
    first = run(first_cache, "a")
    assert (first_cache.stats.hashed, first_cache.stats.hits) == (1, 0)
    _aged(store)
    again_cache = FingerprintCache(str(store))  # the next run
    again = run(again_cache, "b")
    assert (again_cache.stats.hashed, again_cache.stats.hits) == (0, 1)  # not read again
    assert again["version"] == first["version"] == run(None, "c")["version"]


def test_determinism_two_outputs_identical(bundle, mem):
    put(f"{mem}/in/x.csv", csv_text(many_rows(40) + [("e", "")]))
    a = label(bundle, f"{mem}/in/x.csv", f"{mem}/a", shard_rows=16, batch_size=8)
    b = label(bundle, f"{mem}/in/x.csv", f"{mem}/b", shard_rows=16, batch_size=8)
    assert a["version"] == b["version"]
    assert digests(f"{mem}/a") == digests(f"{mem}/b")
    assert a["files"] == b["files"]  # the manifests' file lists (sha256 of every file) agree too


def test_resume_after_simulated_crash_recomputes_only_missing(bundle, mem):
    put(f"{mem}/in/x.csv", csv_text(many_rows(30) + [("e", " ")]))
    args = dict(shard_rows=11, batch_size=4)
    label(bundle, f"{mem}/in/x.csv", f"{mem}/ref", **args)
    label(bundle, f"{mem}/in/x.csv", f"{mem}/crash", **args)
    fs = fsspec.filesystem("memory")
    crash = f"{mem}/crash".split("://")[1]
    # what a kill leaves: no manifest, a missing part, a half-written temp file
    fs.rm(f"{crash}/{MANIFEST}")
    fs.rm(f"{crash}/part-00001.parquet")
    fs.pipe_file(f"{crash}/part-00001.parquet.tmp-deadbeef", b"PAR1 half")
    res = label(bundle, f"{mem}/in/x.csv", f"{mem}/crash", **args)
    assert res["skipped_shards"] == 2 and not res["cached"]
    assert digests(f"{mem}/crash") == digests(f"{mem}/ref")
    ids = [r["row_id"] for r in all_rows(f"{mem}/crash", "part-")]
    assert len(ids) == len(set(ids)) == 30
    assert res["stats"] == manifest(f"{mem}/ref")["stats"]


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


def test_resume_after_real_sigkill(bundle_uri, bundle, tmp_path):
    inp = tmp_path / "in.csv"
    inp.write_text(csv_text(many_rows(50)), encoding="utf-8")
    args = dict(shard_rows=10, batch_size=4)
    ref = label(bundle, str(inp), str(tmp_path / "ref"), threads=1, **args)
    out, marker = tmp_path / "out", tmp_path / "paused"
    code = (
        "import sys; from tasks.inference.bundle import load_bundle; from tasks.label.run import label_stream; "
        "from tasks.label.config import LabelOptions; "
        f"label_stream(load_bundle(sys.argv[1]), sys.argv[2], sys.argv[3], LabelOptions(**{args!r}), "
        "progress=False, threads=1)"
    )
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "LEXIFLOW_PAUSE_IN": "label"}
    env["LEXIFLOW_PAUSE_MARKER"] = str(marker)
    proc = subprocess.Popen([sys.executable, "-c", code, bundle_uri, str(inp), str(out)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "the labelling subprocess never reached its pause point"
            time.sleep(0.1)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the process we started, by its id
        proc.wait()
    left = sorted(p.name for p in out.iterdir())
    assert "part-00000.parquet" in left and MANIFEST not in left and "part-00001.parquet" not in left
    res = label(bundle, str(inp), str(out), threads=1, **args)
    assert res["skipped_shards"] == 1 and res["version"] == ref["version"]
    assert digests(str(out)) == digests(str(tmp_path / "ref"))
    ids = [r["row_id"] for r in all_rows(str(out), "part-")]
    assert len(ids) == len(set(ids)) == 50


# ----------------------------------------------------------------------------- formats, streaming


def test_gzip_csv_glob_tsv_and_parquet_inputs(bundle, mem):
    rows = many_rows(9)
    put(f"{mem}/in/p1.csv.gz", gzip.compress(csv_text(rows[:4]).encode(), mtime=0))
    put(f"{mem}/in/p2.csv", csv_text(rows[4:]))
    res = label(bundle, f"{mem}/in/p*.csv*", f"{mem}/glob", id_column="id")
    assert [r["row_id"] for r in all_rows(f"{mem}/glob", "part-")] == [r[0] for r in rows]
    assert res["metrics"]["input_files"] == 2
    put(f"{mem}/tsv/t.tsv.gz", gzip.compress(csv_text(rows, sep="\t").encode(), mtime=0))
    label(bundle, f"{mem}/tsv/t.tsv.gz", f"{mem}/tsvout", id_column="id")
    buf = pa.BufferOutputStream()
    ids = pa.array([int(r[0][1:]) for r in rows], pa.int64())  # a non-string id column is read as strings
    pq.write_table(pa.table({"n": ids, "review": [t for _, t in rows]}), buf)
    put(f"{mem}/pq/data.parquet", buf.getvalue().to_pybytes())
    label(bundle, f"{mem}/pq/data.parquet", f"{mem}/pqout", id_column="n")
    probs = [r["prob"] for r in all_rows(f"{mem}/glob", "part-")]
    assert [r["prob"] for r in all_rows(f"{mem}/tsvout", "part-")] == probs
    pq_rows = all_rows(f"{mem}/pqout", "part-")
    assert [r["row_id"] for r in pq_rows] == [str(i) for i in range(9)] and [r["prob"] for r in pq_rows] == probs


def test_reader_rejects_are_rows_with_exact_lines(bundle, mem):
    """Bad bytes and field counts reject one record each (not the file); quoted newlines keep lines exact."""
    body = (
        "id,review\n"
        f'a,"{GOOD[0]}\n第二行"\n'  # lines 2-3: one record
        f"b,{GOOD[1]},extra\n"  # line 4: three fields
        "\n"  # line 5: blank, not a record
    ).encode() + "c,".encode() + b"\xff\xfe bad\n" + f"d,{GOOD[2]}\n".encode()  # line 6: undecodable
    put(f"{mem}/in/x.csv", body)
    res = label(bundle, f"{mem}/in/x.csv", f"{mem}/out", id_column="id")
    assert res["stats"] == {"in": 4, "out": 2, "rejected": {"bad_columns": 1, "undecodable": 1}}
    assert [r["row_id"] for r in all_rows(f"{mem}/out", "part-")] == ["a", "d"]
    rejected = all_rows(f"{mem}/out", "rejected-")
    assert [(r["line"], r["id"], r["reason"]) for r in rejected] == [
        (4, "x.csv:1", "bad_columns"), (6, "x.csv:2", "undecodable"),
    ]
    assert rejected[0]["text"] == f"b,{GOOD[1]},extra" and rejected[1]["text"] == "c,\ufffd\ufffd bad"
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"review": [GOOD[0], None, " ", GOOD[1]]}), buf)
    put(f"{mem}/pq/p.parquet", buf.getvalue().to_pybytes())
    res = label(bundle, f"{mem}/pq/p.parquet", f"{mem}/pqout")
    assert [(r["line"], r["id"], r["reason"]) for r in all_rows(f"{mem}/pqout", "rejected-")] == [
        (2, "p.parquet:1", "missing_text"), (3, "p.parquet:2", "empty_text"),
    ]


def test_empty_input_still_commits(bundle, mem):
    put(f"{mem}/in/e.csv", "id,review\n")
    res = label(bundle, f"{mem}/in/e.csv", f"{mem}/out")
    assert res["stats"] == {"in": 0, "out": 0, "rejected": {}} and res["parts"] == ["part-00000.parquet"]
    put(f"{mem}/in/zero.csv", b"")  # not even a header: zero rows, not a missing-column error
    res = label(bundle, f"{mem}/in/*.csv", f"{mem}/both")
    assert res["stats"]["in"] == 0 and read(f"{mem}/both", "part-00000.parquet") == []


# ----------------------------------------------------------------------------- flow


@pytest.mark.flow
def test_label_flow_publishes_artifact(prefect_server, bundle_uri, tmp_path):
    from prefect import get_client

    from flows.label import label_flow

    inp = tmp_path / "in.csv"
    inp.write_text(csv_text(many_rows(12) + [("e", "")]), encoding="utf-8")
    # options as a deployment passes them (a mapping): Prefect validates them into LabelOptions
    res = label_flow(bundle_uri, str(inp), str(tmp_path / "out"), {"id_column": "id", "shard_rows": 5},
                     fingerprint_store=str(tmp_path / "store"))  # as the pipeline passes its store
    assert [e.name for e in (tmp_path / "store" / "_fingerprints").glob("*.json")] != []  # the input went through
    assert res["stats"] == {"in": 13, "out": 12, "rejected": {"empty_text": 1}} and len(res["parts"]) == 3
    assert manifest(str(tmp_path / "out"))["config"]["id_column"] == "id"
    # the run record names the bundle by stage and version only: no store path in the output's bytes
    run = json.loads((tmp_path / "out" / "_run.json").read_text())
    assert set(run["bundle"]) == {"stage", "version"} and bundle_uri not in json.dumps(run)

    async def latest():
        async with get_client() as c:
            return await c.read_latest_artifacts()

    import asyncio

    arts = {a.key: a for a in asyncio.run(latest())}
    table = arts["label"].data
    assert str(tmp_path / "out") in json.dumps(table) and "rejected.empty_text" in json.dumps(table)
    assert "label-progress" in arts


def test_cpu_batches_hold_one_padded_length_at_most_the_token_budget_and_every_row_once():
    import numpy as np

    from tasks.inference.sentiment import _batches, padded_lengths

    lengths = np.array([128, 5, 64, 128, 30, 2, 100, 64, 7, 128])
    padded = padded_lengths(lengths, 120)  # a row's own length rounded up to 16, capped at max_len
    assert padded.tolist() == [120, 16, 64, 120, 32, 16, 112, 64, 16, 120]
    got = list(_batches(padded, batch_size=4, max_tokens=256))
    assert sorted(np.concatenate(got).tolist()) == list(range(10))  # each row once
    assert [b.tolist() for b in got] == [[0, 3], [9], [6], [2, 7], [4], [1, 5, 8]]  # longest first, input order
    assert all(len(set(padded[b])) == 1 and len(b) * padded[b[0]] <= 256 for b in got)
    assert [len(b) for b in _batches(padded, 4, None)] == [3, 1, 2, 1, 3]  # no budget (CUDA): batch_size rows
    assert [len(b) for b in _batches(np.array([304]), 4, 256)] == [1]  # a row longer than the budget


def test_the_token_budget_does_not_change_probabilities(bundle, monkeypatch):
    from tasks.inference import sentiment as scorer

    texts = [t for _, t in many_rows(40)]
    ref = score_texts(bundle, texts, batch_size=16)
    monkeypatch.setattr(scorer, "CPU_BATCH_TOKENS", 40)  # a few rows per batch
    # exact on purpose: another token budget means other batches, and a text's bits must not depend on its batch
    assert np.array_equal(score_texts(bundle, texts, batch_size=16), ref)
