"""tasks.prepare.tencent and its parts: the Tencent text reader (fast numba path + careful Python parser) and
the vectors.npy/words.txt cache (tasks.text.embedding_files)."""

from __future__ import annotations

import bz2
import gzip
import logging
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from tasks.prepare import tencent as E
from tasks.prepare.tencent import TencentEmbeddings, read_tencent
from tasks.prepare.tencent_careful import parse_block_careful
from tasks.prepare.tencent_kernel import parse_block_fast
from tasks.prepare.tencent_source import StreamSource
from tasks.text.embedding_files import load_embeddings, save_embeddings

SAMPLE = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "embeddings" / "Tencent_AILab_ChineseEmbedding_sample.txt"
)


def _bits(a: np.ndarray) -> np.ndarray:
    """Compare float32 arrays bit for bit (so -0.0 != 0.0 and NaN == NaN)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _reference_parse(data: bytes):
    """The seed code's parser: rstrip, split on ' ', float() each value."""
    lines = data.decode("utf-8").split("\n")[1:]
    words, rows = [], []
    for line in lines:
        if not line:
            continue
        parts = line.rstrip().split(" ")
        words.append(parts[0])
        rows.append(np.array([float(x) for x in parts[1:]], dtype=np.float32))
    return words, np.stack(rows)


def _memory_uri(name: str) -> str:
    return f"memory://test-embeddings/{uuid.uuid4().hex}/{name}"


def _put(uri: str, data: bytes) -> str:
    with fsspec.open(uri, "wb") as f:
        f.write(data)
    return uri


# --------------------------------------------------------------------------- real sample


def test_real_sample_header_is_checked_not_trusted(caplog):
    if not SAMPLE.exists():
        pytest.skip(f"{SAMPLE} is absent")
    with caplog.at_level(logging.WARNING, logger="tasks.prepare.tencent"):
        emb = read_tencent(str(SAMPLE), progress=False)
    ref_words, ref_vectors = _reference_parse(SAMPLE.read_bytes())
    assert len(emb.words) == 9 and emb.words == ref_words
    assert emb.words[:2] == ["</s>", "的"]
    assert emb.vectors.shape == (9, 200) and emb.vectors.dtype == np.float32
    assert emb.vectors.flags.c_contiguous
    np.testing.assert_array_equal(_bits(emb.vectors), _bits(ref_vectors))
    s = emb.stats
    assert s["header_count"] == 8_824_330 and s["header_dim"] == 200
    assert s["loaded"] == 9 and s["lines_read"] == 9
    assert s["header_mismatch"] is True
    assert sum(s["rejected"].values()) == 0 and emb.rejects == []
    assert "8824330" in caplog.text


# --------------------------------------------------------------------------- bad lines

HANDMADE = (
    (
        "8 3\n"  # line 1: header (8 data lines follow)
        "你好 0.1 -0.2 3e-05\n"  # 2 ok
        "new york 1 2 3\n"  # 3 ok: the word contains a space
        "短 0.5 0.6\n"  # 4 short_line
        "坏 0.1 abc 0.3\n"  # 5 non_numeric
        "你好 9 9 9\n"  # 6 duplicate_word (the first one is kept)
    ).encode()
    + b"\xff\xfe\xfd 1 2 3\n"
    + (  # 7 undecodable
        "末 -1E+02 +2.5 .5\n"  # 8 ok
        "tail 1.0 2.0 3.0"  # 9 ok, no final newline
    ).encode()
)
HANDMADE_REJECTS = [
    (4, "short_line"),
    (5, "non_numeric"),
    (6, "duplicate_word"),
    (7, "undecodable"),
]


