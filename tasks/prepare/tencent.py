"""Tencent embeddings file: the text parser (fast numba kernel + careful reference), reader, save and load.

Pure logic, no Prefect; the ``embeddings`` stage (:mod:`tasks.prepare.embeddings`) runs it.

Format: line 1 is a ``"<count> <dim>"`` header, then one ``word v1 ... vD`` line per
word, fields separated by single spaces.  The header count is reported but never
trusted (the public sample claims 8,824,330 words and ships 9).

Two parsers share one definition of a valid line:

* the *careful* parser (:func:`_parse_line_careful`), plain Python, is the reference
  semantics: decode UTF-8, strip trailing whitespace, split on single spaces; the last
  ``D`` fields are the vector (``float()`` each, then float32), everything before them,
  joined with single spaces, is the word (so words may contain spaces);
* the *fast* parser (:func:`_parse_block_fast`), a numba kernel, handles the common
  subset (a word without spaces + ``D`` plain decimals such as ``-0.123456`` or
  ``1e-05``) and hands every other line to the careful parser.  Its numbers are
  bit-identical to ``np.float32(float(text))``: ``D.DDDDDD`` values (the Tencent
  layout) are checked and converted 8 bytes at a time; other decimals ``m * 10**e``
  with ``m <= 2**53`` and ``|e| <= 22`` take Clinger's fast path (exact operands, one
  IEEE rounding, so the same double as ``float()``; ``m / 10**k`` is computed as
  ``m * 10**-k`` unless that lands within 8 ulps of a float32 rounding midpoint),
  then are rounded to float32 as numpy does; anything else goes to the careful parser.

Plain local files are memory-mapped, anything else (compressed, remote, memory://, a member
of a tar archive named by ``tar://<member>::<archive>``) is read in blocks; blocks of whole
lines are cut in order on the calling thread, parsed by a small thread pool (the kernel
releases the GIL) and merged in file order,
so line numbers in ``rejects`` are exact file line numbers (the header is line 1).

``stats["lines_read"]`` counts data lines examined (the header excluded), so
``loaded + sum(rejected.values()) == lines_read`` always holds; ``header_mismatch``
compares the header count with it once the file was read to the end (False when
``max_scan_num`` stopped the read).  ``rejects`` keeps the first 100,000 records.
"""

from __future__ import annotations

import contextlib
import io
import logging
import mmap
import os
import posixpath
import tarfile
import threading
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec
import numpy as np
from tqdm import tqdm

from storage.urls import public_url
from tasks.common.rejects import DUPLICATE_WORD, NON_NUMERIC, SHORT_LINE, UNDECODABLE

log = logging.getLogger(__name__)

__all__ = [
    "TencentEmbeddings",
    "read_tencent",
    "save_embeddings",
    "load_embeddings",
    "load_embedding_words",
    "VectorRows",
    "REJECT_REASONS",
]

# in this order in stats["rejected"] (and so in the embeddings manifest); a change in what a given
# file parses to must bump tasks.prepare.embeddings.CODE_VERSION
REJECT_REASONS = (SHORT_LINE, NON_NUMERIC, UNDECODABLE, DUPLICATE_WORD)
VECTORS_FILE = "vectors.npy"
WORDS_FILE = "words.txt"
_REJECT_TEXT_CHARS = 120
# Every reject is counted in stats["rejected"]; only the first ones keep a record.
_MAX_REJECT_RECORDS = 100_000
_HEADER_MAX_BYTES = 1 << 16
_MAX_DIM = 1 << 20  # a larger header dim is taken for a broken header
_RELEASE_BYTES = 64 << 20  # drop mapped input pages from the resident set in steps of this


@dataclass
class TencentEmbeddings:
    words: list[str]
    vectors: np.ndarray  # float32 [n, d], C-contiguous
    stats: dict = field(default_factory=dict)
    rejects: list[dict] = field(default_factory=list)


# --------------------------------------------------------------------------- careful


