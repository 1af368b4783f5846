"""Small MediaWiki XML dumps made in the test: realistic zhwiki wikitext (templates, refs, tables, links, files,
categories, traditional script), a redirect, a disambiguation page and pages outside namespace 0; written as
``.xml``, ``.xml.bz2`` or a multistream ``.xml.bz2`` (one bz2 stream per group of pages) with its index."""

from __future__ import annotations

import bz2
from xml.sax.saxutils import escape, quoteattr

HEADER = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:schemaLocation="http://www.mediawiki.org/xml/export-0.11/ http://www.mediawiki.org/xml/export-0.11.xsd" version="0.11" xml:lang="zh">
  <siteinfo>
    <sitename>Wikipedia</sitename>
    <dbname>zhwiki</dbname>
    <base>https://zh.wikipedia.org/wiki/Wikipedia:%E9%A6%96%E9%A1%B5</base>
    <generator>MediaWiki 1.43.0-wmf.1</generator>
    <case>first-letter</case>
    <namespaces>
      <namespace key="0" case="first-letter" />
      <namespace key="4" case="first-letter">Wikipedia</namespace>
      <namespace key="6" case="first-letter">File</namespace>
      <namespace key="10" case="first-letter">Template</namespace>
      <namespace key="14" case="first-letter">Category</namespace>
    </namespaces>
  </siteinfo>
