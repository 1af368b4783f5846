"""clean over MediaWiki XML dumps as downloaded: .xml, .xml.bz2 and multistream .xml.bz2 with its index."""

from __future__ import annotations

import bz2
import uuid
from collections import Counter

import fsspec
import pytest

from storage.artifacts import ArtifactStore, open_artifact
from tasks.common.stage import run_stage
from tasks.prepare import clean, wikidump
from tasks.prepare.clean import clean_records
from tasks.prepare.config import CleanConfig, DumpConfig
from tasks.prepare.corpus import Doc, Reject, corpus_files, read_records
from tests.dump_fixture import BEIJING, dump_xml, many_pages, multistream, sample_pages

DUMP = "zhwiki-20241101-pages-articles-multistream.xml.bz2"
INDEX = "zhwiki-20241101-pages-articles-multistream-index.txt.bz2"


def _put(url: str, data: bytes) -> str:
    with fsspec.open(url, "wb") as f:
        f.write(data)
    return url


def test_wikitext_keeps_prose_and_link_text_and_drops_markup():
    text = wikidump.wikitext_to_text(BEIJING)
    assert text.startswith("北京市，简称京，是中华人民共和国的首都，也是全国的政治、文化中心。")
    assert "称为大都。" in text  # [[元大都|大都]]: the display text
    assert "参见北京市统计局的资料" in text  # [url title]: the title
    assert "\n 历史 \n" in text  # a heading is a line of its own
    for gone in ("Infobox", "cite web", "北京出版社",  # templates, <ref>…</ref> (and <ref name=…/>)
                 "wikitable", "1961万", "常住人口\n",  # the table
                 "thumb", "天际线", "缩略图", "天安门广场",  # [[File:…]], [[文件:…]] with their captions
                 "Category", "分类", "中华人民共和国首都", "en:Beijing", "编者注", "Reflist", "{{", "[[", "<ref"):
        assert gone not in text, gone


def test_file_image_category_namespaces_in_both_scripts_are_removed():
    wt = ("甲[[Image:A.png|图一]]乙[[图像:B.png|图二]]丙[[檔案:C.png|图三]]丁[[Category:X]]戊[[分類:Y]]"
          "己[[:Category:城市|城市分类]]庚[[wikt:词|词语]]")
    assert wikidump.wikitext_to_text(wt) == "甲乙丙丁戊己城市分类庚词语"


def _records(url: str, cfg: CleanConfig | None = None) -> list:
    return list(read_records(url, cfg or CleanConfig()))


@pytest.mark.parametrize("suffix,compress", [("xml", None), ("xml.bz2", bz2.compress)])
def test_xml_and_bz2_dumps_give_articles_and_page_rejects_that_reconcile(suffix, compress):
    data = dump_xml(sample_pages())
    url = _put(f"memory://dump-{uuid.uuid4().hex}/zhwiki-pages-articles.{suffix}", compress(data) if compress else data)
    recs = _records(url)
    docs = [r for r in recs if isinstance(r, Doc)]
    rejects = Counter(r.reason for r in recs if isinstance(r, Reject))
    assert len(recs) == 8 == len(docs) + sum(rejects.values())  # pages in = articles + rejected pages
    assert [d.doc_id for d in docs] == ["1", "2", "6"]
    assert rejects == {"redirect": 1, "disambiguation": 2, "other_namespace": 2}
    assert [r.line for r in recs] == list(range(1, 9))  # a record's line: the page's position in the dump
    cfg = CleanConfig()
    events = list(clean_records(recs, cfg))
    kept = [r["text"] for k, r in events if k == "keep"]
    assert "台湾位于东亚，是太平洋西部的一个岛屿。" in kept  # 臺灣位於東亞 in the wikitext: OpenCC t2s as before
    assert "信息技术产业是台湾经济的重要支柱。" in kept  # -{zh-hans:…;zh-hant:…}- resolved by the usual cleaning
    assert not any(t in s for s in kept for t in ("[[", "{{", "|", "thumb", "Category"))
    assert {r["reason"] for k, r in events if k == "reject"} == {"redirect", "disambiguation", "other_namespace",
                                                                 "too_short"}  # headings like 历史 are short


