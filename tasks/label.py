"""label: stream a table of texts through a bundle's classifier into sharded Parquet, resumably.

Input: CSV, TSV, JSON lines or Parquet on any fsspec URL or glob (sorted expansion; ``.gz``,
``.bz2``, ``.zst`` … inferred from the name). Files are *streamed* in batches of ``READ_ROWS``
rows at most; nothing holds more than one shard's row ids and probabilities at a time.

Counting unit (``in``): one data row (CSV/TSV/Parquet), one non-blank line (JSON lines).
Every row ends up either labelled (``part-*``) or rejected with a reason (``rejected-*``), so
``in == out + sum(rejected)`` holds and is checked before the manifest is written.

Output directory ``output_uri`` (not a versioned store path: the caller picks it)::

    _run.json                 written first: this run's version + config (refuses to mix versions)
    rejected-00000.parquet    row_id, reason, text (snippet), source, row   (only when non-empty)
    part-00000.parquet        row_id, prob (float32), label (int8), threshold, bundle_version
    ...
    _manifest.json            written last: stats, sha256 of every file (the commit marker)

Shard ``i`` covers input rows ``[i*shard_rows, (i+1)*shard_rows)`` in input order (files in
sorted order), and within a shard rows keep their input order. A shard's files are each written
under a temporary name and moved into place, ``rejected-i`` before ``part-i``, so an existing
``part-i`` means shard ``i`` is complete: a re-run after a crash skips it (the input is still
streamed, without scoring, to stay aligned) and computes only the missing shards.

Determinism: which rows are scored together depends only on the shard's rows and ``batch_size``
(windows of ``batch_size * WINDOW_BATCHES`` scorable rows, sorted by length, cut into mini-batches),
never on where the reader's batches fall, so a resumed run writes the same bytes as an
uninterrupted one (for the same torch thread count/device).
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from storage.artifacts import MANIFEST, TMP_MARK, ArtifactRef, ArtifactWriter, Manifest, Stats, compute_version
from tasks.common.stage import logger, pause_point

CODE_VERSION = "label-1"
RUN_FILE = "_run.json"
READ_ROWS = 4096  # rows per reader batch (memory bound of the reader)
WINDOW_BATCHES = 32  # a scoring window (sorted by length) = batch_size * WINDOW_BATCHES scorable rows
SNIPPET = 200
PART_SCHEMA = pa.schema(
    [
        ("row_id", pa.string()),
        ("prob", pa.float32()),
        ("label", pa.int8()),
        ("threshold", pa.float64()),
        ("bundle_version", pa.string()),
    ]
)
REJECT_SCHEMA = pa.schema(
    [
        ("row_id", pa.string()),
        ("reason", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("row", pa.int64()),
    ]
)
FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}

# reject reasons
EMPTY_TEXT = "empty_text"  # "" or whitespace only
EMPTY_AFTER_NORMALIZATION = "empty_after_normalization"  # e.g. only markup: the model would see [CLS][SEP]
MISSING_TEXT = "missing_text"  # null, or the key is absent (JSON lines)
NOT_A_STRING = "not_a_string"  # JSON value of another type
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"  # a JSON-lines line that does not parse to an object
MISSING_ID = "missing_id"  # id column given but null/empty in this row


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Source:
    """One input file: where it is, its format, and the name used in ``file:row`` ids."""

    fs: Any
    path: str
    fmt: str
    name: str
    size: int

    @property
    def uri(self) -> str:
        return self.fs.unstrip_protocol(self.path)


def file_format(path: str) -> str:
    """Format from the file name, compression suffix ignored: ``a.csv.gz`` -> ``csv``."""
    from fsspec.utils import infer_compression

    base = posixpath.basename(path)
    if infer_compression(base):
        base = posixpath.splitext(base)[0]
    ext = posixpath.splitext(base)[1].lower()
    if ext not in FORMATS:
        raise ValueError(f"{path}: cannot tell the input format from {ext or 'no extension'!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[ext]


def expand_inputs(input_uri: str | Sequence[str]) -> list[Source]:
    """Every input file, globs expanded in sorted order. Ids use the file's base name, or its path
    relative to the inputs' common directory when two inputs share a base name."""
    uris = [input_uri] if isinstance(input_uri, str) else list(input_uri)
    found: list[tuple[Any, str]] = []
    for u in uris:
        fs, path = fsspec.core.url_to_fs(u)
        if any(c in path for c in "*?["):
            paths = sorted(p for p in fs.glob(path) if fs.isfile(p))
            if not paths:
                raise FileNotFoundError(f"input_uri {u!r} matches no file")
        else:
            if not fs.exists(path):
                raise FileNotFoundError(f"input_uri {u!r}: no such file")
            if fs.isdir(path):
                raise ValueError(f"input_uri {u!r} is a directory; pass a glob such as {u.rstrip('/')}/*.csv")
            paths = [path]
        found.extend((fs, p) for p in paths)
    base = [posixpath.basename(p) for _, p in found]
    if len(set(base)) < len(base):
        common = posixpath.commonpath([posixpath.dirname(p) for _, p in found])
        base = [posixpath.relpath(p, common) for _, p in found]
    return [Source(fs, p, file_format(p), name, int(fs.size(p) or 0)) for (fs, p), name in zip(found, base)]


