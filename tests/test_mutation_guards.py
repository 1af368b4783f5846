"""Behaviour of the modules that guard data, pinned where mutation testing (``make mutate``) found them blind:
the #NUM# stage end to end (shards in, shards out, counts), ..."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage.artifacts import ArtifactStore, open_artifact
from storage.parquet import write_rows
from tasks.prepare.config import NumbersConfig
from tests.staging import begin, context

CLEAN = pa.schema([("doc_id", pa.string()), ("sent_idx", pa.int32()), ("text", pa.string())])


def _mem_store() -> ArtifactStore:
    return ArtifactStore(f"memory://guards-{uuid.uuid4().hex}")


# ----------------------------------------------------------------------------- numbers: the stage


def _clean_artifact(store: ArtifactStore):
    w = begin(store, "clean", "c1")
    shards = {
        "shards/part-00000.parquet": [
            {"doc_id": "d1", "sent_idx": 0, "text": "1998年GDP增长7.8%"},
            {"doc_id": "d1", "sent_idx": 1, "text": "没有数字的句子"},
        ],
        "shards/part-00001.parquet": [{"doc_id": "d2", "sent_idx": 0, "text": "人口1,234,567人和OK"}],
    }
    for rel, rows in shards.items():
        write_rows(w, rel, rows, CLEAN)
    return w.commit(code_version="t", config={}, parents=[], stats={"in": 3, "out": 3},
                    rows={k: len(v) for k, v in shards.items()})


def test_numbers_stage_maps_every_shard_row_for_row():
    from tasks.prepare.numbers import build
    from tasks.text.numbers import NUM

    store = _mem_store()
    clean = _clean_artifact(store)
    writer = begin(store, "numbers", "n1")
    res = build(context(writer, NumbersConfig(min_english_len=2)), clean_ref=clean.ref)
    assert res.stats == {"in": 3, "out": 3, "rejected": {}}
    assert res.metrics == {"numbers_replaced": 3}  # 1998, 7.8 and 1,234,567
    assert res.rows == {"shards/part-00000.parquet": 2, "shards/part-00001.parquet": 1}
    art = writer.commit(code_version="t", config={}, parents=[clean.ref], stats=res.stats, metrics=res.metrics,
                        rows=res.rows)
    first = pq.read_table(art.fs.open(art.file_path("shards/part-00000.parquet"), "rb")).to_pylist()
    assert first == [
        {"doc_id": "d1", "sent_idx": 0, "text": f"{NUM}年GDP增长{NUM}%", "n_numbers": 2, "en_starts": [2],
         "en_ends": [5]},
        {"doc_id": "d1", "sent_idx": 1, "text": "没有数字的句子", "n_numbers": 0, "en_starts": [], "en_ends": []},
    ]
    from tasks.prepare.numbers import SCHEMA
    from tasks.text.numbers import english_spans, number_row

    assert pq.read_schema(art.fs.open(art.file_path("shards/part-00000.parquet"), "rb")).equals(SCHEMA)
    assert english_spans("a OK ab") == [(2, 4), (5, 7)]  # two letters by default
    assert number_row({"doc_id": "d", "sent_idx": 0, "text": "OK"})["en_starts"] == [0]
    second = pq.read_table(art.fs.open(art.file_path("shards/part-00001.parquet"), "rb")).to_pylist()
    assert second == [{"doc_id": "d2", "sent_idx": 0, "text": f"人口{NUM}人和OK", "n_numbers": 1, "en_starts": [5],
                       "en_ends": [7]}]


def test_numbers_min_english_len_and_the_shard_task_by_uri():
    from storage.artifacts import StagingHandle
    from tasks.prepare.numbers import number_shard_task

    store = _mem_store()
    clean = _clean_artifact(store)
    begin(store, "numbers", "n2")
    got = number_shard_task(StagingHandle(store.uri, "numbers", "n2"), clean.uri, "shards/part-00001.parquet",
                            "shards/x.parquet", 3)
    assert got == {"rel": "shards/x.parquet", "in": 1, "out": 1, "numbers": 1}
    writer = store.attach("numbers", "n2")
    rows = pq.read_table(writer.fs.open(writer.file_path("shards/x.parquet"), "rb")).to_pylist()
    assert rows[0]["en_starts"] == [] and rows[0]["en_ends"] == []  # "OK" is shorter than 3 letters


def test_numbers_of_an_empty_shard():
    from tasks.prepare.numbers import number_shard

    store = _mem_store()
    w = begin(store, "clean", "c0")
    write_rows(w, "shards/a.parquet", [], CLEAN)
    clean = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    out = begin(store, "numbers", "n0")
    assert number_shard(open_artifact(clean.uri), "shards/a.parquet", out, "shards/a.parquet") == {
        "rel": "shards/a.parquet", "in": 0, "out": 0, "numbers": 0}
    w = begin(store, "clean", "c2")
    write_rows(w, "shards/b.parquet", [{"doc_id": "d", "sent_idx": 0, "text": "OK了"}], CLEAN)
    clean2 = w.commit(code_version="t", config={}, parents=[], stats={"in": 1, "out": 1})
    number_shard(open_artifact(clean2.uri), "shards/b.parquet", out, "shards/b.parquet")  # default: 2 letters
    rows = pq.read_table(out.fs.open(out.file_path("shards/b.parquet"), "rb")).to_pylist()
    assert (rows[0]["en_starts"], rows[0]["en_ends"]) == ([0], [2])


# ----------------------------------------------------------------------------- artifact store


def _committed(store: ArtifactStore, stage: str, version: str, parents=()):
    w = begin(store, stage, version)
    w.write_bytes("x.txt", version.encode())
    return w.commit(code_version="t", config={}, parents=list(parents), stats={"in": 2, "out": 1,
                                                                               "rejected": {"bad": 1}})


def test_lineage_names_stage_version_uri_stats_and_parents():
    from storage.artifacts import lineage

    store = _mem_store()
    parent = _committed(store, "clean", "c1")
    child = _committed(store, "numbers", "n1", [parent.ref])
    stats = {"in": 2, "out": 1, "rejected": {"bad": 1}}
    leaf = {"stage": "clean", "version": "c1", "uri": parent.uri, "stats": stats, "parents": []}
    assert lineage(child.uri) == {"stage": "numbers", "version": "n1", "uri": child.uri, "stats": stats,
                                  "parents": [leaf]}


def test_remove_checkpoints_reports_whether_there_were_any():
    store = _mem_store()
    assert store.remove_checkpoints("pretrain", "v1") is False
    path = store.checkpoint_path("pretrain", "v1")
    assert path == f"{store.root}/_checkpoints/pretrain/v1" and store.checkpoint_path("ner", "v2").endswith("/ner/v2")
    store.fs.makedirs(path, exist_ok=True)
    store.fs.pipe(f"{path}/state.json", b"{}")
    assert store.remove_checkpoints("pretrain", "v1") is True
    assert not store.fs.exists(f"{path}/state.json")
    assert store.remove_checkpoints("pretrain", "v1") is False


def test_ref_json_keeps_non_ascii_and_attach_writes_into_the_staging_directory(tmp_path):
    import json

    from storage.artifacts import ArtifactRef, fingerprint_uri

    ref = ArtifactRef(stage="bundle", version="v", uri="memory://商店/bundle/v")
    assert ref.to_json() == '{"stage": "bundle", "version": "v", "uri": "memory://商店/bundle/v"}'
    assert json.loads(ref.to_json()) == ref.model_dump()

    store = ArtifactStore(str(tmp_path / "store"))
    begin(store, "numbers", "n1")
    w = store.attach("numbers", "n1")
    assert (w.stage, w.version) == ("numbers", "n1")
    w.write_bytes("a.txt", b"abc")
    art = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
    assert art.is_local() and not _committed(_mem_store(), "x", "v").is_local()
    assert art.read_verified("a.txt") == b"abc"
    assert fingerprint_uri(str(tmp_path / "store" / "numbers" / "n1" / "a.txt")) == {
        "size": 3, "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"}


# ----------------------------------------------------------------------------- labeller helpers


def test_id_strings_and_reject_snippets_of_json_values():
    import datetime

    from tasks.label.run import _snippet, id_string

    assert id_string(None) is None and id_string("") is None and id_string("a1") == "a1"
    assert id_string(7) == "7" and id_string(2.5) == "2.5"
    assert id_string(True) == "true"  # a bool is JSON, not the int 1
    assert id_string({"b": 1, "a": "中"}) == '{"a": "中", "b": 1}'  # sorted keys, characters kept
    assert id_string([1, "文"]) == '[1, "文"]'
    assert _snippet(None) is None and _snippet("文本") == "文本"
    assert _snippet({"z": "好", "a": [1]}) == '{"a": [1], "z": "好"}'
    assert _snippet({"d": datetime.date(2024, 1, 2)}) == '{"d": "2024-01-02"}'  # not JSON: shown via str


def test_which_files_in_an_output_directory_are_the_labellers():
    from tasks.label.output import OutputDir, _ours

    for rel in ("part-00000.parquet", "rejected-00003.parquet", "_manifest.json", "_run.json",
                "part-00001.parquet.tmp-ab12", "_run.json.tmp-1"):
        assert _ours(rel), rel
    for rel in ("notes.txt", "part-00000.csv", "rejected-1.json", "sub/part-00000.parquet", "part-0/x.parquet",
                "data.parquet", "_other.json", "x/.tmp-1", "sub/part-00000.parquet.tmp-1", "part-0.parquet",
                "part-00000-1f2e.snappy.parquet", "notes.tmp-1"):
        assert not _ours(rel), rel
    out = OutputDir(f"memory://out-{uuid.uuid4().hex}", "v")
    out.remove("part-00000.parquet")  # nothing there: no error
    out.write_bytes("part-00000.parquet", b"x")
    out.remove("part-00000.parquet")
    assert out.rels() == []


# ----------------------------------------------------------------------------- threshold


def test_safe_div_is_zero_where_the_denominator_is_zero():
    import numpy as np

    from tasks.finetune.threshold import _safe_div

    got = _safe_div(np.array([1, 3, 2]), np.array([0, 1, 4]))
    assert got.dtype == np.float64 and got.tolist() == [0.0, 3.0, 0.5]


def test_threshold_stage_writes_the_rule_and_refuses_a_disagreeing_choice():
    import json

    from storage.parquet import write_table
    from tasks.finetune.threshold import RULE, build, search_threshold

    y, p = [0, 0, 1, 1, 0, 1], [0.1, 0.4, 0.35, 0.8, 0.2, 0.9]
    res = search_threshold(y, p)
    store = _mem_store()
    for chosen, version in ((res.threshold, "f1"), (res.threshold + 0.01, "f2")):
        w = begin(store, "finetune", version)
        write_table(w, "dev_predictions.parquet", pa.table({"label": y, "prob": p}))
        w.write_bytes("threshold.json", json.dumps({"threshold": chosen}).encode())
        ft = w.commit(code_version="t", config={}, parents=[], stats={"in": 0, "out": 0})
        writer = begin(store, "threshold", version)
        if version == "f2":
            with pytest.raises(RuntimeError, match="differs from the one fine-tuning chose"):
                build(writer, ft)
            continue
        out = build(writer, ft)
        assert out.stats == {"in": 6, "out": 6, "rejected": {}}
        assert out.metrics == {"threshold": res.threshold, "dev_f1": round(res.f1, 6)}
        art = writer.commit(code_version="t", config={}, parents=[], stats=out.stats, rows=out.rows)
        info = {"threshold": res.threshold, "dev_f1": res.f1, "rule": RULE}
        assert art.read_verified("threshold.json") == json.dumps(info, indent=1).encode()
        table = pq.read_table(art.fs.open(art.file_path("f1_table.parquet"), "rb")).to_pylist()
        assert table == res.table and out.rows == {"f1_table.parquet": len(res.table)} == {"f1_table.parquet": 99}


def test_threshold_search_checks_lengths():
    from tasks.finetune.threshold import search_threshold

    with pytest.raises(ValueError, match="y_true has 2 values, prob has 3"):
        search_threshold([0, 1], [0.1, 0.2, 0.3])


# ----------------------------------------------------------------------------- devices


def test_resolve_device_names():
    from unittest import mock

    import torch

    from tasks.inference.runtime import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert resolve_device("cuda") == torch.device("cuda") and resolve_device("cuda", 1) == torch.device("cuda", 1)
    if not torch.cuda.is_available():  # asked for, not there: one line that says what to do
        with pytest.raises(ValueError, match=r"^pretrain\.device is 'cuda' but .*https://pytorch\.org/"):
            resolve_device("cuda", key="pretrain.device")
    want = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == want


# ----------------------------------------------------------------------------- labeller: windows and resume


class KeywordScorer:
    """A rule scorer with the labeller's scorer members: positive when the text holds 好; ``<br>`` alone is
    empty after normalisation. The labeller under test is real; this stands in for the model only."""

    positive_column = "label"

    def __init__(self):
        from storage.artifacts import ArtifactRef

        self.ref = ArtifactRef(stage="bundle", version="kw", uri="memory://kw/bundle/kw")
        self.windows: list[int] = []

    def score(self, texts):
        self.windows.append(len(texts))
        empty = {i for i, t in enumerate(texts) if t == "<br>"}
        return [int("好" in t) for i, t in enumerate(texts) if i not in empty], empty

    def part_table(self, ids, outputs):
        return pa.table({"row_id": pa.array(ids, pa.string()), "label": pa.array(outputs, pa.int8())})

    def metrics(self):
        return {"scorer": "keyword"}


def _texts_csv(uri: str, texts: list[str]) -> str:
    import fsspec

    with fsspec.open(uri, "w", encoding="utf-8") as f:
        f.write("id,text\n" + "".join(f"r{i},{t}\n" for i, t in enumerate(texts)))
    return uri


def _label(inp: str, out: str | None, **options):
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream

    read_rows = options.pop("read_rows", 7)
    kw = {k: options.pop(k) for k in ("output_root", "overwrite") if k in options}
    scorer = KeywordScorer()
    res = label_stream(scorer, inp, out, LabelOptions(text_column="text", id_column="id", **options),
                       progress=False, read_rows=read_rows, **kw)
    return res, scorer


def _parquet(uri: str) -> list[dict]:
    import fsspec

    with fsspec.open(uri, "rb") as f:
        return pq.read_table(f).to_pylist()


def test_windows_fill_and_empty_rows_are_rejected_at_their_own_position():
    texts = ["好" if i % 3 else "差" for i in range(40)]
    texts[3] = texts[35] = "<br>"  # one in the first window (32 scorable rows at batch_size 1), one after it
    root = f"memory://win-{uuid.uuid4().hex}"
    inp = _texts_csv(f"{root}/in.csv", texts)
    res, scorer = _label(inp, f"{root}/out", shard_rows=100, batch_size=1)
    assert scorer.windows == [32, 8]  # a full window is scored as soon as it fills, the rest at the shard's end
    assert res["stats"] == {"in": 40, "out": 38, "rejected": {"empty_after_normalization": 2}}
    rej = _parquet(f"{root}/out/rejected-00000.parquet")
    assert [(r["id"], r["line"], r["reason"], r["text"]) for r in rej] == [
        ("r3", 5, "empty_after_normalization", "<br>"), ("r35", 37, "empty_after_normalization", "<br>")]
    part = _parquet(f"{root}/out/part-00000.parquet")
    want = [(f"r{i}", int("好" in t)) for i, t in enumerate(texts) if t != "<br>"]
    assert [(r["row_id"], r["label"]) for r in part] == want
    assert res["metrics"]["positive"] == sum(v for _, v in want)


def test_reader_batches_that_straddle_shards_and_a_resume_that_reads_counts_back():
    import fsspec

    from storage.artifacts import MANIFEST

    texts = ["差"] * 10 + ["好"] * 7 + ["", "<br>", "好"] + ["好", "差"] * 3  # shard 0 has no positive row
    root = f"memory://resume-{uuid.uuid4().hex}"
    inp = _texts_csv(f"{root}/in.csv", texts)
    ref, _ = _label(inp, f"{root}/ref", shard_rows=10, batch_size=2, read_rows=7)
    assert ref["stats"] == {"in": 26, "out": 24, "rejected": {"empty_text": 1, "empty_after_normalization": 1}}
    assert ref["parts"] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert [f["rows"] for f in ref["files"] if f["path"].startswith("part-")] == [10, 8, 6]
    assert ref["metrics"]["positive"] == 7 + 1 + 3

    crash, _ = _label(inp, f"{root}/crash", shard_rows=10, batch_size=2, read_rows=7)
    fs, path = fsspec.core.url_to_fs(f"{root}/crash")
    fs.rm(f"{path}/{MANIFEST}")  # a kill after shards 0 and 1 were written
    fs.rm(f"{path}/part-00002.parquet")
    again, scorer = _label(inp, f"{root}/crash", shard_rows=10, batch_size=2, read_rows=7)
    assert again["skipped_shards"] == 2 and scorer.windows == [6]  # only shard 2 is scored again
    assert (again["stats"], again["metrics"], again["files"]) == (ref["stats"], ref["metrics"], ref["files"])


# ----------------------------------------------------------------------------- versions, fingerprints


def test_versions_are_stable_across_releases():
    """A version is a content address users' stores are keyed by: the canonical JSON and the hash never drift."""
    from storage.artifacts import ArtifactRef, canonical_json, compute_version

    assert canonical_json({"b": 1, "a": "中", "t": (1, 2), "s": {3}}) == '{"a":"中","b":1,"s":"{3}","t":[1,2]}'
    parent = ArtifactRef(stage="x", version="abc", uri="memory://s/x/abc")
    config = {"a": 1, "中": [1, 2.5], "d": None}
    assert compute_version("clean", "clean-1", config, [parent]) == "5c39407f5ab3d304"
    moved = ArtifactRef(stage="x", version="abc", uri="file:///elsewhere/x/abc")  # parents by stage and version
    assert compute_version("clean", "clean-1", config, [moved]) == "5c39407f5ab3d304"
    for other in (("numbers", "clean-1", config, [parent]), ("clean", "clean-2", config, [parent]),
                  ("clean", "clean-1", {**config, "a": 2}, [parent]), ("clean", "clean-1", config, [])):
        assert compute_version(*other) != "5c39407f5ab3d304", other


