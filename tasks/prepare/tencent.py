"""The Tencent embeddings reader: header checked, blocks parsed in parallel and merged in file order.

Format: line 1 is a ``"<count> <dim>"`` header, then one ``word v1 ... vD`` line per word, fields separated by
single spaces. The header count is reported but never trusted (the public sample claims 8,824,330 words and
ships 9).

The job is split by module: :mod:`tasks.prepare.tencent_source` cuts the file (memory map, stream or tar member)
into blocks of whole lines; :mod:`tasks.prepare.tencent_kernel` parses a block (the numba kernel, which hands odd
lines to the careful reference parser of :mod:`tasks.prepare.tencent_careful`); this module runs the blocks through
a small thread pool (the kernel releases the GIL), merges them in file order, keeps the first of duplicate words
and counts rejects, so line numbers in ``rejects`` are exact file line numbers (the header is line 1).
:mod:`tasks.text.embedding_files` writes and loads the result.

``stats["lines_read"]`` counts data lines examined (the header excluded), so
``loaded + sum(rejected.values()) == lines_read`` always holds; ``header_mismatch`` compares the header count with
it once the file was read to the end (False when ``max_scan_num`` stopped the read). ``rejects`` keeps the first
100,000 records.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from models.numerics import available_cpus
from storage.urls import public_url
from tasks.common.rejects import DUPLICATE_WORD, NON_NUMERIC, SHORT_LINE, UNDECODABLE
from tasks.prepare.tencent_careful import Block, parse_block_careful
from tasks.prepare.tencent_kernel import kernel_available, parse_block_fast, rows_needed
from tasks.prepare.tencent_source import open_blocks

log = logging.getLogger(__name__)

__all__ = ["REJECT_REASONS", "TencentEmbeddings", "read_tencent"]

# in this order in stats["rejected"] (and so in the embeddings manifest); a change in what a given
# file parses to must bump tasks.prepare.embeddings.CODE_VERSION
REJECT_REASONS = (SHORT_LINE, NON_NUMERIC, UNDECODABLE, DUPLICATE_WORD)
# Every reject is counted in stats["rejected"]; only the first ones keep a record.
_MAX_REJECT_RECORDS = 100_000
_MAX_DIM = 1 << 20  # a larger header dim is taken for a broken header


@dataclass
class TencentEmbeddings:
    """The words and float32 vectors read from a Tencent file, with the read's stats and reject records."""

    words: list[str]
    vectors: np.ndarray  # float32 [n, d], C-contiguous
    stats: dict = field(default_factory=dict)
    rejects: list[dict] = field(default_factory=list)


def _parse_header(line: bytes, uri: str) -> tuple[int, int]:
    expected = "'<count> <dim>' header"
    try:
        text = line.decode("utf-8").lstrip("\ufeff").strip()
    except UnicodeDecodeError:
        text = None
    parts = text.split() if text else []
    if len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts):
        count, dim = int(parts[0]), int(parts[1])
        if 0 < dim <= _MAX_DIM:
            return count, dim
    shown = line[:80].decode("utf-8", errors="replace").rstrip("\r\n")
    raise ValueError(f"{uri}: line 1: expected {expected}, got {shown!r}")


class _ScratchPool:
    """Reusable float32 buffers for the kernel's output (saves page faults per block)."""

    def __init__(self, dim: int):
        self.dim = dim
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()

    def get(self, rows: int) -> np.ndarray:
        need = rows * self.dim
        with self.lock:
            for i, flat in enumerate(self.free):
                if flat.size >= need:
                    del self.free[i]
                    break
            else:
                flat = np.empty(max(need, 1), dtype=np.float32)
        return flat

    def put(self, flat: np.ndarray | None) -> None:
        if flat is not None:
            with self.lock:
                self.free.append(flat)


