"""The one streaming table reader: CSV, TSV, JSON lines or Parquet -> batches of records with per-row reasons.

Inputs are fsspec URLs, globs (expanded in sorted order) or lists of them; the format comes from the
name (``.csv``, ``.tsv``/``.tab``, ``.jsonl``/``.ndjson``/``.json``, ``.parquet``/``.pq``) behind any
compression suffix fsspec infers (``.gz``, ``.bz2``, ``.xz``, ``.zst``, ``.zip``, ``.lz4`` where
installed). A file is streamed: at most ``batch_rows`` records are held at a time, never its bytes.

Records, and how each is numbered (``line``, 1-based, of where the record starts; Parquet: row):

* CSV: RFC 4180 quoting (quoted values may hold newlines; ``\\r\\n`` inside quotes is kept),
  a header row is required, blank lines are not records. TSV: no quoting at all (a ``"`` is text).
  A line that is not valid UTF-8 is rejected whole as ``undecodable`` and never parsed (inside a
  quoted value the record goes on without it, as the fine-tuning reader always did); a record
  with another field count than the header, or one the csv module refuses (a bare ``\\r`` outside
  quotes), is ``bad_columns``.
* JSON lines: one object per non-blank line; ``undecodable`` or ``invalid_json`` (not an object).
  A key a record lacks reads as None.
* Parquet: one record per row; nothing is rejected by the reader.

A UTF-8 byte-order mark at the start of a text file is dropped. Lines are split on ``\\n`` only.
A column that the header/schema lacks (JSON lines: that no record of the file has) raises a
ValueError naming the file, the column and the columns that exist.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import posixpath
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.utils import infer_compression

from storage.archives import check_regular_member
from storage.artifacts import fingerprint as content_fingerprint
from storage.fingerprints import FingerprintCache
from storage.urls import has_secret_parts, public_url, url_digest
from tasks.common.rejects import BAD_COLUMNS, INVALID_JSON, UNDECODABLE

READ_ROWS = 4096  # records per batch (the reader's memory bound)
FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".tab": "tsv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
# compression suffixes fsspec knows when the codec's package is installed
_CODECS = {".gz", ".bz2", ".xz", ".lzma", ".zst", ".lz4", ".zip", ".sz", ".snappy"}
_BOM = b"\xef\xbb\xbf"
_MAX_KEYS = 1000  # JSON-lines keys remembered for the missing-column message
_Record = tuple[int, "tuple | None", "str | None", "str | None"]  # line, values (None: bad), reason, raw text


@dataclass(frozen=True)
class Source:
    """One input file: where it is, its format, the name used in row ids, its size, its URI as given (without
    userinfo or query string: :func:`storage.urls.public_url`)."""

    fs: Any
    path: str
    fmt: str
    name: str
    size: int
    uri: str

    def fingerprint(self, cache: FingerprintCache | None = None) -> dict[str, Any]:
        """Identify the file by its bytes (``storage.artifacts.fingerprint``), name and format; the
        directory is not part of it, so moving the inputs keeps a version computed from it. With ``cache`` (a run's
        fingerprint cache beside its store) an unchanged local file is not read again."""
        return {"name": self.name, "format": self.fmt, **content_fingerprint(self.fs, self.path, cache)}


@dataclass
class Batch:
    """At most ``batch_rows`` consecutive records of one file."""

    start: int  # 0-based index (in the file) of the first record
    lines: list[int]  # per record: 1-based line where it starts (Parquet: 1-based row)
    values: dict[str, list[Any]]  # role -> raw value per record (None when absent or bad)
    bad: list[str | None]  # per record: the reader's reject reason, None for a readable record
    raw: list[str | None]  # per record: the text of a bad record (its line, or the parse error)
    done: float  # fraction of the file consumed after this batch (progress only)

    def __len__(self) -> int:
        return len(self.lines)


def file_format(path: str, fmt: str = "auto") -> str:
    """Format from the name, a compression suffix ignored: ``a.csv.gz`` -> ``csv`` (``fmt`` overrides)."""
    if fmt != "auto":
        return fmt
    base = posixpath.basename(path.split("?")[0])
    ext = posixpath.splitext(base)[1].lower()
    if infer_compression(base):
        base = posixpath.splitext(base)[0]
    elif ext in _CODECS:
        raise ValueError(f"{path}: {ext!r} compression is not available here (install the codec's package)")
    ext = posixpath.splitext(base)[1].lower()
    if ext not in FORMATS:
        what = ext or "no extension"
        raise ValueError(f"{path}: cannot tell the format from {what!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[ext]


def expand_inputs(input_uri: str | Sequence[str], fmt: str = "auto") -> list[Source]:
    """Every input file, globs expanded in sorted order. Names (for row ids) are base names, or paths
    relative to the inputs' common directory when two inputs share a base name; a URL with a query string or
    userinfo is named by its base name and a digest of the whole URL, ``x.csv#<12 hex>`` (:mod:`storage.urls`)."""
    uris = [input_uri] if isinstance(input_uri, str) else list(input_uri)
    found: list[tuple[Any, str, str]] = []
    for u in uris:
        fs, path = fsspec.core.url_to_fs(u)
        shown = public_url(u)  # never a credential in a message, a row id or a manifest
        if not has_secret_parts(u) and any(c in path for c in "*?["):  # a query string's "?" is not a glob
            paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
            if not paths:
                raise FileNotFoundError(f"input {u!r} matches no file")
            found.extend((fs, p, fs.unstrip_protocol(p)) for p in paths)
            continue
        if not fs.exists(path):
            raise FileNotFoundError(f"input {shown!r}: no such file")
        if fs.isdir(path):
            raise ValueError(f"input {shown!r} is a directory; pass a glob such as {shown.rstrip('/')}/*.csv")
        check_regular_member(fs, path, f"input {shown!r}")
        found.append((fs, path, u))
    base = [posixpath.basename(p) for _, p, _ in found]
    if len(set(base)) < len(base):
        common = posixpath.commonpath([posixpath.dirname(p) for _, p, _ in found])
        base = [posixpath.relpath(p, common) for _, p, _ in found]
    # a URL with a query string or userinfo: its public base name plus a digest of the whole URL (two query
    # strings may name two files); plain paths and URLs keep the names above
    out = []
    for (fs, p, u), name in zip(found, base):
        if has_secret_parts(u):
            first_link = public_url(u).split("::", 1)[0].rstrip("/")
            name = f"{posixpath.basename(first_link)}#{url_digest(u)}"
        out.append(Source(fs, p, file_format(public_url(u) if has_secret_parts(u) else p, fmt), name,
                          int(fs.size(p) or 0), public_url(u)))
    return out


