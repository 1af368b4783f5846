"""Labelled-table reading for fine-tuning (rejects with reasons and lines, reconciliation) and the split."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from tasks.common.labelled import REJECT_SCHEMA, load_data, read_labelled
from tasks.common.splits import split_rows
from tasks.finetune.config import FinetuneConfig

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
    assert rej[0] == {"source": "d.csv", "line": 4, "id": None, "reason": "bad_label", "text": "坏标签", "label": "2"}
    assert rej[2]["text"] == "1,\ufffd\ufffd bad" and rej[2]["label"] is None
    assert REJECT_SCHEMA.names == ["source", "line", "id", "reason", "text", "label"]
    assert len(rows) + len(rej) == 7  # every record kept or rejected
    data = load_data(_cfg(data_uri=str(p)))
    assert data.stats == {"in": 7, "out": 4, "rejected": {"bad_label": 1, "empty_text": 1, "undecodable": 1}}
    assert sorted(r["row_id"] for r in data.train + data.dev + data.test) == [2, 3, 6, 9]
    # the clean file gzipped, with CRLF line ends and a BOM: same rows and line numbers
    g = tmp_path / "d.csv.gz"
    g.write_bytes(gzip.compress(b"\xef\xbb\xbf" + raw.replace(b"\n", b"\r\n")))
    rows2, rej2 = read_labelled(str(g), _cfg())
    assert [r["row_id"] for r in rows2] == [2, 3, 6, 8] and rows2[:2] == rows[:2]
    assert rows2[2]["text"] == "多行\r\n文本"  # a line end inside quotes is kept as written
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
    lines = ['{"label": 1, "review": "好"}', "", '{"label": true, "review": " 差 "}', "not json"]
    lines.append('{"label": 3, "review": "x"}')
    j.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rows, rej = read_labelled(str(j), _cfg())
    assert rows == [{"row_id": 1, "text": "好", "label": 1}, {"row_id": 3, "text": "差", "label": 1}]
    assert [(r["line"], r["reason"]) for r in rej] == [(4, "invalid_json"), (5, "bad_label")]
    q = tmp_path / "d.parquet"
    pq.write_table(pa.table({"label": [0, 1, 5], "review": ["a", None, "c"]}), q)
    rows, rej = read_labelled(str(q), _cfg())
    assert rows == [{"row_id": 1, "text": "a", "label": 0}]
    assert [(r["line"], r["reason"]) for r in rej] == [(2, "empty_text"), (3, "bad_label")]


def test_missing_column_names_existing_columns(tmp_path):
    p = tmp_path / "d.csv"
    p.write_text(CSV_CLEAN, encoding="utf-8")
    have = r"the file has columns \['label', 'review'\]"
    with pytest.raises(ValueError, match=r"d\.csv: text column 'text' not found; " + have):
        read_labelled(str(p), _cfg(text_column="text"))
    j = tmp_path / "d.jsonl"  # JSON lines: a column no record has (checked over the whole file)
    j.write_text('{"label": 1, "review": "好"}\n{"label": 0, "text": "差"}\n', encoding="utf-8")
    assert [r["text"] for r in read_labelled(str(j), _cfg(text_column="text"))[0]] == ["差"]
    with pytest.raises(ValueError, match=r"d\.jsonl: label column 'y' not found; .* \['label', 'review', 'text'\]"):
        read_labelled(str(j), _cfg(label_column="y"))
    e = tmp_path / "e.csv"
    e.write_bytes(b"")
    with pytest.raises(ValueError, match=r"e\.csv: empty file; expected a header line naming .* \['label', 'review'\]"):
        read_labelled(str(e), _cfg())
    with pytest.raises(ValueError, match=r"names 2 files; a labelled input is one file"):
        read_labelled(str(tmp_path / "d.*"), _cfg())


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


def test_split_keeps_near_duplicates_together():
    """Texts equal after normalisation (traditional/simplified, full-width) never straddle splits, so the
    finetune contamination count (also on normalised text) is 0 for a split file."""
    from tasks.common.text import normalize_text
    from tasks.finetune.baseline import contamination

    rng = np.random.default_rng(1)
    variants = ["這個酒店很好{}", "这个酒店很好{}", "这个酒店很好{}".replace("好", "好 ")]
    rows = []
    for i in range(3000):
        k = int(rng.integers(0, 400))
        text = variants[int(rng.integers(0, 3))].format(chr(ord("Ａ") + k % 26) + str(k // 26))
        rows.append({"row_id": i, "text": text, "label": k % 2})
    assert len({r["text"] for r in rows}) > len({normalize_text(r["text"]) for r in rows})
    train, dev, test = split_rows(rows, (0.8, 0.1, 0.1), 7)
    texts = [[r["text"] for r in part] for part in (train, dev, test)]
    assert contamination(texts[0], texts[1]) == contamination(texts[0], texts[2]) == 0
    assert min(map(len, texts)) > 100