def fingerprint(src: Source) -> dict[str, Any]:
    """Identify an input (``storage.artifacts.fingerprint``) plus its name, which is in the row ids;
    the directory is not part of it, so moving the inputs keeps the version."""
    from storage.artifacts import fingerprint as bytes_fingerprint

    return {"name": src.name, "format": src.fmt, **bytes_fingerprint(src.fs, src.path)}


@dataclass
class RowBatch:
    """At most ``batch_rows`` consecutive data rows of one file."""

    start: int  # 0-based row number of the first row within its file
    texts: list[Any]  # str, None (missing), bytes (CSV: undecoded), or any JSON value
    ids: list[Any] | None  # raw id values, or None without an id column
    bad: list[str | None] | None = None  # a per-row reject reason found by the reader (JSON lines)
    done: float = 0.0  # fraction of the file consumed after this batch (progress only)

    def __len__(self) -> int:
        return len(self.texts)


def _open(src: Source):
    from fsspec.utils import infer_compression

    return fsspec.core.OpenFile(src.fs, src.path, "rb", compression=infer_compression(src.path))


def _csv_options(src: Source, columns: list[str] | None = None, types: dict[str, Any] | None = None):
    import pyarrow.csv as pacsv

    parse = pacsv.ParseOptions(delimiter="\t" if src.fmt == "tsv" else ",", newlines_in_values=True)
    conv = pacsv.ConvertOptions(include_columns=columns or [], column_types=types or {}, strings_can_be_null=False)
    return pacsv.ReadOptions(use_threads=False), parse, conv


def input_columns(src: Source) -> list[str] | None:
    """Column names of a file: the CSV/TSV header, the Parquet schema, or the keys of the first
    JSON-lines record (None for an empty JSON-lines file)."""
    if src.fmt in ("csv", "tsv"):
        import pyarrow.csv as pacsv

        ro, po, _ = _csv_options(src)
        with _open(src) as f:
            try:
                return list(pacsv.open_csv(f, read_options=ro, parse_options=po).schema.names)
            except pa.ArrowInvalid as e:
                if "Empty CSV file" in str(e):
                    return None  # a 0-byte file: no header, no rows
                raise ValueError(f"{src.uri}: cannot read the CSV header: {e}") from e
    if src.fmt == "parquet":
        import pyarrow.parquet as pq

        with src.fs.open(src.path, "rb") as f:
            return list(pq.ParquetFile(f).schema_arrow.names)
    with _open(src) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            if line.lstrip().startswith(b"["):
                raise ValueError(f"{src.uri}: looks like a JSON array; only JSON lines (one object per line) are supported")
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    return list(rec)
            if n > 1000:
                break
    return None