def test_format_is_detected_from_the_contents_whatever_the_name():
    url = _put(f"memory://dump-{uuid.uuid4().hex}/download.bin", dump_xml(sample_pages()))
    assert wikidump.is_dump(url, CleanConfig())
    assert not wikidump.is_dump(url, CleanConfig(input_format="text"))
    assert sum(isinstance(r, Doc) for r in _records(url)) == 3


def test_index_is_found_by_its_standard_name_and_left_out_of_a_glob(tmp_path):
    assert wikidump.standard_index_uri(f"/data/{DUMP}") == f"/data/{INDEX}"
    assert wikidump.standard_index_uri("s3://b/zhwiki-latest-pages-articles-multistream3.xml-p1p2.bz2") == (
        "s3://b/zhwiki-latest-pages-articles-multistream-index3.txt-p1p2.bz2")
    assert wikidump.standard_index_uri("/data/zhwiki-latest-pages-articles.xml.bz2") is None
    dump, index = multistream(sample_pages())
    (tmp_path / DUMP).write_bytes(dump)
    (tmp_path / INDEX).write_bytes(index)
    assert [f.rsplit("/", 1)[-1] for f in corpus_files(str(tmp_path / "zhwiki-*"))] == [DUMP]
    assert wikidump.find_index(str(tmp_path / DUMP), CleanConfig()) == str(tmp_path / INDEX)
    with pytest.raises(FileNotFoundError, match="index_uri"):
        wikidump.find_index(str(tmp_path / DUMP), CleanConfig(dump=DumpConfig(index_uri=str(tmp_path / "none"))))


def _clean_stage(store: str, files: list[str], cfg: CleanConfig):
    ref = run_stage(None, ArtifactStore(store), clean.STAGE, cfg, files=files)
    art = open_artifact(ref)
    return art, {f.path: f.sha256 for f in art.manifest.files}


def test_multistream_in_parallel_pieces_gives_the_same_artifact_as_a_sequential_read(tmp_path):
    pages = many_pages(60)
    dump, index = multistream(pages, per_stream=4)  # 15 page streams
    split, whole = tmp_path / "split", tmp_path / "whole"
    for d in (split, whole):
        d.mkdir()
        (d / DUMP).write_bytes(dump)
    (split / INDEX).write_bytes(index)  # `whole` has no index: read from start to end
    cfg = CleanConfig(shard_rows=50, dump=DumpConfig(streams_per_task=4))
    pieces = wikidump.plan_pieces(str(split / INDEX), 4)
    assert len(pieces) == 4 and [p["pages"] for p in pieces] == [16, 16, 16, 12]
    assert pieces[-1]["end"] is None and pieces[1]["first_ordinal"] == 17
    a, files_a = _clean_stage(str(tmp_path / "store_a"), [str(split / DUMP)], cfg)
    b, files_b = _clean_stage(str(tmp_path / "store_b"), [str(whole / DUMP)], cfg)
    assert a.manifest.version == b.manifest.version  # the index and the split are not in the version
    assert files_a == files_b and len(files_a) > 2  # same shards, same rejects, same bytes
    assert (a.manifest.run["dump_tasks"], b.manifest.run["dump_tasks"]) == (4, 1)
    pages_in = a.manifest.metrics["pages"]
    assert pages_in == b.manifest.metrics["pages"]
    assert pages_in["in"] == 60 == pages_in["articles"] + sum(pages_in["rejected"].values())
    assert pages_in["rejected"] == {"other_namespace": 1, "redirect": 6}  # pages 25; 10, 20, ..., 60
    st = a.manifest.stats
    assert st["in"] == st["out"] + sum(st["rejected"].values()) and st["rejected"]["redirect"] == 6
    assert st["rejected"]["duplicate"] > 0  # repeats across pieces: rejects keep the order of a whole read


