"""Lexicon matcher: LEBERT-style char-word matching over a trie (pure Python reference and compiled arrays).

Pure logic, no Prefect.  Lexicon words come from an embedding file in
frequency-rank order; a word's *rank* is its index in that list (0 = most
frequent; for duplicates the first occurrence wins).  For each character of a
text the candidates are all lexicon words of >= 2 characters that cover it
(every occurrence of a dictionary word as a substring, overlaps allowed); a
character keeps the ``max_word_num`` distinct candidates with the smallest
rank, ordered by rank and padded.

Two implementations with identical results:

* :func:`match_words` - simple pure-python walk over a :mod:`pygtrie` trie;
* :func:`compile_trie` + :func:`match_batch` - the trie flattened into numpy
  arrays and walked by numba-jitted code (``nogil`` so threads can run it in
  parallel), once per batch of texts.

Codepoints ``0`` (the batch separator) and ``U+E000`` (stands for a ``#NUM#``
token) never match: words containing them are ignored by every function here.
"""

from __future__ import annotations

import contextlib
import gc
import io
import zipfile
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np
import pygtrie

from tasks.text.match_kernels import build_nodes, fmm_spans, top_k, top_k_spans, walk
from tasks.text.numbers import NUM_CHAR  # a #NUM# token: never inside a matched word

__all__ = [
    "PAD",
    "SEP_CODEPOINT",
    "CompiledTrie",
    "build_trie",
    "match_words",
    "compile_trie",
    "compile_words",
    "gc_paused",
    "find_matches",
    "top_k_ranks",
    "slot_spans",
    "match_batch",
    "fmm_segments",
    "spans_per_text",
    "text_codepoints",
    "ranks_to_words",
]

PAD = "[PAD]"
SEP_CODEPOINT = 0  # separator between texts in a batch
_NEVER = frozenset(("\x00", NUM_CHAR))
# Dense root table covers at most the BMP; astral first characters fall back to
# a binary search over the root's CSR children (keeps the table <= 256 KiB).
_ROOT_DENSE_LIMIT = 0x10000


def _usable(word: str) -> bool:
    return bool(word) and "\x00" not in word and NUM_CHAR not in word


# --------------------------------------------------------------------------
# pygtrie trie + pure-python matching
# --------------------------------------------------------------------------


def build_trie(words: Iterable[str]) -> pygtrie.CharTrie:
    """Trie mapping each word to its rank (index in ``words``).

    The first occurrence of a duplicate wins; empty strings (and words
    containing the separator ``\\x00`` or ``U+E000``, which can never match) are
    skipped but still consume their index.
    """
    trie = pygtrie.CharTrie()
    for rank, word in enumerate(words):
        if _usable(word):
            trie.setdefault(word, rank)
    return trie


def _text_matches_py(text: str, trie: pygtrie.CharTrie, min_len: int = 2):
    """Yield (start, word, rank) for every occurrence (pure python)."""
    n = len(text)
    end = n  # never walk past a separator / #NUM# placeholder
    ends = [n] * n
    for i in range(n - 1, -1, -1):
        if text[i] in _NEVER:
            end = i
        ends[i] = end
    for i in range(n):
        window = 32
        while True:
            stop = min(ends[i], i + window)
            piece = text[i:stop]
            if stop < ends[i] and trie.has_subtrie(piece):
                window *= 2  # the trie goes deeper than the window: widen it
                continue
            break
        for step in trie.prefixes(piece):
            word, rank = step.key, step.value
            if len(word) >= min_len:
                yield i, word, rank


def match_words(text: str, trie: pygtrie.CharTrie, max_word_num: int = 3) -> list[list[str]]:
    """Per character of ``text``: its ``max_word_num`` best-ranked covering words.

    Each inner list has exactly ``max_word_num`` entries, padded with ``"[PAD]"``.
    A word is listed once per character even if several of its occurrences
    cover it.
    """
    cands: list[dict[str, int]] = [dict() for _ in range(len(text))]
    for start, word, rank in _text_matches_py(text, trie):
        for p in range(start, start + len(word)):
            cands[p][word] = rank
    out = []
    for c in cands:
        best = sorted(c, key=c.__getitem__)[:max_word_num]
        out.append(best + [PAD] * (max_word_num - len(best)))
    return out