def _one(src: Source | str) -> Source:
    if isinstance(src, Source):
        return src
    found = expand_inputs(src)
    if len(found) != 1:
        raise ValueError(f"{src!r} names {len(found)} files; expected one")
    return found[0]


# ----------------------------------------------------------------------------- opening, lines


@contextlib.contextmanager
def _open_text(src: Source) -> Iterator[tuple[Any, Callable[[], float]]]:
    """(decompressed binary stream that iterates lines, fraction-consumed function)."""
    of = fsspec.core.OpenFile(src.fs, src.path, "rb", compression=infer_compression(src.path))
    with of as f:
        raw = of.fobjects[0]

        def done() -> float:
            try:
                return min(1.0, raw.tell() / src.size) if src.size else 1.0
            except Exception:  # a stream that cannot tell: progress is only a hint
                return 0.0

        # zstd's reader is not an io stream (no readline): buffer it
        yield (f if isinstance(f, io.IOBase) else io.BufferedReader(f, 1 << 16)), done


def _numbered(f) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes with its ``\\n``), the BOM of line 1 dropped."""
    for n, raw in enumerate(f, start=1):
        if n == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        yield n, raw


def _require(src: Source, roles: Mapping[str, str], have: Sequence[str]) -> None:
    for role, col in roles.items():
        if col not in have:
            raise ValueError(f"{src.uri}: {role} column {col!r} not found; the file has columns {list(have)}")


# ----------------------------------------------------------------------------- CSV / TSV


class _Delimited:
    """A csv reader over the decodable lines of a file, remembering which lines it took.

    ``taken`` holds the line numbers the reader consumed since it was last cleared (the csv module
    reads exactly the lines of one record per call), ``skipped`` the undecodable lines not yet
    reported. Lines keep their own ending, so ``\\r\\n`` inside a quoted value stays as written."""

    def __init__(self, src: Source, f):
        csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
        self.src = src
        self.delimiter = "\t" if src.fmt == "tsv" else ","
        self.taken: list[int] = []
        self.skipped: deque[tuple[int, str]] = deque()
        kw: dict[str, Any] = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if src.fmt == "tsv" else {"delimiter": ","}
        self.reader = csv.reader(self._lines(f), **kw)

    def _lines(self, f) -> Iterator[str]:
        for n, raw in _numbered(f):
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError:
                if n == 1:
                    raise ValueError(f"{self.src.uri}: line 1 (the header) is not valid UTF-8") from None
                body = raw[:-1] if raw.endswith(b"\n") else raw
                self.skipped.append((n, (body[:-1] if body.endswith(b"\r") else body).decode("utf-8", "replace")))
                continue
            self.taken.append(n)
            yield s if s.endswith("\n") else s + "\n"

    def header(self) -> list[str] | None:
        try:
            return next(self.reader, None)
        except csv.Error as e:
            line = self.taken[0] if self.taken else 1
            raise ValueError(f"{self.src.uri}: line {line}: cannot read the header: {e}") from e

    def records(self, header: list[str], cols: Sequence[str]) -> Iterator[_Record]:
        """(line, values of ``cols`` | None, reason | None, raw text | None) per record, in line order."""
        idx = [header.index(c) for c in cols]
        while True:
            self.taken.clear()
            try:
                fields = next(self.reader)
            except StopIteration:
                break
            except csv.Error as e:
                rec = (self.taken[0] if self.taken else -1, None, BAD_COLUMNS, str(e))
            else:
                if not fields:  # a blank line: not a record
                    continue
                if len(fields) != len(header):
                    rec = (self.taken[0], None, BAD_COLUMNS, self.delimiter.join(fields))
                else:
                    rec = (self.taken[0], tuple(fields[i] for i in idx), None, None)
            while self.skipped and self.skipped[0][0] < rec[0]:
                n, text = self.skipped.popleft()
                yield n, None, UNDECODABLE, text
            yield rec
        while self.skipped:
            n, text = self.skipped.popleft()
            yield n, None, UNDECODABLE, text


# ----------------------------------------------------------------------------- JSON lines


def _jsonl_records(src: Source, f, roles: Mapping[str, str]) -> Iterator[_Record]:
    cols = list(roles.values())
    missing, keys, parsed = set(cols), set(), False
    for n, raw in _numbered(f):
        raw = raw.rstrip(b"\n").rstrip(b"\r")
        if not raw.strip():
            continue  # blank lines are not records
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield n, None, UNDECODABLE, raw.decode("utf-8", "replace")
            continue
        try:
            obj = json.loads(s)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            yield n, None, INVALID_JSON, s
            continue
        parsed = True
        missing.difference_update(obj)
        if len(keys) < _MAX_KEYS:
            keys.update(obj)
        yield n, tuple(obj.get(c) for c in cols), None, None
    if parsed and missing:  # a column no record has is a configuration error, not bad rows
        _require(src, roles, sorted(keys))


# ----------------------------------------------------------------------------- Parquet


def _pylist(col: pa.Array, as_strings: bool) -> list[Any]:
    if as_strings:
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            with contextlib.suppress(pa.ArrowInvalid, pa.ArrowNotImplementedError):
                col = col.cast(pa.string())  # else left as is: the caller rejects non-strings
    return col.to_pylist()


def _parquet_file(src: Source, f, **kw):
    """``pq.ParquetFile`` of ``src``, or a ValueError that names the file (pyarrow's own message does not: an
    empty file says only "Parquet file size is 0 bytes")."""
    try:
        return pq.ParquetFile(f, **kw)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{src.uri}: not a readable Parquet file ({e})") from e


@contextlib.contextmanager
def _open_parquet(src: Source) -> Iterator[Any]:
    """A seekable binary file of the Parquet bytes. A compressed Parquet file (``x.parquet.gz``) cannot be read
    in place (Parquet seeks to its footer): it is decompressed, streamed, into a temporary file first."""
    codec = infer_compression(src.path)
    if codec is None:
        with src.fs.open(src.path, "rb") as f:
            yield f
        return
    of = fsspec.core.OpenFile(src.fs, src.path, "rb", compression=codec)
    with of as f, tempfile.TemporaryFile() as tmp:
        shutil.copyfileobj(f, tmp, 1 << 20)
        tmp.seek(0)
        yield tmp


def _parquet_batches(src: Source, roles: Mapping[str, str], batch_rows: int, as_strings: bool) -> Iterator[Batch]:
    with _open_parquet(src) as f:
        # pre_buffer (pyarrow's default) would read whole row groups' column chunks up front
        pf = _parquet_file(src, f, pre_buffer=False, buffer_size=1 << 20)
        _require(src, roles, pf.schema_arrow.names)
        total, row = pf.metadata.num_rows, 0
        for rb in pf.iter_batches(batch_size=batch_rows, columns=list(dict.fromkeys(roles.values()))):
            n = rb.num_rows
            values = {role: _pylist(rb.column(col), as_strings) for role, col in roles.items()}
            yield Batch(row, list(range(row + 1, row + n + 1)), values, [None] * n, [None] * n, (row + n) / total)
            row += n


# ----------------------------------------------------------------------------- public


def file_columns(src: Source | str) -> list[str] | None:
    """A file's columns: the CSV/TSV header, the Parquet schema, or every key of the JSON-lines objects among its
    first 1000 non-blank lines, in the order first met (records need not share their keys: a record without a
    column reads None for it); None for a file without any (empty)."""
    src = _one(src)
    if src.fmt == "parquet":
        with _open_parquet(src) as f:
            return list(_parquet_file(src, f).schema_arrow.names)
    with _open_text(src) as (f, _):
        if src.fmt in ("csv", "tsv"):
            return _Delimited(src, f).header()
        seen, keys, found = 0, {}, False
        for n, line in _numbered(f):
            if not line.strip():
                continue
            if seen == 0 and line.lstrip().startswith(b"["):
                raise ValueError(f"{src.uri}: line {n} looks like a JSON array; expected one JSON object per line")
            with contextlib.suppress(ValueError, RecursionError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    found = True
                    if len(keys) < _MAX_KEYS:
                        keys.update(dict.fromkeys(rec))
            seen += 1
            if seen >= 1000:
                break
    return list(keys) if found else None


def check_columns(sources: Sequence[Source], columns: Mapping[str, str | None]) -> None:
    """One clear error, before any row is read, when a file lacks a column (``{role: name}``;
    None names are skipped). Files without columns (:func:`file_columns` is None) pass."""
    roles = {r: c for r, c in columns.items() if c is not None}
    for src in sources:
        have = file_columns(src)
        if have is not None:
            _require(src, roles, have)


def _is_text_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)
            or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(t)))


def check_text_column(sources: Sequence[Source], column: str) -> None:
    """One clear error, before any row is read, when a Parquet file's ``column`` is typed as something other than
    text (an integer, a float, a list): it would otherwise be cast to strings and scored. CSV values are always
    text, and a JSON-lines value that is not a string is a row's ``not_a_string`` reject."""
    for src in sources:
        if src.fmt != "parquet":
            continue
        with _open_parquet(src) as f:
            schema = pq.ParquetFile(f).schema_arrow
        if column in schema.names and not _is_text_type(t := schema.field(column).type):
            raise ValueError(f"{src.uri}: text column {column!r} holds {t}, not text; name a column of strings")