def check_columns(sources: Sequence[Source], text_column: str, id_column: str | None) -> None:
    """One clear error before any scoring when a file lacks the text (or id) column."""
    for src in sources:
        cols = input_columns(src)
        if cols is None:  # empty file, or JSON lines with no parseable record: rows, if any, are rejected
            continue
        for role, col in (("text", text_column), ("id", id_column)):
            if col is not None and col not in cols:
                raise ValueError(f"{src.uri}: {role} column {col!r} not found; the file has columns {cols}")


def read_batches(src: Source | str, text_column: str, id_column: str | None = None, batch_rows: int = READ_ROWS) -> Iterator[RowBatch]:
    """Stream one file as :class:`RowBatch` es of at most ``batch_rows`` rows (memory bound)."""
    if isinstance(src, str):
        (src,) = expand_inputs(src)
    if batch_rows < 1:
        raise ValueError("batch_rows must be >= 1")
    reader = {"csv": _read_csv, "tsv": _read_csv, "jsonl": _read_jsonl, "parquet": _read_parquet}[src.fmt]
    yield from reader(src, text_column, id_column, batch_rows)


def _frac(raw, size: int) -> float:
    try:
        return min(1.0, raw.tell() / size) if size else 1.0
    except Exception:
        return 0.0


def _read_csv(src: Source, text_column: str, id_column: str | None, batch_rows: int) -> Iterator[RowBatch]:
    import pyarrow.csv as pacsv

    cols = [text_column] + ([id_column] if id_column else [])
    # text as bytes (decoded per row: a bad byte rejects one row, not the file); ids as strings
    types = {text_column: pa.binary(), **({id_column: pa.string()} if id_column else {})}
    ro, po, co = _csv_options(src, cols, types)
    of = _open(src)
    with of as f:
        try:
            reader = pacsv.open_csv(f, read_options=ro, parse_options=po, convert_options=co)
        except pa.ArrowInvalid as e:
            if "Empty CSV file" in str(e):
                return
            raise
        row = 0
        while True:
            try:
                rb = reader.read_next_batch()
            except StopIteration:
                break
            except pa.ArrowInvalid as e:
                raise ValueError(f"{src.uri}: CSV parse error after data row {row}: {e}") from e
            for off in range(0, rb.num_rows, batch_rows):
                part = rb.slice(off, batch_rows)
                ids = part.column(id_column).to_pylist() if id_column else None
                yield RowBatch(row, part.column(text_column).to_pylist(), ids, None, _frac(of.fobjects[0], src.size))
                row += part.num_rows


def _read_jsonl(src: Source, text_column: str, id_column: str | None, batch_rows: int) -> Iterator[RowBatch]:
    of = _open(src)
    with of as f:
        row = 0
        texts: list[Any] = []
        ids: list[Any] = []
        bad: list[str | None] = []
        for line in f:
            if not line.strip():
                continue  # blank lines are not records
            text = rid = reason = None
            try:
                rec = json.loads(line)
            except UnicodeDecodeError:
                reason = INVALID_UTF8
            except ValueError:
                reason = INVALID_JSON
            else:
                if isinstance(rec, dict):
                    text = rec.get(text_column)
                    rid = rec.get(id_column) if id_column else None
                else:
                    reason = INVALID_JSON
            if reason is not None:
                text = line.decode("utf-8", "replace").strip()
            texts.append(text)
            ids.append(rid)
            bad.append(reason)
            if len(texts) == batch_rows:
                yield RowBatch(row, texts, ids if id_column else None, bad, _frac(of.fobjects[0], src.size))
                row += len(texts)
                texts, ids, bad = [], [], []
        if texts:
            yield RowBatch(row, texts, ids if id_column else None, bad, 1.0)


def _as_strings(col: pa.ChunkedArray | pa.Array, what: str) -> pa.ChunkedArray | pa.Array:
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return col
    try:
        return col.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return col  # left as is: non-string values are rejected row by row (not_a_string)