# --------------------------------------------------------------------------
# compiled trie
# --------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CompiledTrie:
    """Flat arrays compiled from a pygtrie trie, for a numba-jitted walk.

    Node 0 is the root; ``compile_trie`` numbers nodes breadth-first with
    children in codepoint order, so a node's children are consecutive ids and
    edge ``e`` leads to node ``e + 1`` (``child == arange(1, n_nodes)``).

    ``root``  int32 [min(max_codepoint, 0xFFFF)+1]: child of the root for a
              codepoint, or -1 (codepoints past the table use the CSR arrays);
    ``start`` int32 [n_nodes+1] CSR offsets into ``ch``/``child``;
    ``ch``    int32 child codepoints, sorted within each node;
    ``child`` int32 child node ids;
    ``term``  int32 [n_nodes]: rank of the word ending at the node, else -1;
    ``max_depth`` length of the longest word;
    ``words`` rank -> word (``""`` for unused ranks), or None.

    The walk uses a packed ``[n_nodes, 4]`` view of these arrays derived on
    first use (not serialised); see ``_walk_tables``.
    """

    root: np.ndarray
    start: np.ndarray
    ch: np.ndarray
    child: np.ndarray
    term: np.ndarray
    max_depth: int
    words: tuple[str, ...] | None = None

    @property
    def n_nodes(self) -> int:
        """Number of trie nodes."""
        return int(self.term.shape[0])

    def __getstate__(self) -> dict:
        # pickles (Prefect results, dask) carry the fields, not the walk cache
        state = dict(self.__dict__)
        state.pop("_walk_cache", None)
        return state

    def to_bytes(self) -> bytes:
        """Deterministic ``.npz`` (uncompressed, fixed timestamps) bytes."""
        arrays = {
            "root": self.root,
            "start": self.start,
            "ch": self.ch,
            "child": self.child,
            "term": self.term,
            "max_depth": np.asarray([self.max_depth], dtype=np.int64),
            "n_words": np.asarray([-1 if self.words is None else len(self.words)], dtype=np.int64),
            "words": np.frombuffer(
                "\x00".join(self.words or ()).encode("utf-8", "surrogatepass"), dtype=np.uint8
            ),
        }
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in arrays.items():
                info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = zipfile.ZIP_STORED
                info.external_attr = 0o600 << 16
                with zf.open(info, "w", force_zip64=True) as fh:
                    np.lib.format.write_array(fh, np.ascontiguousarray(arr), allow_pickle=False)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, b: bytes, with_words: bool = True) -> "CompiledTrie":
        """The arrays back; ``with_words=False`` leaves ``words`` None (matching never reads it; the tuple of
        strings is the largest part of a big lexicon's trie in memory)."""
        with np.load(io.BytesIO(b), allow_pickle=False) as z:
            n_words = int(z["n_words"][0]) if with_words else -1
            words = None
            if n_words == 0:
                words = ()
            elif n_words > 0:
                words = tuple(z["words"].tobytes().decode("utf-8", "surrogatepass").split("\x00"))
                if len(words) != n_words:
                    raise ValueError(f"corrupt CompiledTrie bytes: {len(words)} words, expected {n_words}")
            return cls(
                root=z["root"],
                start=z["start"],
                ch=z["ch"],
                child=z["child"],
                term=z["term"],
                max_depth=int(z["max_depth"][0]),
                words=words,
            )


