"""Labelled sentiment rows for fine-tuning: read (with rejects), split, cap -> :class:`LoadedData`.

One labelled file (``data_uri``, split deterministically) or given ``train_uri``/``dev_uri``
(/``test_uri``) files, CSV/TSV/JSON lines/Parquet on any fsspec URL (compression inferred from the
suffix). A header row is required. Every record is kept or rejected with a reason, so
``in == out + sum(rejected)`` holds; ``row_id`` is the 1-based line where a record starts
(Parquet: its 1-based row number).
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from tasks.common.config import FinetuneConfig
from tasks.common.splits import split_rows, subsample

SNIPPET = 200  # characters of text kept in a reject row


@dataclass
class _Rec:
    line: int
    label: Any
    text: Any
    reason: str | None = None  # set for records rejected while parsing


_SUFFIX_FORMAT = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")


def detect_format(uri: str, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    name = posixpath.basename(uri.split("?")[0]).lower()
    for suf in _COMPRESSION_SUFFIXES:
        if name.endswith(suf):
            name = name[: -len(suf)]
    ext = posixpath.splitext(name)[1]
    if ext not in _SUFFIX_FORMAT:
        raise ValueError(f"{uri}: cannot tell the format from {ext or 'no suffix'!r}; set format to csv, tsv, jsonl or parquet")
    return _SUFFIX_FORMAT[ext]


def read_labelled(uri: str, cfg: FinetuneConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read one labelled file -> (rows [{row_id, text, label}], rejects [{source, line, reason, label, text}]).

    Labels must be 0 or 1 after stripping spaces (also int/float/bool 0/1 in JSON/Parquet), else
    ``bad_label``; empty or whitespace-only text -> ``empty_text``; invalid UTF-8 -> ``undecodable``;
    a record with the wrong number of fields -> ``bad_columns``; bad JSON -> ``bad_json``. The label
    is checked before the text. Kept texts are stripped of surrounding whitespace. A missing column
    raises ValueError naming the file, the column and the columns that exist.
    """
    fmt = detect_format(uri, cfg.format)
    cols = (cfg.label_column, cfg.text_column)
    if fmt == "parquet":
        recs = _parquet_records(uri, cols)
    else:
        with fsspec.open(uri, "rb", compression="infer") as f:
            data = f.read()
        if data.startswith(b"\xef\xbb\xbf"):
            data = data[3:]
        recs = _jsonl_records(data, uri, cols) if fmt == "jsonl" else _delimited_records(data, uri, cols, "\t" if fmt == "tsv" else ",")
    rows, rejects = [], []
    for r in recs:
        reason, label, text = r.reason, None, None
        if reason is None:
            label = parse_label(r.label)
            text = r.text.strip() if isinstance(r.text, str) else (None if r.text is None else str(r.text).strip())
            reason = "bad_label" if label is None else ("empty_text" if not text else None)
        if reason is None:
            rows.append({"row_id": r.line, "text": text, "label": label})
        else:
            snippet = r.text if isinstance(r.text, str) else ("" if r.text is None else str(r.text))
            raw_label = None if r.label is None else str(r.label)
            rejects.append({"source": uri, "line": r.line, "reason": reason, "label": raw_label, "text": snippet[:SNIPPET]})
    return rows, rejects


def parse_label(v: Any) -> int | None:
    """0/1 from ' 1', 1, 1.0, True …; None for anything else."""
    if isinstance(v, (bool, np.bool_)):
        return int(v)
    if isinstance(v, (int, np.integer)):
        return int(v) if v in (0, 1) else None
    if isinstance(v, (float, np.floating)):
        return int(v) if v in (0.0, 1.0) else None
    if isinstance(v, str):
        s = v.strip()
        return int(s) if s in ("0", "1") else None
    return None


def _missing_column(uri: str, col: str, have: list[str]) -> ValueError:
    return ValueError(f"{uri}: column {col!r} not found; columns are {have}")


def _check_columns(uri: str, cols: tuple[str, ...], have: list[str]) -> None:
    for c in cols:
        if c not in have:
            raise _missing_column(uri, c, have)


def _parquet_records(uri: str, cols: tuple[str, str]) -> Iterator[_Rec]:
    import pyarrow.parquet as pq

    with fsspec.open(uri, "rb") as f:
        pf = pq.ParquetFile(f)
        _check_columns(uri, cols, pf.schema_arrow.names)
        table = pf.read(columns=list(cols))
    labels, texts = table.column(cols[0]).to_pylist(), table.column(cols[1]).to_pylist()
    return (_Rec(i + 1, lab, txt) for i, (lab, txt) in enumerate(zip(labels, texts)))


def _jsonl_records(data: bytes, uri: str, cols: tuple[str, str]) -> list[_Rec]:
    recs: list[_Rec] = []
    keys: set[str] = set()
    for n, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            continue
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            recs.append(_Rec(n, None, raw.decode("utf-8", "replace"), "undecodable"))
            continue
        try:
            obj = json.loads(s)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            recs.append(_Rec(n, None, s, "bad_json"))
            continue
        keys.update(obj)
        recs.append(_Rec(n, obj.get(cols[0]), obj.get(cols[1])))
    if any(r.reason is None for r in recs):  # a column no record has is a config error, not bad rows
        _check_columns(uri, cols, sorted(keys))
    return recs