def _read_parquet(src: Source, text_column: str, id_column: str | None, batch_rows: int) -> Iterator[RowBatch]:
    import pyarrow.parquet as pq

    cols = [text_column] + ([id_column] if id_column else [])
    with src.fs.open(src.path, "rb") as f:
        pf = pq.ParquetFile(f)
        total = pf.metadata.num_rows
        row = 0
        for rb in pf.iter_batches(batch_size=batch_rows, columns=cols):
            texts = _as_strings(rb.column(text_column), "text").to_pylist()
            ids = _as_strings(rb.column(id_column), "id").to_pylist() if id_column else None
            row_end = row + rb.num_rows
            yield RowBatch(row, texts, ids, None, row_end / total if total else 1.0)
            row = row_end


# ----------------------------------------------------------------------------- rows


def row_reason(text: Any) -> str | None:
    """Why a text cannot be scored (None: it can). ``bytes`` are decoded by :func:`as_text` first."""
    if text is None:
        return MISSING_TEXT
    if not isinstance(text, str):
        return NOT_A_STRING
    if not text.strip():
        return EMPTY_TEXT
    return None


def as_text(value: Any) -> tuple[Any, str | None]:
    """(text, reason) for a raw reader value: CSV bytes are decoded here."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return value.decode("utf-8", "replace"), INVALID_UTF8
    return value, row_reason(value)


def id_string(value: Any) -> str | None:
    """An id value as a string; None for null/empty (the row is rejected as ``missing_id``)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value if value != "" else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    return str(value)


def _snippet(text: Any) -> str | None:
    if text is None:
        return None
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False, sort_keys=True, default=str)
    return text[:SNIPPET]


# ----------------------------------------------------------------------------- scoring


def _device(model) -> "Any":
    return next(model.parameters()).device


def _score_encoded(model, encs: list, batch_size: int) -> np.ndarray:
    """Probabilities for pre-encoded rows: sort by length, mini-batches with dynamic padding,
    inference mode (bf16 autocast on CUDA); returned in the input order."""
    import torch

    n = len(encs)
    out = np.empty(n, dtype=np.float32)
    if n == 0:
        return out
    dev = _device(model)
    lengths = np.fromiter((len(e.input_ids) for e in encs), dtype=np.int64, count=n)
    order = np.argsort(-lengths, kind="stable")  # longest first: the peak memory shows up at once
    W = encs[0].word_ids.shape[1]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
    with torch.inference_mode(), autocast:
        for s in range(0, n, batch_size):
            idx = order[s : s + batch_size]
            T = int(lengths[idx].max())
            ids = np.zeros((len(idx), T), dtype=np.int64)
            words = np.zeros((len(idx), T, W), dtype=np.int64)
            for r, i in enumerate(idx):
                L = lengths[i]
                ids[r, :L] = encs[i].input_ids
                words[r, :L] = encs[i].word_ids
            input_ids = torch.from_numpy(ids).to(dev, non_blocking=True)
            logits = model(input_ids, attention_mask=input_ids != 0, word_ids=torch.from_numpy(words).to(dev, non_blocking=True))
            out[idx] = torch.sigmoid(logits.float()).cpu().numpy()
    return out


