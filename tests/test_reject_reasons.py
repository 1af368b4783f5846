"""Every reject reason in ``tasks/common/rejects.py`` is produced by a real input through the real code that gives
it, and a new reason without a case here fails the suite (``test_every_reason_has_a_case``)."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import fsspec
import pytest

from tasks.common.rejects import REASONS
from tasks.prepare.config import CleanConfig
from tests.staging import begin


def _url(name: str) -> str:
    return f"memory://rejects-{uuid.uuid4().hex}/{name}"


def _put(name: str, data: bytes | str) -> str:
    url = _url(name)
    with fsspec.open(url, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return url


def _doc(doc_id: str, body: str) -> str:
    return f'<doc id="{doc_id}" url="u" title="t">\nt\n\n{body}\n</doc>\n'


def _clean(data: bytes | str, name: str = "corpus.jsonl", **cfg) -> Counter:
    from tasks.prepare.clean import clean_records
    from tasks.prepare.corpus import read_records

    config = CleanConfig(**cfg)
    events = clean_records(read_records(_put(name, data), config), config)
    return Counter(r["reason"] for kind, r in events if kind == "reject")


def _jsonl(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode()) + b"\n"
                    for r in records)


GOOD = {"id": "1", "text": "北京是中华人民共和国的首都。"}


def _duplicate() -> Counter:
    from storage.artifacts import ArtifactStore
    from tasks.prepare.clean import clean_file, dedup_and_shard

    url = _put("corpus.jsonl", _jsonl(GOOD, {"id": "2", "text": "北京是中华人民共和国的首都。上海很大很大。"}))
    writer = begin(ArtifactStore(_url("store")), "clean", "c1")
    part = clean_file(url, 0, CleanConfig(), writer)
    res = dedup_and_shard([part], CleanConfig(), writer)
    assert (res["in"], res["out"]) == (3, 2)
    return Counter(res["rejected"])


def _dump_page(text: str, ns: int = 0) -> Counter:
    from tests.dump_fixture import dump_xml, page

    pages = [page(1, "北京市", "北京是中华人民共和国的首都。"), page(2, "x", text, ns=ns)]
    return _clean(dump_xml(pages), "zhwiki.xml")


def _vocab(**kw) -> Counter:
    from tasks.prepare.vocab import build_vocab

    tokens, stats = build_vocab(Counter({"好": 5, "差": 1, "书": 3, "人": 4}), **kw)
    assert stats["in"] == stats["out"] + sum(stats["rejected"].values())
    return Counter(stats["rejected"])


def _checkpoint_vocab() -> Counter:
    from tasks.prepare.vocab import checkpoint_vocab

    ckpt = ["[PAD]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "好", "人"]
    tokens, stats, _ = checkpoint_vocab(ckpt, Counter({"好": 5, "差": 1, "书": 3, "人": 4}))
    assert stats["in"] == stats["out"] + sum(stats["rejected"].values())
    return Counter(stats["rejected"])


def _tencent(body: bytes) -> Counter:
    from tasks.prepare.tencent import read_tencent

    emb = read_tencent(_put("emb.txt", body), progress=False)
    assert emb.stats["lines_read"] == emb.stats["loaded"] + sum(emb.stats["rejected"].values())
    assert all(r["line"] > 1 for r in emb.rejects)  # 1-based file lines, after the header
    return Counter(emb.stats["rejected"])


def _trie() -> Counter:
    from tasks.prepare.trie import build_trie_files

    _, _, info = build_trie_files(["你好", "世界", "你好"], None)
    assert info["stats"]["in"] == 3 and info["stats"]["out"] == 2
    return Counter(info["stats"]["rejected"])


def _ner(text: str) -> Counter:
    from tasks.ner.data import read_ner

    data = read_ner(_put("train.bio", text))
    assert data.stats["in"] == data.stats["out"] + sum(data.stats["rejected"].values())
    return Counter(r["reason"] for r in data.rejects)


def _labelled(csv: str) -> Counter:
    from tasks.common.labelled import read_labelled
    from tasks.finetune.config import FinetuneConfig

    url = _put("reviews.csv", csv)
    rows, rejects = read_labelled(url, FinetuneConfig(data_uri=url))
    return Counter(r["reason"] for r in rejects)


def _label(name: str, data: bytes | str, **options) -> Counter:
    from tasks.label.config import LabelOptions
    from tasks.label.run import label_stream
    from tests.test_mutation_guards import KeywordScorer

    res = label_stream(KeywordScorer(), _put(name, data), _url("out"), LabelOptions(text_column="text", **options),
                       progress=False)
    st = res["stats"]
    assert st["in"] == st["out"] + sum(st["rejected"].values())
    return Counter(st["rejected"])


CASES = {
    # reading any input
    "undecodable": lambda: _clean(_jsonl(GOOD, b'{"id": "2", "text": "\xff\xfe"}')),
    "line_too_long": lambda: _clean(_jsonl(GOOD, {"id": "2", "text": "很长" * 200}), max_line_bytes=1024),
    "invalid_json": lambda: _clean(_jsonl(GOOD, b'{"id": "2", "text": "broken')),
    "bad_columns": lambda: _label("in.csv", "text,id\n好,1\n好,2,extra\n", id_column="id"),
    "invalid_unicode": lambda: _label("in.jsonl", b'{"text": "\\u597d"}\n{"text": "\\ud800"}\n'),
    "missing_text": lambda: _clean(_jsonl(GOOD, {"id": "2", "title": "no text"})),
    "not_a_string": lambda: _label("in.jsonl", _jsonl({"text": "好"}, {"text": 5})),
    "empty_text": lambda: _clean(_jsonl(GOOD, {"id": "2", "text": "   "})),
    "missing_id": lambda: _label("in.csv", "id,text\na,好\n,差\n", id_column="id"),
    "duplicate_id": lambda: _label("in.csv", "id,text\na,好\nb,差\na,好\n", id_column="id"),
    "bad_label": lambda: _labelled("label,review\n1,很好很好\n2,不好\n"),
    # clean (wiki dumps)
    "unterminated_doc": lambda: _clean(_doc("1", "句子很好很好。") + '<doc id="2" url="u" title="t">\n没有结束。\n',
                                       "wiki_00"),
    "stray_close_tag": lambda: _clean(_doc("1", "句子很好很好。") + "</doc>\n", "wiki_00"),
    "outside_doc": lambda: _clean(_doc("1", "句子很好很好。") + "文档之外的文字。\n" + _doc("2", "另一个句子。"),
                                  "wiki_00"),
    "too_short": lambda: _clean(_jsonl({"id": "1", "text": "好。这个句子足够长。"}), min_chars=5),
    "low_cjk_ratio": lambda: _clean(_jsonl({"id": "1", "text": "ok ok ok ok ok ok ok 好。"})),
    "duplicate": _duplicate,
    # MediaWiki XML dumps: pages that are not articles
    "redirect": lambda: _dump_page("#REDIRECT [[北京市]]"),
    "disambiguation": lambda: _dump_page("'''长城'''可以指：\n* [[万里长城]]\n{{消歧义}}"),
    "other_namespace": lambda: _dump_page("{{Navbox}}", ns=10),
    # vocab
    "below_min_count": lambda: _vocab(min_count=2),
    "over_max_size": lambda: _vocab(max_size=8),  # 6 specials + the 2 most frequent characters
    "not_in_checkpoint_vocab": _checkpoint_vocab,  # 差 and 书: the imported vocabulary lacks them
    # embeddings and trie
    "short_line": lambda: _tencent(b"3 2\n\xe4\xbd\xa0\xe5\xa5\xbd 0.1 0.2\n\xe5\x9d\x8f 0.1\n\xe5\xa5\xbd 0.3 0.4\n"),
    "non_numeric": lambda: _tencent("2 2\n你好 0.1 0.2\n好 x 0.4\n".encode()),
    "duplicate_word": lambda: _tencent("2 2\n你好 0.1 0.2\n你好 0.3 0.4\n".encode()),
    "duplicate_or_unusable": _trie,
    # NER files
    "no_separator": lambda: _ner("北 B-LOC\n京I-LOC\n\n"),
    "empty_char": lambda: _ner("北 B-LOC\n\tO\n\n"),
    "bad_tag": lambda: _ner("北 B-LOC\n京 Z-LOC\n\n"),
    # labelling
    "empty_after_normalization": lambda: _label("in.csv", "text\n好\n<br>\n"),
}


def test_every_reason_has_a_case():
    assert set(CASES) == set(REASONS.values())


@pytest.mark.parametrize("reason", sorted(CASES))
def test_reason_is_produced(reason):
    got = CASES[reason]()
    assert got[reason] >= 1, f"{reason} not produced: {dict(got)}"
