"""Corpus readers: stream wiki dumps (JSON lines, ``<doc>`` blocks, plain text, MediaWiki XML) as documents or
located rejects.

Readers stream any fsspec URL (``.gz``/``.bz2``/``.zst`` inferred) and yield either a parsed
:class:`Doc` or a :class:`Reject` with its source location (1-based line).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from typing import Any

import fsspec

from storage.archives import check_regular_member
from tasks.common.rejects import (
    EMPTY_TEXT,
    INVALID_JSON,
    INVALID_UNICODE,
    LINE_TOO_LONG,
    MISSING_TEXT,
    OUTSIDE_DOC,
    SNIPPET,
    STRAY_CLOSE_TAG,
    UNDECODABLE,
    UNTERMINATED_DOC,
)
from tasks.common.text import replace_invalid, valid_unicode
from tasks.prepare import wikidump
from tasks.prepare.config import CleanConfig
from tasks.prepare.records import Doc, Reject


def corpus_files(corpus_uri: str | list[str]) -> list[str]:
    """Every corpus file, in a stable (sorted) order; globs allowed (the files' names and bytes, not their
    directory, are part of the clean version)."""
    uris = [corpus_uri] if isinstance(corpus_uri, str) else list(corpus_uri)
    files: list[str] = []
    for u in uris:
        opened = fsspec.open_files(u, "rb")
        for f in opened:  # a link inside an archive is refused before any work (storage.archives)
            check_regular_member(f.fs, f.path, f"corpus_uri {u!r}")
        found = sorted(f.full_name for f in opened)
        if len(found) > 1:  # a glob over a dump's folder: its multistream index is not a corpus file
            found = [f for f in found if not wikidump.is_index_file(f)]
        if not found:
            raise FileNotFoundError(f"corpus_uri {u!r} matches no file")
        files.extend(found)
    return files


class _Chunks(io.RawIOBase):
    """Any readable object (``read(n)`` is all it needs) as a raw stream, so :class:`io.BufferedReader` can give it
    a bounded ``readline(size)``: fsspec's remote files (s3, gs, http) take no size, and zstd readers have no
    ``readline`` at all."""

    def __init__(self, f):
        self.f = f

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(len(b))
        b[: len(data)] = data
        return len(data)


def line_reader(f) -> io.BufferedReader:
    """``f`` (binary, any fsspec file) behind a buffer whose ``readline(size)`` stops at ``size`` bytes."""
    return io.BufferedReader(_Chunks(f), 1 << 16)


def iter_lines(f, source: str, max_line_bytes: int) -> Iterator[tuple[int, str | None, str | None]]:
    """Yield (lineno, text, reject_reason) from a binary stream with bounded memory.

    A line over ``max_line_bytes`` is consumed in chunks and reported as ``line_too_long``;
    invalid UTF-8 is reported as ``undecodable``.
    """
    lineno = 0
    while True:
        raw = f.readline(max_line_bytes + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
            head = raw[:SNIPPET]
            while raw and not raw.endswith(b"\n"):  # drain the rest of the line
                raw = f.readline(1 << 20)
            yield lineno, head.decode("utf-8", "replace"), LINE_TOO_LONG
            continue
        try:
            yield lineno, raw.decode("utf-8").rstrip("\r\n"), None
        except UnicodeDecodeError:
            yield lineno, raw[:SNIPPET].decode("utf-8", "replace"), UNDECODABLE


def detect_format(first_line: str) -> str:
    """The input format a file's first non-blank line shows: ``jsonl``, ``wikiextractor_doc`` or ``text``."""
    s = first_line.lstrip("\ufeff").lstrip()
    if s.startswith("{"):
        return "jsonl"
    if s.startswith("<doc"):
        return "wikiextractor_doc"
    return "text"


_DOC_OPEN = re.compile(r"<doc\b([^>]*)>")
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def read_records(uri: str, cfg: CleanConfig, name: str | None = None,
                 piece: dict[str, Any] | None = None) -> Iterator[Doc | Reject]:
    """Stream one input file: wiki2019zh / WikiExtractor ``--json`` lines, ``<doc>`` blocks, text, or a
    MediaWiki XML dump (:mod:`tasks.prepare.wikidump`; ``piece``: one group of a multistream dump's streams).

    Records name their file ``name`` (``source``, and the ``name:line`` id of a record without one); the
    clean stage passes a name that does not depend on the file's directory (``input_names``), so where the
    corpus lies never reaches its data. Default: ``uri``."""
    if piece is not None or wikidump.is_dump(uri, cfg):
        yield from wikidump.read_dump(uri, cfg, name, piece)
        return
    label = name or uri
    with fsspec.open(uri, "rb", compression="infer") as f:
        lines = iter_lines(line_reader(f), label, cfg.max_line_bytes)
        fmt = cfg.input_format
        pending: list[tuple[int, str | None, str | None]] = []
        if fmt == "auto":
            fmt = "text"
            for item in lines:
                pending.append(item)
                if item[2] is None and item[1] and item[1].strip():
                    fmt = detect_format(item[1])
                    break
        stream = _chain(pending, lines)
        if fmt == "jsonl":
            yield from _read_jsonl(stream, label)
        elif fmt == "wikiextractor_doc":
            yield from _read_doc_blocks(stream, label)
        else:
            yield from _read_text(stream, label)