def score_texts(bundle, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """float32 probabilities for ``texts`` (strings), in order. No rejection here: an empty text is
    scored as ``[CLS][SEP]``. Encoded and scored in windows, so memory does not grow with ``texts``."""
    window = batch_size * WINDOW_BATCHES
    out = np.empty(len(texts), dtype=np.float32)
    for s in range(0, len(texts), window):
        chunk = list(texts[s : s + window])
        out[s : s + len(chunk)] = _score_encoded(bundle.model, bundle.featurizer.encode(chunk), batch_size)
    return out


class ClassifierScorer:
    """What the labeller needs from a sentiment bundle: scores and the part-file columns.

    Another model (NER) plugs into the same streaming, resume and reconciliation machinery by
    providing the same five members: ``ref``, ``score``, ``part_table``, ``positive_column``, ``metrics``."""

    positive_column = "label"

    def __init__(self, bundle, batch_size: int):
        self.bundle, self.batch_size = bundle, batch_size
        self.ref = ArtifactRef(stage="bundle", version=bundle.version, uri=bundle.uri)

    def score(self, texts: list[str]) -> tuple[list[Any], set[int]]:
        """Outputs for the scorable texts (in order) and the indices that were empty after normalisation."""
        encs = self.bundle.featurizer.encode(texts)
        keep = [i for i, e in enumerate(encs) if len(e.input_ids) > 2]
        probs = _score_encoded(self.bundle.model, [encs[i] for i in keep], self.batch_size)
        return list(probs), set(range(len(texts))) - set(keep)

    def part_table(self, ids: list[str], outputs: list[Any]) -> pa.Table:
        probs = np.asarray(outputs, dtype=np.float32)
        th = float(self.bundle.threshold)
        labels = (probs.astype(np.float64) >= th).astype(np.int8)  # from the stored float32 value
        n = len(ids)
        return pa.table(
            {
                "row_id": pa.array(ids, pa.string()),
                "prob": pa.array(probs, pa.float32()),
                "label": pa.array(labels, pa.int8()),
                "threshold": pa.array(np.full(n, th), pa.float64()),
                "bundle_version": pa.array([self.bundle.version] * n, pa.string()),
            },
            schema=PART_SCHEMA,
        )

    def metrics(self) -> dict[str, Any]:
        return {"bundle_version": self.bundle.version, "threshold": float(self.bundle.threshold)}


# ----------------------------------------------------------------------------- output directory


class OutputDir(ArtifactWriter):
    """An ArtifactWriter onto a caller-chosen directory (not ``{store}/{stage}/{version}``):
    same tmp-then-move writes and the same manifest commit."""

    def __init__(self, uri: str, version: str):  # noqa: D107 - no store: the directory is given
        self.store = None
        self.stage, self.version = "label", version
        self.uri = uri.rstrip("/")
        self.fs, path = fsspec.core.url_to_fs(self.uri)
        self.path = path.rstrip("/")

    def rels(self) -> list[str]:
        if not self.fs.exists(self.path):
            return []
        out = []
        for full in self.fs.find(self.path):
            out.append(posixpath.relpath(full.rstrip("/"), self.path))
        return sorted(out)

    def read_json(self, rel: str) -> dict[str, Any] | None:
        if not self.exists(rel):
            return None
        with self.fs.open(self.file_path(rel), "rb") as f:
            return json.loads(f.read())

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.file_path(rel))


def part_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


def rejected_name(i: int) -> str:
    return f"rejected-{i:05d}.parquet"


def _ours(rel: str) -> bool:
    return rel in (MANIFEST, RUN_FILE) or TMP_MARK in rel or (rel.startswith(("part-", "rejected-")) and rel.endswith(".parquet") and "/" not in rel)


class OutputConflict(FileExistsError):
    """The output directory holds another label run's files."""


def claim_output(out: OutputDir, overwrite: bool) -> Manifest | None:
    """Decide fresh / resume / done for ``out``. Returns the manifest when this exact version is
    already committed (and complete); raises :class:`OutputConflict` rather than mix versions."""
    rels = out.rels()
    if not rels:
        return None
    if overwrite:
        for rel in rels:
            if _ours(rel):
                out.remove(rel)
        return None
    manifest = out.read_json(MANIFEST)
    run = out.read_json(RUN_FILE)
    theirs = (manifest or {}).get("version") or (run or {}).get("version")
    if theirs is None:
        raise OutputConflict(
            f"{out.uri} is not empty ({len(rels)} files, e.g. {rels[:3]}) and holds no label run; "
            "refusing to write into it: choose an empty output_uri or pass overwrite=True"
        )
    if theirs != out.version:
        raise OutputConflict(
            f"{out.uri} holds label output version {theirs}; this run (other bundle, input or settings) "
            f"is version {out.version}. Refusing to mix them: choose another output_uri or pass overwrite=True"
        )
    if manifest is not None:
        m = Manifest.model_validate(manifest)
        if all(out.exists(f.path) for f in m.files):
            return m
        out.remove(MANIFEST)  # files were deleted after the commit: recompute what is missing
    return None


