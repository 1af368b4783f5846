"""Labelled-table reading for fine-tuning (rejects with reasons and lines, reconciliation) and the split."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from tasks.common.config import FinetuneConfig
from tasks.common.splits import split_rows
from tasks.train.labelled import read_labelled


# ----------------------------------------------------------------------------- reader


def _cfg(**kw):
    kw.setdefault("data_uri", "unused.csv")
    return FinetuneConfig(**kw)


CSV_CLEAN = "label,review\n1,好评\n 1,\"有空格的标签, 带逗号\"\n2,坏标签\n0,\n0,\"多行\n文本\"\n0,正常\n"


def test_csv_reader_rejects_and_reconciles(tmp_path):
    p = tmp_path / "d.csv"
    raw = CSV_CLEAN.encode()
    p.write_bytes(raw.replace(b"0,\xe6\xad\xa3", b"1,\xff\xfe bad\n0,\xe6\xad\xa3"))  # line 8 undecodable
    rows, rej = read_labelled(str(p), _cfg())
    assert rows == [
        {"row_id": 2, "text": "好评", "label": 1},
        {"row_id": 3, "text": "有空格的标签, 带逗号", "label": 1},
        {"row_id": 6, "text": "多行\n文本", "label": 0},
        {"row_id": 9, "text": "正常", "label": 0},
    ]
    assert [(r["line"], r["reason"]) for r in rej] == [(4, "bad_label"), (5, "empty_text"), (8, "undecodable")]
    assert rej[0]["label"] == "2" and rej[0]["source"] == str(p)
    assert len(rows) + len(rej) == 7  # every record kept or rejected
    # clean file (pyarrow fast path), gzipped: same rows and line numbers as the line reader gave
    g = tmp_path / "d.csv.gz"
    g.write_bytes(gzip.compress(raw))
    rows2, rej2 = read_labelled(str(g), _cfg())
    assert [r["row_id"] for r in rows2] == [2, 3, 6, 8] and rows2[:3] == rows[:3]
    assert [(r["line"], r["reason"]) for r in rej2] == [(4, "bad_label"), (5, "empty_text")]


def test_tsv_without_quoting_and_wrong_field_count(tmp_path):
    p = tmp_path / "d.tsv"
    p.write_text('label\ttext_a\n1\t他说"很好"吧\n    0\t"引号开头\n1\ta\tb\n', encoding="utf-8")
    rows, rej = read_labelled(str(p), _cfg(text_column="text_a"))
    assert rows == [{"row_id": 2, "text": '他说"很好"吧', "label": 1}, {"row_id": 3, "text": '"引号开头', "label": 0}]
    assert [(r["line"], r["reason"]) for r in rej] == [(4, "bad_columns")]


def test_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    j = tmp_path / "d.jsonl"
    j.write_text('{"label": 1, "review": "好"}\n\n{"label": true, "review": " 差 "}\nnot json\n{"label": 3, "review": "x"}\n', encoding="utf-8")
    rows, rej = read_labelled(str(j), _cfg())
    assert rows == [{"row_id": 1, "text": "好", "label": 1}, {"row_id": 3, "text": "差", "label": 1}]
    assert [(r["line"], r["reason"]) for r in rej] == [(4, "bad_json"), (5, "bad_label")]
    q = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": [0, 1, 5], "review": ["a", None, "c"]}), q)
    rows, rej = read_labelled(str(q), _cfg())
    assert rows == [{"row_id": 1, "text": "a", "label": 0}]
    assert [(r["line"], r["reason"]) for r in rej] == [(2, "empty_text"), (3, "bad_label")]


def test_missing_column_names_existing_columns(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text(CSV_CLEAN, encoding="utf-8")
    with pytest.raises(ValueError, match=r"d\.csv: column 'text' not found; columns are \['label', 'review'\]"):
        read_labelled(str(p), _cfg(text_column="text"))


# ----------------------------------------------------------------------------- split


def test_split_is_deterministic_stratified_and_keeps_duplicates_together():
    rng = np.random.default_rng(0)
    rows = [{"row_id": i, "text": f"t{rng.integers(0, 700)}", "label": int(rng.random() < 0.3)} for i in range(2000)]
    a = split_rows(rows, (0.8, 0.1, 0.1), 7)
    b = split_rows(list(reversed(rows)), (0.8, 0.1, 0.1), 7)
    ids = [sorted(r["row_id"] for r in part) for part in a]
    assert ids == [sorted(r["row_id"] for r in part) for part in b]  # order-independent, repeatable
    assert sorted(sum(ids, [])) == list(range(2000))
    for part, frac in zip(a, (0.8, 0.1, 0.1)):
        assert abs(len(part) / 2000 - frac) < 0.03
        assert abs(np.mean([r["label"] for r in part]) - 0.3) < 0.06
    where = {}
    for s, part in enumerate(a):
        for r in part:
            assert where.setdefault((r["text"], r["label"]), s) == s
    assert split_rows(rows, (0.8, 0.1, 0.1), 8) != a  # the seed matters