def _chain(first, rest):
    yield from first
    yield from rest


def _read_jsonl(lines, uri: str) -> Iterator[Doc | Reject]:
    for lineno, text, bad in lines:
        if bad:
            yield Reject(uri, lineno, bad, text or "")
            continue
        if not text.strip():
            continue  # blank separator lines are not records
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield Reject(uri, lineno, INVALID_JSON, f"{e.msg} at column {e.colno}: {text[:SNIPPET]}")
            continue
        if not isinstance(obj, dict):
            yield Reject(uri, lineno, INVALID_JSON, f"expected an object, got {type(obj).__name__}")
            continue
        doc_id = str(obj.get("id", f"{uri}:{lineno}"))
        body = obj.get("text")
        if not valid_unicode(doc_id) or (isinstance(body, str) and not valid_unicode(body)):
            # a "\ud800" escape decodes to a lone surrogate: no text (and no Parquet string) can be made of it
            shown = body[:SNIPPET] if isinstance(body, str) else ""
            yield Reject(uri, lineno, INVALID_UNICODE, replace_invalid(shown), replace_invalid(doc_id))
            continue
        if not isinstance(body, str):
            keys = replace_invalid(",".join(map(str, obj)))
            yield Reject(uri, lineno, MISSING_TEXT, "no string 'text' field; keys: " + keys, doc_id)
            continue
        if not body.strip():
            yield Reject(uri, lineno, EMPTY_TEXT, "", doc_id)
            continue
        title = obj.get("title")
        if isinstance(title, str) and title.strip():
            first, _, rest = body.partition("\n")
            if first.strip() == title.strip():  # WikiExtractor --json repeats the title as line one
                body = rest
        yield Doc(uri, lineno, doc_id, ((lineno, body),))


def _read_doc_blocks(lines, uri: str) -> Iterator[Doc | Reject]:
    cur: dict[str, Any] | None = None
    for lineno, text, bad in lines:
        if bad:
            yield Reject(uri, lineno, bad, text or "", cur["id"] if cur else "")
            continue
        m = _DOC_OPEN.match(text.strip())
        if m:
            if cur is not None:
                yield Reject(
                    uri, cur["line"], UNTERMINATED_DOC, f"<doc> opened here, next <doc> at line {lineno}", cur["id"]
                )
            attrs = dict(_ATTR.findall(m.group(1)))
            cur = {"id": attrs.get("id", f"{uri}:{lineno}"), "line": lineno, "paras": [], "title": attrs.get("title")}
            continue
        if text.strip() == "</doc>":
            if cur is None:
                yield Reject(uri, lineno, STRAY_CLOSE_TAG, "</doc> without <doc>")
                continue
            paras = [(ln, t) for ln, t in cur["paras"] if t.strip()]
            if paras and cur["title"] and paras[0][1].strip() == cur["title"].strip():
                paras = paras[1:]  # WikiExtractor repeats the title as the first line
            if not paras:
                yield Reject(uri, cur["line"], EMPTY_TEXT, "", cur["id"])
            else:
                yield Doc(uri, cur["line"], cur["id"], tuple(paras))
            cur = None
            continue
        if cur is None:
            if text.strip():
                yield Reject(uri, lineno, OUTSIDE_DOC, text[:SNIPPET])
            continue
        cur["paras"].append((lineno, text))
    if cur is not None:
        yield Reject(uri, cur["line"], UNTERMINATED_DOC, "<doc> not closed before end of file", cur["id"])


def _read_text(lines, uri: str) -> Iterator[Doc | Reject]:
    """Plain text: a document is a run of non-blank lines; blank lines separate documents."""
    paras: list[tuple[int, str]] = []
    for lineno, text, bad in lines:
        if bad:
            yield Reject(uri, lineno, bad, text or "")
            continue
        if text.strip():
            paras.append((lineno, text))
        elif paras:
            yield Doc(uri, paras[0][0], f"{uri}:{paras[0][0]}", tuple(paras))
            paras = []
    if paras:
        yield Doc(uri, paras[0][0], f"{uri}:{paras[0][0]}", tuple(paras))