# ----------------------------------------------------------------------------- shards


@dataclass
class _Shard:
    index: int
    skip: bool  # part file already committed by an earlier (killed) run
    rows: int = 0
    # per row (only when not skipped); reason None = scorable
    ids: list[str] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    snippets: list[str | None] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    rownums: list[int] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # one per scorable row, in row order
    window_pos: list[int] = field(default_factory=list)
    window_texts: list[str] = field(default_factory=list)


class _Labeller:
    def __init__(self, scorer, out: OutputDir, shard_rows: int, batch_size: int):
        self.scorer, self.out = scorer, out
        self.shard_rows, self.batch_size = shard_rows, batch_size
        self.window = batch_size * WINDOW_BATCHES
        self.stats = Stats()
        self.positive = 0
        self.rows: dict[str, int] = {}
        self.files: list[str] = []
        self.skipped = 0
        self.shard: _Shard | None = None

    # -- feeding
    def _new_shard(self, i: int) -> _Shard:
        return _Shard(i, self.out.exists(part_name(i)))

    def feed(self, src: Source, batch: RowBatch) -> Iterator[int]:
        """Add a reader batch; yields the index of every shard that got completed."""
        k, n = 0, len(batch)
        while k < n:
            if self.shard is None:
                self.shard = self._new_shard(self.stats.in_ // self.shard_rows)
            sh = self.shard
            take = min(n - k, self.shard_rows - sh.rows)
            if not sh.skip:
                self._add_rows(sh, src, batch, k, k + take)
            sh.rows += take
            self.stats.in_ += take
            k += take
            if sh.rows == self.shard_rows:
                self.finish_shard()
                yield sh.index

    def _add_rows(self, sh: _Shard, src: Source, batch: RowBatch, a: int, b: int) -> None:
        for j in range(a, b):
            rownum = batch.start + j
            text, reason = as_text(batch.texts[j])
            if batch.bad is not None and batch.bad[j] is not None:
                reason = batch.bad[j]
            rid = f"{src.name}:{rownum}"
            if batch.ids is not None:
                given = id_string(batch.ids[j])
                if given is None:
                    reason = MISSING_ID
                else:
                    rid = given
            sh.ids.append(rid)
            sh.reasons.append(reason)
            sh.sources.append(src.name)
            sh.rownums.append(rownum)
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
        outputs, empty = self.scorer.score(sh.window_texts)
        for i, pos in enumerate(sh.window_pos):
            if i in empty:
                sh.reasons[pos] = EMPTY_AFTER_NORMALIZATION
                sh.snippets[pos] = _snippet(sh.window_texts[i])
        sh.outputs.extend(outputs)
        sh.window_pos, sh.window_texts = [], []

    # -- committing
    def finish_shard(self) -> None:
        sh, self.shard = self.shard, None
        if sh is None:
            return
        part, rej = part_name(sh.index), rejected_name(sh.index)
        if sh.skip:
            out, reasons, positive = self._read_existing(sh)
            self.skipped += 1
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
        self.files.append(part)
        self.rows[part] = out

    def _write_shard(self, sh: _Shard) -> tuple[int, dict[str, int], int]:
        from storage.parquet import write_table

        ok = [r is None for r in sh.reasons]
        ids = [i for i, good in zip(sh.ids, ok) if good]
        if len(ids) != len(sh.outputs):
            raise AssertionError(f"shard {sh.index}: {len(ids)} scorable rows but {len(sh.outputs)} outputs")
        rej_idx = [i for i, good in enumerate(ok) if not good]
        rej = self.out.file_path(rejected_name(sh.index))
        if rej_idx:  # rejected first: part-i is the shard's commit marker
            table = pa.table(
                {
                    "row_id": [sh.ids[i] for i in rej_idx],
                    "reason": [sh.reasons[i] for i in rej_idx],
                    "text": [sh.snippets[i] for i in rej_idx],
                    "source": [sh.sources[i] for i in rej_idx],
                    "row": [sh.rownums[i] for i in rej_idx],
                },
                schema=REJECT_SCHEMA,
            )
            write_table(self.out, rejected_name(sh.index), table)
        elif self.out.fs.exists(rej):
            self.out.remove(rejected_name(sh.index))
        table = self.scorer.part_table(ids, sh.outputs)
        write_table(self.out, part_name(sh.index), table)
        positive = int(np.asarray(table.column(self.scorer.positive_column)).sum()) if len(ids) else 0
        return len(ids), dict(Counter(sh.reasons[i] for i in rej_idx)), positive

    def _read_existing(self, sh: _Shard) -> tuple[int, dict[str, int], int]:
        """Counts of a shard committed by an earlier run (read back, not recomputed)."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        with self.out.fs.open(self.out.file_path(part_name(sh.index)), "rb") as f:
            labels = pq.read_table(f, columns=[self.scorer.positive_column]).column(self.scorer.positive_column)
        positive = int(pc.sum(labels).as_py() or 0)
        reasons: Counter = Counter()
        if self.out.exists(rejected_name(sh.index)):
            with self.out.fs.open(self.out.file_path(rejected_name(sh.index)), "rb") as f:
                reasons.update(pq.read_table(f, columns=["reason"]).column("reason").to_pylist())
        return len(labels), dict(reasons), positive


# ----------------------------------------------------------------------------- main


def _in_prefect_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def label_config(sources: Sequence[Source], text_column: str, id_column: str | None, shard_rows: int, batch_size: int) -> dict[str, Any]:
    return {
        "inputs": [fingerprint(s) for s in sources],
        "text_column": text_column,
        "id_column": id_column,
        "shard_rows": shard_rows,
        "batch_size": batch_size,
    }


def _summary(out: OutputDir, m: Manifest, cached: bool, skipped: int = 0) -> dict[str, Any]:
    return {
        "uri": out.uri,
        "version": m.version,
        "stats": m.stats,
        "metrics": m.metrics,
        "files": [f.model_dump() for f in m.files],
        "parts": [f.path for f in m.files if f.path.startswith("part-")],
        "cached": cached,
        "skipped_shards": skipped,
    }


def label_stream(
    bundle,
    input_uri: str | Sequence[str],
    output_uri: str,
    text_column: str = "review",
    id_column: str | None = None,
    shard_rows: int = 50_000,
    batch_size: int = 64,
    overwrite: bool = False,
    progress: bool = True,
    threads: int | None = None,
    read_rows: int = READ_ROWS,
) -> dict[str, Any]:
    """Label every row of ``input_uri`` with ``bundle`` into ``output_uri`` (see the module doc).

    ``bundle`` is a sentiment :class:`tasks.train.bundle.Bundle`, or any scorer with the members of
    :class:`ClassifierScorer` (the NER model's ``tasks.ner.train.NerScorer``).

    Returns a summary: ``uri``, ``version``, ``stats`` {in, out, rejected{reason: n}}, ``metrics``,
    ``files`` (path, bytes, sha256, rows), ``parts``, ``cached`` (already complete: nothing done)
    and ``skipped_shards`` (committed by an earlier, interrupted run). ``threads`` sets torch's CPU
    thread count for the run (restored afterwards); equal settings give identical bytes."""
    import torch
    from tqdm.auto import tqdm

    if id_column is not None and id_column == text_column:
        raise ValueError(f"id_column and text_column are both {text_column!r}")
    if shard_rows < 1 or batch_size < 1 or read_rows < 1:
        raise ValueError(f"shard_rows ({shard_rows}), batch_size ({batch_size}) and read_rows ({read_rows}) must be >= 1")
    sources = expand_inputs(input_uri)
    check_columns(sources, text_column, id_column)
    config = label_config(sources, text_column, id_column, shard_rows, batch_size)
    scorer = bundle if hasattr(bundle, "part_table") else ClassifierScorer(bundle, batch_size)
    bundle_ref = scorer.ref
    version = compute_version("label", CODE_VERSION, config, [bundle_ref])
    out = OutputDir(output_uri, version)
    done = claim_output(out, overwrite)
    if done is not None:
        logger().info("label %s: %s is already complete, nothing to do", version, out.uri)
        return _summary(out, done, cached=True)

    run_info = {"stage": "label", "version": version, "code_version": CODE_VERSION, "config": config, "bundle": bundle_ref.model_dump()}
    run_bytes = json.dumps(run_info, indent=1, sort_keys=True, ensure_ascii=False).encode()
    if out.read_json(RUN_FILE) != run_info:
        out.write_bytes(RUN_FILE, run_bytes)
    for rel in out.rels():  # temp files of a killed run
        if TMP_MARK in rel:
            out.remove(rel)

    lab = _Labeller(scorer, out, shard_rows, batch_size)
    total_bytes = sum(s.size for s in sources) or 1
    prefect_progress = None
    if _in_prefect_run():
        from tasks.common.stage import Progress

        prefect_progress = Progress("label", total_bytes)
    done_bytes = 0.0

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    bar = tqdm(total=None, unit="row", desc=f"label {version}", disable=not progress)
    try:
        for fi, src in enumerate(sources):
            before = sum(s.size for s in sources[:fi])
            for batch in read_batches(src, text_column, id_column, read_rows):
                for _shard in lab.feed(src, batch):
                    if prefect_progress is not None:
                        now = before + batch.done * src.size
                        prefect_progress.step(max(0.0, now - done_bytes))
                        done_bytes = max(done_bytes, now)
                    pause_point("label")
                bar.update(len(batch))
        if lab.shard is not None or lab.stats.in_ == 0:
            if lab.shard is None:  # empty input: still one (empty) part file
                lab.shard = lab._new_shard(0)
            lab.finish_shard()
        if prefect_progress is not None:
            prefect_progress.step(max(0.0, total_bytes - done_bytes))
    finally:
        bar.close()
        if threads:
            torch.set_num_threads(old_threads)

    if not lab.stats.reconciles():
        raise RuntimeError(f"label: counts do not reconcile: {lab.stats.dump()}")
    metrics = {
        **scorer.metrics(),
        "positive": lab.positive,
        "shards": sum(1 for f in lab.files if f.startswith("part-")),
        "input_files": len(sources),
    }
    art = out.commit(
        code_version=CODE_VERSION,
        config=config,
        parents=[bundle_ref],
        stats=lab.stats,
        metrics=metrics,
        rows=lab.rows,
        files=[RUN_FILE, *lab.files],
    )
    st = art.manifest.stats
    logger().info("label %s: in=%s out=%s rejected=%s (%d shards resumed) -> %s", version, st["in"], st["out"], st["rejected"], lab.skipped, out.uri)
    return _summary(out, art.manifest, cached=False, skipped=lab.skipped)


# ----------------------------------------------------------------------------- Prefect wrapper
from prefect import task  # noqa: E402
from prefect.cache_policies import NONE  # noqa: E402


@task(name="label", cache_policy=NONE)
def label_task(
    bundle,
    input_uri: str,
    output_uri: str,
    text_column: str = "review",
    id_column: str | None = None,
    shard_rows: int = 50_000,
    batch_size: int = 64,
    overwrite: bool = False,
    progress: bool = True,
    threads: int | None = None,
) -> dict[str, Any]:
    return label_stream(bundle, input_uri, output_uri, text_column, id_column, shard_rows, batch_size, overwrite, progress, threads)