class _Rows:
    """A growable float32 [n, dim] array, trimmed in place at the end."""

    def __init__(self, dim: int):
        self.dim = dim
        self.n = 0
        self.arr = np.empty((0, dim), dtype=np.float32)

    def reserve(self, rows: int) -> None:
        if rows > self.arr.shape[0]:
            new = np.empty((rows, self.dim), dtype=np.float32)  # no zero-fill (unlike resize)
            new[: self.n] = self.arr[: self.n]
            self.arr = new

    def append(self, rows: np.ndarray) -> None:
        k = rows.shape[0]
        if self.n + k > self.arr.shape[0]:
            self.reserve(max(self.n + k, int(self.arr.shape[0] * 1.5) + 1024))
        self.arr[self.n : self.n + k] = rows
        self.n += k

    def finish(self) -> np.ndarray:
        out, self.arr = self.arr, np.empty((0, self.dim), dtype=np.float32)
        if out.shape[0] != self.n:
            try:  # shrinking realloc: no copy
                out.resize((self.n, self.dim), refcheck=False)
            except (ValueError, SystemError):  # pragma: no cover - does not own its data
                out = out[: self.n].copy()
        return out


def _workers() -> int:
    return max(1, min(available_cpus(), 8))


def read_tencent(
    uri: str,
    max_scan_num: int | None = None,
    *,
    block_size: int = 1 << 24,
    progress: bool = True,
) -> TencentEmbeddings:
    """Stream a Tencent-format embedding file (any fsspec URL, optionally compressed).

    Stops after ``max_scan_num`` accepted words (reading little beyond them).  Bad
    lines never stop the run; they are counted in ``stats["rejected"]`` and listed in
    ``rejects`` with their 1-based file line number.  Duplicate words keep the first.
    Plain local files are memory-mapped; anything else is read in blocks: ``.txt.gz`` (or
    ``.bz2``/``.zst``) decompressed by its suffix, and the v0.2.0 archives as downloaded through an
    fsspec chain ``tar://<dir>/<name>.txt::<path>/<name>.tar.gz``
    (:func:`tasks.prepare.tencent_source.open_tar_member`).
    """
    if max_scan_num is not None and max_scan_num < 0:
        raise ValueError(f"max_scan_num must be >= 0, got {max_scan_num}")
    block_size = max(int(block_size), 1 << 12)
    with open_blocks(uri) as (src, total):
        header = src.header()
        if not header:
            raise ValueError(f"{uri}: line 1: expected '<count> <dim>' header, got an empty file")
        count, dim = _parse_header(header, uri)
        with tqdm(
            total=total,
            initial=len(header),
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"read {posixpath.basename(str(uri)) or uri}",
            disable=not progress,
            leave=False,
        ) as bar:
            return _read_body(src, uri, count, dim, max_scan_num, block_size, bar, total)


