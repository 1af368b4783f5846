"""trie: pygtrie trie over the first ``max_scan_num`` embedding words, persisted and checksum-loaded."""

from __future__ import annotations

import pickle
from typing import Any

import pygtrie

from storage.artifacts import ArtifactRef, open_artifact
from tasks.common.config import TrieConfig
from tasks.common.rejects import DUPLICATE_OR_UNUSABLE
from tasks.common.stage import StageResult
from tasks.prepare.matcher import CompiledTrie, build_trie, compile_trie
from tasks.prepare.tencent import load_embeddings

CODE_VERSION = "trie-1"
TRIE_FILE = "trie.pkl"  # the pygtrie.CharTrie (pickle: loaded only after sha256 check)
COMPILED_FILE = "compiled.npz"  # flat arrays for the jitted matcher (no pickle)


def build_trie_files(
    words: list[str], max_scan_num: int | None
) -> tuple[pygtrie.CharTrie, CompiledTrie, dict[str, Any]]:
    scanned = words[:max_scan_num] if max_scan_num else words
    trie = build_trie(scanned)
    ct = compile_trie(trie)
    n_in, n_out = len(scanned), len(trie)
    stats = {"in": n_in, "out": n_out, "rejected": {DUPLICATE_OR_UNUSABLE: n_in - n_out} if n_in != n_out else {}}
    metrics = {"max_depth": int(ct.max_depth), "words": n_out, "nodes": int(len(ct.term))}
    return trie, ct, {"stats": stats, "metrics": metrics}


def write_trie(writer, trie: pygtrie.CharTrie, ct: CompiledTrie) -> None:
    writer.write_bytes(TRIE_FILE, pickle.dumps(trie, protocol=4))
    writer.write_bytes(COMPILED_FILE, ct.to_bytes())


def load_trie(art) -> pygtrie.CharTrie:
    """Unpickle the trie only after its sha256 matches the manifest (IntegrityError otherwise)."""
    return pickle.loads(art.read_verified(TRIE_FILE))  # noqa: S301 - verified against the manifest


_COMPILED: dict[tuple[str, str], CompiledTrie] = {}


def load_compiled(art) -> CompiledTrie:
    """The matcher's arrays, checksum-verified, cached per process (keyed by uri and sha256)."""
    key = (art.uri, art.manifest.file(COMPILED_FILE).sha256)
    if key not in _COMPILED:
        if len(_COMPILED) >= 4:
            _COMPILED.clear()
        _COMPILED[key] = CompiledTrie.from_bytes(art.read_verified(COMPILED_FILE))
    return _COMPILED[key]


def build(writer, version: str, *, emb_ref: ArtifactRef, cfg: TrieConfig) -> StageResult:
    """The trie over the embedding words (by rank), written as trie.pkl and compiled.npz."""
    emb = open_artifact(emb_ref)
    words, _ = load_embeddings(emb.fs, emb.path, mmap=True)
    trie, ct, info = build_trie_files(words, cfg.max_scan_num)
    write_trie(writer, trie, ct)
    return StageResult(stats=info["stats"], metrics=info["metrics"])