class _ObjectStore:
    """What an object store's fsspec filesystem answers for ``info`` (no download)."""

    def __init__(self, protocol, info):
        self.protocol, self._info = protocol, info

    def info(self, path):
        assert path == "bucket/key.csv"
        return self._info


def test_object_store_inputs_are_fingerprinted_by_their_etag_and_checksums():
    from storage.artifacts import fingerprint

    s3 = _ObjectStore(("s3", "s3a"), {"size": 10, "ETag": '"e1"', "etag": None, "md5Hash": "", "other": 1})
    assert fingerprint(s3, "bucket/key.csv") == {"size": 10, "ETag": '"e1"'}
    gcs = _ObjectStore("gcs", {"size": 3, "etag": "e2", "md5Hash": "m", "crc32c": 7})
    assert fingerprint(gcs, "bucket/key.csv") == {"size": 3, "etag": "e2", "md5Hash": "m", "crc32c": "7"}


# ----------------------------------------------------------------------------- labeller: options and records


def test_label_run_record_metrics_and_output_root(tmp_path):
    import json

    from tasks.label.run import CODE_VERSION

    root = f"memory://rec-{uuid.uuid4().hex}"
    inp = _texts_csv(f"{root}/in.csv", ["好", "差", "<br>"])
    res, _ = _label(inp, None, output_root=f"{root}/nightly/", shard_rows=2, batch_size=2)
    version = res["version"]
    assert res["uri"] == f"{root}/nightly/{version}"  # the root's trailing slash is not doubled
    assert res["metrics"] == {"scorer": "keyword", "positive": 1, "shards": 2, "input_files": 1}
    assert res["parts"] == ["part-00000.parquet", "part-00001.parquet"]
    import fsspec

    with fsspec.open(f"{res['uri']}/_run.json", "rb") as f:
        text = f.read().decode()
    run = json.loads(text)
    assert run["bundle"] == {"stage": "bundle", "version": "kw"}  # no store path: relocatable
    assert (run["stage"], run["version"], run["code_version"]) == ("label", version, CODE_VERSION)
    assert run["config"]["text_column"] == "text" and len(run["config"]["inputs"]) == 1
    assert text.startswith('{\n "bundle": {\n  "stage": "bundle",\n  "version": "kw"\n },\n "code_version": ')


