"""The careful Tencent line parser: the reference meaning of a valid line, in plain Python.

Decode UTF-8, strip trailing whitespace, split on single spaces; the last ``D`` fields are the vector
(``float()`` each, then float32), everything before them, joined with single spaces, is the word (so words may
contain spaces). The fast parser (:mod:`tasks.prepare.tencent_kernel`) must agree with it bit for bit and hands it
every line outside its common subset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.common.rejects import NON_NUMERIC, SHORT_LINE, UNDECODABLE

REJECT_TEXT_CHARS = 120  # a reject record keeps at most this many characters of its line


def parse_line(raw: bytes, dim: int):
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


def reject_text(raw: bytes) -> str:
    """The start of a rejected line as the reject record keeps it (undecodable bytes replaced)."""
    return raw[: REJECT_TEXT_CHARS * 4].decode("utf-8", errors="replace")[:REJECT_TEXT_CHARS]


def reject_text_at(buf: np.ndarray, start: int) -> str:
    """:func:`reject_text` of the line that starts at byte ``start`` of the block ``buf``."""
    raw = buf[start : start + REJECT_TEXT_CHARS * 4].tobytes().split(b"\n", 1)[0]
    return reject_text(raw)


def parse_lines(lines, dim: int) -> tuple[list[str], list[list[float]], list[int], list[int], list[tuple]]:
    """Parse ``(line in block, byte start, raw line)`` triples in order: the accepted lines' words, values, line
    numbers and starts, and the rejects as ``(line, reason, text)``."""
    words: list[str] = []
    rows: list[list[float]] = []
    word_lines: list[int] = []
    word_starts: list[int] = []
    rejects: list[tuple[int, str, str]] = []
    for li, start, raw in lines:
        res = parse_line(raw, dim)
        if isinstance(res, str):
            rejects.append((li, res, reject_text(raw)))
        else:
            words.append(res[0])
            rows.append(res[1])
            word_lines.append(li)
            word_starts.append(start)
    return words, rows, word_lines, word_starts, rejects


@dataclass
class Block:
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
        """The reject text of the line of the block's ``i``-th word."""
        return reject_text_at(self.buf, int(self.word_starts[i]))


def parse_block_careful(data, dim: int) -> Block:
    """Careful pure-Python parse of a block of whole lines (bytes-like)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    lines = buf.tobytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the block ends with a newline: no extra line after it
    starts = np.cumsum([0, *(len(line) + 1 for line in lines)])
    words, rows, word_lines, word_starts, rejects = parse_lines(
        ((i, int(starts[i]), line) for i, line in enumerate(lines)), dim)
    vectors = np.array(rows, dtype=np.float32).reshape(len(rows), dim)
    return Block(
        len(lines),
        words,
        vectors,
        np.array(word_lines, dtype=np.int64),
        np.array(word_starts, dtype=np.int64),
        buf,
        rejects,
    )