def _read_body(src, uri, count, dim, max_scan_num, block_size, bar, total=None) -> TencentEmbeddings:
    fast = kernel_available()
    if not fast:
        log.warning("numba unavailable: parsing %s with the slow pure-Python parser", public_url(uri))
    pool_scratch = _ScratchPool(dim)

    def parse(block: np.ndarray) -> Block:
        if not fast:
            return parse_block_careful(block, dim)
        flat = pool_scratch.get(rows_needed(block.size + 1, dim))
        out = flat[: (flat.size // dim) * dim].reshape(-1, dim)
        b = parse_block_fast(block, dim, out)
        b.scratch = flat
        return b

    words: list[str] = []
    rows = _Rows(dim)
    seen: set[str] = set()
    rejected = {r: 0 for r in REJECT_REASONS}
    rejects: list[dict] = []
    loaded = 0
    next_line = 2  # file line number of the first line of the next block to merge
    lines_read = 0
    stopped = False
    bytes_done = 0
    lines_done = 0
    est_bpl = float(dim * 10 + 16)  # bytes per line, until measured

    def add_reject(line_no: int, reason: str, text: str) -> None:
        rejected[reason] += 1
        if len(rejects) < _MAX_REJECT_RECORDS:
            rejects.append({"line": line_no, "reason": reason, "text": text})

    def merge(block: Block) -> None:
        nonlocal loaded, next_line, lines_read, stopped
        if rows.arr.shape[0] == 0 and block.n_lines:
            # first block: size the result from the file size (or the word limit)
            guess = block.vectors.shape[0] * 4 + 1024
            if total:
                guess = int(total / max(est_bpl, 1.0) * 1.02) + 1024
            if max_scan_num is not None:
                guess = min(guess, max_scan_num)
            rows.reserve(guess)
        base = next_line
        bw = block.words
        limit = None if max_scan_num is None else max_scan_num - loaded
        rej = block.rejects
        # fast path: no duplicates, no rejects, no truncation
        if not rej and (limit is None or len(bw) < limit) and seen.isdisjoint(bw):
            n0 = len(seen)
            seen.update(bw)
            if len(seen) - n0 == len(bw):
                words.extend(bw)
                rows.append(block.vectors)
                loaded += len(bw)
                lines_read += block.n_lines
                next_line += block.n_lines
                return
            seen.difference_update(bw)  # a word repeats inside the block: all were new
        # slow path: walk words and rejects in line order
        keep: list[int] = []
        ri = 0
        last_line = block.n_lines - 1
        word_lines = block.word_lines.tolist()
        for i, w in enumerate(bw):
            li = word_lines[i]
            while ri < len(rej) and rej[ri][0] < li:
                add_reject(base + rej[ri][0], rej[ri][1], rej[ri][2])
                ri += 1
            if w in seen:
                add_reject(base + li, DUPLICATE_WORD, block.line_text(i))
                continue
            seen.add(w)
            keep.append(i)
            if limit is not None and len(keep) >= limit:
                last_line = li
                stopped = True
                break
        while ri < len(rej) and rej[ri][0] <= last_line:
            add_reject(base + rej[ri][0], rej[ri][1], rej[ri][2])
            ri += 1
        if len(keep) == len(bw):
            words.extend(bw)
            rows.append(block.vectors)
        elif keep:
            words.extend(bw[i] for i in keep)
            rows.append(block.vectors[keep])
        loaded += len(keep)
        lines_read += last_line + 1
        next_line += block.n_lines

    workers = _workers()
    if total and workers > 1:  # small files: blocks small enough to keep every worker busy
        block_size = min(block_size, max(1 << 20, total // (4 * workers)))
    pending: deque = deque()  # (future, n_bytes, block)
    inflight_bytes = 0
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tencent") as pool:

        def collect() -> None:
            nonlocal inflight_bytes, bytes_done, lines_done, est_bpl
            fut, nb, raw = pending.popleft()
            inflight_bytes -= nb
            block = fut.result()
            bytes_done += nb
            lines_done += block.n_lines
            if lines_done:
                est_bpl = max(bytes_done / lines_done, 1.0)
            if not stopped:
                merge(block)
            pool_scratch.put(block.scratch)
            src.release(raw)

        try:
            while not stopped:
                size = block_size
                if max_scan_num is not None:
                    need = max_scan_num - loaded - inflight_bytes / est_bpl
                    if need <= 0:
                        if not pending:  # nothing in flight: loaded >= max_scan_num
                            stopped = True
                            break
                        collect()
                        continue
                    size = int(min(block_size, max(1 << 16, need * est_bpl * 1.05 + 4096)))
                got = src.next_block(size)
                if got is None:
                    break
                block, nread = got
                bar.update(nread)
                pending.append((pool.submit(parse, block), block.size, block))
                inflight_bytes += block.size
                del block, got
                while pending and (len(pending) > workers or pending[0][0].done()):
                    collect()
                    if stopped:
                        break
            while pending and not stopped:
                collect()
        finally:
            for fut, _, _ in pending:  # stopped early (or failed): drop queued work
                fut.cancel()
            for fut, _, _ in pending:
                if not fut.cancelled():
                    try:
                        fut.result()
                    except Exception:
                        pass
            pending.clear()
        complete = not stopped and src.exhausted

    vectors = rows.finish()
    header_mismatch = bool(complete and count != lines_read)
    stats = {
        "header_count": count,
        "header_dim": dim,
        "loaded": loaded,
        "rejected": rejected,
        "lines_read": lines_read,
        "header_mismatch": header_mismatch,
    }
    if header_mismatch:
        log.warning("%s: header claims %d words but the file has %d data lines", public_url(uri), count, lines_read)
    n_rej = sum(rejected.values())
    if n_rej:
        log.warning(
            "%s: rejected %d of %d lines (%s); first: line %d %s",
            uri,
            n_rej,
            lines_read,
            ", ".join(f"{k}={v}" for k, v in rejected.items() if v),
            rejects[0]["line"],
            rejects[0]["reason"],
        )
    return TencentEmbeddings(words=words, vectors=vectors, stats=stats, rejects=rejects)