def _check_handmade(emb: TencentEmbeddings):
    assert emb.words == ["你好", "new york", "末", "tail"]
    expected = np.array([[0.1, -0.2, 3e-05], [1, 2, 3], [-100, 2.5, 0.5], [1, 2, 3]], dtype=np.float32)
    np.testing.assert_array_equal(_bits(emb.vectors), _bits(expected))
    assert [(r["line"], r["reason"]) for r in emb.rejects] == HANDMADE_REJECTS
    assert emb.rejects[0]["text"] == "短 0.5 0.6"
    assert emb.rejects[2]["text"].startswith("你好 9")
    s = emb.stats
    assert s["rejected"] == {"short_line": 1, "non_numeric": 1, "undecodable": 1, "duplicate_word": 1}
    assert s["loaded"] == 4 and s["lines_read"] == 8
    assert s["loaded"] + sum(s["rejected"].values()) == 8  # every line after the header
    assert s["header_count"] == 8 and s["header_dim"] == 3
    assert s["header_mismatch"] is False


def test_bad_lines_are_rejected_with_exact_line_numbers(tmp_path):
    path = tmp_path / "handmade.txt"
    path.write_bytes(HANDMADE)
    _check_handmade(read_tencent(str(path), progress=False))


@pytest.mark.parametrize("block_size", [4096, 1 << 24])
def test_line_numbers_stay_exact_across_blocks(tmp_path, block_size):
    """Bad lines scattered over many blocks (block_size is clamped to >= 4 KiB)."""
    rng = np.random.default_rng(7)
    lines, expect_rejects, expect_words = ["5000 4"], [], []
    for i in range(3000):
        line_no = len(lines) + 1
        kind = rng.integers(0, 50)
        if kind == 0:
            lines.append(f"s{i} 1 2")
            expect_rejects.append((line_no, "short_line"))
        elif kind == 1:
            lines.append(f"n{i} 1 x 2 3")
            expect_rejects.append((line_no, "non_numeric"))
        elif kind == 2 and expect_words:
            lines.append(f"{expect_words[0]} 1 2 3 4")
            expect_rejects.append((line_no, "duplicate_word"))
        elif kind == 3:
            lines.append(f"a b{i} 1 2 3 4")
            expect_words.append(f"a b{i}")
        else:
            lines.append(f"w{i} " + " ".join(f"{x:.6f}" for x in rng.normal(size=4)))
            expect_words.append(f"w{i}")
    path = tmp_path / "many.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    emb = read_tencent(str(path), block_size=block_size, progress=False)
    assert emb.words == expect_words
    assert [(r["line"], r["reason"]) for r in emb.rejects] == expect_rejects
    assert emb.stats["lines_read"] == 3000
    assert emb.stats["header_mismatch"] is True


def test_careful_parser_agrees_on_the_handmade_file():
    block = parse_block_careful(HANDMADE.split(b"\n", 1)[1], 3)
    fast = parse_block_fast(HANDMADE.split(b"\n", 1)[1], 3)
    assert block.words == fast.words == ["你好", "new york", "你好", "末", "tail"]
    np.testing.assert_array_equal(_bits(block.vectors), _bits(fast.vectors))
    assert block.rejects == fast.rejects
    assert block.word_lines.tolist() == fast.word_lines.tolist() == [0, 1, 4, 6, 7]


def test_bad_header_names_the_file_and_line_1(tmp_path):
    path = tmp_path / "noheader.txt"
    path.write_text("的 0.1 0.2\n了 0.3 0.4\n", encoding="utf-8")
    with pytest.raises(ValueError) as err:
        read_tencent(str(path), progress=False)
    msg = str(err.value)
    assert "noheader.txt" in msg and "line 1" in msg and "'<count> <dim>' header" in msg
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="line 1"):
        read_tencent(str(empty), progress=False)


# --------------------------------------------------------------------------- streaming


def _numbered_file(n: int, dim: int) -> bytes:
    rng = np.random.default_rng(1)
    vec = rng.normal(size=(n, dim))
    body = "".join(f"w{i} " + " ".join(f"{x:.6f}" for x in vec[i]) + "\n" for i in range(n))
    return (f"{n} {dim}\n" + body).encode()


