"""MediaWiki XML dumps as the clean stage's input: ``.xml``, ``.xml.bz2`` and multistream ``.xml.bz2`` + index.

Pages are read with ``mwxml`` (a streaming ``iterparse`` reader; this module drops every finished ``<page>``
from the root element, which ``mwxml`` keeps, so memory stays flat over millions of pages) and their wikitext
is turned into text with ``mwparserfromhell``: its parse tree is pruned of templates, ``<ref>``s, tables,
files/images, categories, interlanguage links and other non-prose tags (math, gallery, ...), then its
``strip_code`` keeps the prose, links' display text and section headings (each on a line of its own). The
clean stage's usual steps (OpenCC t2s, sentence split, ``min_chars``, CJK ratio, dedup) follow unchanged.

Only articles are documents: a page outside namespace 0, a redirect or a disambiguation page is one reject
(``other_namespace``, ``redirect``, ``disambiguation``), so pages in = articles + rejected pages. A record's
``line`` is the page's 1-based position in the dump (its ordinal), ``doc_id`` its page id.

Multistream dumps (``...-pages-articles-multistream.xml.bz2``) are concatenated bz2 streams of about 100 pages
each; the index beside them (``...-multistream-index.txt.bz2``, lines ``offset:page_id:title``) gives each
stream's byte offset. :func:`plan_pieces` groups consecutive streams into pieces that shard tasks decode in
parallel (each piece gets the dump's header, the first stream's ``<mediawiki><siteinfo>``, in front and a
closing ``</mediawiki>`` behind); the index's page count and first and last page ids are checked against what
each piece holds. The pieces' pages in piece order are the dump's pages in order, with the same ordinals, so
the clean artifact has the same bytes read either way.
"""

from __future__ import annotations

import bz2
import io
import logging
import re
from collections.abc import Iterator
from typing import Any
from xml.etree.ElementTree import ParseError

import fsspec
import mwparserfromhell
import mwxml
from mwparserfromhell.nodes import Argument, Comment, ExternalLink, Heading, Tag, Template, Wikilink
from mwxml.element_iterator import ElementIterator
from mwxml.errors import MalformedXML

from tasks.common.rejects import DISAMBIGUATION, OTHER_NAMESPACE, REDIRECT, SNIPPET
from tasks.prepare.config import CleanConfig
from tasks.prepare.records import Doc, Reject

log = logging.getLogger(__name__)

READER_VERSION = "wikidump-1"  # bump when the text made from a given page changes (it enters the clean version)

# links into these namespaces are media or categories: removed with their captions
FILE_NAMESPACES = ("file", "image", "media", "文件", "檔案", "档案", "图像", "圖像", "媒体", "媒體", "媒体文件")
CATEGORY_NAMESPACES = ("category", "分类", "分類")
_DROP_LINK_NS = frozenset(FILE_NAMESPACES + CATEGORY_NAMESPACES)
# tags whose content is not prose (a table is a Tag "table", wiki {| |} or HTML)
DROP_TAGS = frozenset({
    "ref", "references", "table", "gallery", "math", "chem", "ce", "score", "timeline", "imagemap", "syntaxhighlight",
    "source", "pre", "code", "graph", "mapframe", "maplink", "templatedata", "templatestyles", "inputbox",
    "categorytree", "hiero", "charinsert", "indicator", "noinclude", "includeonly", "onlyinclude",
})
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(-[a-z0-9]+)*$")  # interlanguage links: [[en:Beijing]]
_REDIRECT_TEXT = re.compile(r"\s*#\s*(redirect|重定向)\s*[:：]?\s*\[\[", re.I)
_DISAMBIG_TITLE = re.compile(r"[(（](消歧义|消歧義|disambiguation)[)）]\s*$", re.I)
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
# brackets a removed template leaves behind: 李白（{{lang-en|Li Bai}}，701年） -> 李白（701年）
_EMPTY_BRACKETS = re.compile(r"[（(]\s*[，、；;,]?\s*[）)]")
_BRACKET_LEAD = re.compile(r"([（(])\s*[，、；;,]\s*")
_TABLE_LINE = re.compile(r"^\s*(\{\||\|\}|\|-|\|\+|\||!)")  # remnants of a table the parser could not close
_INDEX_NAME = re.compile(r"^(?P<stem>.*-multistream)(?P<n>\d*)\.xml(?P<range>-p\d+p\d+)?\.bz2$")
_FOOTER = b"</mediawiki>\n"
_CHUNK = 1 << 20


