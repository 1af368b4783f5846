"""Every row-level problem is a reject with a reason, never a crash and never silent, in the labeller (the CLI's
path, and a Dask worker's share), the Python API (``label_dataframe``, ``predict``) and the clean stage, with one
reason vocabulary; scored rows carry the ``no_cjk`` and ``truncated_at`` flags. Each finding is reproduced as it
was met: a lone surrogate aborting the run, a JSON-lines file refused for its first record, duplicate ids, an
integer Parquet column cast and scored, texts without Chinese or cut to the model's length passing without a word."""

from __future__ import annotations

import dataclasses
import io
import json

import fsspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import lexiflow
from storage.artifacts import MANIFEST
from tasks.label.config import LabelOptions
from tasks.label.run import label_stream
from tasks.prepare.config import CleanConfig
from tests.bundle_fixture import make_tiny_bundle
from tests.test_label import put

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)
LONG = "这家酒店服务很好，房间干净" * 10  # 130 characters: past the tiny bundle's 46 text tokens


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    from tasks.inference.bundle import load_bundle

    return load_bundle(make_tiny_bundle(str(tmp_path_factory.mktemp("store"))))


@pytest.fixture(scope="module")
def three_class(bundle):
    """The tiny bundle with a seeded three-class head (``finetune.classes: any``): K > 2, arg-max labels."""
    import torch

    from models import LebertClassifier

    torch.manual_seed(3)
    model = LebertClassifier(bundle.model.cfg, use_layers=2, dropout=0.4, num_labels=3)
    state = {k: v for k, v in bundle.model.state_dict().items() if not k.startswith("head.")}
    assert not model.load_state_dict(state, strict=False).unexpected_keys
    model.eval()
    return dataclasses.replace(bundle, model=model, threshold=None, info={**bundle.info, "classes": ["差", "中", "好"]})


def label(bundle, inp, out, **options) -> dict:
    return label_stream(bundle, inp, out, LabelOptions(**options), progress=False)


def rows(out: str, prefix: str) -> list[dict]:
    with fsspec.open(f"{out}/{MANIFEST}", "rb") as f:
        files = [x["path"] for x in json.loads(f.read())["files"] if x["path"].startswith(prefix)]
    got = []
    for rel in files:
        with fsspec.open(f"{out}/{rel}", "rb") as f:
            got.extend(pq.read_table(f).to_pylist())
    return got


def reasons(out: str) -> dict[str, str]:
    return {r["id"]: r["reason"] for r in rows(out, "rejected-")}


# ----------------------------------------------------------------------------- invalid Unicode


def test_a_lone_surrogate_is_a_reject_not_a_crash_and_the_rerun_is_not_blocked(bundle, mem):
    """One lone surrogate (a JSON ``"\\ud800"`` escape) aborted the whole run in the scorer (OpenCC cannot encode
    it) and left a ``_run.json`` that refused the rerun; in the id it would have broken the Parquet writer."""
    data = (json.dumps({"id": "a", "review": "房间干净"}) + "\n" + '{"id": "b", "review": "好\\ud800"}\n'
            + '{"id": "c\\udc00", "review": "前台态度冷淡"}\n' + json.dumps({"id": "d", "review": "失望"}) + "\n")
    inp = put(f"{mem}/in.jsonl", data)
    res = label(bundle, inp, f"{mem}/out", id_column="id")
    assert res["stats"] == {"in": 4, "out": 2, "rejected": {"invalid_unicode": 2}}
    assert reasons(f"{mem}/out") == {"b": "invalid_unicode", "c\ufffd": "invalid_unicode"}
    assert [r["row_id"] for r in rows(f"{mem}/out", "part-")] == ["a", "d"]
    again = label(bundle, inp, f"{mem}/out", id_column="id")
    assert again["cached"] and again["version"] == res["version"]
    # the Python API: the same reasons; a direct scorer call no longer fails either
    df = pd.DataFrame({"review": ["好\ud800", "好"], "id": ["x", "y\udfff"]}, dtype=object)  # no Arrow strings
    frame = lexiflow.label_dataframe(df, bundle, id_column="id")
    assert frame["reason"].tolist() == ["invalid_unicode", "invalid_unicode"]
    assert lexiflow.Model(bundle).predict(["好\ud800"])["reason"].tolist() == ["invalid_unicode"]
    from tasks.inference.sentiment import score_texts

    assert np.isfinite(score_texts(bundle, ["好\ud800"])).all()


