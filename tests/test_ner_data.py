"""tasks.ner.data (reader, scheme conversion, spans, split) and tasks.ner.metrics."""

from __future__ import annotations

import gzip
import itertools
from pathlib import Path

import pytest

from tasks.inference.tags import spans, to_bio
from tasks.ner.data import read_ner, split_sentences
from tasks.ner.metrics import entity_prf

NER = Path(__file__).resolve().parents[2] / "shared" / "data" / "ner"


def _write(tmp_path: Path, text: str, name: str = "x.bio") -> str:
    p = tmp_path / name
    if name.endswith(".gz"):
        p.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        p.write_bytes(text.encode("utf-8"))
    return str(p)


# ----------------------------------------------------------------------------- to_bio / spans


def test_to_bio_schemes():
    assert to_bio(["B-PER", "M-PER", "E-PER", "O", "S-LOC"]) == ["B-PER", "I-PER", "I-PER", "O", "B-LOC"]
    assert to_bio(["B-PER", "I-PER", "E-PER", "S-PER", "S-PER"]) == ["B-PER", "I-PER", "I-PER", "B-PER", "B-PER"]
    bio = ["B-ORG", "I-ORG", "O", "B-PER"]
    assert to_bio(bio) == bio  # idempotent on BIO
    # conll repair: I-X without an open X starts an entity (IOB1 too)
    assert to_bio(["O", "I-PER", "I-PER", "I-LOC"]) == ["O", "B-PER", "I-PER", "B-LOC"]
    assert to_bio(["E-PER", "E-PER"]) == ["B-PER", "B-PER"]  # E after a closed entity
    assert to_bio(["B-PER.NAM", "E-PER.NAM"]) == ["B-PER.NAM", "I-PER.NAM"]
    assert to_bio(["B-PER.NAM", "E-PER.NOM"]) == ["B-PER.NAM", "B-PER.NOM"]  # suffix is type
    assert to_bio(["B-PER.NAM", "E-PER.NOM"], strip_suffix=True) == ["B-PER", "I-PER"]
    for bad in ["Q-PER", "B-", "PER", "b-PER", "B_PER", ""]:
        with pytest.raises(ValueError):
            to_bio([bad])


def test_spans():
    assert spans([]) == []
    assert spans(["O", "O"]) == []
    assert spans(["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-LOC"]) == [("PER", 0, 2), ("LOC", 3, 4), ("LOC", 4, 6)]
    assert spans(["B-PER", "I-LOC"]) == [("PER", 0, 1), ("LOC", 1, 2)]
    assert spans(["I-ORG", "I-ORG"]) == [("ORG", 0, 2)]
    assert spans(["B-X", "M-X", "E-X", "S-Y"]) == [("X", 0, 3), ("Y", 3, 4)]
    assert spans(["O", "B-GPE.NAM"]) == [("GPE.NAM", 1, 2)]


# ----------------------------------------------------------------------------- reader

SAMPLE = "江 B-PER\n泽 I-PER\n民 I-PER\n说 O\n\n北 B-LOC\n京 I-LOC\n\n\n"


def test_read_sample_format(tmp_path):
    data = read_ner(_write(tmp_path, SAMPLE))
    assert data.sentences == [
        {"chars": ["江", "泽", "民", "说"], "tags": ["B-PER", "I-PER", "I-PER", "O"], "line": 1},
        {"chars": ["北", "京"], "tags": ["B-LOC", "I-LOC"], "line": 6},
    ]
    assert data.rejects == []
    assert data.stats["in"] == data.stats["out"] == 2 and data.stats["rejected"] == {}
    assert data.stats["types"] == {"LOC": 1, "PER": 1} and data.stats["repaired_i_start"] == 0


def test_read_bmes_tabs_gz_crlf_no_trailing_blank(tmp_path):
    text = "\ufeff张\tB-PER.NAM\r\n三\tE-PER.NAM\r\n\u3000\tO\r\n\r\n李 S-PER.NOM\n好 O"
    for name in ("a.bmes", "a.bmes.gz"):
        data = read_ner(_write(tmp_path, text, name))
        assert [s["chars"] for s in data.sentences] == [["张", "三", "\u3000"], ["李", "好"]]
        assert [s["tags"] for s in data.sentences] == [["B-PER.NAM", "I-PER.NAM", "O"], ["B-PER.NOM", "O"]]
        assert [s["line"] for s in data.sentences] == [1, 5]
    stripped = read_ner(_write(tmp_path, text), strip_suffix=True)
    assert stripped.sentences[0]["tags"] == ["B-PER", "I-PER", "O"]
    assert stripped.stats["types"] == {"PER": 2}


