"""NER data: read character-per-line NER files into one internal tagging scheme (BIO).

Input format (Resume / Weibo / MSRA / the embedded ``ner_sample.bio``)::

    张 B-PER          one ``char<sep>tag`` per line; ``<sep>`` is a space or a tab
    三 E-PER          (a run of spaces/tabs counts as one separator)
    说 O
                      a blank (or whitespace-only) line ends a sentence

Any fsspec URL is accepted; compression is inferred from the name (``.gz``, ``.bz2``, ``.zst``..).
Lines are split on ``\\n`` only, a trailing ``\\r`` is dropped, a UTF-8 BOM on line 1 is ignored.
Only ASCII space/tab separate the character from its tag, so a full-width space (U+3000) or any
other Unicode whitespace is a valid *character*. The character field is kept as written; a
multi-character field (``abc O``) is accepted as one token and counted in ``stats["multi_char"]``.

Tags in any scheme are converted to BIO (:mod:`tasks.inference.tags`, which says how).

Malformed lines are never dropped silently. Reasons (:mod:`tasks.common.rejects`; a sentence
containing one is rejected as a whole, with the reason, line number and raw text of its *first*
bad line):

* ``undecodable``  - the line is not valid UTF-8;
* ``no_separator`` - a non-blank line with no space/tab between character and tag;
* ``empty_char``   - the line starts with the separator (no character before it);
* ``bad_tag``      - the tag is not ``O`` or ``[BIMES]-<type>`` with a non-empty type
  (``Q-PER``, ``B-``, ``b-PER``, ``PER``).

``stats`` reconciles: ``in == out + sum(rejected.values())`` where ``in`` counts non-empty
sentences. Line numbers are 1-based.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import fsspec
import numpy as np

from tasks.common.rejects import BAD_TAG, EMPTY_CHAR, NO_SEPARATOR, UNDECODABLE
from tasks.inference.tags import TAG, to_bio_repaired

__all__ = ["NerData", "read_ner", "split_sentences", "REASONS"]

REASONS = (UNDECODABLE, NO_SEPARATOR, EMPTY_CHAR, BAD_TAG)
_SEP = " \t"


class NerData(NamedTuple):
    """What :func:`read_ner` returns: the sentences, the rejected lines and the counts."""
    sentences: list[dict[str, Any]]  # {"chars": [str], "tags": [BIO str], "line": first line no}
    rejects: list[dict[str, Any]]  # {"line": n, "reason": str, "text": raw line}
    stats: dict[str, Any]  # {"in", "out", "rejected": {reason: n}, "repaired_i_start", ...}


# ----------------------------------------------------------------------------- reading


def _parse_line(raw: bytes, lineno: int) -> tuple[str, str] | str | None:
    """``(char, tag)``, a reason string for a malformed line, or None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return UNDECODABLE
    if lineno == 1 and text.startswith("\ufeff"):
        text = text[1:]
    text = text.rstrip("\r\n").rstrip(_SEP)
    if not text:
        return None
    cut = max(text.rfind(" "), text.rfind("\t"))
    if cut < 0:
        return NO_SEPARATOR
    char, tag = text[:cut].rstrip(_SEP), text[cut + 1 :]
    if not char:
        return EMPTY_CHAR
    if tag != "O" and TAG.fullmatch(tag) is None:
        return BAD_TAG
    return char, tag


def _raw_text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _iter_sentences(f) -> Iterator[tuple[int, list[str], list[str], dict[str, Any] | None]]:
    """Yield ``(first_line, chars, tags, first_reject_or_None)`` per non-empty sentence."""
    chars: list[str] = []
    tags: list[str] = []
    first = 0
    bad: dict[str, Any] | None = None
    n = 0
    for n, raw in enumerate(f, start=1):
        parsed = _parse_line(raw, n)
        if parsed is None:
            if first:
                yield first, chars, tags, bad
            chars, tags, first, bad = [], [], 0, None
            continue
        if not first:
            first = n
        if isinstance(parsed, str):
            if bad is None:
                bad = {"line": n, "reason": parsed, "text": _raw_text(raw)}
        elif bad is None:
            chars.append(parsed[0])
            tags.append(parsed[1])
    if first:
        yield first, chars, tags, bad


def read_ner(uri: str, strip_suffix: bool = False) -> NerData:
    """Read one character-per-line NER file (any fsspec URL, compression inferred).

    Returns ``NerData(sentences, rejects, stats)``; every sentence's ``tags`` are BIO. ``stats``:
    ``in`` (non-empty sentences seen), ``out`` (kept), ``rejected`` ({reason: sentences}),
    ``repaired_i_start`` (tags turned into ``B-X``), ``chars`` (kept tokens), ``multi_char``
    (kept tokens longer than one character), ``entities`` (kept), ``types`` ({type: entities})."""
    sentences: list[dict[str, Any]] = []
    rejects: list[dict[str, Any]] = []
    rejected: dict[str, int] = {}
    n_in = repaired = n_chars = multi = 0
    types: dict[str, int] = {}
    with fsspec.open(uri, "rb", compression="infer") as f:
        for first, chars, tags, bad in _iter_sentences(f):
            n_in += 1
            if bad is not None:
                rejects.append(bad)
                rejected[bad["reason"]] = rejected.get(bad["reason"], 0) + 1
                continue
            bio, rep = to_bio_repaired(tags, strip_suffix)
            repaired += rep
            n_chars += len(chars)
            multi += sum(len(c) != 1 for c in chars)
            for tag in bio:
                if tag[0] == "B":
                    types[tag[2:]] = types.get(tag[2:], 0) + 1
            sentences.append({"chars": chars, "tags": bio, "line": first})
    stats = {
        "in": n_in,
        "out": len(sentences),
        "rejected": dict(sorted(rejected.items())),
        "repaired_i_start": repaired,
        "chars": n_chars,
        "multi_char": multi,
        "entities": sum(types.values()),
        "types": dict(sorted(types.items())),
    }
    assert stats["in"] == stats["out"] + sum(rejected.values())
    return NerData(sentences, rejects, stats)


# ----------------------------------------------------------------------------- splitting


def split_sentences(
    sentences: Sequence[Any], fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 7
) -> tuple[list[Any], ...]:
    """Deterministic random split into ``len(fractions)`` parts (e.g. train/dev/test).

    A seeded ``numpy.random.default_rng(seed).permutation`` of the indices is cut at
    ``round(n * cumsum(fractions))``; each part keeps the input order (indices sorted), so
    the result depends only on ``n``, ``fractions`` and ``seed``. Fractions must be >= 0 and
    sum to 1 (within 1e-6)."""
    fr = np.asarray(fractions, dtype=np.float64)
    if fr.ndim != 1 or fr.size == 0 or (fr < 0).any() or abs(fr.sum() - 1.0) > 1e-6:
        raise ValueError(f"fractions must be non-negative and sum to 1, got {tuple(fractions)}")
    n = len(sentences)
    perm = np.random.default_rng(seed).permutation(n)
    bounds = np.rint(np.cumsum(fr) * n).astype(np.int64)
    bounds[-1] = n
    parts, lo = [], 0
    for hi in bounds:
        hi = max(int(hi), lo)
        parts.append([sentences[i] for i in np.sort(perm[lo:hi])])
        lo = hi
    return tuple(parts)
