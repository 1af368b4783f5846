"""label: stream a table of texts through a scorer into sharded Parquet, resumably (the labeller).

Input: any table :mod:`tasks.common.table` reads (CSV, TSV, JSON lines, Parquet; fsspec URLs and
globs, compression inferred), streamed in batches; nothing holds more than one shard's row ids and
outputs (with an id column, also an 8-byte hash of every id met: :class:`SeenIds`). The scorer is a
sentiment bundle (:class:`tasks.inference.sentiment.ClassifierScorer`) or another
:class:`tasks.inference.interface.Scorer` (the NER scorer); :class:`LabelOptions` carries the text/id columns, shard
and batch sizes. Every input record (``in``: a data row, a non-blank JSON line) is labelled (``part-*``) or
rejected with a reason (``rejected-*``): ``in == out + sum(rejected)`` is checked before the manifest
is written. Output directory ``output_uri``::

    _run.json                 written first: this run's version + config (refuses to mix versions)
    rejected-00000.parquet    source, line, id, reason, text (snippet)   (only when non-empty)
    monitor-00000.json        the shard's monitoring sketch (sentiment bundles with a reference, monitoring on)
    part-00000.parquet        the scorer's columns: row_id, prob, label, threshold, bundle_version, no_cjk,
                              truncated_at
    monitor.json              the run's monitoring report (:mod:`tasks.label.monitor`), from the sketches
    _manifest.json            written last: stats, sha256 of every file (the commit marker)

Monitoring (``monitor``, :class:`tasks.label.config.MonitorConfig`) is not part of the label version and changes no
part file or reject: with it on, each shard's sketch is written before its part file, a resumed shard whose sketch
is missing (or not this run's) is scored again (to the same bytes), and the report is written before the manifest.

Every row-level problem is a reject with a reason from :mod:`tasks.common.rejects`, shared with the Python API
(``lexiflow.label_dataframe``, ``Model.predict``): the reader's (``undecodable``, ``invalid_json``,
``bad_columns``), then the id's (``missing_id``; ``invalid_unicode``: a lone surrogate, as a JSON ``"\\ud800"``
escape gives; ``duplicate_id``: an id an earlier row has, the first keeps it), then the text's (``missing_text``,
``not_a_string``, ``invalid_unicode``, ``empty_text``, ``empty_after_normalization``). A text column that is not
text (an integer Parquet column) is one error before anything is read. Scored rows carry two flags for the user to
decide on: ``no_cjk`` (no CJK ideograph in the text) and ``truncated_at`` (the token offset where a text longer than
the model's length was cut; null when read whole).

Row ids: the id column's value, or ``{file name}:{0-based record index}``; a reject's ``line`` is the
1-based line where its record starts (Parquet: row), ``source`` the file name used in the ids.
Shard ``i`` covers records ``[i*shard_rows, (i+1)*shard_rows)`` in input order (files sorted). A
shard's files are written under temporary names and moved into place, ``rejected-i`` before
``part-i``, so an existing ``part-i`` means shard ``i`` is complete: a re-run after a crash skips
it (streaming the input without scoring, to stay aligned) and computes only the missing shards. ``part-i``
carries the content digests of itself and ``rejected-i`` (Parquet metadata); a shard whose files do not
match them (edited, truncated, unreadable) is recomputed with a warning, never mixed in.

Determinism: rows are scored together by shard and ``batch_size`` only (windows of ``batch_size *
WINDOW_BATCHES`` scorable rows, sorted by length, cut into mini-batches of at most ``batch_size`` rows and, on
CPU, ``scorer.CPU_BATCH_TOKENS`` padded tokens), never by where reader
batches fall, so a resumed run writes the same bytes as an uninterrupted one (same threads/device).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from models.numerics import NUMPY_KEYS
from storage.artifacts import TMP_MARK, Manifest, Stats, compute_version
from storage.fingerprints import FingerprintCache
from storage.parquet import write_table
from storage.urls import public_url, scrub
from tasks.common import rejects
from tasks.common.context import PLAIN_RUNTIME, Runtime, pause_point
from tasks.common.table import (
    READ_ROWS,
    Batch,
    Source,
    check_columns,
    check_text_column,
    expand_inputs,
    read_batches,
)
from tasks.common.text import replace_invalid, valid_unicode
from tasks.common.ui import PLAIN, Reporter
from tasks.inference.runtime import numerics_config
from tasks.inference.sentiment import WINDOW_BATCHES, ClassifierScorer
from tasks.label.config import LabelOptions, MonitorConfig
from tasks.label.monitor import LOGGER as MONITOR_LOGGER
from tasks.label.monitor import REPORT_FILE, Monitor, earlier_sketches, sketch_name, verified_report
from tasks.label.output import (  # noqa: F401 - OutputConflict is part of this module's interface
    RUN_FILE,
    OutputConflict,
    OutputDir,
    claim_output,
    part_digest,
    part_name,
    read_part_digest,
    rejected_name,
    shard_digests_metadata,
    shard_problem,
)

CODE_VERSION = "label-6"  # bump when the same texts and bundle give other output bytes
REJECT_SCHEMA = rejects.reject_schema()


def row_reason(text: Any) -> str | None:
    """Why a text cannot be scored (None: it can)."""
    if text is None:
        return rejects.MISSING_TEXT
    if not isinstance(text, str):
        return rejects.NOT_A_STRING
    if not valid_unicode(text):
        return rejects.INVALID_UNICODE
    if not text.strip():
        return rejects.EMPTY_TEXT
    return None


def id_string(value: Any) -> str | None:
    """An id value as a string; None for null/empty (the row is rejected as ``missing_id``)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value if value != "" else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    return str(value)


