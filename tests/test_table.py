"""tasks.common.table: every format x compression, exact line numbers, per-row reasons, column errors,
glob order, and bounded memory (batches, not files)."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import tracemalloc
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from fsspec.utils import infer_compression

from tasks.common.table import check_columns, expand_inputs, file_columns, file_format, read_batches

ROWS = [("r0", "好评"), ("r1", '带"引号'), ("r2", "多行\n文本"), ("r3", "逗号, 也行"), ("r4", "")]
COLS = {"text": "review", "id": "id"}
COMPRESS = {
    "": lambda b: b,
    ".gz": lambda b: gzip.compress(b, mtime=0),
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
    ".zst": lambda b: zstandard.ZstdCompressor().compress(b),
    ".zip": lambda b: _zip(b),
}


def _zip(data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("inner", data)
    return buf.getvalue()


def _csv(rows, sep=",") -> bytes:
    def q(v: str) -> str:
        return '"' + v.replace('"', '""') + '"' if sep == "," and any(c in v for c in ',"\n') else v

    return ("id" + sep + "review\n" + "".join(q(i) + sep + q(t) + "\n" for i, t in rows)).encode()


def _jsonl(rows) -> bytes:
    return "".join(json.dumps({"id": i, "review": t}, ensure_ascii=False) + "\n" for i, t in rows).encode()


def _parquet(table: pa.Table, **kw) -> bytes:
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, **kw)
    return buf.getvalue().to_pybytes()


def _read(path, columns=COLS, batch_rows=2, **kw) -> dict:
    batches = list(read_batches(str(path), columns, batch_rows, **kw))
    flat = {k: [v for b in batches for v in getattr(b, k)] for k in ("lines", "bad", "raw")}
    flat["values"] = {r: [v for b in batches for v in b.values[r]] for r in batches[0].values} if batches else {}
    flat["batches"] = batches
    return flat


# ----------------------------------------------------------------------------- formats x compression


@pytest.mark.parametrize("suffix", list(COMPRESS))
@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_every_text_format_and_compression_reads_the_same_records(tmp_path, fmt, suffix):
    rows = [r for r in ROWS if not (fmt == "tsv" and "\n" in r[1])]  # TSV has no quoting: no newlines in values
    data = {"csv": _csv, "tsv": lambda r: _csv(r, "\t"), "jsonl": _jsonl}[fmt](rows)
    p = tmp_path / f"in.{fmt}{suffix}"
    p.write_bytes(COMPRESS[suffix](data))
    got = _read(p)
    assert got["values"] == {"text": [t for _, t in rows], "id": [i for i, _ in rows]}
    assert got["bad"] == [None] * len(rows)
    first = 1 if fmt == "jsonl" else 2  # CSV/TSV: line 1 is the header
    lines = [first]
    for _, t in rows[:-1]:
        lines.append(lines[-1] + 1 + (t.count("\n") if fmt == "csv" else 0))
    assert got["lines"] == lines
    assert [len(b) for b in got["batches"]] == [2] * (len(rows) // 2) + [1] * (len(rows) % 2)


def test_parquet_rows_nulls_ints_bools_and_string_cast(tmp_path):
    p = tmp_path / "t.parquet"
    p.write_bytes(_parquet(pa.table({"id": [7, 8, None], "review": ["a", None, "c"], "flag": [True, False, None]})))
    got = _read(p, {"text": "review", "id": "id", "label": "flag"})
    assert got["lines"] == [1, 2, 3] and got["bad"] == [None] * 3
    assert got["values"] == {"text": ["a", None, "c"], "id": [7, 8, None], "label": [True, False, None]}
    cast = _read(p, {"text": "review", "id": "id"}, as_strings=True)["values"]
    assert cast == {"text": ["a", None, "c"], "id": ["7", "8", None]}
    assert file_columns(str(p)) == ["id", "review", "flag"]


# ----------------------------------------------------------------------------- lines and reasons


def test_csv_line_numbers_and_reasons(tmp_path):
    p = tmp_path / "x.csv"
    p.write_bytes(
        b"\xef\xbb\xbfid,review\r\n"  # 1: BOM + CRLF header
        b'a,"two\r\nlines"\r\n'  # 2-3: a quoted CRLF stays in the value
        b"\r\n"  # 4: blank: not a record
        b"b,x,extra\n"  # 5: three fields
        b"c,\xff\xfe bad\n"  # 6: not UTF-8: rejected whole, never parsed
        b"d,bare\rcr\n"  # 7: a bare CR outside quotes
        b'e,"q\n\nq"\n'  # 8-10: blank line inside quotes is part of the value
        b"f,last"  # 11: no final newline
    )
    got = _read(p, batch_rows=3)
    assert got["lines"] == [2, 5, 6, 7, 8, 11]
    assert got["bad"] == [None, "bad_columns", "undecodable", "bad_columns", None, None]
    assert got["values"]["text"] == ["two\r\nlines", None, None, None, "q\n\nq", "last"]
    assert got["values"]["id"] == ["a", None, None, None, "e", "f"]
    assert got["raw"][1:3] == ["b,x,extra", "c,\ufffd\ufffd bad"]
    assert "new-line character" in got["raw"][3]
    assert [b.start for b in got["batches"]] == [0, 3]


def test_tsv_quotes_are_text(tmp_path):
    p = tmp_path / "x.tsv"
    p.write_text('id\treview\n1\t"引号开头\n2\t他说"好"\n3\ta\tb\n', encoding="utf-8")
    got = _read(p)
    assert got["values"]["text"] == ['"引号开头', '他说"好"', None] and got["lines"] == [2, 3, 4]
    assert got["bad"] == [None, None, "bad_columns"] and got["raw"][2] == "3\ta\tb"


def test_jsonl_reasons_and_blank_lines(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"review": "a"}\n\n  \n[1]\n{bad\n{"review": "\xff"}\n\xff\n{"other": 1}\r\n{"review": 5, "id": 2}')
    got = _read(p, batch_rows=4)
    assert got["lines"] == [1, 4, 5, 6, 7, 8, 9]
    assert got["bad"] == [None, "invalid_json", "invalid_json", "undecodable", "undecodable", None, None]
    assert got["values"] == {"text": ["a", None, None, None, None, None, 5], "id": [None] * 6 + [2]}
    assert got["raw"][1:5] == ["[1]", "{bad", '{"review": "\ufffd"}', "\ufffd"]


# ----------------------------------------------------------------------------- columns, inputs


def test_missing_column_errors_name_file_column_and_columns(tmp_path):
    (tmp_path / "a.csv").write_text("id,comment\n1,x\n", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"title": "x"}\n{"title": "y", "body": "z"}\n', encoding="utf-8")
    (tmp_path / "c.parquet").write_bytes(_parquet(pa.table({"n": [1]})))
    (tmp_path / "d.jsonl").write_text('{"title": "x"}\n{"review": "y"}\n', encoding="utf-8")
    for name, have in (("a.csv", "['id', 'comment']"), ("b.jsonl", "['body', 'title']"), ("c.parquet", "['n']")):
        with pytest.raises(ValueError) as e:
            _read(tmp_path / name, {"text": "review"})
        assert str(e.value) == f"{tmp_path / name}: text column 'review' not found; the file has columns {have}"
    # JSON lines: a column is there when any record has it (rows without it read None)
    assert _read(tmp_path / "d.jsonl", {"text": "review"})["values"]["text"] == [None, "y"]
    sources = expand_inputs(str(tmp_path / "*.jsonl"))
    with pytest.raises(ValueError, match=r"b\.jsonl: id column 'key' not found; the file has columns "
                                         r"\['title', 'body'\]"):
        check_columns(sources, {"text": "title", "id": "key"})  # the up-front check: every record's keys
    check_columns(sources, {"text": "title", "id": None})
    # a first record without the column does not decide for the file: d.jsonl's second record has it
    check_columns(expand_inputs(str(tmp_path / "d.jsonl")), {"text": "review"})
    assert file_columns(str(tmp_path / "d.jsonl")) == ["title", "review"]


def test_empty_files_header_and_json_array(tmp_path):
    (tmp_path / "e.csv").write_bytes(b"")
    assert file_columns(str(tmp_path / "e.csv")) is None and _read(tmp_path / "e.csv")["lines"] == []
    with pytest.raises(ValueError, match=r"e\.csv: empty file; expected a header line naming the columns \['review'\]"):
        list(read_batches(str(tmp_path / "e.csv"), {"text": "review"}, header_required=True))
    (tmp_path / "h.csv").write_bytes(b"id,\xffreview\n1,x\n")
    with pytest.raises(ValueError, match=r"h\.csv: line 1 \(the header\) is not valid UTF-8"):
        list(read_batches(str(tmp_path / "h.csv"), {"text": "review"}))
    (tmp_path / "arr.json").write_text('\n[{"review": "x"}]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"arr\.json: line 2 looks like a JSON array"):
        file_columns(str(tmp_path / "arr.json"))
    with pytest.raises(ValueError, match="batch_rows must be >= 1"):
        list(read_batches(str(tmp_path / "e.csv"), {"text": "review"}, 0))


def test_formats_from_names():
    assert [file_format(n) for n in ("a.CSV", "a.csv.gz", "b.tab.zst", "c.ndjson.bz2", "d.json", "e.pq")] == [
        "csv", "csv", "tsv", "jsonl", "jsonl", "parquet",
    ]
    assert file_format("notes.txt", "tsv") == "tsv"
    with pytest.raises(ValueError, match=r"notes\.txt: cannot tell the format from '\.txt'; expected one of"):
        file_format("notes.txt")
    if not infer_compression("a.csv.lz4"):
        with pytest.raises(ValueError, match=r"a\.csv\.lz4: '\.lz4' compression is not available"):
            file_format("a.csv.lz4")


def test_glob_order_names_and_lists(tmp_path):
    for rel in ("b/x.csv", "a/x.csv", "a/c.csv", "a/sub/z.csv"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(_csv(ROWS[:1]))
    srcs = expand_inputs(str(tmp_path / "*/*.csv"))
    assert [s.name for s in srcs] == ["a/c.csv", "a/x.csv", "b/x.csv"]  # sorted; shared base names -> relative
    assert all(s.uri.endswith(s.name) for s in srcs)
    listed = expand_inputs([str(tmp_path / "b/x.csv"), str(tmp_path / "a/c.csv")])
    assert [s.name for s in listed] == ["x.csv", "c.csv"] and listed[0].uri == str(tmp_path / "b/x.csv")
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_inputs(str(tmp_path / "*.parquet"))
    with pytest.raises(ValueError, match="is a directory; pass a glob"):
        expand_inputs(str(tmp_path / "a"))


# ----------------------------------------------------------------------------- bounded memory


@pytest.mark.parametrize("name", ["big.csv", "big.jsonl.gz", "big.parquet"])
def test_streams_in_bounded_batches_and_memory(tmp_path, name):
    n = 60_000
    rows = [(f"r{i}", f"第{i}条评论，" + "好" * (i % 40)) for i in range(n)]
    p = tmp_path / name
    if name.endswith(".parquet"):
        table = pa.table({"id": [i for i, _ in rows], "review": [t for _, t in rows]})
        p.write_bytes(_parquet(table, row_group_size=2000))
    else:
        p.write_bytes(_csv(rows) if name.endswith(".csv") else gzip.compress(_jsonl(rows), mtime=0))
    size = len(_csv(rows))  # ~ the decoded size
    tracemalloc.start()
    try:
        count, starts, first_done, it = 0, [], None, read_batches(str(p), COLS, 256)
        for b in it:
            assert len(b) <= 256 and len(b.values["text"]) == len(b.lines) == len(b)
            starts.append(b.start)
            first_done = b.done if first_done is None else first_done
            count += len(b)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == n and starts == list(range(0, n, 256))
    assert first_done < 0.5  # the first batch came before most of the file was read
    assert peak < size / 5, f"peak {peak} bytes for a {size}-byte table: the reader held more than a batch"