def test_label_refuses_bad_options_with_a_clear_message(tmp_path):
    root = f"memory://opts-{uuid.uuid4().hex}"
    inp = _texts_csv(f"{root}/in.csv", ["好"])
    with pytest.raises(ValueError, match=r"^give exactly one of output_uri \(a directory\) and output_root"):
        _label(inp, f"{root}/o", output_root=f"{root}/r")
    with pytest.raises(ValueError, match=r"^give exactly one of output_uri"):
        _label(inp, None)
    with pytest.raises(ValueError, match=r"^read_rows must be >= 1, got 0$"):
        _label(inp, f"{root}/o", read_rows=0)
    with pytest.raises(ValueError, match=r"^precision 'int8' applies to sentiment bundles only; use fp32$"):
        _label(inp, f"{root}/o", precision="int8")
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream

    with pytest.raises(ValueError, match=r"^id_column and text_column are both 'text'$"):
        label_stream(KeywordScorer(), inp, f"{root}/o", LabelOptions(text_column="text", id_column="text"))
    res, _ = _label(inp, f"{root}/one", read_rows=1)  # one row per reader batch is allowed
    assert res["stats"] == {"in": 1, "out": 1, "rejected": {}}


def test_claim_output_refuses_to_mix_and_overwrite_removes_only_the_labellers_files():
    import fsspec

    from tasks.label.output import OutputConflict

    root = f"memory://claim-{uuid.uuid4().hex}"
    inp = _texts_csv(f"{root}/in.csv", ["好", "差"])
    fs, path = fsspec.core.url_to_fs(f"{root}/out")
    fs.pipe(f"{path}/notes.txt", b"mine")
    with pytest.raises(OutputConflict, match=r"is not empty \(1 files, e\.g\. \['notes\.txt'\]\) and holds no label"):
        _label(inp, f"{root}/out")
    with pytest.raises(OutputConflict, match=r"holds no label run \(1 files, e\.g\. \['notes\.txt'\]\); --overwrite"):
        _label(inp, f"{root}/out", overwrite=True)
    assert fs.cat(f"{path}/notes.txt") == b"mine"  # not the labeller's: kept, and nothing written
    assert [p.rsplit("/", 1)[1] for p in fs.find(path)] == ["notes.txt"]
    fs.rm(f"{path}/notes.txt")
    first, _ = _label(inp, f"{root}/out")
    with pytest.raises(OutputConflict, match=f"holds label output version {first['version']}; this run"):
        _label(inp, f"{root}/out", shard_rows=1)
    second, _ = _label(inp, f"{root}/out", shard_rows=1, overwrite=True)
    assert second["parts"] == ["part-00000.parquet", "part-00001.parquet"] and not second["cached"]
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find(path)) == [
        "_manifest.json", "_run.json", "part-00000.parquet", "part-00001.parquet"]
    again, _ = _label(inp, f"{root}/out", shard_rows=1)
    assert again["cached"] and again["version"] == second["version"]