def test_max_scan_num_stops_early(tmp_path):
    path = tmp_path / "ten.txt"
    path.write_bytes(_numbered_file(10, 5))
    emb = read_tencent(str(path), 3, progress=False)
    assert emb.words == ["w0", "w1", "w2"] and emb.vectors.shape == (3, 5)
    assert emb.stats["loaded"] == 3 and emb.stats["lines_read"] == 3
    assert emb.stats["header_mismatch"] is False  # not read to the end: not compared
    full = read_tencent(str(path), progress=False)
    np.testing.assert_array_equal(emb.vectors, full.vectors[:3])
    assert read_tencent(str(path), 0, progress=False).words == []


def test_max_scan_num_counts_accepted_words_and_reads_little(tmp_path):
    data = _numbered_file(5000, 50)
    lines = data.split(b"\n")
    lines.insert(2, b"bad 1 2")  # a rejected line does not count towards max_scan_num
    path = tmp_path / "big.txt"
    path.write_bytes(b"\n".join(lines))
    emb = read_tencent(str(path), 100, progress=False)
    assert emb.words == [f"w{i}" for i in range(100)]
    assert emb.stats["lines_read"] == 101 and emb.stats["rejected"]["short_line"] == 1

    class Counting:
        def __init__(self, f):
            self.f, self.n = f, 0

        def readline(self, size=-1):
            line = self.f.readline(size)
            self.n += len(line)
            return line

        def read(self, size=-1):
            chunk = self.f.read(size)
            self.n += len(chunk)
            return chunk

    with open(path, "rb") as raw:
        f = Counting(raw)
        src = StreamSource(f)
        assert src.header() == b"5000 50\n"
        with E.tqdm(disable=True) as bar:
            out = E._read_body(src, str(path), 5000, 50, 100, 1 << 24, bar)
    assert out.words == emb.words
    assert f.n < len(data) // 10  # streamed: nowhere near the whole file


def test_gzip_and_memory_urls(tmp_path):
    gz = tmp_path / "handmade.txt.gz"
    gz.write_bytes(gzip.compress(HANDMADE))
    _check_handmade(read_tencent(str(gz), progress=False))
    _check_handmade(read_tencent("file://" + str(gz), progress=False))
    plain = tmp_path / "handmade.txt"
    plain.write_bytes(HANDMADE)
    _check_handmade(read_tencent("file://" + str(plain), progress=False))
    bz = tmp_path / "handmade.txt.bz2"
    bz.write_bytes(bz2.compress(HANDMADE))
    _check_handmade(read_tencent(str(bz), progress=False))
    zstandard = pytest.importorskip("zstandard")
    zst = tmp_path / "handmade.txt.zst"  # its reader has no readline()
    zst.write_bytes(zstandard.ZstdCompressor().compress(HANDMADE))
    _check_handmade(read_tencent(str(zst), progress=False))
    uri = _put(_memory_uri("handmade.txt"), HANDMADE)
    _check_handmade(read_tencent(uri, progress=False))
    uri_gz = _put(_memory_uri("handmade.txt.gz"), gzip.compress(HANDMADE))
    _check_handmade(read_tencent(uri_gz, progress=True))


def test_crlf_trailing_spaces_and_blank_lines():
    data = b"3 2\r\na 1 2\r\nb 3 4 \r\n\nc 5 6\n"
    emb = read_tencent(_put(_memory_uri("crlf.txt"), data), progress=False)
    assert emb.words == ["a", "b", "c"]
    np.testing.assert_array_equal(emb.vectors, [[1, 2], [3, 4], [5, 6]])
    assert [(r["line"], r["reason"]) for r in emb.rejects] == [(4, "short_line")]
    assert emb.stats["header_mismatch"] is True  # 4 data lines, header says 3