def test_a_lone_surrogate_in_a_corpus_record_is_rejected_by_the_clean_stage(mem):
    from tasks.prepare.clean import clean_records
    from tasks.prepare.corpus import read_records

    data = (json.dumps({"id": "1", "text": "北京是中华人民共和国的首都。"}) + "\n"
            + '{"id": "2", "text": "上海\\ud800是一座很大的城市。"}\n' + '{"id": "3\\ud800", "title": "x"}\n')
    cfg = CleanConfig()
    events = list(clean_records(read_records(put(f"{mem}/c.jsonl", data), cfg), cfg))
    rejected = [r for kind, r in events if kind == "reject"]
    assert [(r["doc_id"], r["reason"]) for r in rejected] == [("2", "invalid_unicode"), ("3\ufffd", "invalid_unicode")]
    assert rejected[0]["text"] == "上海\ufffd是一座很大的城市。"
    pa.table({k: [r[k] for r in rejected] for k in rejected[0]})  # the reject rows can be written


# ----------------------------------------------------------------------------- JSON lines: the key in any record


def test_a_jsonl_file_whose_first_record_lacks_the_text_key_is_read_record_by_record(bundle, mem):
    """The first record's keys decided for the whole file: a file whose first record had no text key was refused
    as a whole, though later records had it. Now that record is a ``missing_text`` reject, the rest labelled."""
    lines = [{"id": "a", "title": "只有标题"}, {"id": "b", "review": "房间干净"}, {"id": "c", "review": "失望"},
             {"review": "没有编号"}]
    inp = put(f"{mem}/in.jsonl", "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    res = label(bundle, inp, f"{mem}/out", id_column="id")
    assert res["stats"] == {"in": 4, "out": 2, "rejected": {"missing_text": 1, "missing_id": 1}}
    assert reasons(f"{mem}/out") == {"a": "missing_text", "in.jsonl:3": "missing_id"}


# ----------------------------------------------------------------------------- duplicate ids


def test_duplicate_ids_reject_the_later_rows_across_shards_files_and_a_resume(bundle, mem):
    """Duplicate ids passed silently: two output rows with one id. The first row keeps the id; every later one
    is a ``duplicate_id`` reject, across shards and files, the same in a resumed run and in a share."""
    put(f"{mem}/in/a.csv", "id,review\nk1,房间干净\nk2,失望\nk1,前台态度冷淡\nk3,价格便宜\n")
    put(f"{mem}/in/b.csv", "id,review\nk2,早餐不错\nk4, \nk4,环境一般\nk5,我们非常满意\n")
    opts = dict(id_column="id", shard_rows=3, batch_size=2)
    res = label(bundle, f"{mem}/in/*.csv", f"{mem}/ref", **opts)
    assert res["stats"] == {"in": 8, "out": 4, "rejected": {"duplicate_id": 3, "empty_text": 1}}
    rej = rows(f"{mem}/ref", "rejected-")
    assert [(r["source"], r["line"], r["id"], r["reason"]) for r in rej] == [
        ("a.csv", 4, "k1", "duplicate_id"), ("b.csv", 2, "k2", "duplicate_id"), ("b.csv", 3, "k4", "empty_text"),
        ("b.csv", 4, "k4", "duplicate_id")]  # the first k4 is empty, yet it holds the id
    assert [r["row_id"] for r in rows(f"{mem}/ref", "part-")] == ["k1", "k2", "k3", "k5"]
    # a resumed run (its first shards already written) finds the same duplicates
    label(bundle, f"{mem}/in/*.csv", f"{mem}/crash", **opts)
    fs, path = fsspec.core.url_to_fs(f"{mem}/crash")
    fs.rm(f"{path}/{MANIFEST}")
    fs.rm(f"{path}/part-00002.parquet")
    again = label(bundle, f"{mem}/in/*.csv", f"{mem}/crash", **opts)
    assert again["skipped_shards"] == 2 and again["stats"] == res["stats"] and again["files"] == res["files"]
    # one worker's share writes only its own shards, with the duplicates of the whole input
    from tasks.label.run import open_run, prepare_output

    prepare_output(open_run(bundle, f"{mem}/in/*.csv", f"{mem}/share", LabelOptions(**opts)))
    label_stream(bundle, f"{mem}/in/*.csv", f"{mem}/share", LabelOptions(**opts), progress=False, share=(1, 2))
    with fsspec.open(f"{mem}/share/rejected-00001.parquet", "rb") as f, \
            fsspec.open(f"{mem}/ref/rejected-00001.parquet", "rb") as g:
        assert f.read() == g.read()
    # the Python API: the same rule
    df = pd.DataFrame({"review": ["房间干净", "失望", "早餐不错"], "id": ["k1", "k2", "k1"]})
    assert lexiflow.label_dataframe(df, bundle, id_column="id")["reason"].tolist() == [None, None, "duplicate_id"]


def test_seen_ids_across_the_merge_of_recent_hashes():
    from tasks.label.run import SeenIds

    seen = SeenIds()
    seen._MERGE = 4
    assert all(seen.add(f"id{i}") for i in range(10))
    assert seen.sorted.size == 8 and len(seen.recent) == 2
    assert not any(seen.add(f"id{i}") for i in range(10)) and seen.add("id10")


# ----------------------------------------------------------------------------- non-text column


def test_an_integer_text_column_is_one_error_before_any_work(bundle, mem):
    """An integer Parquet column was cast to strings and scored; now one error names the file, column and type
    before anything is written. A DataFrame column of numbers is refused the same way."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ["a", "b"], "review": pa.array([1, 2], pa.int64())}), buf)
    inp = put(f"{mem}/in.parquet", buf.getvalue())
    with pytest.raises(ValueError, match=r"in\.parquet: text column 'review' holds int64, not text"):
        label(bundle, inp, f"{mem}/out")
    assert not fsspec.filesystem("memory").exists(f"{mem}/out".split("://")[1])
    with pytest.raises(ValueError, match="text column 'review' holds int64, not text"):
        lexiflow.label_dataframe(pd.DataFrame({"review": [1, 2]}), bundle)
    # dictionary-encoded strings are text; a column of only nulls is rows of missing_text
    buf = io.BytesIO()
    pq.write_table(pa.table({"review": pa.array(["好", "差"]).dictionary_encode(), "n": pa.nulls(2)}), buf)
    put(f"{mem}/d.parquet", buf.getvalue())
    assert label(bundle, f"{mem}/d.parquet", f"{mem}/d")["stats"]["out"] == 2
    assert label(bundle, f"{mem}/d.parquet", f"{mem}/n", text_column="n")["stats"]["rejected"] == {"missing_text": 2}
    nan = lexiflow.label_dataframe(pd.DataFrame({"review": [np.nan, np.nan]}), bundle)
    assert nan["reason"].tolist() == ["missing_text"] * 2


# ----------------------------------------------------------------------------- flags: no_cjk, truncated_at


def test_texts_without_chinese_and_truncated_texts_are_flagged(bundle, mem):
    """Texts with no Chinese (English, emoji) were scored without a word, texts longer than the model's length cut
    without a flag. Both are still labelled, with ``no_cjk`` and ``truncated_at`` columns."""
    texts = ["房间干净", "great hotel", "😀😀", LONG, "ok 好"]
    put(f"{mem}/in.csv", "review\n" + "".join(t + "\n" for t in texts))
    res = label(bundle, f"{mem}/in.csv", f"{mem}/out")
    assert res["stats"] == {"in": 5, "out": 5, "rejected": {}}
    got = rows(f"{mem}/out", "part-")
    assert [r["no_cjk"] for r in got] == [False, True, True, False, False]
    n = bundle.featurizer.max_len - 2
    assert [r["truncated_at"] for r in got] == [None, None, None, n, None]
    schema = pq.read_schema(fsspec.open(f"{mem}/out/part-00000.parquet", "rb").open())
    assert schema.field("no_cjk").type == pa.bool_() and schema.field("truncated_at").type == pa.int32()
    head_tail = dataclasses.replace(bundle, featurizer=dataclasses.replace(bundle.featurizer, truncation="head_tail"))
    assert lexiflow.Model(head_tail).predict([LONG])["truncated_at"].tolist() == [n // 2]


# ----------------------------------------------------------------------------- one vocabulary: CLI path = pandas path

MIXED = [("k1", "房间干净"), ("k2", "great hotel"), ("k3", " "), ("k1", "失望"), ("k4", "<br/>"), ("k5", LONG),
         ("", "没有编号"), ("k6", "好\ud800"), ("k7\udc00", "好"), ("k8", None), ("k9", "前台态度冷淡")]


def _mixed_jsonl() -> str:
    return "".join(json.dumps({"id": i, "review": t}) + "\n" for i, t in MIXED)


@pytest.mark.parametrize("kind", ["binary", "three_class"])
def test_the_labeller_and_label_dataframe_agree_row_for_row(kind, bundle, three_class, mem):
    """The same rows through the labeller (what ``lexiflow label`` and a Dask share run) and ``label_dataframe``:
    the same reasons, probabilities (exact), labels and flags, binary and K-class."""
    model = bundle if kind == "binary" else three_class
    inp = put(f"{mem}/in.jsonl", _mixed_jsonl())
    res = label(model, inp, f"{mem}/out", id_column="id", shard_rows=4, batch_size=2)
    cli = lexiflow.read_labelled(f"{mem}/out")
    df = pd.DataFrame({"review": [t for _, t in MIXED], "id": [i for i, _ in MIXED]}, dtype=object)
    ours = lexiflow.label_dataframe(df, model, id_column="id", batch_size=2, shard_rows=4)
    want = [None, None, "empty_text", "duplicate_id", "empty_after_normalization", None, "missing_id",
            "invalid_unicode", "invalid_unicode", "missing_text", None]
    assert ours["reason"].tolist() == want
    assert sum(r is not None for r in want) == sum(res["stats"]["rejected"].values())
    # rows matched by (row id, reason): a duplicate id's two rows differ in their reason
    key = {(r, why): i for i, (r, why) in enumerate(zip(ours["row_id"], ours["reason"]))}
    key[("in.jsonl:6", "missing_id")] = key.pop(("6", "missing_id"))  # no id: the record index there, the index here
    order = [key[(r, why)] for r, why in zip(cli["row_id"], cli["reason"])]
    cli = cli.assign(order=order).sort_values("order").drop(columns="order").reset_index(drop=True)
    assert cli["reason"].tolist() == want
    cols = [c for c in ours.columns if c != "row_id"]
    assert list(cli.columns[: len(ours.columns)]) == list(ours.columns)
    if kind != "binary":  # class names: pandas' str in a fresh frame, objects (None when missing) read back
        ours = ours.assign(label=ours["label"].astype(object).where(ours["label"].notna(), None))
    pd.testing.assert_frame_equal(cli[cols], ours[cols])
    assert {c: str(cli[c].dtype) for c in ("no_cjk", "truncated_at")} == {"no_cjk": "boolean", "truncated_at": "Int32"}
    scored = ours[ours["reason"].isna()]
    assert scored["no_cjk"].tolist() == [False, True, False, False]
    assert scored["truncated_at"].isna().tolist() == [True, True, False, True]