def test_claim_output_messages_name_the_files_the_remedy_and_read_the_manifest_alone():
    import fsspec

    from tasks.label.output import OutputConflict

    root = f"memory://claim2-{uuid.uuid4().hex}"
    inp = _texts_csv(f"{root}/in.csv", ["好", "差"])
    fs, path = fsspec.core.url_to_fs(f"{root}/busy")
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        fs.pipe(f"{path}/{name}", b"x")
    with pytest.raises(OutputConflict) as e:
        _label(inp, f"{root}/busy")
    assert ("is not empty (4 files, e.g. ['a.txt', 'b.txt', 'c.txt']) and holds no label run; refusing to write "
            "into it: choose an empty output (--output), or one directory per version under --output-root"
            ) in str(e.value)
    assert "--overwrite" not in str(e.value)  # it would not help: it removes a label run's own files only
    first, _ = _label(inp, f"{root}/out")
    _, opath = fsspec.core.url_to_fs(f"{root}/out")
    fs.rm(f"{opath}/_run.json")  # the manifest alone still names the version
    with pytest.raises(OutputConflict) as e:
        _label(inp, f"{root}/out", shard_rows=1)
    assert ("Refusing to mix them: choose another output (--output), write one directory per version under "
            "--output-root, or replace it with --overwrite (overwrite=True from Python)") in str(e.value)
    assert f"holds label output version {first['version']}" in str(e.value)