def _parse_line_careful(raw: bytes, dim: int):
    """Parse one line (without its ``\\n``). Returns ``(word, floats)`` or a reason str."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return UNDECODABLE
    parts = text.rstrip().split(" ")
    if len(parts) < dim + 1:
        return SHORT_LINE
    try:
        values = [float(x) for x in parts[len(parts) - dim :]]
    except ValueError:
        return NON_NUMERIC
    word = parts[0] if len(parts) == dim + 1 else " ".join(parts[: len(parts) - dim])
    return word, values


def _reject_text(raw: bytes) -> str:
    return raw[: _REJECT_TEXT_CHARS * 4].decode("utf-8", errors="replace")[:_REJECT_TEXT_CHARS]


@dataclass
class _Block:
    """Parse result of one block of whole lines; ``*_lines`` are 0-based within the block."""

    n_lines: int
    words: list[str]
    vectors: np.ndarray  # float32 [len(words), dim]
    word_lines: np.ndarray  # int64 [len(words)]
    word_starts: np.ndarray  # int64 [len(words)]: byte offset of each word's line in buf
    buf: np.ndarray  # uint8: the block (kept for the text of duplicate rejects)
    rejects: list[tuple[int, str, str]]  # (line in block, reason, text), in line order
    scratch: np.ndarray | None = None  # pooled buffer that ``vectors`` may view

    def line_text(self, i: int) -> str:
        s = int(self.word_starts[i])
        raw = self.buf[s : s + _REJECT_TEXT_CHARS * 4].tobytes().split(b"\n", 1)[0]
        return _reject_text(raw)


def _parse_block_careful(data, dim: int) -> _Block:
    """Careful pure-Python parse of a block of whole lines (bytes-like)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    lines = buf.tobytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the block ends with a newline: no extra line after it
    words: list[str] = []
    rows: list[list[float]] = []
    word_lines: list[int] = []
    word_starts: list[int] = []
    rejects: list[tuple[int, str, str]] = []
    pos = 0
    for i, line in enumerate(lines):
        res = _parse_line_careful(line, dim)
        if isinstance(res, str):
            rejects.append((i, res, _reject_text(line)))
        else:
            words.append(res[0])
            rows.append(res[1])
            word_lines.append(i)
            word_starts.append(pos)
        pos += len(line) + 1
    vectors = np.array(rows, dtype=np.float32).reshape(len(rows), dim)
    return _Block(
        len(lines),
        words,
        vectors,
        np.array(word_lines, dtype=np.int64),
        np.array(word_starts, dtype=np.int64),
        buf,
        rejects,
    )


# --------------------------------------------------------------------------- fast

_POW10 = np.array([10.0**i for i in range(23)], dtype=np.float64)
_INV10 = np.array([float(f"1e-{i}") for i in range(23)], dtype=np.float64)
_TWO53 = 1 << 53
_LO = 1.0 - 2.0**-49
_HI = 1.0 + 2.0**-49
_E6 = float("1e-6")
_u = np.uint64  # index with unsigned ints: numba then skips negative-index wraparound
# SWAR constants for the 8-byte "D.DDDDDD" fast path
_SW_ZEROS = np.uint64(0x3030303030303030)
_SW_NOT_DOT = np.uint64(0xFFFFFFFFFFFF00FF)
_SW_ADD = np.uint64(0x7676767676767676)
_SW_HIGH = np.uint64(0x8080808080808080)
_SW_M = np.uint64(0x000000FF000000FF)
_SW_MUL1 = np.uint64(0x000F424000000064)  # 100 + (1000000 << 32)
_SW_MUL2 = np.uint64(0x0000271000000001)  # 1 + (10000 << 32)