def text_codepoints(text: str) -> np.ndarray:
    """Codepoints of ``text`` as int32 (astral characters included)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int32)



def compile_trie(trie: pygtrie.CharTrie) -> CompiledTrie:
    """Flatten a ``build_trie`` trie (values = ranks) into a :class:`CompiledTrie`.

    Deterministic: an identical trie (same word -> rank items, whatever the
    insertion order) gives identical arrays and bytes.
    """
    items = sorted((w, int(r)) for w, r in trie.iteritems() if _usable(w))
    return _compile_items(items)


def compile_words(words: Iterable[str]) -> CompiledTrie:
    """``compile_trie(build_trie(words))`` straight from the word list: the same arrays and bytes, without the
    pygtrie trie in memory (the first occurrence of a word gives its rank; unusable words are skipped)."""
    first: dict[str, int] = {}
    for rank, word in enumerate(words):
        if _usable(word):
            first.setdefault(word, rank)
    return _compile_items(sorted(first.items()))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (restored after). Building, pickling and compiling
    a trie of millions of words allocates millions of containers, none of them in a cycle, and each full
    collection walks them all: 1M words took 80 s with the collector on and 9 s with it off."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _compile_items(items: list[tuple[str, int]]) -> CompiledTrie:
    """``items``: (word, rank) sorted by word, words unique and usable."""
    words = [w for w, _ in items]
    ranks = np.fromiter((r for _, r in items), dtype=np.int32, count=len(items))
    lens = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    offs = np.zeros(len(words) + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    cps = text_codepoints("".join(words))
    max_len = int(lens.max()) if len(words) else 0
    parent, code, depth, term = build_nodes(cps, offs, ranks, max_len)
    n_nodes = parent.shape[0]
    # Renumber breadth-first.  Within one depth, pre-order (of sorted words) is
    # the lexicographic order of the prefixes, which is exactly BFS order with
    # sorted children: a stable sort by depth does it.  Then every node's
    # children are consecutive ids in ascending codepoint order, and edge e
    # (CSR index) leads to node e + 1.
    order = np.argsort(depth, kind="stable")
    newid = np.empty(n_nodes, dtype=np.int64)
    newid[order] = np.arange(n_nodes)
    par = newid[parent[order][1:]]  # parent (new id) of nodes 1..n-1, nondecreasing
    start = np.zeros(n_nodes + 1, dtype=np.int32)
    np.cumsum(np.bincount(par, minlength=n_nodes), out=start[1:])
    ch = np.ascontiguousarray(code[order][1:], dtype=np.int32)
    child = np.arange(1, n_nodes, dtype=np.int32)
    term = np.ascontiguousarray(term[order], dtype=np.int32)
    n_root = int(start[1])
    root_codes = ch[:n_root]
    bmp = root_codes[root_codes < _ROOT_DENSE_LIMIT]
    size = int(bmp.max()) + 1 if bmp.size else 1
    root = np.full(size, -1, dtype=np.int32)
    dense = root_codes < size
    root[root_codes[dense]] = child[:n_root][dense]
    lookup = [""] * (int(ranks.max()) + 1 if len(items) else 0)
    for w, r in items:
        lookup[r] = w
    return CompiledTrie(
        root=root,
        start=start,
        ch=ch,
        child=child,
        term=term,
        max_depth=max_len,
        words=tuple(lookup),
    )


# --------------------------------------------------------------------------
# jitted walk
# --------------------------------------------------------------------------


def _walk_tables(ct: CompiledTrie) -> tuple[np.ndarray, np.ndarray]:
    """(root table, packed rows) for the jitted walk, computed once per trie.

    ``rows`` is int32 ``[n_edges + 1, 4]``: row ``e + 1`` is the node reached
    by CSR edge ``e`` (row 0 the root) holding (code into it, term rank, first
    child row, end child row).  A node's children are then the consecutive
    rows ``[first, end)`` sorted by code, so one step of the walk (search the
    children, read the found child's term and child range) touches one small
    contiguous block of memory.  With ``compile_trie``'s breadth-first
    numbering, row ids equal node ids; any other numbering works too.
    """
    cached = ct.__dict__.get("_walk_cache")
    if cached is None:
        start = ct.start.astype(np.int64)
        child = ct.child.astype(np.int64)
        n_rows = child.shape[0] + 1
        node_of_row = np.zeros(n_rows, dtype=np.int64)
        node_of_row[1:] = child
        rows = np.empty((n_rows, 4), dtype=np.int32)
        rows[0, 0] = -1
        rows[1:, 0] = ct.ch
        rows[:, 1] = ct.term[node_of_row]
        rows[:, 2] = start[node_of_row] + 1
        rows[:, 3] = start[node_of_row + 1] + 1
        row_of = np.zeros(ct.n_nodes, dtype=np.int64)
        row_of[child] = np.arange(1, n_rows)
        root = np.where(ct.root >= 0, row_of[np.maximum(ct.root, 0)], -1).astype(np.int32)
        cached = (np.ascontiguousarray(root), rows)
        object.__setattr__(ct, "_walk_cache", cached)
    return cached




def _as_cps(codepoints: np.ndarray) -> np.ndarray:
    cps = np.asarray(codepoints)
    if cps.dtype != np.int32:
        cps = cps.astype(np.int32)
    return np.ascontiguousarray(cps)


def find_matches(
    codepoints: np.ndarray, ct: CompiledTrie, min_len: int = 2
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every dictionary-word occurrence of length >= ``min_len``.

    Returns ``(starts int64, lengths int32, ranks int32)`` sorted by
    ``(start, length)``.
    """
    cps = _as_cps(codepoints)
    root, rows = _walk_tables(ct)
    return walk(cps, root, rows, max(1, int(ct.max_depth)), max(1, int(min_len)))



def top_k_ranks(n: int, starts, lengths, ranks, k: int) -> np.ndarray:
    """int32 [n, k]: per position the k best distinct ranks of covering matches, -1 padded."""
    return top_k(
        int(n),
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int32),
        np.ascontiguousarray(ranks, dtype=np.int32),
        int(k),
    )