def read_batches(
    src: Source | str,
    columns: Mapping[str, str | None],
    batch_rows: int = READ_ROWS,
    *,
    as_strings: bool = False,
    header_required: bool = False,
) -> Iterator[Batch]:
    """Stream one file as :class:`Batch` es of at most ``batch_rows`` records.

    ``columns`` maps a role to a column name (``{"text": "review", "id": None}``; None roles are not
    read); ``Batch.values`` is keyed by role. CSV values are strings, JSON values keep their JSON
    type, Parquet values their Arrow type, or strings where Arrow can cast with ``as_strings``.
    A CSV/TSV file of 0 bytes has no records, or raises with ``header_required``."""
    src = _one(src)
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    roles = {r: c for r, c in columns.items() if c is not None}
    if src.fmt == "parquet":
        yield from _parquet_batches(src, roles, batch_rows, as_strings)
        return
    with _open_text(src) as (f, done):
        if src.fmt == "jsonl":
            records = _jsonl_records(src, f, roles)
        else:
            reader = _Delimited(src, f)
            header = reader.header()
            if header is None:
                if header_required:
                    want = list(roles.values())
                    raise ValueError(f"{src.uri}: empty file; expected a header line naming the columns {want}")
                return
            _require(src, roles, header)
            records = reader.records(header, list(roles.values()))
        start = 0
        while chunk := list(islice(records, batch_rows)):
            lines, vals, bad, raw = (list(x) for x in zip(*chunk))
            values = {r: [None if v is None else v[k] for v in vals] for k, r in enumerate(roles)}
            yield Batch(start, lines, values, bad, raw, 1.0 if len(chunk) < batch_rows else done())
            start += len(chunk)
