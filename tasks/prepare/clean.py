"""clean: raw wiki dumps -> normalised, filtered, deduplicated sentences with counted rejects.

The readers (:mod:`tasks.prepare.corpus`) turn each input file into documents and located rejects.
Counting unit (``in``): a record that cannot be parsed counts as one item; a parsed record counts
as its sentences (one item if it yields none). So ``in = out + sum(rejected)`` holds for the stage.
Each input file is cleaned by its own task (``clean-file``); a multistream MediaWiki dump with its index is
cleaned by one task per piece of ``clean.dump.streams_per_task`` bz2 streams (:mod:`tasks.prepare.wikidump`).
One reduce task (``clean-dedup``) drops repeated sentences across files and writes the final shards, reading
the parts in input order (file, then piece), so the artifact's bytes do not depend on how a dump was split.
For dumps, pages are also counted: pages in = articles + rejected pages (``metrics.pages``).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from storage.artifacts import StagingHandle
from storage.fingerprints import FingerprintCache
from storage.parquet import ShardSink, iter_batches
from tasks.common.context import StageContext
from tasks.common.rejects import DUPLICATE, EMPTY_TEXT, LOW_CJK_RATIO, SNIPPET, TOO_SHORT, reject_schema
from tasks.common.stage import Stage, StageResult, input_names, input_source
from tasks.common.text import normalize_text
from tasks.prepare import wikidump
from tasks.prepare.config import CleanConfig
from tasks.prepare.corpus import Doc, Reject, read_records

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
REJECT_SCHEMA = reject_schema(id_name="doc_id")  # source, line, doc_id, reason, text


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
    """Share of CJK ideographs among the non-space characters (0 for none)."""
    chars = [c for c in s if not c.isspace()]
    return sum(map(_is_cjk, chars)) / len(chars) if chars else 0.0


def sentence_reject_reason(s: str, cfg: CleanConfig) -> str | None:
    """Why a normalised sentence is rejected (too short, too little CJK), or None to keep it."""
    if len(s) < cfg.min_chars:
        return TOO_SHORT
    if cjk_ratio(s) < cfg.min_cjk_ratio:
        return LOW_CJK_RATIO
    return None


def sentence_key(s: str) -> int:
    """64-bit blake2b key (collision odds ~n²/2⁶⁵: about 2e-5 for 30M distinct sentences)."""
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


# ----------------------------------------------------------------------------- per-file cleaning


def clean_records(records, cfg: CleanConfig) -> Iterator[tuple[str, dict[str, Any]]]:
    """Turn records into ("keep", sentence row) / ("reject", reject row) events (no dedup here)."""
    for rec in records:
        if isinstance(rec, Reject):
            yield (
                "reject",
                {
                    "source": rec.source,
                    "line": rec.line,
                    "doc_id": rec.doc_id,
                    "reason": rec.reason,
                    "text": rec.text[:SNIPPET],
                },
            )
            continue
        idx = seen = 0
        for lineno, para in rec.paragraphs:
            for sent in (s for line in para.split("\n") for s in split_sentences(normalize_text(line))):
                seen += 1
                reason = sentence_reject_reason(sent, cfg)
                if reason:
                    yield (
                        "reject",
                        {
                            "source": rec.source,
                            "line": lineno,
                            "doc_id": rec.doc_id,
                            "reason": reason,
                            "text": sent[:SNIPPET],
                        },
                    )
                else:
                    yield (
                        "keep",
                        {"doc_id": rec.doc_id, "sent_idx": idx, "text": sent, "source": rec.source, "line": lineno},
                    )
                    idx += 1
        if seen == 0:  # only whitespace/markup: one item, rejected
            yield (
                "reject",
                {"source": rec.source, "line": rec.line, "doc_id": rec.doc_id, "reason": EMPTY_TEXT, "text": ""},
            )


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
        """Whether the sentence was not seen before (and remember it)."""
        k = sentence_key(text)
        if k in self.recent or self._in_sorted(k):
            return False
        self.recent.add(k)
        if len(self.recent) >= self.flush_at:
            self.sorted = np.union1d(self.sorted, np.fromiter(self.recent, dtype=np.uint64, count=len(self.recent)))
            self.recent = set()
        return True


# ----------------------------------------------------------------------------- stage steps


class _RecordCount:
    """Counts the records a reader yields (documents, and rejects by reason) as they pass."""

    def __init__(self, records):
        self.records, self.docs, self.rejected = records, 0, Counter()

    def __iter__(self):
        for rec in self.records:
            if isinstance(rec, Doc):
                self.docs += 1
            else:
                self.rejected[rec.reason] += 1
            yield rec

    def as_dict(self) -> dict[str, Any]:
        return {"in": self.docs + sum(self.rejected.values()), "articles": self.docs, "rejected": dict(self.rejected)}


def clean_file(uri: str, file_index: int, cfg: CleanConfig, writer, progress: bool = False,
               name: str | None = None, piece: dict[str, Any] | None = None, piece_index: int = 0) -> dict[str, Any]:
    """Map step: one input file (or one ``piece`` of a multistream dump) -> ``_parts/fNNNNN[-PPPPP]-*.parquet``
    (kept) and ``_parts/rNNNNN[-PPPPP]-*`` (rejects). Rows name the file ``name`` (``source``; default: ``uri``)."""
    tag = f"{file_index:05d}" if piece is None else f"{file_index:05d}-{piece_index:05d}"
    keep = ShardSink(writer, f"_parts/f{tag}", SENTENCE_SCHEMA, cfg.shard_rows)
    rej = ShardSink(writer, f"_parts/r{tag}", REJECT_SCHEMA, cfg.shard_rows)
    reasons: Counter = Counter()
    kept = 0
    records = _RecordCount(read_records(uri, cfg, name, piece))
    events = clean_records(records, cfg)
    for kind, row in tqdm(
        events, desc=f"clean {uri.rsplit('/', 1)[-1]}", unit=" sent", disable=not progress, mininterval=2
    ):
        if kind == "keep":
            keep.add(row)
            kept += 1
        else:
            rej.add(row)
            reasons[row["reason"]] += 1
    return {
        "file_index": file_index,
        "piece_index": piece_index,
        "records": records.as_dict(),
        "source": name or uri,
        "kept_parts": sorted(keep.close()),
        "reject_parts": sorted(rej.close()),
        "kept": kept,
        "rejected": dict(reasons),
    }


def dedup_and_shard(part_results: list[dict[str, Any]], cfg: CleanConfig, writer) -> dict[str, Any]:
    """Reduce step: stream the parts in input order, drop repeated sentences, write final shards.

    Parts are removed afterwards, so the committed artifact holds only ``shards/`` and ``rejected/``.
    """

    def art_reader(rel):
        return iter_batches(writer, rel)

    shards = ShardSink(writer, "shards/part", SENTENCE_SCHEMA, cfg.shard_rows)
    rejected = ShardSink(writer, "rejected/part", REJECT_SCHEMA, cfg.shard_rows)
    dedup = Deduper()
    reasons: Counter = Counter()
    n_in = out = 0
    by_file: dict[int, list[dict[str, Any]]] = {}
    for res in sorted(part_results, key=lambda r: (r["file_index"], r.get("piece_index", 0))):
        by_file.setdefault(res["file_index"], []).append(res)
    for pieces in by_file.values():  # per file: its rejects, then its kept rows, piece after piece (the rows and
        # their order are those of one task reading the file whole: the split never shows in the artifact)
        for rel in (r for res in pieces for r in res["reject_parts"]):
            for batch in art_reader(rel):
                for row in batch.to_pylist():
                    rejected.add(row)
                    reasons[row["reason"]] += 1
                    n_in += 1
        for rel in (r for res in pieces for r in res["kept_parts"]):
            for batch in art_reader(rel):
                for row in batch.to_pylist():
                    n_in += 1
                    if cfg.dedup and not dedup.is_new(row["text"]):
                        rejected.add({**{k: row[k] for k in ("source", "line", "doc_id", "text")}, "reason": DUPLICATE})
                        reasons[DUPLICATE] += 1
                    else:
                        shards.add(row)
                        out += 1
    shard_files = shards.close(always_one=True)
    reject_files = rejected.close(always_one=True)
    for res in part_results:
        for rel in res["kept_parts"] + res["reject_parts"]:
            writer.fs.rm(writer.file_path(rel))
    return {"in": n_in, "out": out, "rejected": dict(reasons), "shards": shard_files, "rejects": reject_files}


# ----------------------------------------------------------------------------- shard task entry points


def clean_file_task(
    staging: StagingHandle, uri: str, file_index: int, cfg: CleanConfig, progress: bool = False,
    name: str | None = None, piece: dict[str, Any] | None = None, piece_index: int = 0,
) -> dict[str, Any]:
    """One input file cleaned into the clean artifact's staging area (a shard task's entry point)."""
    return clean_file(uri, file_index, cfg, staging.writer(), progress, name, piece, piece_index)


# ----------------------------------------------------------------------------- the stage


def version_config(cfg: CleanConfig, files: list[str], cache: FingerprintCache | None = None) -> dict[str, Any]:
    """The clean stage's config: its section and every input file's URI, name and bytes' fingerprint (the
    version counts the names and bytes, in order, never the URIs: see ``storage.artifacts.without_locations``).

    ``clean.dump`` enters only when an input is a MediaWiki dump, and then only what changes the text (the
    reader's version and the disambiguation templates; not the index's location nor the split), so the
    versions of other corpora are what they were before dumps could be read."""
    conf = cfg.model_dump(exclude={"dump"})
    if any(wikidump.is_dump(u, cfg) for u in files):
        conf["dump"] = {"reader": wikidump.READER_VERSION,
                        "disambiguation_templates": cfg.dump.disambiguation_templates}
    return {**conf, "inputs": [input_source(u, n, cache) for u, n in zip(files, input_names(files))]}


def plan_work(files: list[str], cfg: CleanConfig) -> list[dict[str, Any]]:
    """One work item per input file, or per piece of a multistream dump whose index is found (or given):
    ``{uri, file_index, name, piece, piece_index, dump}`` in input order."""
    items = []
    for i, (u, n) in enumerate(zip(files, input_names(files))):
        dump = wikidump.is_dump(u, cfg)
        index = wikidump.find_index(u, cfg) if dump else None
        pieces = wikidump.plan_pieces(index, cfg.dump.streams_per_task) if index else [None]
        items += [dict(uri=u, file_index=i, name=n, piece=p, piece_index=k, dump=dump) for k, p in enumerate(pieces)]
    return items


def page_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pages of the dump inputs: ``in`` = ``articles`` + rejected pages by reason."""
    rejected: Counter = Counter()
    articles = 0
    for p in parts:
        articles += p["records"]["articles"]
        rejected.update(p["records"]["rejected"])
    return {"in": articles + sum(rejected.values()), "articles": articles, "rejected": dict(sorted(rejected.items()))}