def _kernel_py(buf, dim, out):  # pragma: no cover - compiled by numba
    """Parse a block of whole lines; ``buf`` must be empty or end with ``\\n``; ``out``
    (float32, C order) needs at least ``min(lines, buf.size // (2 * dim) + 1)`` rows.

    Returns ``(n_lines, n_ok, ok_line, ok_start, words, words_len, bad_line,
    bad_start, bad_end, n_bad)``: ``out[:n_ok]`` holds the vectors of the lines the
    kernel accepted, ``words[:words_len]`` their words, each followed by ``\\n``;
    ``bad_*[:n_bad]`` the lines it leaves to the careful parser.  Every line ends
    with ``\\n``, which no scanning loop below goes past, so they need no bounds
    checks.

    A value is either the common ``D.DDDDDD`` (checked and converted 8 bytes at a
    time: float32(m * 1e-6) equals float32(m / 1e6) for every m < 10**7, checked
    exhaustively) or parsed digit by digit into ``m * 10**ex`` (Clinger's fast path,
    see the module docstring); anything else sends the line to the careful parser.
    """
    n = buf.size
    n_lines = 0
    for i in range(n):
        if buf[_u(i)] == 10:
            n_lines += 1
    # A line the kernel accepts has at least 2*dim bytes including its newline.
    max_ok = min(n_lines, n // (2 * dim) + 1)
    if out.shape[0] < max_ok or out.shape[1] != dim:
        raise ValueError("kernel: out has too few rows or the wrong width")
    ok_line = np.empty(max_ok, dtype=np.int64)
    ok_start = np.empty(max_ok, dtype=np.int64)
    bad_line = np.empty(n_lines, dtype=np.int64)
    bad_start = np.empty(n_lines, dtype=np.int64)
    bad_end = np.empty(n_lines, dtype=np.int64)
    words = np.empty(n + 1, dtype=np.uint8)
    n_ok = 0
    n_bad = 0
    wpos = 0
    pos = 0
    line = 0
    last = dim - 1
    while pos < n:
        ls = pos
        p = pos
        while buf[_u(p)] != 32 and buf[_u(p)] != 10:
            p += 1
        wend = p
        ok = buf[_u(p)] == 32
        if ok:
            p += 1
            for j in range(dim):
                c = buf[_u(p)]
                neg = c == 45  # '-'
                p += np.int64(neg or c == 43)  # '+'
                fast = False
                f = np.float32(0.0)
                if p + 9 <= n:
                    q = _u(p)
                    x = (
                        _u(buf[q])
                        | (_u(buf[q + _u(1)]) << _u(8))
                        | (_u(buf[q + _u(2)]) << _u(16))
                        | (_u(buf[q + _u(3)]) << _u(24))
                        | (_u(buf[q + _u(4)]) << _u(32))
                        | (_u(buf[q + _u(5)]) << _u(40))
                        | (_u(buf[q + _u(6)]) << _u(48))
                        | (_u(buf[q + _u(7)]) << _u(56))
                    )
                    c8 = buf[q + _u(8)]
                    y = (x ^ _SW_ZEROS) & _SW_NOT_DOT  # digits -> 0..9, the '.' -> 0
                    if (
                        ((y + _SW_ADD) | y) & _SW_HIGH == _u(0)  # 7 digits around ...
                        and (x >> _u(8)) & _u(0xFF) == _u(46)  # ... a '.' at byte 1
                        and (c8 == 32 or c8 == 10)
                    ):
                        v8 = y * _u(10) + (y >> _u(8))
                        v8 = (((v8 & _SW_M) * _SW_MUL1) + (((v8 >> _u(16)) & _SW_M) * _SW_MUL2)) >> _u(32)
                        # v8 is the value of "d0 0 dddddd"; m is that of "d0 dddddd"
                        m = np.int64(v8) - np.int64(y & _u(0xFF)) * 9000000
                        f = np.float32(float(m) * _E6)
                        p += 8
                        fast = True
                if not fast:
                    m = 0
                    q = p
                    while True:
                        d = np.int64(buf[_u(p)]) - 48
                        if d < 0 or d > 9:
                            break
                        m = m * 10 + d
                        p += 1
                    nd = p - q
                    fr = 0
                    if buf[_u(p)] == 46:  # '.'
                        p += 1
                        q = p
                        while True:
                            d = np.int64(buf[_u(p)]) - 48
                            if d < 0 or d > 9:
                                break
                            m = m * 10 + d
                            p += 1
                        fr = p - q
                        nd += fr
                    if nd == 0 or (nd > 15 and (nd > 18 or m > _TWO53)):
                        ok = False
                        break
                    ex = -fr
                    c = buf[_u(p)]
                    if c == 101 or c == 69:  # 'e' / 'E'
                        p += 1
                        c = buf[_u(p)]
                        eneg = c == 45
                        if eneg or c == 43:
                            p += 1
                        ev = 0
                        q = p
                        while True:
                            d = np.int64(buf[_u(p)]) - 48
                            if d < 0 or d > 9:
                                break
                            if ev < 100000:
                                ev = ev * 10 + d
                            p += 1
                        if p == q:
                            ok = False
                            break
                        ex += -ev if eneg else ev
                    x64 = float(m)
                    if ex == 0:
                        f = np.float32(x64)
                    elif 0 < ex <= 22:
                        f = np.float32(x64 * _POW10[ex])  # exact operands, one rounding
                    elif -22 <= ex < 0:
                        # x64 / 10**k is the correctly rounded double that float() gives;
                        # x64 * 10**-k is within 3 ulps of it and rounds to the same
                        # float32 unless a float32 midpoint lies within 8 ulps.
                        v = x64 * _INV10[-ex]
                        f = np.float32(v * _LO)
                        if f != np.float32(v * _HI):
                            f = np.float32(x64 / _POW10[-ex])
                    else:
                        ok = False
                        break
                # a value ends at a single space; the last one at the end of the line
                c = buf[_u(p)]
                if j != last:
                    if c != 32:
                        ok = False
                        break
                    p += 1
                else:
                    # trailing ASCII whitespace is stripped, like str.rstrip()
                    while c == 32 or c == 9 or c == 13 or c == 11 or c == 12:
                        p += 1
                        c = buf[_u(p)]
                    if c != 10:
                        ok = False
                        break
                out[_u(n_ok), _u(j)] = -f if neg else f
        # every loop above stops at the line's newline at the latest
        while buf[_u(p)] != 10:
            p += 1
        if ok:
            ok_line[n_ok] = line
            ok_start[n_ok] = ls
            n_ok += 1
            for k in range(ls, wend):
                words[wpos] = buf[_u(k)]
                wpos += 1
            words[wpos] = 10
            wpos += 1
        else:
            bad_line[n_bad] = line
            bad_start[n_bad] = ls
            bad_end[n_bad] = p
            n_bad += 1
        line += 1
        pos = p + 1
    return (n_lines, n_ok, ok_line, ok_start, words, wpos, bad_line, bad_start, bad_end, n_bad)


_kernel = None
_kernel_lock = threading.Lock()


def _get_kernel():
    """The block kernel, compiled by numba on first use (and cached on disk by numba);
    None when numba cannot be imported (everything then takes the careful path)."""
    global _kernel
    if _kernel is None:
        with _kernel_lock:
            if _kernel is None:
                try:  # imported lazily: loading cached embeddings does not need numba
                    import numba
                except Exception:  # pragma: no cover - only on broken installs
                    _kernel = False
                else:
                    _kernel = numba.njit(nogil=True, cache=True, boundscheck=False)(_kernel_py)
    return _kernel or None


def _rows_needed(nbytes: int, dim: int) -> int:
    """Upper bound on the lines the kernel accepts in ``nbytes`` bytes."""
    return nbytes // (2 * dim) + 1


def _parse_block_fast(data, dim: int, out: np.ndarray | None = None) -> _Block:
    """Parse a block of whole lines (bytes-like) with the kernel; odd lines go careful.

    ``out`` (float32 ``[>= _rows_needed(len(data), dim), dim]``) receives the vectors;
    the returned block's ``vectors`` may be a view of it."""
    kernel = _get_kernel()
    if kernel is None:
        return _parse_block_careful(data, dim)
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size and buf[-1] != 10:  # the file's last line has no newline
        buf = np.frombuffer(buf.tobytes() + b"\n", dtype=np.uint8)
    if buf.flags.writeable:  # one array type for numba: one compiled specialisation
        buf = buf.view()
        buf.flags.writeable = False
    if out is None:
        out = np.empty((_rows_needed(buf.size, dim), dim), dtype=np.float32)
    (n_lines, n_ok, ok_line, ok_s, wbuf, wpos, bad_line, bad_s, bad_e, n_bad) = kernel(
        buf, dim, out
    )
    vectors = out[:n_ok]
    word_lines = ok_line[:n_ok]
    word_starts = ok_s[:n_ok]
    wbytes = wbuf[:wpos].tobytes()
    rejects: list[tuple[int, str, str]] = []
    try:
        words = wbytes.decode("utf-8").split("\n")
        words.pop()  # after the final separator
    except UnicodeDecodeError:  # rare: find the undecodable words one by one
        words, keep = [], []
        for i, w in enumerate(wbytes.split(b"\n")[:-1]):
            try:
                words.append(w.decode("utf-8"))
                keep.append(i)
            except UnicodeDecodeError:
                s = int(word_starts[i])
                raw = buf[s : s + _REJECT_TEXT_CHARS * 4].tobytes().split(b"\n", 1)[0]
                rejects.append((int(word_lines[i]), UNDECODABLE, _reject_text(raw)))
        vectors, word_lines, word_starts = vectors[keep], word_lines[keep], word_starts[keep]
    if n_bad:
        extra_words: list[str] = []
        extra_rows: list[list[float]] = []
        extra_lines: list[int] = []
        extra_starts: list[int] = []
        for k in range(n_bad):
            raw = buf[bad_s[k] : bad_e[k]].tobytes()
            li = int(bad_line[k])
            res = _parse_line_careful(raw, dim)
            if isinstance(res, str):
                rejects.append((li, res, _reject_text(raw)))
            else:
                extra_words.append(res[0])
                extra_rows.append(res[1])
                extra_lines.append(li)
                extra_starts.append(int(bad_s[k]))
        if extra_words:
            all_lines = np.concatenate([word_lines, np.array(extra_lines, dtype=np.int64)])
            order = np.argsort(all_lines, kind="stable")
            vectors = np.concatenate(
                [vectors, np.array(extra_rows, dtype=np.float32).reshape(-1, dim)]
            )[order]
            merged = words + extra_words
            words = [merged[i] for i in order.tolist()]
            word_lines = all_lines[order]
            word_starts = np.concatenate(
                [word_starts, np.array(extra_starts, dtype=np.int64)]
            )[order]
    if rejects:
        rejects.sort(key=lambda r: r[0])
    return _Block(int(n_lines), words, vectors, word_lines, word_starts, buf, rejects)


# --------------------------------------------------------------------------- reading


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


class _StreamSource:
    """Newline-aligned blocks read from a file object into fresh numpy buffers."""

    def __init__(self, f):
        self.f = f
        self.carry = b""
        self.eof = False
        self._readinto = getattr(f, "readinto", None)

    @property
    def exhausted(self) -> bool:
        return self.eof and not self.carry

    def header(self) -> bytes:
        """The first line; what was read past it becomes the start of the first block
        (plain ``read``: not every decompressing reader has ``readline``)."""
        data = b""
        while b"\n" not in data and len(data) < _HEADER_MAX_BYTES:
            chunk = self.f.read(4096)
            if not chunk:
                self.eof = True
                break
            data += chunk
        cut = data.find(b"\n")
        cut = min(len(data), _HEADER_MAX_BYTES) if cut < 0 else cut + 1
        self.carry = data[cut:]
        return data[:cut]

    def release(self, block: np.ndarray) -> None:
        pass

    def close(self) -> None:
        pass

    def _fill(self, buf: np.ndarray, start: int) -> int:
        """Fill ``buf[start:]`` as far as the file allows; returns the end offset."""
        pos = start
        end = buf.size
        while pos < end:
            if self._readinto is not None:
                try:
                    n = self._readinto(memoryview(buf[pos:]))
                except (io.UnsupportedOperation, NotImplementedError, AttributeError):
                    self._readinto = None
                    continue
            else:
                chunk = self.f.read(end - pos)
                n = len(chunk)
                buf[pos : pos + n] = np.frombuffer(chunk, dtype=np.uint8)
            if not n:
                self.eof = True
                break
            pos += n
        return pos

    def next_block(self, size: int):
        """``(block, n_bytes_read)``: a uint8 array of whole lines, or None at the end."""
        size = max(int(size), 1)
        got = 0
        while True:
            if self.eof:
                if not self.carry:
                    return None
                data, self.carry = self.carry, b""
                return np.frombuffer(data, dtype=np.uint8), got
            c = len(self.carry)
            buf = np.empty(c + size, dtype=np.uint8)
            if c:
                buf[:c] = np.frombuffer(self.carry, dtype=np.uint8)
            end = self._fill(buf, c)
            got += end - c
            if self.eof:
                self.carry = b""
                if end == 0:
                    return None
                return buf[:end], got
            cut = _rfind_newline(buf, end)
            if cut < 0:  # one line longer than the block: keep reading
                self.carry = buf[:end].tobytes()
                size *= 2
                continue
            self.carry = buf[cut + 1 : end].tobytes()
            return buf[: cut + 1], got


def _rfind_newline(buf: np.ndarray, end: int) -> int:
    window = 1 << 16
    hi = end
    while hi > 0:
        lo = max(0, hi - window)
        k = buf[lo:hi].tobytes().rfind(b"\n")
        if k >= 0:
            return lo + k
        hi = lo
        window *= 4
    return -1


class _MmapSource:
    """Newline-aligned blocks as views of a memory-mapped local file (no copies)."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if hasattr(self.mm, "madvise") and hasattr(mmap, "MADV_SEQUENTIAL"):
            self.mm.madvise(mmap.MADV_SEQUENTIAL)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.size = len(self.mm)
        self.pos = 0
        self.released = 0
        self.base = self.arr.ctypes.data

    @property
    def exhausted(self) -> bool:
        return self.pos >= self.size

    def header(self) -> bytes:
        end = self.mm.find(b"\n", 0, _HEADER_MAX_BYTES)
        end = min(self.size, _HEADER_MAX_BYTES) if end < 0 else end + 1
        self.pos = end
        return self.mm[:end]

    def next_block(self, size: int):
        if self.pos >= self.size:
            return None
        start = self.pos
        end = min(self.size, start + max(int(size), 1))
        if end < self.size:
            cut = self.mm.rfind(b"\n", start, end)
            if cut < 0:  # one line longer than the block
                cut = self.mm.find(b"\n", end)
            end = self.size if cut < 0 else cut + 1
        self.pos = end
        return self.arr[start:end], end - start

    def release(self, block: np.ndarray) -> None:
        """Drop the pages of everything up to the end of ``block`` (merged, in file
        order) from this process's resident set; the page cache keeps them."""
        end = block.ctypes.data + block.size - self.base
        if not (0 <= end <= self.size) or not hasattr(self.mm, "madvise"):
            return  # not a view of this map (the last line's copy)
        end -= end % mmap.PAGESIZE
        if end - self.released >= _RELEASE_BYTES:  # batched: each call costs TLB flushes
            try:
                self.mm.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            except (OSError, ValueError, AttributeError):
                pass
            self.released = end

    def close(self) -> None:
        self.arr = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass


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
    from models.numerics import available_cpus

    return max(1, min(available_cpus(), 8))


def _open_source(of):
    """A memory map for plain local files, else a stream (compressed, remote, memory)."""
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(of.fs, LocalFileSystem) and not of.compression:
        try:
            if os.path.getsize(of.path) > 0:
                return _MmapSource(of.path), None
        except (OSError, ValueError):
            pass
    f = of.open()
    return _StreamSource(f), f


def tar_member(uri: str) -> tuple[str, str] | None:
    """``(member, archive URL)`` for an fsspec chain ``tar://<member>::<archive URL>``, else None."""
    head, sep, target = uri.partition("::")
    if not sep or not head.startswith("tar://"):
        return None
    return head[len("tar://"):].strip("/"), target


@contextlib.contextmanager
def open_tar_member(member: str, archive: str):
    """``(file, size)``: ``member`` of a tar archive (``.tar``, ``.tar.gz``, ``.tar.bz2``, ``.tar.xz``; any fsspec
    URL), read in one forward pass. fsspec's own ``tar://`` file system indexes the archive first, which for a
    compressed one means decompressing all of it, then decompresses it again from the start to reach the member;
    here ``tarfile``'s stream mode stops at the member and hands it over as a stream, never extracted to disk nor
    read whole."""
    with fsspec.open(archive, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tf:
        for ti in tf:
            name = ti.name.strip("/")
            if name.startswith("./"):
                name = name[2:]
            if name != member:
                continue
            if not ti.isfile():
                raise ValueError(f"{archive}: member {member!r} is not a regular file")
            with tf.extractfile(ti) as f:
                yield f, ti.size
            return
    raise FileNotFoundError(f"{archive}: the archive has no member {member!r}")


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
    fsspec chain ``tar://<dir>/<name>.txt::<path>/<name>.tar.gz`` (:func:`open_tar_member`).
    """
    if max_scan_num is not None and max_scan_num < 0:
        raise ValueError(f"max_scan_num must be >= 0, got {max_scan_num}")
    block_size = max(int(block_size), 1 << 12)
    with contextlib.ExitStack() as stack:
        chain = tar_member(uri)
        if chain is not None:
            f, total = stack.enter_context(open_tar_member(*chain))
            src = _StreamSource(f)
        else:
            of = fsspec.open(uri, "rb", compression="infer")
            total = None if of.compression else _size_of(of)
            src, f = _open_source(of)
            if f is not None:
                stack.callback(f.close)
        stack.callback(src.close)
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


def _size_of(of) -> int | None:
    try:
        size = of.fs.size(of.path)
        return int(size) if size is not None else None
    except Exception:
        return None


def _read_body(src, uri, count, dim, max_scan_num, block_size, bar, total=None) -> TencentEmbeddings:
    fast = _get_kernel() is not None
    if not fast:
        log.warning("numba unavailable: parsing %s with the slow pure-Python parser", public_url(uri))
    pool_scratch = _ScratchPool(dim)

    def parse(block: np.ndarray) -> _Block:
        if not fast:
            return _parse_block_careful(block, dim)
        flat = pool_scratch.get(_rows_needed(block.size + 1, dim))
        out = flat[: (flat.size // dim) * dim].reshape(-1, dim)
        b = _parse_block_fast(block, dim, out)
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

    def merge(block: _Block) -> None:
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


# --------------------------------------------------------------------------- cache


def _join(fs, dir_path: str, name: str) -> str:
    sep = getattr(fs, "sep", "/")
    return dir_path.rstrip(sep) + sep + name if dir_path else name


def _is_local(fs) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    proto = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return isinstance(fs, LocalFileSystem) or "file" in proto


def save_embeddings(emb: TencentEmbeddings, fs, dir_path: str) -> dict[str, str]:
    """Write ``vectors.npy`` (float32, np.save format) and ``words.txt`` into ``dir_path``.

    Each file is written under a temporary name and moved into place.  Returns the
    file names relative to ``dir_path``.
    """
    vectors = np.ascontiguousarray(emb.vectors, dtype=np.float32)
    if vectors.ndim != 2 or len(vectors) != len(emb.words):
        raise ValueError(
            f"vectors shape {vectors.shape} does not match {len(emb.words)} words"
        )
    for w in emb.words:
        if "\n" in w:
            raise ValueError(f"word contains a newline: {w[:40]!r}")
    fs.makedirs(dir_path, exist_ok=True)
    words_blob = "".join(w + "\n" for w in emb.words).encode("utf-8")

    def write(name: str, writer) -> None:
        final = _join(fs, dir_path, name)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"  # the artifact store skips ".tmp-" names
        try:
            with fs.open(tmp, "wb") as fh:
                writer(fh)
            fs.mv(tmp, final)
        except BaseException:
            try:
                if fs.exists(tmp):
                    fs.rm(tmp)
            finally:
                raise

    write(VECTORS_FILE, lambda fh: np.save(fh, vectors, allow_pickle=False))
    write(WORDS_FILE, lambda fh: fh.write(words_blob))
    return {"vectors": VECTORS_FILE, "words": WORDS_FILE}


def load_embedding_words(fs, dir_path: str) -> list[str]:
    """The word list :func:`save_embeddings` wrote, checked against the vectors' ``.npy`` header (read alone):
    for callers that need no vector (the trie stage), so a remote store never sends the matrix."""
    vpath, wpath = _join(fs, dir_path, VECTORS_FILE), _join(fs, dir_path, WORDS_FILE)
    with fs.open(vpath, "rb") as fh:
        major, _ = np.lib.format.read_magic(fh)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(fh)
    words = _read_words(fs, wpath)
    if len(shape) != 2 or dtype != np.float32 or shape[0] != len(words):
        raise ValueError(f"{dir_path}: {len(words)} words but vectors of shape {shape} and dtype {dtype}")
    return words


class VectorRows:
    """The ``vectors.npy`` of an embeddings directory, read only where indexed: ``rows[idx]`` for an ascending
    int array ``idx`` gives those rows (float32 ``[len(idx), dim]``). A local file is memory-mapped; any other
    filesystem is read in windows of at most ``window_bytes`` around the wanted rows, so taking the matched
    words' vectors never holds the whole matrix (7.0 GB for Tencent's 8.8M words)."""

    def __init__(self, fs, dir_path: str, window_bytes: int = 64 << 20):
        self.fs, self.path, self.window_bytes = fs, _join(fs, dir_path, VECTORS_FILE), window_bytes
        with fs.open(self.path, "rb") as fh:
            major, _ = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(fh)
            self.offset = fh.tell()
        if len(shape) != 2 or dtype != np.float32 or (fortran and shape[0] > 1 and shape[1] > 1):
            raise ValueError(f"{self.path}: expected a C-order float32 matrix, found {dtype} {shape}")
        self.shape = tuple(shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        n, d = self.shape
        if idx.size and (idx[0] < 0 or idx[-1] >= n or np.any(np.diff(idx) < 0)):
            raise IndexError(f"{self.path}: row indices must be ascending within [0, {n})")
        if _is_local(self.fs):
            return np.asarray(np.load(self.fs._strip_protocol(self.path), mmap_mode="r")[idx], dtype=np.float32)
        out = np.empty((idx.size, d), dtype=np.float32)
        per = max(1, self.window_bytes // (4 * d))  # rows a window spans
        with self.fs.open(self.path, "rb") as fh:
            i = 0
            while i < idx.size:
                first = int(idx[i])
                j = int(np.searchsorted(idx, first + per, side="left"))  # rows of this window: idx[i:j]
                last = int(idx[j - 1])
                fh.seek(self.offset + first * d * 4)
                block = np.frombuffer(fh.read((last - first + 1) * d * 4), dtype=np.float32).reshape(-1, d)
                out[i:j] = block[idx[i:j] - first]
                i = j
        return out


def _read_words(fs, wpath: str) -> list[str]:
    with fs.open(wpath, "rb") as fh:
        blob = fh.read()
    words = blob.decode("utf-8").split("\n") if blob else []
    if words:
        if words[-1] != "":
            raise ValueError(f"{wpath}: truncated (no final newline)")
        words.pop()
    return words


def load_embeddings(fs, dir_path: str, *, mmap: bool = True) -> tuple[list[str], np.ndarray]:
    """Load what :func:`save_embeddings` wrote.

    On a local filesystem the vectors are memory-mapped read-only (``np.memmap``)
    unless ``mmap=False``; on any other filesystem the bytes are read into memory.
    """
    vpath = _join(fs, dir_path, VECTORS_FILE)
    wpath = _join(fs, dir_path, WORDS_FILE)
    if _is_local(fs):
        local = fs._strip_protocol(vpath)
        vectors = np.load(local, mmap_mode="r" if mmap else None, allow_pickle=False)
    else:
        with fs.open(vpath, "rb") as fh:
            vectors = np.load(io.BytesIO(fh.read()), allow_pickle=False)
    words = _read_words(fs, wpath)
    if vectors.ndim != 2 or vectors.dtype != np.float32 or len(vectors) != len(words):
        raise ValueError(
            f"{dir_path}: {len(words)} words but vectors of shape {vectors.shape} "
            f"and dtype {vectors.dtype}"
        )
    return words, vectors