def test_an_index_that_does_not_match_the_streams_is_refused(tmp_path):
    pages = sample_pages()
    dump, _ = multistream(pages, per_stream=3)
    _, other = multistream(pages[:7] + [dict(pages[7], id=99)], per_stream=3)  # last page id differs
    (tmp_path / DUMP).write_bytes(dump)
    (tmp_path / INDEX).write_bytes(other)
    piece = wikidump.plan_pieces(str(tmp_path / INDEX), 1)[-1]
    with pytest.raises(ValueError, match="index lists 2 pages"):
        list(wikidump.read_dump(str(tmp_path / DUMP), CleanConfig(), piece=piece))


def test_versions_of_other_corpora_do_not_see_the_dump_section():
    url = _put(f"memory://dump-{uuid.uuid4().hex}/wiki.jsonl", '{"id": "1", "text": "北京是首都。"}\n'.encode())
    conf = clean.version_config(CleanConfig(), [url])
    assert "dump" not in conf and list(conf)[:6] == ["input_format", "min_chars", "min_cjk_ratio", "max_line_bytes",
                                                     "dedup", "shard_rows"]
    dump = _put(f"memory://dump-{uuid.uuid4().hex}/zhwiki.xml", dump_xml(sample_pages()))
    conf = clean.version_config(CleanConfig(dump=DumpConfig(streams_per_task=7, index_uri="x")), [dump])
    assert conf["dump"] == {"reader": wikidump.READER_VERSION,
                            "disambiguation_templates": DumpConfig().disambiguation_templates}


def test_full_profile_starts_from_the_downloads():
    from pathlib import Path

    from flows.config import PipelineConfig, load_config
    from tasks.prepare.tencent_source import tar_member

    cfg = load_config(PipelineConfig, Path(__file__).resolve().parents[1] / "configs" / "full.yaml", [])
    assert cfg.prepare.corpus_uri == "/data/zhwiki/zhwiki-latest-pages-articles-multistream.xml.bz2"
    index = "/data/zhwiki/zhwiki-latest-pages-articles-multistream-index.txt.bz2"
    assert wikidump.standard_index_uri(cfg.prepare.corpus_uri) == index
    name = "tencent-ailab-embedding-zh-d200-v0.2.0"
    assert tar_member(cfg.prepare.embeddings_uri) == (f"{name}/{name}.txt", f"/data/tencent/{name}.tar.gz")


MEMORY_PROBE = """
import io, json, tracemalloc
import mwxml
from tasks.prepare import wikidump
from tests.dump_fixture import FOOTER, HEADER, page, page_xml

def peak(read, n):
    data = (HEADER + "".join(page_xml(page(i + 1, f"T{i}", "#REDIRECT [[X]]", redirect="X")) for i in range(n))
            + FOOTER).encode()
    tracemalloc.start()
    try:
        assert read(io.BytesIO(data)) == n
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

def ours(f):
    return sum(1 for _ in wikidump._pages(f, "x"))

def plain(f):
    return sum(1 for p in mwxml.Dump.from_file(f) for _ in p)

peak(ours, 50)  # warm
print(json.dumps([peak(ours, 2000) - peak(ours, 300), peak(plain, 2000) - peak(plain, 300)]))
"""


def test_memory_stays_flat_over_pages():
    """mwxml keeps every finished <page> element on the root (about 90 bytes a page: 400 MB over zhwiki's 4.5M pages);
    the reader drops them. Python-heap peak reading 300 and then 2,000 pages: flat for ours, growing for mwxml's
    plain Dump (the control). Measured in a fresh interpreter: tracemalloc counts every thread's allocations, and a
    test worker may hold other tests' background threads (a Prefect client, a server)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], cwd=repo, capture_output=True, text=True, check=True)
    grow_ours, grow_plain = json.loads(out.stdout.splitlines()[-1])
    assert grow_ours < 40_000 < 100_000 < grow_plain, (grow_ours, grow_plain)