def test_content_digest_is_pinned_and_sees_key_order_and_non_ascii():
    import pyarrow as pa

    from tasks.label.output import content_digest

    t = pa.table({"row_id": ["a:1"], "prob": pa.array([0.25], pa.float32()), "text": ["好评"]})
    # the digest is written into part files: a different encoding would orphan a killed run's shards
    import hashlib
    import json as _json

    want = hashlib.sha256(_json.dumps({"row_id": ["a:1"], "prob": [0.25], "text": ["好评"]}, ensure_ascii=False)
                          .encode()).hexdigest()
    assert content_digest(t) == want
    assert content_digest(t.select(["prob", "row_id", "text"])) != want  # column order is content


def test_shares_return_what_they_wrote_and_the_coordinator_commits_the_same_bytes():
    import fsspec

    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream, open_run, prepare_output

    root = f"memory://shares-{uuid.uuid4().hex}"
    inp = _texts_csv(f"{root}/in.csv", ["好", "差", "很好", "一般", "好的"])
    alone, _ = _label(inp, f"{root}/alone", shard_rows=2)
    opts = LabelOptions(text_column="text", id_column="id", shard_rows=2)
    scorer = KeywordScorer()
    prepare_output(open_run(scorer, inp, f"{root}/split", opts))  # what the coordinator does first
    got = [label_stream(scorer, inp, f"{root}/split", opts, progress=False, read_rows=7, share=(t, 2))
           for t in (0, 1)]
    assert [sorted(g) for g in got] == [["share", "uri", "version", "written"]] * 2
    assert [g["share"] for g in got] == [[0, 2], [1, 2]] and got[0]["version"] == alone["version"]
    parts = [sorted(f for f in g["written"] if f.startswith("part-")) for g in got]
    assert parts == [["part-00000.parquet", "part-00002.parquet"], ["part-00001.parquet"]]  # i % 2 == t
    done = label_stream(scorer, inp, f"{root}/split", opts, progress=False, read_rows=7)
    assert done["skipped_shards"] == 3 and done["stats"] == alone["stats"]
    fs, a = fsspec.core.url_to_fs(f"{root}/alone")
    _, b = fsspec.core.url_to_fs(f"{root}/split")
    for f in alone["parts"]:
        assert fs.cat(f"{a}/{f}") == fs.cat(f"{b}/{f}")
    # a share of a committed run writes nothing and says so
    again = label_stream(scorer, inp, f"{root}/split", opts, progress=False, read_rows=7, share=(1, 2))
    assert again == {"uri": done["uri"], "version": done["version"], "written": [], "share": [1, 2]}