def build(ctx: StageContext, files: list[str], progress: bool = False) -> StageResult:
    """Clean every input file or dump piece (one task each), then dedup across files into the final shards. Rows
    name their file by :func:`tasks.common.stage.input_names` (its name, never its directory: not in the version)."""
    cfg = ctx.cfg
    work = plan_work(files, cfg)
    items = [dict(staging=ctx.staging, cfg=cfg, progress=progress,
                  **{k: w[k] for k in ("uri", "file_index", "name", "piece", "piece_index")}) for w in work]
    parts = ctx.map(clean_file_task, items, name="clean-file")  # pragma: no mutate (UI names)
    res = ctx.call(dedup_and_shard, "clean-dedup", part_results=parts, cfg=cfg, writer=ctx.writer)
    metrics: dict[str, Any] = {"input_files": len(files), "shards": len(res["shards"])}
    run: dict[str, Any] = {}
    dump_parts = [p for p, w in zip(parts, work) if w["dump"]]
    if dump_parts:
        metrics["pages"] = page_counts(dump_parts)
        run["dump_tasks"] = len(dump_parts)  # how the dumps were split: not part of the version
    return StageResult(
        stats={"in": res["in"], "out": res["out"], "rejected": res["rejected"]},
        metrics=metrics,
        rows={**res["shards"], **res["rejects"]},
        run=run,
    )


STAGE = Stage("clean", CODE_VERSION, CleanConfig, parents=(), build=build, version_config=version_config,
              version_inputs=("files",))
