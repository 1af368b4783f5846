"""clean: normalisation, sentence split, readers and the corrupt-input corpus."""

import bz2
import gzip
import json
import uuid

import fsspec
import pytest

from tasks.prepare.clean import clean_records, normalize_text, split_sentences
from tasks.prepare.config import CleanConfig
from tasks.prepare.corpus import read_records


def test_traditional_to_simplified():
    assert normalize_text("這間酒店環境") == "这间酒店环境"


def test_fullwidth_letters_digits_and_whitespace():
    assert normalize_text("ＡＢＣ　１２３\t\t好  的\n") == "ABC 123 好 的"
    assert normalize_text("，。") == "，。"  # punctuation stays full width


def test_markup_leftovers_removed():
    assert normalize_text("一种-{zh-hans:计算机;zh-hant:電腦;}-程序") == "一种计算机程序"
    assert normalize_text("-{简单}-文字<br/>和&amp;") == "简单文字和&"


def test_sentence_split_keeps_closing_quotes():
    assert split_sentences("他说：“你好。”然后走了！真的吗？是的") == [
        "他说：“你好。”",
        "然后走了！",
        "真的吗？",
        "是的",
    ]
    assert split_sentences("第一段。\n第二段") == ["第一段。", "第二段"]


def _write(fs_url: str, data: bytes):
    with fsspec.open(fs_url, "wb") as f:
        f.write(data)


CORRUPT = (
    b"\n".join(
        [
            json.dumps(
                {"id": "1", "title": "t", "text": "北京是中华人民共和国的首都。北京是中华人民共和国的首都。上海很大。"},
                ensure_ascii=False,
            ).encode(),
            b'{"id": "2", "text": "broken json',  # invalid_json
            json.dumps({"id": "3", "title": "no text"}).encode(),  # missing_text
            json.dumps({"id": "4", "text": "   "}).encode(),  # empty_text
            b'{"id": "5", "text": "\xff\xfe bad bytes"}',  # undecodable
            json.dumps({"id": "6", "text": "很长" * 400}, ensure_ascii=False).encode(),  # line_too_long (> 1024 bytes)
            json.dumps(
                {"id": "7", "text": "好。ok ok ok ok ok ok。"}, ensure_ascii=False
            ).encode(),  # too_short + low_cjk_ratio
            b"[1, 2]",  # valid JSON, not an object
            json.dumps({"id": "8", "text": "这是最后一篇文章的内容。"}, ensure_ascii=False).encode(),
        ]
    )
    + b"\n"
)


@pytest.mark.parametrize("suffix,compress", [("jsonl", None), ("jsonl.gz", gzip.compress), ("jsonl.bz2", bz2.compress)])
def test_corrupt_corpus_reconciles(suffix, compress):
    url = f"memory://c-{uuid.uuid4().hex}/corpus.{suffix}"
    _write(url, compress(CORRUPT) if compress else CORRUPT)
    cfg = CleanConfig(max_line_bytes=1024)
    events = list(clean_records(read_records(url, cfg), cfg))
    kept = [r for k, r in events if k == "keep"]
    rejected = [r for k, r in events if k == "reject"]
    reasons = sorted((r["line"], r["reason"]) for r in rejected)
    assert reasons == [
        (2, "invalid_json"),
        (3, "missing_text"),
        (4, "empty_text"),
        (5, "undecodable"),
        (6, "line_too_long"),
        (7, "low_cjk_ratio"),
        (7, "too_short"),
        (8, "invalid_json"),
    ]
    assert [r["text"] for r in kept] == [
        "北京是中华人民共和国的首都。",
        "北京是中华人民共和国的首都。",
        "上海很大。",
        "这是最后一篇文章的内容。",
    ]
    assert all(r["source"] == url for r in rejected)
    # every reject names where it came from: file and line
    assert all(isinstance(r["line"], int) and r["line"] > 0 for r in rejected)


def test_wikiextractor_doc_format_and_unterminated():
    data = (
        '<doc id="12" url="u" title="数学">\n数学\n\n数学是研究数量的学科。它很重要。\n</doc>\n'
        '<doc id="13" url="u" title="空">\n空\n</doc>\n'
        '<doc id="14" url="u" title="未闭合">\n这一篇没有结束标签的文章。\n'
    ).encode()
    url = f"memory://d-{uuid.uuid4().hex}/wiki_00"
    _write(url, data)
    cfg = CleanConfig()
    events = list(clean_records(read_records(url, cfg), cfg))
    kept = [(r["doc_id"], r["sent_idx"], r["text"], r["line"]) for k, r in events if k == "keep"]
    assert kept == [("12", 0, "数学是研究数量的学科。", 4), ("12", 1, "它很重要。", 4)]
    rej = sorted((r["doc_id"], r["reason"], r["line"]) for k, r in events if k == "reject")
    assert rej == [("13", "empty_text", 6), ("14", "unterminated_doc", 9)]


def test_wikiextractor_json_and_plain_text():
    url = f"memory://j-{uuid.uuid4().hex}/wiki_00"
    _write(
        url,
        (
            json.dumps(
                {"id": "9", "revid": "1", "url": "u", "title": "t", "text": "t\n\n歷史悠久的城市。"}, ensure_ascii=False
            )
            + "\n"
        ).encode(),
    )
    cfg = CleanConfig(min_chars=2)
    kept = [r["text"] for k, r in clean_records(read_records(url, cfg), cfg) if k == "keep"]
    assert kept == ["历史悠久的城市。"]
    url2 = f"memory://p-{uuid.uuid4().hex}/a.txt"
    _write(url2, "第一篇第一句。第二句！\n\n第二篇的句子。\n".encode())
    events = list(clean_records(read_records(url2, CleanConfig()), CleanConfig()))
    assert [(r["doc_id"].rsplit(":", 1)[1], r["text"]) for _, r in events] == [
        ("1", "第一篇第一句。"),
        ("1", "第二句！"),
        ("3", "第二篇的句子。"),
    ]


def test_deduper_keeps_exact_first_occurrences_across_flushes():
    from tasks.prepare.clean import Deduper

    d = Deduper(flush_at=3)  # force several merges into the sorted array
    seq = [f"句子{i % 7}" for i in range(30)]
    assert [d.is_new(s) for s in seq] == [i < 7 for i in range(30)]
    assert len(d) == 7 and len(d.sorted) >= 6


def test_corpus_files_sorted_globs_and_missing(tmp_path):
    from tasks.prepare.corpus import corpus_files

    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("x\n")
    files = corpus_files([str(tmp_path / "*.jsonl"), str(tmp_path / "c.txt")])
    assert [f.rsplit("/", 1)[-1] for f in files] == ["a.jsonl", "b.jsonl", "c.txt"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        corpus_files(str(tmp_path / "*.parquet"))
