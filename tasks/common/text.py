"""Text normalisation shared by cleaning, featurising and NER: markup, OpenCC t2s, full-width -> half-width."""

from __future__ import annotations

import html
import re
from functools import lru_cache

_MARKUP = re.compile(r"-\{(.*?)\}-", re.S)
_TAG = re.compile(r"</?[A-Za-z][^<>]{0,200}>")
_WS = re.compile(r"\s+")
_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")
# a str can hold a lone surrogate (a JSON "\ud800" escape decodes to one); no UTF-8 encoder, OpenCC or Arrow takes it
_SURROGATE = re.compile("[\ud800-\udfff]")
# CJK ideographs: the unified block, extension A, extensions B-F (the clean stage's CJK ratio counts the same)
_CJK = re.compile("[\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002ebef]")
# full-width digits and Latin letters -> ASCII; U+3000 ideographic space -> space
FULLWIDTH = {cp: cp - 0xFEE0 for cp in [*range(0xFF10, 0xFF1A), *range(0xFF21, 0xFF3B), *range(0xFF41, 0xFF5B)]}
FULLWIDTH[0x3000] = 0x20


@lru_cache(maxsize=1)
def t2s():
    """The OpenCC traditional-to-simplified converter, built once per process."""
    import opencc  # noqa: PLC0415 - only normalising needs it: pretraining-only hosts may lack the C++ binding

    return opencc.OpenCC("t2s")


def _pick_variant(m: re.Match) -> str:
    """``-{zh-hans:计算机;zh-hant:電腦}-`` -> 计算机; ``-{X}-`` -> X."""
    body = m.group(1)
    if ":" not in body:
        return body
    variants = {}
    for part in body.split(";"):
        if ":" in part:
            k, v = part.split(":", 1)
            variants[k.strip().lower()] = v.strip()
    for key in ("zh-hans", "zh-cn", "zh", "zh-sg", "zh-hant", "zh-tw", "zh-hk"):
        if key in variants:
            return variants[key]
    return next(iter(variants.values()), "")


def valid_unicode(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (no lone surrogate)."""
    return _SURROGATE.search(text) is None


def replace_invalid(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD, so it can be shown and stored."""
    return _SURROGATE.sub("\ufffd", text)


def has_cjk(text: str) -> bool:
    """Whether ``text`` holds at least one CJK ideograph."""
    return _CJK.search(text) is not None


def normalize_text(text: str) -> str:
    """Markup removal, OpenCC t2s, full-width -> half-width letters/digits, collapsed whitespace. A lone surrogate
    (which the labeller rejects as ``invalid_unicode``) becomes U+FFFD here, so a direct caller never fails on it."""
    text = _MARKUP.sub(_pick_variant, replace_invalid(text))
    text = html.unescape(_TAG.sub("", text))
    text = _PRIVATE_USE.sub("", text)  # U+E000 is reserved for the #NUM# token downstream
    text = t2s().convert(text)
    text = text.translate(FULLWIDTH)
    return _WS.sub(" ", text).strip()


@lru_cache(maxsize=1 << 16)
def norm_char(ch: str) -> str:
    """One character -> one normalised character (t2s, full-width -> half-width); a conversion that
    would change the length is not applied, and multi-character tokens are returned unchanged."""
    if len(ch) != 1:
        return ch
    c = ch.translate(FULLWIDTH)
    t = t2s().convert(c)
    return t if len(t) == 1 else c
