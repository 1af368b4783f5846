"""The embeddings artifact's files: ``vectors.npy`` (float32) and ``words.txt``, written, loaded and read by row.

A local store memory-maps the vectors; any other file system reads them into memory, or only the rows asked for
(:class:`VectorRows`), so taking a few words' vectors never downloads the whole matrix.
"""

from __future__ import annotations

import io
import uuid
from typing import Protocol

import numpy as np
from fsspec.implementations.local import LocalFileSystem

VECTORS_FILE = "vectors.npy"
WORDS_FILE = "words.txt"


class WordVectors(Protocol):
    """What :func:`save_embeddings` writes: words and their float matrix (the embeddings stage's parsed file)."""

    words: list[str]
    vectors: np.ndarray


def _join(fs, dir_path: str, name: str) -> str:
    sep = getattr(fs, "sep", "/")
    return dir_path.rstrip(sep) + sep + name if dir_path else name


def _is_local(fs) -> bool:
    proto = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return isinstance(fs, LocalFileSystem) or "file" in proto


def _npy_header(fh) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` file open at its start; leaves ``fh`` at the data."""
    major, _ = np.lib.format.read_magic(fh)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    return read_header(fh)


def save_embeddings(emb: WordVectors, fs, dir_path: str) -> dict[str, str]:
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
        shape, _, dtype = _npy_header(fh)
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
            shape, fortran, dtype = _npy_header(fh)
            self.offset = fh.tell()
        if len(shape) != 2 or dtype != np.float32 or (fortran and shape[0] > 1 and shape[1] > 1):
            raise ValueError(f"{self.path}: expected a C-order float32 matrix, found {dtype} {shape}")
        self.shape = tuple(shape)

    def __len__(self) -> int:
        """The number of rows (words)."""
        return self.shape[0]

    def __getitem__(self, idx) -> np.ndarray:
        """The rows at the ascending indices ``idx``, float32 ``[len(idx), dim]``."""
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