# ----------------------------------------------------------------------------- format detection


def looks_like_dump(head: bytes) -> bool:
    """Whether the first (decompressed) bytes of a file are a MediaWiki XML export."""
    s = head.decode("utf-8", "ignore").lstrip("\ufeff \t\r\n")
    return s.startswith("<mediawiki") or (s.startswith("<?xml") and "<mediawiki" in s[:2048])


def is_dump(uri: str, cfg: CleanConfig) -> bool:
    """Whether ``uri`` is read as a MediaWiki dump: ``input_format: mediawiki_xml``, or ``auto`` and its content
    (decompressed as its name says) starts as one."""
    if cfg.input_format != "auto":
        return cfg.input_format == "mediawiki_xml"
    with fsspec.open(uri, "rb", compression="infer") as f:
        return looks_like_dump(f.read(4096))


def standard_index_uri(uri: str) -> str | None:
    """The multistream index's URI by the dumps' naming (``X-multistream.xml.bz2`` -> ``X-multistream-index.txt.bz2``,
    also for the split ``...-multistream3.xml-p1p2.bz2``); None for a name that is not a multistream dump's."""
    head, _, base = uri.rpartition("/")
    m = _INDEX_NAME.match(base)
    if not m:
        return None
    name = f"{m['stem']}-index{m['n']}.txt{m['range'] or ''}.bz2"
    return f"{head}/{name}" if head or uri.startswith("/") else name


def is_index_file(uri: str) -> bool:
    """A multistream index (``...-multistream-index.txt.bz2``): never a corpus file itself."""
    return re.search(r"-multistream-index\d*\.txt(-p\d+p\d+)?\.bz2$", uri) is not None


def find_index(uri: str, cfg: CleanConfig) -> str | None:
    """The index to split ``uri`` by: ``clean.dump.index_uri`` if given (it must exist), else the standard name
    beside the dump if it exists, else None (the dump is then read sequentially)."""
    if cfg.dump.index_uri:
        fs, path = fsspec.core.url_to_fs(cfg.dump.index_uri)
        if not fs.exists(path):
            raise FileNotFoundError(f"prepare.clean.dump.index_uri {cfg.dump.index_uri!r} does not exist")
        return cfg.dump.index_uri
    cand = standard_index_uri(uri)
    if cand is None:
        return None
    fs, path = fsspec.core.url_to_fs(cand)
    return cand if fs.exists(path) else None


# ----------------------------------------------------------------------------- multistream pieces