def test_read_rejects_and_repairs(tmp_path):
    text = (
        "好 O\n坏\nX Q-PER\n\n"  # 1-3: no separator first -> whole sentence rejected
        " O\n甲 O\n\n"  # 5-6: empty char
        "乙 B-\n\n"  # 8: bad tag
        "丙 O\n丁 I-ORG\n戊 E-ORG\n\n"  # 10-12: repaired, kept
    ).encode() + b"\xff\xfe O\n\n"  # 14: bad utf-8
    p = tmp_path / "r.txt"
    p.write_bytes(text)
    data = read_ner(str(p))
    assert data.rejects == [
        {"line": 2, "reason": "no_separator", "text": "坏"},
        {"line": 5, "reason": "empty_char", "text": " O"},
        {"line": 8, "reason": "bad_tag", "text": "乙 B-"},
        {"line": 14, "reason": "undecodable", "text": "\ufffd\ufffd O"},
    ]
    assert data.sentences == [{"chars": ["丙", "丁", "戊"], "tags": ["O", "B-ORG", "I-ORG"], "line": 10}]
    st = data.stats
    assert st["in"] == 5 and st["out"] == 1 and st["repaired_i_start"] == 1
    assert st["rejected"] == {"bad_tag": 1, "undecodable": 1, "empty_char": 1, "no_separator": 1}
    assert st["in"] == st["out"] + sum(st["rejected"].values())


def test_split_sentences_deterministic():
    items = list(range(103))
    a = split_sentences(items)
    assert a == split_sentences(items, seed=7)
    assert [len(x) for x in a] == [82, 11, 10]
    assert sorted(itertools.chain(*a)) == items
    assert all(x == sorted(x) for x in a)
    assert split_sentences(items, seed=8) != a
    assert [len(x) for x in split_sentences(items, (0.5, 0.5))] == [52, 51]
    assert split_sentences([], (0.8, 0.1, 0.1)) == ([], [], [])
    with pytest.raises(ValueError):
        split_sentences(items, (0.8, 0.1))


# ----------------------------------------------------------------------------- metrics


def test_entity_prf_hand_examples():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "I-ORG"]]
    pred = [["B-PER", "I-PER", "O", "B-PER"], ["B-ORG", "I-ORG", "O"]]  # wrong type; partial
    r = entity_prf(gold, pred)
    o = r["overall"]
    assert (o["support"], o["predicted"], o["tp"]) == (3, 3, 1)
    assert o["precision"] == pytest.approx(1 / 3) and o["recall"] == pytest.approx(1 / 3)
    assert o["f1"] == pytest.approx(1 / 3)
    assert r["per_type"]["PER"]["precision"] == pytest.approx(0.5)
    assert r["per_type"]["PER"]["recall"] == 1.0 and r["per_type"]["PER"]["support"] == 1
    assert r["per_type"]["LOC"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 1, "predicted": 0, "tp": 0}
    assert r["per_type"]["ORG"]["f1"] == 0.0
    assert list(r["per_type"]) == ["LOC", "ORG", "PER"]
    perfect = entity_prf(gold, gold)["overall"]
    assert perfect["f1"] == perfect["precision"] == perfect["recall"] == 1.0


def test_entity_prf_empty_and_schemes():
    r = entity_prf([["O", "O"]], [["O", "O"]])
    assert r["overall"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0, "predicted": 0, "tp": 0}
    assert r["per_type"] == {}
    assert entity_prf([], [])["overall"]["f1"] == 0.0
    # BMES gold vs BIO pred of the same entity
    assert entity_prf([["B-X", "E-X", "S-Y"]], [["B-X", "I-X", "B-Y"]])["overall"]["f1"] == 1.0
    with pytest.raises(ValueError):
        entity_prf([["O"]], [["O", "O"]])
    with pytest.raises(ValueError):
        entity_prf([["O"]], [])


# ----------------------------------------------------------------------------- real files


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume", "weibo"])
def test_real_bmes_files(name):
    paths = [NER / name / f"{split}.char.bmes" for split in ("train", "dev", "test")]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"{name} NER files not present under {NER}")
    for p in paths:
        data = read_ner(str(p))
        st = data.stats
        assert st["in"] == st["out"] + sum(st["rejected"].values())
        assert st["out"] > 0 and st["entities"] > 0
        for s in data.sentences[:200]:
            assert len(s["chars"]) == len(s["tags"]) and to_bio(s["tags"]) == s["tags"]
        if name == "weibo":
            assert all("." in t for t in st["types"])
            stripped = read_ner(str(p), strip_suffix=True).stats["types"]
            assert set(stripped) <= {"PER", "ORG", "LOC", "GPE"}


@pytest.mark.slow
def test_real_msra_head(tmp_path):
    src = NER / "msra" / "dh_msra.txt"
    if not src.is_file():
        pytest.skip(f"{src} not present")
    lines = []
    with src.open("rb") as f:  # the first ~200 sentences only (the file is 2.4M lines)
        for raw in f:
            lines.append(raw)
            if len(lines) > 5000 and not raw.strip():
                break
    head = tmp_path / "msra_head.txt"
    head.write_bytes(b"".join(lines))
    data = read_ner(str(head))
    assert data.stats["out"] > 0
    assert set(data.stats["types"]) <= {"PER", "ORG", "LOC"}
