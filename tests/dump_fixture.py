# ruff: noqa: E501 - wikitext paragraphs are single long lines, as in real articles
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
"""
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
    base = [BEIJING, TAIWAN_TRAD, SHANGHAI, LIBAI, PYTHAGORAS, HONGKONG_TRAD]  # (the last three: defined below)
    out = []
    for i in range(n):
        pid = i + 1
        if i % 10 == 9:
            out.append(page(pid, f"重定向{pid}", f"#REDIRECT [[条目{pid - 1}]]", redirect=f"条目{pid - 1}"))
        elif i % 25 == 24:
            out.append(page(pid, f"Template:模板{pid}", TEMPLATE_TEXT, ns=10))
        else:
            text = base[i % len(base)].replace("。", f"（第{pid}篇）。")
            out.append(page(pid, f"条目{pid}", text))
    return out


# more article wikitext for benchmarks/eval_dump_clean.py (lists, galleries, formulas, poems, nested templates,
# inline {{lang}} templates, HTML, quotes), written in the style of zhwiki articles
LIBAI = """{{Infobox person
| name = 李白
| image = Li Bai.jpg
| birth_date = {{birth date|701|2|28}}
}}
'''李白'''（{{lang-en|Li Bai}}，701年－762年），字'''太白'''，号'''青莲居士'''，[[唐朝]]著名[[诗人]]，被后人誉为“[[诗仙]]”。<ref>{{cite book|title=新唐书|author=欧阳修}}</ref>
== 生平 ==
李白出生于[[西域]][[碎叶城]]，幼年随父迁居[[绵州]][[昌隆县]]。<ref name="jiu">《旧唐书·李白传》</ref>他青年时期漫游各地，结交了许多朋友。
天宝元年，李白奉诏入京，供奉翰林。<ref name="jiu"/>后来因得罪权贵而被赐金放还。
== 作品 ==
李白的诗歌想象丰富，语言豪放。代表作有：
* 《[[静夜思]]》
* 《[[将进酒]]》
* 《[[蜀道难]]》
<poem>
床前明月光，疑是地上霜。
举头望明月，低头思故乡。
</poem>
<gallery>
File:Li Bai 1.jpg|李白像
File:Li Bai 2.jpg|李白诗碑
</gallery>
{{唐朝诗人}}
{{Authority control}}
[[Category:唐朝诗人]]
[[Category:701年出生]]
"""

PYTHAGORAS = """{{about|数学定理|其他用法|勾股 (消歧义)}}
'''勾股定理'''，又称'''毕达哥拉斯定理'''，是[[平面几何]]中一个基本而重要的定理。<ref>{{Cite web|url=http://example.org|title=勾股定理}}</ref>
勾股定理说明，[[直角三角形]]两条直角边的平方和等于斜边的平方：<math>a^2 + b^2 = c^2</math>。
== 历史 ==
中国古代的《[[周髀算经]]》记载了“勾三股四弦五”的特例。<ref>{{harvnb|程贞一|1999}}</ref>古希腊的[[毕达哥拉斯]]学派也独立发现了这个定理。
{| class="wikitable"
|+ 常见的勾股数
! 勾 !! 股 !! 弦
|-
| 3 || 4 || 5
|-
| 5 || 12 || 13
|}
== 证明 ==
这个定理有数百种不同的证明方法，其中'''赵爽弦图'''是中国古代著名的证明。[[File:Zhao Shuang.svg|thumb|200px|赵爽弦图]]
''参见'':[[勾股数]]、[[费马大定理]]。
{{数学主题}}
[[分类:几何定理]]
"""

HONGKONG_TRAD = """{{noteTA|G1=地名}}
{{Infobox city|name=香港}}
'''香港'''（{{lang-en|Hong Kong}}），全稱'''中華人民共和國香港特別行政區'''，位於[[南海]]北岸、[[珠江口]]東側。<ref>{{cite web|title=香港概況}}</ref>
香港是全球重要的[[國際金融中心]]之一，與[[紐約]]、[[倫敦]]並稱為“紐倫港”。<ref name="fin">{{cite news|title=金融中心}}</ref>
== 地理 ==
香港由[[香港島]]、[[九龍半島]]、[[新界]]及兩百多個離島組成，總面積約1,106平方公里。<br/>境內多山，平地較少。
=== 氣候 ===
香港屬於[[亞熱帶季風氣候]]，夏季炎熱潮濕，冬季溫和乾燥。每年[[颱風]]季節為五月至十一月。
<blockquote>香港天文台負責發出颱風警告信號。</blockquote>
== 參考資料 ==
{{reflist|2}}
[[Category:香港]]
[[分類:中國城市]]
"""


def eval_pages() -> list[dict]:
    """The sample's pages plus three more articles (one more in traditional script) for the WikiExtractor
    comparison."""
    return sample_pages() + [page(9, "李白", LIBAI), page(10, "勾股定理", PYTHAGORAS), page(11, "香港", HONGKONG_TRAD)]