def plan_pieces(index_uri: str, streams_per_task: int) -> list[dict[str, Any]]:
    """Read a multistream index (streamed) into pieces of ``streams_per_task`` consecutive streams:
    ``{start, end, header_end, pages, first_id, last_id, first_ordinal}`` (``end`` None: to the end of file)."""
    pieces: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    last_offset = -1
    streams = ordinal = 0
    with fsspec.open(index_uri, "rt", compression="infer", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            parts = line.split(":", 2)
            try:
                offset, page_id = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                raise ValueError(f"{index_uri}: line {lineno}: expected 'offset:page_id:title', got {line[:80]!r}")
            if offset < last_offset:
                raise ValueError(f"{index_uri}: line {lineno}: offset {offset} goes back (previous {last_offset})")
            ordinal += 1
            if offset != last_offset:
                if cur is None or streams == streams_per_task:
                    if cur is not None:
                        cur["end"] = offset
                        pieces.append(cur)
                    cur = {"start": offset, "end": None, "pages": 0, "first_id": page_id, "first_ordinal": ordinal}
                    streams = 0
                streams += 1
                last_offset = offset
            cur["pages"] += 1
            cur["last_id"] = page_id
    if cur is None:
        raise ValueError(f"{index_uri}: the index lists no page")
    pieces.append(cur)
    for p in pieces:
        p["header_end"] = pieces[0]["start"]
    return pieces


class _StreamsReader(io.RawIOBase):
    """A binary file: ``header`` + the decompressed bz2 streams in bytes [start, end) of ``f`` + a closing
    ``</mediawiki>`` when those streams do not end with one (every piece but the last)."""

    def __init__(self, f, start: int, end: int | None, header: bytes, where: str):
        super().__init__()
        f.seek(start)
        self.f, self.left, self.where = f, None if end is None else end - start, where
        self.buf = memoryview(header)
        self.dec = bz2.BZ2Decompressor()
        self.fed = False  # bytes went into the current decompressor
        self.tail = b""
        self.finished = False

    def readable(self) -> bool:
        return True

    def _decompress(self, raw: bytes) -> bytes:
        out = []
        while raw:
            if self.dec.eof:
                self.dec, self.fed = bz2.BZ2Decompressor(), False
            self.fed = True
            out.append(self.dec.decompress(raw))
            raw = self.dec.unused_data if self.dec.eof else b""
        return b"".join(out)

    def _next(self) -> bytes:
        while not self.finished:
            n = _CHUNK if self.left is None else min(_CHUNK, self.left)
            raw = self.f.read(n) if n else b""
            if self.left is not None:
                self.left -= len(raw)
            if not raw:
                self.finished = True
                if self.fed and not self.dec.eof:
                    raise ValueError(f"{self.where}: a bz2 stream is cut short (truncated file or wrong index offset)")
                return b"" if _FOOTER.strip() in self.tail else _FOOTER
            out = self._decompress(raw)
            if out:
                self.tail = (self.tail + out)[-64:]
                return out
        return b""

    def readinto(self, b) -> int:
        while not len(self.buf):
            if self.finished:
                return 0
            self.buf = memoryview(self._next())
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n


def _header(fs, path: str, header_end: int, where: str) -> bytes:
    """The dump's first stream(s), before the first page: ``<mediawiki ...><siteinfo>...</siteinfo>``."""
    with fs.open(path, "rb") as f:
        raw = f.read(header_end)
    try:
        head = bz2.decompress(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: bytes 0-{header_end} (before the index's first offset) are not bz2 streams: {e}")
    if not looks_like_dump(head):
        raise ValueError(f"{where}: the first stream does not start a MediaWiki export: {head[:80]!r}")
    return head


# ----------------------------------------------------------------------------- wikitext -> text


def _template_name(t: Template) -> str:
    name = str(t.name).strip().replace("_", " ")
    for prefix in ("template:", "模板:", "模板："):
        if name.lower().startswith(prefix):
            name = name[len(prefix):]
    return name.strip().lower()


def _drop_link(link: Wikilink) -> bool:
    title = str(link.title).strip()
    if title.startswith(":"):  # [[:Category:X|...]] is an inline link to the page: its text stays
        return False
    ns, sep, _ = title.partition(":")
    if not sep:
        return False
    ns = ns.strip().replace("_", " ").lower()
    return ns in _DROP_LINK_NS or (link.text is None and _LANG_PREFIX.match(ns) is not None)


def _drop(node) -> bool:
    if isinstance(node, (Template, Argument, Comment)):
        return True
    if isinstance(node, Tag):
        return str(node.tag).strip().lower() in DROP_TAGS
    if isinstance(node, Wikilink):
        return _drop_link(node)
    return False


def _prune(code) -> None:
    """Remove the non-prose nodes, top-down (a removed node takes its children with it)."""
    code.nodes = [n for n in code.nodes if not _drop(n)]
    for n in code.nodes:
        if isinstance(n, Tag):
            children = [n.contents]
        elif isinstance(n, Wikilink):
            children = [n.text if n.text is not None else n.title]
        elif isinstance(n, Heading):
            children = [n.title]
        elif isinstance(n, ExternalLink):
            children = [n.title]
        else:
            continue
        for c in children:
            if c is not None:
                _prune(c)


def wikitext_to_text(wikitext: str) -> str:
    """The prose of an article's wikitext: templates, refs, tables, files/images, categories and interlanguage
    links removed; links become their display text; headings are lines of their own; entities decoded."""
    return _render(mwparserfromhell.parse(wikitext))


def _render(code) -> str:
    _prune(code)
    text = _MAGIC_WORD.sub("", code.strip_code(normalize=True, collapse=True))
    text = _BRACKET_LEAD.sub(r"\1", _EMPTY_BRACKETS.sub("", text))
    return "\n".join(line for line in text.split("\n") if not _TABLE_LINE.match(line)).strip()


def page_reason(title: str, namespace: int | None, redirect: str | None, wikitext: str) -> str | None:
    """Why a page is not an article, from its header and first bytes: another namespace, a redirect or a
    ``(消歧义)`` title (a reject reason); None when it may be one (its templates decide: :func:`article_text`)."""
    if namespace not in (0, None):
        return OTHER_NAMESPACE
    if redirect is not None or _REDIRECT_TEXT.match(wikitext):
        return REDIRECT
    if _DISAMBIG_TITLE.search(title or ""):
        return DISAMBIGUATION
    return None


def article_text(wikitext: str, disambiguation: frozenset[str]) -> tuple[str | None, str]:
    """``(DISAMBIGUATION, "")`` for a page using one of the ``disambiguation`` templates (lower case), else
    ``(None, text)``; one parse for both."""
    code = mwparserfromhell.parse(wikitext)
    if disambiguation and any(_template_name(t) in disambiguation for t in code.filter_templates(recursive=False)):
        return DISAMBIGUATION, ""
    return None, _render(code)


# ----------------------------------------------------------------------------- reading


def _pages(f, where: str) -> Iterator[tuple[Any, str]]:
    """(page, text of its last revision) from an XML stream; each finished page is dropped from the root."""
    try:
        root = ElementIterator.from_file(f)
        if root.tag != "mediawiki":
            raise ValueError(f"{where}: root element is <{root.tag}>, expected <mediawiki>")
        for page in mwxml.Dump.from_element(root).pages:
            text = ""
            for rev in page:
                text = rev.text or ""
            yield page, text
            del root.element[:]  # mwxml clears a page's children but leaves the page on the root
    except (ParseError, MalformedXML) as e:
        raise ValueError(f"{where}: malformed MediaWiki XML: {e}") from e


def read_dump(uri: str, cfg: CleanConfig, name: str | None = None,
              piece: dict[str, Any] | None = None) -> Iterator[Doc | Reject]:
    """Stream a dump's pages as articles (:class:`Doc`) or page rejects (:class:`Reject`).

    Without ``piece`` the whole file is read in order (``.xml``, any compression fsspec infers; a multistream
    ``.bz2`` is read stream after stream). With a ``piece`` of :func:`plan_pieces`, only its bz2 streams are
    decoded, and its page count and first and last page ids are checked against the index."""
    label = name or uri
    disamb = frozenset(t.strip().replace("_", " ").lower() for t in cfg.dump.disambiguation_templates)
    if piece is None:
        with fsspec.open(uri, "rb", compression="infer") as f:
            yield from _records(_pages(f, label), label, disamb, 1)
        return
    where = f"{label} bytes {piece['start']}-{piece['end'] if piece['end'] is not None else 'end'}"
    fs, path = fsspec.core.url_to_fs(uri)
    header = _header(fs, path, piece["header_end"], label)
    with fs.open(path, "rb") as raw:
        reader = io.BufferedReader(_StreamsReader(raw, piece["start"], piece["end"], header, where), _CHUNK)
        seen, first, last = 0, None, None
        for rec in _records(_pages(reader, where), label, disamb, piece["first_ordinal"]):
            seen += 1
            first = rec.doc_id if first is None else first
            last = rec.doc_id
            yield rec
    if (seen, first, last) != (piece["pages"], str(piece["first_id"]), str(piece["last_id"])):
        raise ValueError(f"{where}: the index lists {piece['pages']} pages (ids {piece['first_id']}..."
                         f"{piece['last_id']}) but the streams hold {seen} (ids {first}...{last}): wrong index?")


def _records(pages, label: str, disamb: frozenset[str], first_ordinal: int) -> Iterator[Doc | Reject]:
    for ordinal, (page, wikitext) in enumerate(pages, first_ordinal):
        doc_id = str(page.id)
        title = page.title or ""
        reason = page_reason(title, page.namespace, page.redirect, wikitext)
        text = ""
        if reason is None:
            reason, text = article_text(wikitext, disamb)
        if reason is not None:
            shown = {REDIRECT: f"{title} -> {page.redirect or ''}", OTHER_NAMESPACE: f"ns {page.namespace}: {title}"}
            yield Reject(label, ordinal, reason, shown.get(reason, title)[:SNIPPET], doc_id)
            continue
        yield Doc(label, ordinal, doc_id, ((ordinal, text),))