def slot_spans(top: np.ndarray, starts, lengths, ranks) -> tuple[np.ndarray, np.ndarray]:
    """int64 ([n, k], [n, k]): for each slot of ``top`` (from :func:`top_k_ranks` on the same matches)
    the span ``[start, end)`` of its word's occurrence covering that position (the union of the
    occurrences when several cover it); empty slots ``[0, 0)``."""
    return top_k_spans(
        np.ascontiguousarray(top, dtype=np.int32),
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int32),
        np.ascontiguousarray(ranks, dtype=np.int32),
    )


def _batch_codepoints(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Texts joined by the separator (codepoint 0) and each text's offset."""
    lens = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    offs = np.zeros(len(texts), dtype=np.int64)
    if len(texts) > 1:
        np.cumsum(lens[:-1] + 1, out=offs[1:])
    return text_codepoints("\x00".join(texts)), offs


def match_batch(texts: Sequence[str], ct: CompiledTrie, k: int = 3) -> list[np.ndarray]:
    """Per text an int32 ``[len(text), k]`` rank array (``-1`` padding).

    All texts are concatenated into one codepoint array with a separator
    (codepoint 0, never part of a word) so the jitted walk runs once.  The
    returned arrays are views into one ``[total, k]`` array.
    """
    texts = list(texts)
    if not texts:
        return []
    cps, offs = _batch_codepoints(texts)
    starts, lengths, ranks = find_matches(cps, ct, 2)
    top = top_k(cps.shape[0], starts, lengths, ranks, int(k))
    return [top[o : o + len(t)] for o, t in zip(offs.tolist(), texts)]


def ranks_to_words(ranks: np.ndarray, ct: CompiledTrie) -> list[list[str]]:
    """Map a ``[n, k]`` rank array back to words (``"[PAD]"`` for -1)."""
    if ct.words is None:
        raise ValueError("CompiledTrie has no words lookup")
    w = ct.words
    return [[w[r] if r >= 0 else PAD for r in row] for row in np.asarray(ranks).tolist()]



def fmm_segments(n: int, starts, lengths) -> list[tuple[int, int]]:
    """Greedy forward-maximum-matching spans ``(start, end)`` of words >= 2 chars.

    At position i take the longest match starting at i and jump past it, else
    move to i+1.  Matches must lie within ``[0, n)``.
    """
    spans = fmm_spans(
        int(n),
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(lengths, dtype=np.int64),
    )
    return [(int(a), int(b)) for a, b in spans.tolist()]


def spans_per_text(spans: Sequence[tuple[int, int]], lengths: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Sorted spans over texts joined with one separator each, split per text and made relative to its start (no
    match crosses a separator, so a span that starts in a text lies within it)."""
    out, off, j = [], 0, 0
    for n in lengths:
        end = off + n
        own = []
        while j < len(spans) and spans[j][0] < end:
            own.append((spans[j][0] - off, spans[j][1] - off))
            j += 1
        out.append(own)
        off = end + 1
    return out


COMPILED_FILE = "compiled.npz"  # flat arrays for the jitted matcher (no pickle)
_COMPILED: dict[tuple[str, str], CompiledTrie] = {}


def load_compiled(art, with_words: bool = True) -> CompiledTrie:
    """The matcher's arrays, checksum-verified, cached per process (keyed by uri, sha256 and ``with_words``:
    without, ``words`` is None, for callers that only match)."""
    key = (art.uri, art.manifest.file(COMPILED_FILE).sha256, with_words)
    if key not in _COMPILED:
        if len(_COMPILED) >= 4:
            _COMPILED.clear()
        _COMPILED[key] = CompiledTrie.from_bytes(art.read_verified(COMPILED_FILE), with_words)
    return _COMPILED[key]