class SeenIds:
    """The ids a run has met, to reject a repeated one as ``duplicate_id`` (the first row keeps it).

    Held as 64-bit hashes (BLAKE2b), 8 bytes per id in a sorted array plus a small set of recent ones, so a run of
    10 million rows holds about 80 MB, whatever the ids' length; two different ids share a hash with a probability
    of about n^2 / 2^65 (3e-6 for 10 million rows)."""

    _MERGE = 1 << 16  # recent hashes merged into the sorted array at a time

    def __init__(self) -> None:
        self.sorted = np.empty(0, np.uint64)
        self.recent: set[int] = set()

    def add(self, rid: str) -> bool:
        """Record ``rid``; False when it was met before."""
        h = int.from_bytes(hashlib.blake2b(rid.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
        if h in self.recent:
            return False
        if self.sorted.size:
            i = int(np.searchsorted(self.sorted, np.uint64(h)))
            if i < self.sorted.size and int(self.sorted[i]) == h:
                return False
        self.recent.add(h)
        if len(self.recent) >= self._MERGE:
            self.sorted = np.union1d(self.sorted, np.fromiter(self.recent, np.uint64, len(self.recent)))
            self.recent = set()
        return True


def given_id_reason(value: Any, seen: SeenIds | None) -> tuple[str | None, str | None]:
    """(the id of a row whose id column holds ``value`` (None when null or empty), why that id rules the row out:
    ``missing_id``, ``invalid_unicode`` or, when ``seen`` already has it, ``duplicate_id``; None: it does not).
    A usable id is recorded in ``seen``."""
    rid = id_string(value)
    if rid is None:
        return None, rejects.MISSING_ID
    if not valid_unicode(rid):
        return replace_invalid(rid), rejects.INVALID_UNICODE
    if seen is not None and not seen.add(rid):
        return rid, rejects.DUPLICATE_ID
    return rid, None


def _snippet(text: Any) -> str | None:
    """A reject's text: JSON values other than strings are shown as JSON."""
    plain = text is None or isinstance(text, str)
    return rejects.snippet(text if plain else json.dumps(text, ensure_ascii=False, sort_keys=True, default=str))


# ----------------------------------------------------------------------------- shards


@dataclass
class _Shard:
    index: int
    skip: bool  # part file already committed by an earlier (killed) run, or another worker's shard
    foreign: bool = False  # another worker's shard (a share of a scaled-out run): counted past, never read
    rows: int = 0
    # per row (only when not skipped); reason None = scorable
    ids: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    snippets: list[str | None] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # one per scorable row, in row order
    flags: list[tuple[bool, int | None]] = field(default_factory=list)  # per scored row, from a flagging scorer
    descriptors: list[np.ndarray] = field(default_factory=list)  # per window, [rows, features]: monitoring only
    chars: Any = None  # the scored texts' character counts (monitoring with a content reference), summed
    words: Any = None  # the scored texts' lexicon-word counts (a reference with a word sketch), summed
    sketch: dict[str, Any] | None = None  # a resumed shard's monitoring sketch, read back and checked
    window_pos: list[int] = field(default_factory=list)
    window_texts: list[str] = field(default_factory=list)


class _Labeller:
    def __init__(self, scorer, out: OutputDir, shard_rows: int, batch_size: int, share: tuple[int, int] = (0, 1),
                 monitor: Monitor | None = None, log: Any = None):
        self.scorer, self.out, self.share, self.monitor = scorer, out, share, monitor
        self.log = log or PLAIN_RUNTIME.log  # the run's logger
        self.sketches: dict[int, dict[str, Any]] = {}  # shard -> its monitoring sketch (this run's shards)
        self.shard_rows, self.batch_size = shard_rows, batch_size
        self.window = batch_size * WINDOW_BATCHES
        self.stats, self.positive, self.skipped = Stats(), 0, 0
        self.rows: dict[str, int] = {}  # rows per written file
        self.seen = SeenIds()  # every id column value met so far, skipped and other workers' shards included
        self.flagged = hasattr(scorer, "score_rows")  # the scorer flags rows (no_cjk, truncated_at)
        self.files: list[str] = []
        self.shard: _Shard | None = None

    # -- feeding
    def _new_shard(self, i: int) -> _Shard:
        if i % self.share[1] != self.share[0]:
            return _Shard(i, skip=True, foreign=True)
        if not self.out.exists(part_name(i)):
            return _Shard(i, False)
        problem = shard_problem(self.out, i)  # a killed run's shard is reused only when it is what was written
        if problem is not None:
            self.log.warning("label: %s from an earlier run is not used: %s; recomputing shard %d",  # pragma: no mutate
                             self.out.file_path(part_name(i)), problem, i)
            return _Shard(i, False)
        if self.monitor is None:
            return _Shard(i, True)
        sketch = self._read_sketch(i)
        if sketch is None:  # written without monitoring (or not this run's): scored again, to the same bytes
            self.log.info("label: shard %d has no monitoring sketch of this run; scoring it again",  # pragma: no mutate
                          i)
            return _Shard(i, False)
        return _Shard(i, True, sketch=sketch)

    def _read_sketch(self, i: int) -> dict[str, Any] | None:
        """Shard ``i``'s sketch when it is this monitor's sketch of the part file there, else None."""
        try:
            sketch = self.out.read_json(sketch_name(i))
        except (OSError, ValueError):
            return None
        return sketch if self.monitor.valid(sketch, i, read_part_digest(self.out, i)) else None

    def feed(self, src: Source, batch: Batch) -> Iterator[int]:
        """Add a reader batch; yields the index of every shard that got completed."""
        k, n = 0, len(batch)
        # ids are checked on every row, in input order, whether or not this run scores its shard: a duplicate is
        # the same row in a resumed run, and in every worker's share, as in one uninterrupted run
        ids = batch.values.get("id")
        checked = None if ids is None else [
            (None, None) if batch.bad[j] is not None else given_id_reason(ids[j], self.seen) for j in range(n)]
        while k < n:
            if self.shard is None:
                self.shard = self._new_shard(self.stats.in_ // self.shard_rows)
            sh = self.shard
            take = min(n - k, self.shard_rows - sh.rows)
            if not sh.skip:
                self._add_rows(sh, src, batch, k, k + take, checked)
            sh.rows += take
            self.stats.in_ += take
            k += take
            if sh.rows == self.shard_rows:
                self.finish_shard()
                yield sh.index

    def _add_rows(self, sh: _Shard, src: Source, batch: Batch, a: int, b: int,
                  checked: list[tuple[str | None, str | None]] | None) -> None:
        texts = batch.values["text"]
        for j in range(a, b):
            text, reason, rid = texts[j], batch.bad[j], f"{src.name}:{batch.start + j}"
            if reason is not None:  # the reader's own reason (bytes, JSON, field count) comes first
                text = batch.raw[j]
            elif checked is not None:  # then the id's (missing, invalid, duplicate), then the text's
                given, reason = checked[j]
                rid = given if given is not None else rid
                reason = reason or row_reason(text)
            else:
                reason = row_reason(text)
            sh.ids.append(rid)
            sh.reasons.append(reason)
            sh.sources.append(src.name)
            sh.lines.append(batch.lines[j])
            if reason is None:
                sh.snippets.append(None)
                sh.window_pos.append(len(sh.ids) - 1)
                sh.window_texts.append(text)
                if len(sh.window_texts) == self.window:
                    self._score_window(sh)
            else:
                sh.snippets.append(_snippet(text))

    def _score_window(self, sh: _Shard) -> None:
        if not sh.window_texts:
            return
        if self.monitor is not None:
            outputs, empty, flags, desc, words = self.scorer.score_described(sh.window_texts,
                                                                             words=self.monitor.word_lut)
            if words is not None:
                sh.words = words if sh.words is None else sh.words + words
            sh.flags.extend(flags)
            sh.descriptors.append(desc)
            counts = self.monitor.count_chars([t for i, t in enumerate(sh.window_texts) if i not in empty])
            if counts is not None:
                sh.chars = counts if sh.chars is None else sh.chars + counts
        elif self.flagged:
            outputs, empty, flags = self.scorer.score_rows(sh.window_texts)
            sh.flags.extend(flags)
        else:
            outputs, empty = self.scorer.score(sh.window_texts)
        for i, pos in enumerate(sh.window_pos):
            if i in empty:
                sh.reasons[pos] = rejects.EMPTY_AFTER_NORMALIZATION
                sh.snippets[pos] = _snippet(sh.window_texts[i])
        sh.outputs.extend(outputs)
        sh.window_pos, sh.window_texts = [], []

    # -- committing
    def finish_shard(self) -> None:
        sh, self.shard = self.shard, None
        if sh is None or sh.foreign:
            return
        part, rej = part_name(sh.index), rejected_name(sh.index)
        if sh.skip:
            out, reasons, positive = self._read_existing(sh)
            self.skipped += 1
            if sh.sketch is not None:
                self.sketches[sh.index] = sh.sketch
            elif self.out.exists(sketch_name(sh.index)):  # monitoring off: an earlier run's sketch is not kept
                self.out.remove(sketch_name(sh.index))
        else:
            self._score_window(sh)
            out, reasons, positive = self._write_shard(sh)
        if out + sum(reasons.values()) != sh.rows:
            raise RuntimeError(
                f"{self.out.uri}: shard {sh.index} has {out} labelled + {sum(reasons.values())} rejected rows "
                f"but the input gives {sh.rows}; the output directory was modified, rerun with overwrite=True"
            )
        self.stats.out += out
        for r, c in reasons.items():
            self.stats.rejected[r] = self.stats.rejected.get(r, 0) + c
        self.positive += positive
        if reasons:
            self.files.append(rej)
            self.rows[rej] = sum(reasons.values())
        if sh.index in self.sketches:
            self.files.append(sketch_name(sh.index))
        self.files.append(part)
        self.rows[part] = out

    def _write_shard(self, sh: _Shard) -> tuple[int, dict[str, int], int]:
        ok = [r is None for r in sh.reasons]
        ids = [i for i, good in zip(sh.ids, ok) if good]
        if len(ids) != len(sh.outputs):
            raise AssertionError(f"shard {sh.index}: {len(ids)} scorable rows but {len(sh.outputs)} outputs")
        rej_idx = [i for i, good in enumerate(ok) if not good]
        rej = self.out.file_path(rejected_name(sh.index))
        if rej_idx:  # rejected first: part-i is the shard's commit marker
            cols = {"source": sh.sources, "line": sh.lines, "id": sh.ids, "reason": sh.reasons, "text": sh.snippets}
            table_rej = pa.table({k: [v[i] for i in rej_idx] for k, v in cols.items()}, schema=REJECT_SCHEMA)
            write_table(self.out, rejected_name(sh.index), table_rej)
        elif self.out.fs.exists(rej):
            self.out.remove(rejected_name(sh.index))
        table = self.scorer.part_table(ids, sh.outputs, sh.flags) if self.flagged else self.scorer.part_table(
            ids, sh.outputs)
        table = shard_digests_metadata(table, table_rej if rej_idx else None)
        if self.monitor is not None:  # the sketch before the part: a part file means its shard is complete
            desc = np.concatenate(sh.descriptors) if sh.descriptors else np.zeros((0, 0))
            sketch = self.monitor.sketch(sh.index, part_digest(table), sh.outputs, desc, sh.chars, sh.words)
            self.out.write_bytes(sketch_name(sh.index), json.dumps(sketch, sort_keys=True).encode())
            self.sketches[sh.index] = sketch
        elif self.out.fs.exists(self.out.file_path(sketch_name(sh.index))):
            self.out.remove(sketch_name(sh.index))
        write_table(self.out, part_name(sh.index), table)
        col = self.scorer.positive_column  # None: K > 2 classes, no positive class to count
        positive = int(np.asarray(table.column(col)).sum()) if len(ids) and col else 0
        return len(ids), dict(Counter(sh.reasons[i] for i in rej_idx)), positive

    def _read_existing(self, sh: _Shard) -> tuple[int, dict[str, int], int]:
        """Counts of a shard committed by an earlier run (read back, not recomputed)."""
        col = self.scorer.positive_column or "row_id"  # K > 2 classes: rows only, no positive count
        with self.out.fs.open(self.out.file_path(part_name(sh.index)), "rb") as f:
            labels = pq.read_table(f, columns=[col]).column(col)
        positive = int(pc.sum(labels).as_py() or 0) if self.scorer.positive_column else 0
        reasons: Counter = Counter()
        if self.out.exists(rejected_name(sh.index)):
            with self.out.fs.open(self.out.file_path(rejected_name(sh.index)), "rb") as f:
                reasons.update(pq.read_table(f, columns=["reason"]).column("reason").to_pylist())
        return len(labels), dict(reasons), positive


# ----------------------------------------------------------------------------- main


def label_config(sources: Sequence[Source], options: LabelOptions, cache: FingerprintCache | None = None
                 ) -> dict[str, Any]:
    """What the version is computed from: the inputs' fingerprints (through the run's fingerprint ``cache`` when
    it has one) and the options."""
    return {"inputs": [s.fingerprint(cache) for s in sources], **options.model_dump()}


def _summary(out: OutputDir, m: Manifest, cached: bool, skipped: int = 0,
             report: dict[str, Any] | None = None) -> dict[str, Any]:
    listed = {f.path: f for f in m.files}
    if report is None and cached and REPORT_FILE in listed:  # checked against the manifest, as every reader does
        report = verified_report(out.fs, out.file_path(REPORT_FILE), listed[REPORT_FILE].sha256,
                                 public_url(f"{out.uri.rstrip('/')}/{REPORT_FILE}"))
    return {
        "uri": out.uri,
        "version": m.version,
        "stats": m.stats,
        "metrics": m.metrics,
        "files": [f.model_dump() for f in m.files],
        "parts": [f.path for f in m.files if f.path.startswith("part-")],
        "cached": cached,
        "skipped_shards": skipped,
        "monitor": report,  # the monitoring report (monitor.json), None when the run has none
    }


def _stream(lab: _Labeller, sources: list[Source], options: LabelOptions, read_rows: int, bar,
            reporter: Reporter = PLAIN) -> None:
    """Feed every record of ``sources`` to ``lab`` (progress to the run's UI where there is one), then the last
    shard."""
    total_bytes = sum(s.size for s in sources) or 1  # pragma: no mutate
    prefect_progress = reporter.progress_bar("label-progress", total_bytes, "label: bytes read") \
        if reporter.active else None  # pragma: no mutate
    done_bytes = before = 0.0  # pragma: no mutate
    columns = {"text": options.text_column, "id": options.id_column}
    for src in sources:
        for batch in read_batches(src, columns, read_rows, as_strings=True):
            for _shard in lab.feed(src, batch):
                if prefect_progress is not None:
                    now = before + batch.done * src.size  # pragma: no mutate
                    prefect_progress.step(max(0.0, now - done_bytes))  # pragma: no mutate
                    done_bytes = max(done_bytes, now)  # pragma: no mutate
                pause_point("label")  # pragma: no mutate
            bar.update(len(batch))  # pragma: no mutate
        before += src.size  # pragma: no mutate
    if lab.shard is not None or lab.stats.in_ == 0:
        if lab.shard is None:  # empty input: still one (empty) part file
            lab.shard = lab._new_shard(0)
        lab.finish_shard()
    if prefect_progress is not None:
        prefect_progress.step(max(0.0, total_bytes - done_bytes))  # pragma: no mutate


@dataclass
class LabelRun:
    """A labelling run's resolved inputs and output: what :func:`open_run` decided."""

    scorer: Any
    sources: list[Source]
    config: dict[str, Any]
    version: str
    out: OutputDir
    done: Manifest | None  # the manifest when this version is already committed and complete


def open_run(bundle, input_uri: str | Sequence[str], output_uri: str | None, options: LabelOptions,
             output_root: str | None = None, overwrite: bool = False, cache: FingerprintCache | None = None
             ) -> LabelRun:
    """Check the options and inputs, compute the label version (the inputs fingerprinted through ``cache``, the
    run's fingerprint cache, when given), and claim the output directory (fresh, resume, complete, or
    :class:`OutputConflict`)."""
    if (output_uri is None) == (output_root is None):
        raise ValueError("give exactly one of output_uri (a directory) and output_root (one directory per version)")
    if options.id_column is not None and options.id_column == options.text_column:
        raise ValueError(f"id_column and text_column are both {options.text_column!r}")
    sources = expand_inputs(input_uri)
    check_columns(sources, {"text": options.text_column, "id": options.id_column})
    check_text_column(sources, options.text_column)
    config = label_config(sources, options, cache)
    if hasattr(bundle, "part_table") and options.precision != "fp32":
        raise ValueError(f"precision {options.precision!r} applies to sentiment bundles only; use fp32")
    scorer = bundle if hasattr(bundle, "part_table") else ClassifierScorer(bundle, options.batch_size,
                                                                           options.precision, options.threads)
    # labelling computes with torch and exact NumPy operations only: NumPy's SIMD level and BLAS are left out, so a
    # Dask worker that imported NumPy before lexiflow still computes (and so resumes into) the same version
    numerics = numerics_config(options.threads, _device_kind(scorer))
    config["numerics"] = {k: v for k, v in numerics.items() if k not in NUMPY_KEYS}
    version = compute_version("label", CODE_VERSION, config, [scorer.ref])
    if output_root is not None:
        output_uri = f"{output_root.rstrip('/')}/{version}"
    out = OutputDir(output_uri, version)
    return LabelRun(scorer, sources, config, version, out, claim_output(out, overwrite, config["numerics"]))


def _device_kind(scorer) -> str:
    """``cuda`` when the scorer's model sits on a GPU, else ``cpu`` (the NER scorer wraps its tagger)."""
    model = getattr(scorer, "model", None)
    model = getattr(model, "model", model)
    first = next(model.parameters(), None) if hasattr(model, "parameters") else None
    return "cuda" if first is not None and first.device.type == "cuda" else "cpu"


def prepare_output(run: LabelRun) -> None:
    """Before any shard is written: record this run in ``_run.json`` and drop a killed run's temp files."""
    run_info = {"stage": "label", "version": run.version, "code_version": CODE_VERSION, "config": scrub(run.config)}
    run_info["bundle"] = run.scorer.ref.model_dump(exclude={"uri"})  # no store path: relocatable, same bytes
    out = run.out
    if out.read_json(RUN_FILE) != run_info:
        out.write_bytes(RUN_FILE, json.dumps(run_info, indent=1, sort_keys=True, ensure_ascii=False).encode())
    for rel in out.rels():
        if TMP_MARK in rel:
            out.remove(rel)


def run_monitor(scorer, cfg: MonitorConfig | None, version: str, log: Any = None) -> Monitor | None:
    """The run's :class:`~tasks.label.monitor.Monitor`: for a sentiment bundle with a reference (bundle-7 and
    later) while ``cfg`` (default: :class:`MonitorConfig` ``()``) is enabled; None otherwise."""
    cfg = MonitorConfig() if cfg is None else cfg
    bundle = getattr(scorer, "bundle", None)
    if not cfg.enabled or bundle is None or not hasattr(scorer, "score_described"):
        return None
    if getattr(bundle, "reference", None) is None:
        (log or PLAIN_RUNTIME.log).info(
            "label: bundle %s carries no monitoring reference (built before bundle-7): no monitoring report",
            bundle.version)  # pragma: no mutate
        return None
    return Monitor(bundle.reference, bundle.threshold, cfg, bundle.version, getattr(bundle, "classes", None))


def monitor_metrics(report: dict[str, Any]) -> dict[str, Any]:
    """What the run's manifest records of its monitoring report (the full report is ``monitor.json``)."""
    est = report["estimate"]
    metric = est["metric"]
    return {"alert": report["alert"], "alerts": report["alerts"], "warnings": report.get("warnings", []),
            "drift": report["drift"], "metric": metric, "estimate": est[metric],
            "interval": est[f"{metric}_interval"], "reliable": est["reliable"],
            "near_decision": report["near_decision"]["share"]}


def label_stream(
    bundle,
    input_uri: str | Sequence[str],
    output_uri: str | None,
    options: LabelOptions | None = None,
    *,
    output_root: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    threads: int | None = None,
    read_rows: int = READ_ROWS,
    share: tuple[int, int] | None = None,
    monitor: MonitorConfig | None = None,
    runtime: Runtime | None = None,
) -> dict[str, Any]:
    """Label every row of ``input_uri`` with ``bundle`` into ``output_uri`` (see the module doc).

    ``bundle`` is a sentiment :class:`tasks.inference.bundle.Bundle`, or any scorer with the members of
    :class:`ClassifierScorer` (any :class:`tasks.inference.interface.Scorer`, such as the NER scorer); ``options``
    default to :class:`LabelOptions` ``()``.

    Returns a summary: ``uri``, ``version``, ``stats`` {in, out, rejected{reason: n}}, ``metrics``,
    ``files`` (path, bytes, sha256, rows), ``parts``, ``cached`` (already complete: nothing done)
    and ``skipped_shards`` (committed by an earlier, interrupted run). ``options.threads`` (or ``threads``,
    which overrides it) sets torch's CPU thread count for the run (restored afterwards); it is part of the
    version, with the pinned CPU numerics, so equal settings give identical bytes on any machine with the same
    numerics record (:mod:`models.numerics`).

    Give ``output_uri`` (a fixed directory) or ``output_root``: then the output is ``{output_root}/{version}``,
    one directory per label version (bundle version + input fingerprints + options), so a scheduled run
    writes a new directory when its input changes and resumes (or finds complete) its own on a re-run.

    ``share=(t, n)``: one worker's share of a scaled-out run (:mod:`tasks.label.scale`): write the missing shards
    ``i`` with ``i % n == t`` into the directory the coordinator prepared, commit nothing, and return
    ``{uri, version, written, share}``; the coordinator's own pass then finds every shard and commits.

    ``monitor`` (default :class:`MonitorConfig` ``()``: on): the monitoring report ``monitor.json``
    (:mod:`tasks.label.monitor`), also returned as the summary's ``monitor`` and summarised in one log line (a
    warning when it alerts). Not part of the version; the part files and rejects are the same bytes either way.

    ``runtime`` (default: the plain one) is where the run's log lines and UI progress go (a flow's runtime), and
    its fingerprint cache (:attr:`tasks.common.context.Runtime.fingerprints`) is what the inputs are fingerprinted
    through: an unchanged local input is then not read again to compute the version."""
    runtime = runtime or PLAIN_RUNTIME
    if read_rows < 1:
        raise ValueError(f"read_rows must be >= 1, got {read_rows}")
    options = options if options is not None else LabelOptions()
    if threads is not None:  # the keyword wins over options.threads (and enters the version, like it)
        options = options.model_copy(update={"threads": int(threads)})
    run = open_run(bundle, input_uri, output_uri, options, output_root, overwrite and share is None,
                   runtime.fingerprints)
    scorer, sources, version, out = run.scorer, run.sources, run.version, run.out
    if share is not None:
        if run.done is None and out.read_json(RUN_FILE) is None:
            raise RuntimeError(f"{out.uri}: no {RUN_FILE}: a share runs in a directory its coordinator prepared")
        if run.done is not None:
            return {"uri": out.uri, "version": version, "written": [], "share": list(share)}
    elif run.done is not None:
        shown = public_url(out.uri)
        runtime.log.info("label %s: %s is already complete, nothing to do", version, shown)  # pragma: no mutate
        return _summary(out, run.done, cached=True)
    else:
        prepare_output(run)

    mon = run_monitor(scorer, monitor, version, runtime.log)
    lab = _Labeller(scorer, out, options.shard_rows, options.batch_size, share or (0, 1), mon, runtime.log)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    bar = tqdm(total=None, unit="row", desc=f"label {version}", disable=not progress)  # pragma: no mutate
    try:
        _stream(lab, sources, options, read_rows, bar, runtime.reporter)
    finally:
        bar.close()
        torch.set_num_threads(old_threads)

    if share is not None:
        return {"uri": out.uri, "version": version, "written": lab.files, "share": list(share)}
    if not lab.stats.reconciles():
        raise RuntimeError(f"label: counts do not reconcile: {lab.stats.dump()}")
    shards = sum(1 for f in lab.files if f.startswith("part-"))
    positive = lab.positive if getattr(scorer, "positive_column", "label") else None  # None: K > 2 classes
    metrics = {**scorer.metrics(), "positive": positive, "shards": shards, "input_files": len(sources)}
    report, files = None, [RUN_FILE, *lab.files]
    if mon is not None:  # the report before the manifest: committed with the output
        own = [lab.sketches[i] for i in sorted(lab.sketches)]
        earlier = None
        if output_root is not None and sum(s["rows"] for s in own) < mon.cfg.min_rows and mon.cfg.window > 1:
            earlier = earlier_sketches(output_root, mon.bundle_version, version, mon.cfg.window - 1)
        report = mon.report(own, version, lab.stats.dump(), earlier)
        out.write_bytes(REPORT_FILE, json.dumps(report, indent=1, sort_keys=True, ensure_ascii=False).encode())
        files.append(REPORT_FILE)
        metrics["monitor"] = monitor_metrics(report)
    art = out.commit(
        code_version=CODE_VERSION,
        config=run.config,
        parents=[scorer.ref],
        stats=lab.stats,
        metrics=metrics,
        rows=lab.rows,
        files=files,
    )
    st = art.manifest.stats
    msg = "label %s: in=%s out=%s rejected=%s (%d shards resumed) -> %s"  # pragma: no mutate
    shown = public_url(out.uri)
    runtime.log.info(msg, version, st["in"], st["out"], st["rejected"], lab.skipped, shown)  # pragma: no mutate
    if report is not None:  # one line, on stderr and in the run's logs; a warning when it alerts
        monitor_log = logging.getLogger(MONITOR_LOGGER)
        (monitor_log.warning if report["alert"] else monitor_log.info)("%s", report["summary"])  # pragma: no mutate
    return _summary(out, art.manifest, cached=False, skipped=lab.skipped, report=report)