def test_duplicates_alone_inside_a_block_and_across_blocks():
    data = b"4 2\na 1 2\nb 3 4\na 5 6\nc 7 8\n"
    emb = read_tencent(_put(_memory_uri("dup.txt"), data), progress=False)
    assert emb.words == ["a", "b", "c"]
    np.testing.assert_array_equal(emb.vectors, [[1, 2], [3, 4], [7, 8]])
    assert [(r["line"], r["reason"], r["text"]) for r in emb.rejects] == [(4, "duplicate_word", "a 5 6")]
    assert emb.stats["loaded"] == 3 and emb.stats["lines_read"] == 4 and emb.stats["header_mismatch"] is False
    # the repeat far away, in a later block (4 KiB blocks)
    lines = [f"w{i} {i} 0" for i in range(2000)] + ["w5 9 9", "z 1 1"]
    data = f"{len(lines)} 2\n".encode() + "\n".join(lines).encode() + b"\n"
    emb = read_tencent(_put(_memory_uri("dup2.txt"), data), block_size=4096, progress=False)
    assert emb.words == [f"w{i}" for i in range(2000)] + ["z"]
    assert [(r["line"], r["reason"]) for r in emb.rejects] == [(2002, "duplicate_word")]
    assert emb.vectors[5].tolist() == [5, 0]


# --------------------------------------------------------------------------- fast == careful