def _delimited_records(data: bytes, uri: str, cols: tuple[str, str], delimiter: str) -> list[_Rec]:
    """CSV (standard quoting, quoted newlines allowed) or TSV (no quoting: quotes are text).

    Fast path: pyarrow.csv when the bytes are valid UTF-8 with plain line structure. Otherwise
    (undecodable bytes, blank lines, bare CR, rows with the wrong field count) a line-by-line reader
    that names the line of every bad record. Both give identical results on well-formed files."""
    fast = _delimited_pyarrow(data, uri, cols, delimiter)
    return fast if fast is not None else _delimited_lines(data, uri, cols, delimiter)


def _header(data: bytes, delimiter: str) -> list[str]:
    first = data.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8", "replace")
    if delimiter == "\t":
        return first.split("\t")
    return next(csv.reader([first]), [])


def _delimited_pyarrow(data: bytes, uri: str, cols: tuple[str, str], delimiter: str) -> list[_Rec] | None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    norm = data.replace(b"\r\n", b"\n")
    if b"\r" in norm or b"\n\n" in norm or norm.startswith(b"\n"):
        return None  # bare CR / blank lines: let the line reader keep exact line numbers
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    header = _header(data, delimiter)
    _check_columns(uri, cols, header)
    quoted = delimiter != "\t"
    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if quoted else False, newlines_in_values=quoted),
            convert_options=pacsv.ConvertOptions(
                column_types={c: pa.string() for c in header}, strings_can_be_null=False, quoted_strings_can_be_null=False
            ),
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # e.g. a row with the wrong number of fields
        return None
    if table.column_names != header:
        return None
    n = table.num_rows
    if quoted:  # a record starts after all the newlines inside earlier quoted values
        nl = np.zeros(n, np.int64)
        for c in table.columns:
            nl += pc.count_substring(c, "\n").to_numpy(zero_copy_only=False).astype(np.int64)
        extra = np.concatenate([[0], np.cumsum(nl)[:-1]]) if n else nl
    else:
        extra = np.zeros(n, np.int64)
    lines = (2 + np.arange(n) + extra).tolist()
    labels, texts = table.column(cols[0]).to_pylist(), table.column(cols[1]).to_pylist()
    return [_Rec(ln, lab, txt) for ln, lab, txt in zip(lines, labels, texts)]


def _delimited_lines(data: bytes, uri: str, cols: tuple[str, str], delimiter: str) -> list[_Rec]:
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    bad: list[_Rec] = []
    yielded: list[int] = []  # physical line number of every line handed to the csv reader

    def lines() -> Iterator[str]:
        for n, raw in enumerate(raw_lines, start=1):
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError:
                if n == 1:
                    raise ValueError(f"{uri}: the header line is not valid UTF-8") from None
                bad.append(_Rec(n, None, raw.decode("utf-8", "replace"), "undecodable"))
                continue
            yielded.append(n)
            yield s + "\n"

    kw = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if delimiter == "\t" else {"delimiter": ","}
    reader = csv.reader(lines(), **kw)
    header = next(reader, None)
    if header is None:
        raise ValueError(f"{uri}: empty file, no header row")
    _check_columns(uri, cols, header)
    li, ti = header.index(cols[0]), header.index(cols[1])
    recs: list[_Rec] = []
    while True:
        mark = len(yielded)
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as e:  # e.g. NUL byte
            recs.append(_Rec(yielded[mark] if mark < len(yielded) else -1, None, str(e), "bad_columns"))
            continue
        if not fields:  # blank line: not a record
            continue
        line = yielded[mark]
        if len(fields) != len(header):
            recs.append(_Rec(line, None, delimiter.join(fields), "bad_columns"))
        else:
            recs.append(_Rec(line, fields[li], fields[ti]))
    return sorted(recs + bad, key=lambda r: r.line)


@dataclass
class LoadedData:
    train: list[dict[str, Any]]
    dev: list[dict[str, Any]]
    test: list[dict[str, Any]]
    rejects: list[dict[str, Any]]
    stats: dict[str, Any]  # {"in", "out", "rejected": {reason: n}}; out = valid rows (before caps)
    capped: dict[str, int]  # rows left out by max_train_rows / max_eval_rows, per split


def load_data(cfg: FinetuneConfig) -> LoadedData:
    rejects: list[dict[str, Any]] = []
    if cfg.data_uri:
        rows, rej = read_labelled(cfg.data_uri, cfg)
        rejects += rej
        n_valid = len(rows)
        train, dev, test = split_rows(rows, cfg.split, cfg.split_seed)
    else:
        parts = []
        for uri in (cfg.train_uri, cfg.dev_uri, cfg.test_uri):
            rows, rej = read_labelled(uri, cfg) if uri else ([], [])
            parts.append(rows)
            rejects += rej
        train, dev, test = parts
        n_valid = sum(map(len, parts))
    full = {"train": len(train), "dev": len(dev), "test": len(test)}
    train = subsample(train, cfg.max_train_rows, cfg.split_seed + 1)
    dev = subsample(dev, cfg.max_eval_rows, cfg.split_seed + 2)
    test = subsample(test, cfg.max_eval_rows, cfg.split_seed + 3)
    capped = {k: full[k] - len(v) for k, v in (("train", train), ("dev", dev), ("test", test))}
    rejected = dict(sorted(Counter(r["reason"] for r in rejects).items()))
    stats = {"in": n_valid + len(rejects), "out": n_valid, "rejected": rejected}
    return LoadedData(train, dev, test, rejects, stats, capped)