"""  # noqa: E501 - a dump's header is one line
FOOTER = "</mediawiki>\n"

BEIJING = """{{Infobox settlement
| name = 北京市
| capital = [[东城区 (北京市)|东城区]]
}}
'''北京市'''，简称'''京'''<ref name="gov">{{cite web|url=http://www.beijing.gov.cn|title=北京市人民政府}}</ref>，是[[中华人民共和国]]的[[首都]]，也是全国的[[政治]]、[[文化]]中心。北京有三千多年的建城史和八百多年的建都史。<ref>《北京志》，北京出版社。</ref>
[[File:Beijing skyline.jpg|thumb|北京的[[天际线]]]]
[[文件:Tiananmen.jpg|缩略图|天安门广场]]
== 历史 ==
北京古称[[蓟]]，[[战国]]时为[[燕国]]的都城。<ref name="gov"/>[[元朝]]定都于此，称为[[元大都|大都]]。
* [[明朝]]永乐年间迁都北京。
* [[清朝]]沿用明朝的都城。
== 人口 ==
{| class="wikitable"
|-
! 年份 !! 常住人口
|-
| 2010 || 1961万
|-
| 2020 || 2189万
|}
北京的常住人口超过两千万人。外部链接参见[http://www.bjstats.gov.cn 北京市统计局]的资料。
<!-- 编者注：此处待补充 -->
{{Reflist}}
[[Category:北京市| ]]
[[分类:中华人民共和国首都]]
[[en:Beijing]]
"""

TAIWAN_TRAD = """{{Otheruses|臺灣}}
'''臺灣'''位於[[東亞]]，是[[太平洋]]西部的一個島嶼。<ref>{{cite book|title=臺灣地理}}</ref>
島上的[[玉山]]是東北亞最高的山峰。
[[Image:Taiwan relief map.png|thumb|臺灣地形圖]]
[[圖像:Yushan.jpg|玉山主峰]]
臺灣的氣候溫暖潮濕，雨量豐沛。這裡的經濟以[[電子工業|電子產業]]聞名於世界。
-{zh-hans:信息技术;zh-hant:資訊科技}-產業是臺灣經濟的重要支柱。
[[分類:臺灣]]
"""

SHANGHAI = """'''上海市'''是中华人民共和国的[[直辖市]]之一，位于[[长江]]入海口。<ref name="a">上海市统计年鉴。</ref>
上海是全国最大的经济中心城市，也是重要的国际港口城市。{{Citation needed|date=2020年1月}}
== 交通 ==
上海拥有两座国际机场：[[上海浦东国际机场|浦东国际机场]]和[[上海虹桥国际机场|虹桥国际机场]]。
[[Category:上海市]]
"""

REDIRECT_TEXT = "#REDIRECT [[北京市]]"
DISAMBIG_TEXT = """'''长城'''可以指：
* [[万里长城]]，中国古代的军事防御工程。
* [[长城汽车]]，一家汽车制造公司。
{{disambig}}
"""
DISAMBIG_ZH = """'''東方'''可以指：
* [[東方 (方位)]]
{{消歧義}}
"""
TEMPLATE_TEXT = "{{Navbox|name=城市|list1=[[北京市]]}}"
CATEGORY_TEXT = "北京市的条目。[[Category:中国城市]]"


def page(page_id: int, title: str, text: str, ns: int = 0, redirect: str | None = None) -> dict:
    return {"id": page_id, "title": title, "ns": ns, "text": text, "redirect": redirect}


def sample_pages() -> list[dict]:
    """Eight pages: three articles (one in traditional script), a redirect, two disambiguation pages (English
    and Chinese template), a template and a category."""
    return [
        page(1, "北京市", BEIJING),
        page(2, "臺灣", TAIWAN_TRAD),
        page(3, "北京", REDIRECT_TEXT, redirect="北京市"),
        page(4, "长城", DISAMBIG_TEXT),
        page(5, "Template:城市", TEMPLATE_TEXT, ns=10),
        page(6, "上海市", SHANGHAI),
        page(7, "東方", DISAMBIG_ZH),
        page(8, "Category:中国城市", CATEGORY_TEXT, ns=14),
    ]


def page_xml(p: dict) -> str:
    redirect = f"    <redirect title={quoteattr(p['redirect'])} />\n" if p.get("redirect") else ""
    text = p["text"]
    return (
        f"  <page>\n    <title>{escape(p['title'])}</title>\n    <ns>{p['ns']}</ns>\n    <id>{p['id']}</id>\n"
        f"{redirect}"
        f"    <revision>\n      <id>{1000 + p['id']}</id>\n      <timestamp>2024-11-01T00:00:00Z</timestamp>\n"
        f"      <contributor>\n        <username>Editor</username>\n        <id>7</id>\n      </contributor>\n"
        f"      <model>wikitext</model>\n      <format>text/x-wiki</format>\n"
        f"      <text bytes=\"{len(text.encode())}\" xml:space=\"preserve\">{escape(text)}</text>\n"
        f"      <sha1>0</sha1>\n    </revision>\n  </page>\n"
    )


def dump_xml(pages: list[dict]) -> bytes:
    return (HEADER + "".join(page_xml(p) for p in pages) + FOOTER).encode()


def multistream(pages: list[dict], per_stream: int = 3) -> tuple[bytes, bytes]:
    """(dump, index): the header as the first bz2 stream, then ``per_stream`` pages per stream, then the footer as
    its own stream (as Wikimedia writes them); the index lists ``offset:page_id:title`` for every page,
    bz2-compressed."""
    streams = [bz2.compress(HEADER.encode())]
    index = []
    offset = len(streams[0])
    for i in range(0, len(pages), per_stream):
        group = pages[i:i + per_stream]
        data = bz2.compress("".join(page_xml(p) for p in group).encode())
        index += [f"{offset}:{p['id']}:{p['title']}" for p in group]
        streams.append(data)
        offset += len(data)
    streams.append(bz2.compress(FOOTER.encode()))
    return b"".join(streams), bz2.compress(("\n".join(index) + "\n").encode())


def many_pages(n: int) -> list[dict]:
    """``n`` pages for throughput runs: the sample's pages repeated with new ids and titles (every 10th a
    redirect, every 25th a template), each article's sentences numbered so that they are not duplicates."""
    base = [BEIJING, TAIWAN_TRAD, SHANGHAI]
    out = []
    for i in range(n):
        pid = i + 1
        if i % 10 == 9:
            out.append(page(pid, f"重定向{pid}", f"#REDIRECT [[条目{pid - 1}]]", redirect=f"条目{pid - 1}"))
        elif i % 25 == 24:
            out.append(page(pid, f"Template:模板{pid}", TEMPLATE_TEXT, ns=10))
        else:
            text = base[i % 3].replace("。", f"（第{pid}篇）。")
            out.append(page(pid, f"条目{pid}", text))
    return out
