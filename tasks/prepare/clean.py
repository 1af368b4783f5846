"""clean: raw wiki dumps -> normalised, filtered, deduplicated sentences with counted rejects.

Readers stream any fsspec URL (``.gz``/``.bz2``/``.zst`` inferred) and yield either a
parsed document or a reject with its source location. Counting unit (``in``): a record
that cannot be parsed counts as one item; a parsed record counts as its sentences (one
item if it yields none). So ``in = out + sum(rejected)`` holds for the whole stage.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from tasks.common.config import CleanConfig
from tasks.common.text import normalize_text  # noqa: F401 - part of this stage's public API

CODE_VERSION = "clean-1"

SENTENCE_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("sent_idx", pa.int32()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("line", pa.int64()),
    ]
)
REJECT_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("line", pa.int64()),
        ("doc_id", pa.string()),
        ("reason", pa.string()),
        ("text", pa.string()),
    ]
)
SNIPPET = 200


_SENT = re.compile(r"[^。！？!?]*[。！？!?]+[”’」』\"')）]*|[^。！？!?]+$")


def split_sentences(text: str) -> list[str]:
    """Split after 。！？!? (plus any closing quotes/brackets); newlines always split."""
    out = []
    for para in text.split("\n"):
        for m in _SENT.finditer(para):
            s = m.group(0).strip()
            if s:
                out.append(s)
    return out


def _is_cjk(ch: str) -> bool:
    return "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf" or "\U00020000" <= ch <= "\U0002ebef"


def cjk_ratio(s: str) -> float:
    chars = [c for c in s if not c.isspace()]
    return sum(map(_is_cjk, chars)) / len(chars) if chars else 0.0


def sentence_reject_reason(s: str, cfg: CleanConfig) -> str | None:
    if len(s) < cfg.min_chars:
        return "too_short"
    if cjk_ratio(s) < cfg.min_cjk_ratio:
        return "low_cjk_ratio"
    return None


def sentence_key(s: str) -> int:
    """64-bit blake2b key (collision odds ~n²/2⁶⁵: about 2e-5 for 30M distinct sentences)."""
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


# ----------------------------------------------------------------------------- readers


@dataclass(frozen=True)
class Doc:
    source: str
    line: int  # 1-based line where the record starts
    doc_id: str
    paragraphs: tuple[tuple[int, str], ...]  # (line, raw text)


@dataclass(frozen=True)
class Reject:
    source: str
    line: int
    reason: str
    text: str
    doc_id: str = ""


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
            yield lineno, head.decode("utf-8", "replace"), "line_too_long"
            continue
        try:
            yield lineno, raw.decode("utf-8").rstrip("\r\n"), None
        except UnicodeDecodeError:
            yield lineno, raw[:SNIPPET].decode("utf-8", "replace"), "undecodable"


def detect_format(first_line: str) -> str:
    s = first_line.lstrip("\ufeff").lstrip()
    if s.startswith("{"):
        return "jsonl"
    if s.startswith("<doc"):
        return "wikiextractor_doc"
    return "text"


_DOC_OPEN = re.compile(r'<doc\b([^>]*)>')
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def read_records(uri: str, cfg: CleanConfig) -> Iterator[Doc | Reject]:
    """Stream one input file: wiki2019zh / WikiExtractor ``--json`` lines, ``<doc>`` blocks or text."""
    with fsspec.open(uri, "rb", compression="infer") as f:
        lines = iter_lines(f, uri, cfg.max_line_bytes)
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
            yield from _read_jsonl(stream, uri)
        elif fmt == "wikiextractor_doc":
            yield from _read_doc_blocks(stream, uri)
        else:
            yield from _read_text(stream, uri)


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
            yield Reject(uri, lineno, "invalid_json", f"{e.msg} at column {e.colno}: {text[:SNIPPET]}")
            continue
        if not isinstance(obj, dict):
            yield Reject(uri, lineno, "invalid_json", f"expected an object, got {type(obj).__name__}")
            continue
        doc_id = str(obj.get("id", f"{uri}:{lineno}"))
        body = obj.get("text")
        if not isinstance(body, str):
            yield Reject(uri, lineno, "missing_text", "no string 'text' field; keys: " + ",".join(map(str, obj)), doc_id)
            continue
        if not body.strip():
            yield Reject(uri, lineno, "empty_text", "", doc_id)
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
                yield Reject(uri, cur["line"], "unterminated_doc", f"<doc> opened here, next <doc> at line {lineno}", cur["id"])
            attrs = dict(_ATTR.findall(m.group(1)))
            cur = {"id": attrs.get("id", f"{uri}:{lineno}"), "line": lineno, "paras": [], "title": attrs.get("title")}
            continue
        if text.strip() == "</doc>":
            if cur is None:
                yield Reject(uri, lineno, "stray_close_tag", "</doc> without <doc>")
                continue
            paras = [(ln, t) for ln, t in cur["paras"] if t.strip()]
            if paras and cur["title"] and paras[0][1].strip() == cur["title"].strip():
                paras = paras[1:]  # WikiExtractor repeats the title as the first line
            if not paras:
                yield Reject(uri, cur["line"], "empty_text", "", cur["id"])
            else:
                yield Doc(uri, cur["line"], cur["id"], tuple(paras))
            cur = None
            continue
        if cur is None:
            if text.strip():
                yield Reject(uri, lineno, "outside_doc", text[:SNIPPET])
            continue
        cur["paras"].append((lineno, text))
    if cur is not None:
        yield Reject(uri, cur["line"], "unterminated_doc", "<doc> not closed before end of file", cur["id"])


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


# ----------------------------------------------------------------------------- per-file cleaning


def clean_records(records, cfg: CleanConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """Turn records into ("keep", sentence row) / ("reject", reject row) events (no dedup here)."""
    for rec in records:
        if isinstance(rec, Reject):
            yield "reject", {"source": rec.source, "line": rec.line, "doc_id": rec.doc_id, "reason": rec.reason, "text": rec.text[:SNIPPET]}
            continue
        idx = seen = 0
        for lineno, para in rec.paragraphs:
            for sent in (s for line in para.split("\n") for s in split_sentences(normalize_text(line))):
                seen += 1
                reason = sentence_reject_reason(sent, cfg)
                if reason:
                    yield "reject", {"source": rec.source, "line": lineno, "doc_id": rec.doc_id, "reason": reason, "text": sent[:SNIPPET]}
                else:
                    yield "keep", {"doc_id": rec.doc_id, "sent_idx": idx, "text": sent, "source": rec.source, "line": lineno}
                    idx += 1
        if seen == 0:  # only whitespace/markup: one item, rejected
            yield "reject", {"source": rec.source, "line": rec.line, "doc_id": rec.doc_id, "reason": "empty_text", "text": ""}


class Deduper:
    """Exact sentence dedup across the run, in 8 bytes per distinct sentence.

    New keys go to a small Python set; every ``flush_at`` keys they are merged into one sorted
    uint64 array (searched with ``np.searchsorted``), so memory is ~8 B per distinct sentence
    instead of ~90 B for a Python set of bytes."""

    def __init__(self, flush_at: int = 1 << 20) -> None:
        self.recent: set[int] = set()
        self.sorted = np.zeros(0, dtype=np.uint64)
        self.flush_at = flush_at

    def __len__(self) -> int:
        return len(self.recent) + len(self.sorted)

    def _in_sorted(self, k: int) -> bool:
        i = int(np.searchsorted(self.sorted, np.uint64(k)))
        return i < len(self.sorted) and int(self.sorted[i]) == k

    def is_new(self, text: str) -> bool:
        k = sentence_key(text)
        if k in self.recent or self._in_sorted(k):
            return False
        self.recent.add(k)
        if len(self.recent) >= self.flush_at:
            self.sorted = np.union1d(self.sorted, np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent)))
            self.recent = set()
        return True


# ----------------------------------------------------------------------------- stage steps


def clean_file(uri: str, file_index: int, cfg: CleanConfig, writer, progress: bool = False) -> dict[str, Any]:
    """Map step: one input file -> ``_parts/fNNNNN-*.parquet`` (kept) and ``_parts/rNNNNN-*`` (rejects)."""
    from tqdm.auto import tqdm

    from storage.parquet import ShardSink

    keep = ShardSink(writer, f"_parts/f{file_index:05d}", SENTENCE_SCHEMA, cfg.shard_rows)
    rej = ShardSink(writer, f"_parts/r{file_index:05d}", REJECT_SCHEMA, cfg.shard_rows)
    reasons: Counter = Counter()
    kept = 0
    events = clean_records(read_records(uri, cfg), cfg)
    for kind, row in tqdm(events, desc=f"clean {uri.rsplit('/', 1)[-1]}", unit=" sent", disable=not progress, mininterval=2):
        if kind == "keep":
            keep.add(row)
            kept += 1
        else:
            rej.add(row)
            reasons[row["reason"]] += 1
    return {
        "file_index": file_index,
        "source": uri,
        "kept_parts": sorted(keep.close()),
        "reject_parts": sorted(rej.close()),
        "kept": kept,
        "rejected": dict(reasons),
    }


def dedup_and_shard(part_results: list[dict[str, Any]], cfg: CleanConfig, writer) -> dict[str, Any]:
    """Reduce step: stream the parts in input order, drop repeated sentences, write final shards.

    Parts are removed afterwards, so the committed artifact holds only ``shards/`` and ``rejected/``.
    """
    from storage.parquet import ShardSink, iter_batches

    def art_reader(rel):
        return iter_batches(writer, rel)

    shards = ShardSink(writer, "shards/part", SENTENCE_SCHEMA, cfg.shard_rows)
    rejected = ShardSink(writer, "rejected/part", REJECT_SCHEMA, cfg.shard_rows)
    dedup = Deduper()
    reasons: Counter = Counter()
    n_in = out = 0
    for res in sorted(part_results, key=lambda r: r["file_index"]):
        for rel in res["reject_parts"]:
            for batch in art_reader(rel):
                for row in batch.to_pylist():
                    rejected.add(row)
                    reasons[row["reason"]] += 1
                    n_in += 1
        for rel in res["kept_parts"]:
            for batch in art_reader(rel):
                for row in batch.to_pylist():
                    n_in += 1
                    if cfg.dedup and not dedup.is_new(row["text"]):
                        rejected.add({**{k: row[k] for k in ("source", "line", "doc_id", "text")}, "reason": "duplicate"})
                        reasons["duplicate"] += 1
                    else:
                        shards.add(row)
                        out += 1
    shard_files = shards.close(always_one=True)
    reject_files = rejected.close(always_one=True)
    for res in part_results:
        for rel in res["kept_parts"] + res["reject_parts"]:
            writer.fs.rm(writer.file_path(rel))
    return {"in": n_in, "out": out, "rejected": dict(reasons), "shards": shard_files, "rejects": reject_files}


# ----------------------------------------------------------------------------- Prefect wrappers
from prefect import task  # noqa: E402
from prefect.cache_policies import NONE  # noqa: E402


@task(name="clean-file", cache_policy=NONE)
def clean_file_task(store_uri: str, version: str, uri: str, file_index: int, cfg: CleanConfig, progress: bool = False) -> dict[str, Any]:
    from storage.artifacts import ArtifactStore

    return clean_file(uri, file_index, cfg, ArtifactStore(store_uri).attach("clean", version), progress)


@task(name="clean-dedup", cache_policy=NONE)
def dedup_task(store_uri: str, version: str, part_results: list[dict[str, Any]], cfg: CleanConfig) -> dict[str, Any]:
    from storage.artifacts import ArtifactStore

    return dedup_and_shard(part_results, cfg, ArtifactStore(store_uri).attach("clean", version))
