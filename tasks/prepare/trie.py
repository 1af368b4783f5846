"""trie: pygtrie trie over the first ``max_scan_num`` embedding words, persisted and checksum-loaded."""

from __future__ import annotations

import pickle
from typing import Any

import pygtrie

from storage.artifacts import ArtifactRef, open_artifact
from tasks.common.context import StageContext
from tasks.common.rejects import DUPLICATE_OR_UNUSABLE
from tasks.common.stage import Stage, StageResult
from tasks.prepare.config import TrieConfig
from tasks.text.embedding_files import load_embedding_words
from tasks.text.matcher import COMPILED_FILE, CompiledTrie, build_trie, compile_words, gc_paused

CODE_VERSION = "trie-1"
TRIE_FILE = "trie.pkl"  # the pygtrie.CharTrie (pickle: loaded only after sha256 check)


def _info(n_in: int, n_out: int, ct: CompiledTrie) -> dict[str, Any]:
    stats = {"in": n_in, "out": n_out, "rejected": {DUPLICATE_OR_UNUSABLE: n_in - n_out} if n_in != n_out else {}}
    metrics = {"max_depth": int(ct.max_depth), "words": n_out, "nodes": int(len(ct.term))}
    return {"stats": stats, "metrics": metrics}


def build_trie_files(
    words: list[str], max_scan_num: int | None
) -> tuple[pygtrie.CharTrie, CompiledTrie, dict[str, Any]]:
    """The trie over the first ``max_scan_num`` words, its compiled arrays and the stage's stats."""
    scanned = words[:max_scan_num] if max_scan_num else words
    with gc_paused():
        trie = build_trie(scanned)
        ct = compile_words(scanned)
    return trie, ct, _info(len(scanned), len(trie), ct)


def write_trie(writer, trie: pygtrie.CharTrie, ct: CompiledTrie) -> None:
    """Write the pickled trie (streamed) and its compiled arrays."""
    with gc_paused(), writer.open(TRIE_FILE) as f:
        pickle.dump(trie, f, protocol=4)  # streamed: the same bytes as pickle.dumps, never all in memory
    writer.write_bytes(COMPILED_FILE, ct.to_bytes())


def write_trie_files(writer, words: list[str], max_scan_num: int | None) -> dict[str, Any]:
    """Build and write ``trie.pkl`` then ``compiled.npz``, one at a time: the pygtrie trie is dropped before the
    compiled arrays are built from the word list, so peak memory is the larger of the two, not their sum."""
    scanned = words[:max_scan_num] if max_scan_num else words
    with gc_paused():
        trie = build_trie(scanned)
        n_out = len(trie)
        with writer.open(TRIE_FILE) as f:
            pickle.dump(trie, f, protocol=4)
        del trie
        ct = compile_words(scanned)
    writer.write_bytes(COMPILED_FILE, ct.to_bytes())
    return _info(len(scanned), n_out, ct)


def load_trie(art) -> pygtrie.CharTrie:
    """Unpickle the trie only after its sha256 matches the manifest (IntegrityError otherwise)."""
    return pickle.loads(art.read_verified(TRIE_FILE))  # noqa: S301 - verified against the manifest


def build(ctx: StageContext, emb_ref: ArtifactRef) -> StageResult:
    """The trie over the embedding words (by rank), written as trie.pkl and compiled.npz."""
    emb = open_artifact(emb_ref)
    words = load_embedding_words(emb.fs, emb.path)  # no vectors: a remote store would send the whole matrix
    info = write_trie_files(ctx.writer, words, ctx.cfg.max_scan_num)
    return StageResult(stats=info["stats"], metrics=info["metrics"])


STAGE = Stage("trie", CODE_VERSION, TrieConfig, parents=("emb_ref",), build=build)