def _random_text(rows: int, dim: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    vec = rng.normal(scale=rng.choice([1e-6, 0.01, 0.3, 50.0], size=(rows, 1)), size=(rows, dim))
    fmts = ["{:.6f}", "{:.6e}", "{:g}", "{:.3E}", "{!r}", "{:+.4f}", "{:.0f}"]
    out = []
    for i in range(rows):
        fmt_ids = rng.integers(0, len(fmts), size=dim)
        vals = [fmts[k].format(float(x)) for k, x in zip(fmt_ids, vec[i])]
        if i % 97 == 0:
            vals[0] = "-0.000000"
        if i % 89 == 0:
            vals[-1] = "1e-05"
        out.append(f"词{i} " + " ".join(vals))
    return ("\n".join(out) + "\n").encode()


def test_fast_path_agrees_with_careful_parser_on_random_file():
    data = _random_text(2000, 16, seed=3)
    fast = parse_block_fast(data, 16)
    careful = parse_block_careful(data, 16)
    assert fast.n_lines == careful.n_lines == 2000
    assert fast.words == careful.words and len(fast.words) == 2000
    np.testing.assert_array_equal(_bits(fast.vectors), _bits(careful.vectors))
    assert fast.word_lines.tolist() == careful.word_lines.tolist()
    # and through the whole reader, with small blocks
    uri = _put(_memory_uri("random.txt"), b"2000 16\n" + data)
    emb = read_tencent(uri, block_size=8192, progress=False)
    assert emb.words == careful.words
    np.testing.assert_array_equal(_bits(emb.vectors), _bits(careful.vectors))


def test_fast_path_swar_values_and_their_edges():
    """The 8-byte "D.DDDDDD" path: random and extreme mantissas, signs, and tokens that
    look close to the pattern but are not (they take the digit-by-digit path)."""
    rng = np.random.default_rng(5)
    m = np.concatenate([rng.integers(0, 10**7, size=20000), [0, 1, 9_999_999, 5_000_000, 10]])
    tokens = [
        ("-" if i % 3 == 0 else "+" if i % 7 == 0 else "") + f"{v // 10**6}.{v % 10**6:06d}"
        for i, v in enumerate(m.tolist())
    ]
    tokens += ["12.345678", "1.2345678", "1.23456", "1.234567e3", "1.234567E-3", "0.1234567", "-9.999999", "-0.000000"]
    tokens = tokens[: (len(tokens) // 10) * 10]
    rows = [tokens[i : i + 10] for i in range(0, len(tokens), 10)]
    text = "".join(f"s{i} " + " ".join(r) + ("\r\n" if i % 5 == 0 else "\n") for i, r in enumerate(rows))
    data = text.encode()[:-1]  # the last line has no newline: the 8-byte loads stop short of the end
    fast = parse_block_fast(data, 10)
    expected = np.array([[np.float32(float(t)) for t in r] for r in rows], dtype=np.float32)
    assert fast.words == [f"s{i}" for i in range(len(rows))] and not fast.rejects
    np.testing.assert_array_equal(_bits(fast.vectors), _bits(expected))


def test_fast_path_rounds_like_float_then_float32_near_midpoints():
    """Decimals next to float32 rounding midpoints: decimal -> double -> float32 must
    round exactly as np.float32(float(s)) does (double rounding included)."""
    rng = np.random.default_rng(11)
    a = rng.uniform(1e-3, 1e3, size=4000).astype(np.float32)
    b = np.nextafter(a, np.float32(np.inf))
    mid = (a.astype(np.float64) + b.astype(np.float64)) / 2
    tokens = []
    for m in mid:
        for digits in (15, 12, 9):
            tokens.append(f"{m:.{digits}g}")
    tokens = tokens[: (len(tokens) // 8) * 8]
    rows = [tokens[i : i + 8] for i in range(0, len(tokens), 8)]
    data = "".join(f"m{i} " + " ".join(r) + "\n" for i, r in enumerate(rows)).encode()
    fast = parse_block_fast(data, 8)
    expected = np.array([[np.float32(float(t)) for t in r] for r in rows], dtype=np.float32)
    assert len(fast.words) == len(rows) and not fast.rejects
    np.testing.assert_array_equal(_bits(fast.vectors), _bits(expected))


# --------------------------------------------------------------------------- cache


def test_save_load_round_trip_local_and_memory(tmp_path):
    words = ["的", "new york", "", " 空格 ", "tab\tword", "cr\rword"]
    vectors = np.random.default_rng(0).normal(size=(len(words), 7)).astype(np.float32)
    emb = TencentEmbeddings(words=words, vectors=vectors, stats={}, rejects=[])

    local = fsspec.filesystem("file")
    rel = save_embeddings(emb, local, str(tmp_path / "cache"))
    assert rel == {"vectors": "vectors.npy", "words": "words.txt"}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["vectors.npy", "words.txt"]
    w, v = load_embeddings(local, str(tmp_path / "cache"))
    assert isinstance(v, np.memmap) and w == words
    np.testing.assert_array_equal(_bits(v), _bits(vectors))
    w2, v2 = load_embeddings(local, str(tmp_path / "cache"), mmap=False)
    assert not isinstance(v2, np.memmap) and w2 == words
    np.testing.assert_array_equal(v2, vectors)
    assert np.load(tmp_path / "cache" / "vectors.npy").dtype == np.float32

    mem = fsspec.filesystem("memory")
    d = f"/test-embeddings/{uuid.uuid4().hex}/cache"
    save_embeddings(emb, mem, d)
    w3, v3 = load_embeddings(mem, d)
    assert type(v3) is np.ndarray and w3 == words
    np.testing.assert_array_equal(_bits(v3), _bits(vectors))


def test_read_save_load_round_trip_and_edge_cases(tmp_path):
    path = tmp_path / "h.txt"
    path.write_bytes(HANDMADE)
    emb = read_tencent(str(path), progress=False)
    fs = fsspec.filesystem("file")
    save_embeddings(emb, fs, str(tmp_path / "c"))
    w, v = load_embeddings(fs, str(tmp_path / "c"))
    assert w == emb.words
    np.testing.assert_array_equal(v, emb.vectors)

    empty = TencentEmbeddings([], np.empty((0, 3), np.float32), {}, [])
    save_embeddings(empty, fs, str(tmp_path / "e"))
    w, v = load_embeddings(fs, str(tmp_path / "e"))
    assert w == [] and v.shape == (0, 3)

    with pytest.raises(ValueError, match="newline"):
        save_embeddings(TencentEmbeddings(["a\nb"], np.zeros((1, 3), np.float32), {}, []), fs, str(tmp_path / "x"))
