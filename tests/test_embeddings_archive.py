"""Tencent embeddings as distributed: the v0.2.0 ``.tar.gz`` through an fsspec chain ``tar://<member>::<archive>``
(streamed, never extracted), and gzip text (``.txt.gz``); the input's fingerprint is the archive's bytes plus the
member's name."""

from __future__ import annotations

import gzip
import io
import tarfile
import tracemalloc

import numpy as np
import pytest

from storage.artifacts import ArtifactStore, compute_version, open_artifact
from tasks.common.stage import run_stage
from tasks.prepare import embeddings, trie
from tasks.prepare.config import EmbeddingsConfig, TrieConfig
from tasks.prepare.tencent import read_tencent
from tasks.text.embedding_files import load_embeddings

NAME = "tencent-ailab-embedding-zh-d200-v0.2.0"
MEMBER = f"{NAME}/{NAME}.txt"
WORDS = ["的", "中国", "北京", "北京市", "上海", "人民", "首都", "中华人民共和国"]


def tencent_text(words: list[str], dim: int, seed: int = 0, digits: int = 6) -> bytes:
    """Tencent text format: ``N D`` header, then ``word v1 ... vD`` with six decimals (as the files are)."""
    rng = np.random.default_rng(seed)
    vecs = rng.uniform(-1, 1, (len(words), dim))
    lines = [f"{len(words)} {dim}"] + [w + " " + " ".join(f"{v:.{digits}f}" for v in row)
                                       for w, row in zip(words, vecs)]
    return ("\n".join(lines) + "\n").encode()


def write_archive(path, text: bytes, member: str = MEMBER) -> None:
    """A v0.2.0-style archive: ``<name>/`` with a readme ahead of ``<name>/<name>.txt``, gzip-compressed."""
    with tarfile.open(path, "w:gz") as tf:
        d = tarfile.TarInfo(member.split("/")[0])
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for name, data in ((member.split("/")[0] + "/readme.txt", b"Tencent AI Lab Embedding Corpus\n"),
                           (member, text)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.fixture()
def downloads(tmp_path):
    text = tencent_text(WORDS, 8)
    (tmp_path / f"{NAME}.txt").write_bytes(text)
    (tmp_path / f"{NAME}.txt.gz").write_bytes(gzip.compress(text))
    write_archive(tmp_path / f"{NAME}.tar.gz", text)
    return tmp_path


def test_archive_member_and_gzip_text_read_as_the_plain_file(downloads):
    plain = read_tencent(str(downloads / f"{NAME}.txt"), progress=False)
    chained = read_tencent(f"tar://{MEMBER}::{downloads / f'{NAME}.tar.gz'}", progress=False)
    gz = read_tencent(str(downloads / f"{NAME}.txt.gz"), progress=False)
    assert plain.words == WORDS
    for other in (chained, gz):  # the same parser over the same bytes (only the stream differs): the same bits
        assert other.words == plain.words and np.array_equal(other.vectors, plain.vectors)
        assert other.stats == plain.stats
    with pytest.raises(FileNotFoundError, match="no member"):
        read_tencent(f"tar://{NAME}/other.txt::{downloads / f'{NAME}.tar.gz'}", progress=False)


def _version(uri: str) -> str:
    return compute_version("embeddings", embeddings.CODE_VERSION,
                           embeddings.version_config(EmbeddingsConfig(), uri), [])


def test_fingerprint_is_the_archive_bytes_and_the_member(downloads, tmp_path_factory):
    archive = downloads / f"{NAME}.tar.gz"
    uri = f"tar://{MEMBER}::{archive}"
    src = embeddings.version_config(EmbeddingsConfig(), uri)["source"]
    import hashlib

    assert src["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert src["member"] == f"tar://{MEMBER}" and src["name"] == f"{NAME}.tar.gz"
    elsewhere = tmp_path_factory.mktemp("moved") / archive.name
    elsewhere.write_bytes(archive.read_bytes())
    assert _version(f"tar://{MEMBER}::{elsewhere}") == _version(uri)  # same archive in another directory
    other = tmp_path_factory.mktemp("other") / archive.name
    write_archive(other, tencent_text(WORDS, 8, seed=1))
    assert _version(f"tar://{MEMBER}::{other}") != _version(uri)  # same size, other vectors
    assert _version(f"tar://{NAME}/readme.txt::{archive}") != _version(uri)  # another member


def test_embeddings_and_trie_stages_from_the_archive(downloads, tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    uri = f"tar://{MEMBER}::{downloads / f'{NAME}.tar.gz'}"
    cfg = EmbeddingsConfig()
    emb_ref = run_stage(None, store, embeddings.STAGE, cfg, uri=uri)
    words, vectors = load_embeddings(*(lambda a: (a.fs, a.path))(open_artifact(emb_ref)))
    assert words == WORDS and vectors.shape == (8, 8)
    trie_ref = run_stage(None, store, trie.STAGE, TrieConfig(), emb_ref=emb_ref)
    t = trie.load_trie(open_artifact(trie_ref))
    assert t.has_key("北京市") and t["中华人民共和国"] == 7


def test_the_member_is_streamed_not_read_whole(tmp_path):
    """Python-heap peak (numpy arrays included) while reading a ~8 MB member from a .tar.gz in 64 KiB blocks: the
    vectors it returns (2.4 MB, grown by half as they come) plus buffers, under the member's size; a whole read
    would hold all of the member and the vectors (with 16 MiB blocks, the default, the peak is about 12 MB)."""
    words = [f"词{i}" for i in range(3000)]
    text = tencent_text(words, 200, digits=9)
    write_archive(tmp_path / "a.tar.gz", text)
    uri = f"tar://{MEMBER}::{tmp_path / 'a.tar.gz'}"
    read_tencent(uri, block_size=1 << 16, progress=False)  # warm: the parser is compiled outside the measure
    tracemalloc.start()
    try:
        emb = read_tencent(uri, block_size=1 << 16, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert emb.words == words
    assert len(text) > 7e6 and peak < len(text), (peak, emb.vectors.nbytes, len(text))
