"""NER tags: any scheme (BIO, IOB1/IOB2, BMES, BIOES) read as BIO, and a sentence's entities as spans.

Tag schemes (mixed freely, per tag): ``O``; ``B-X``; ``I-X``/``M-X`` (inside); ``E-X`` (end);
``S-X`` (single) - i.e. BIO/IOB1/IOB2, BMES and BIOES. Everything is converted to BIO
(``B-X``/``I-X``/``O``): ``B``/``S`` -> ``B-X``; ``I``/``M``/``E`` -> ``I-X`` when the previous tag
is an *open* entity of the same type (``B``/``I``/``M`` of type X), otherwise the conll repair
``-> B-X``, counted in ``stats["repaired_i_start"]`` (this also covers ``E-X`` right after
``E-X``/``S-X``, and IOB1 files). A ``B-X`` never closed by an ``E-X`` simply ends there.

Types are everything after the first ``-`` and are case sensitive; Weibo's mention-level suffix
(``PER.NAM`` named, ``PER.NOM`` nominal) is part of the type by default, so ``PER.NAM`` and
``PER.NOM`` are different types (as in the usual Weibo evaluation). ``strip_suffix=True`` cuts a
type at its first ``.`` (``PER.NAM`` -> ``PER``, ``GPE.NOM`` -> ``GPE``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

TAG = re.compile(r"([BIMES])-(\S+)")  # a tag other than O: its prefix and its type
_OPEN = frozenset("BIM")  # prefixes after which an I/M/E of the same type continues the entity


def parse_tag(tag: str, strip_suffix: bool = False) -> tuple[str, str]:
    """``"B-PER.NAM"`` -> ``("B", "PER.NAM")``; ``"O"`` -> ``("O", "")``; ValueError if malformed."""
    if tag == "O":
        return "O", ""
    m = TAG.fullmatch(tag)
    if m is None:
        raise ValueError(f"malformed tag {tag!r}")
    kind = m.group(2)
    if strip_suffix:
        kind = kind.partition(".")[0]
        if not kind:
            raise ValueError(f"malformed tag {tag!r}: empty type before '.'")
    return m.group(1), kind


def to_bio_repaired(tags: Iterable[str], strip_suffix: bool = False) -> tuple[list[str], int]:
    """:func:`to_bio`, and how many ``I``/``M``/``E`` tags with nothing open of their type started an entity."""
    out: list[str] = []
    repaired = 0
    prev_prefix, prev_kind = "O", ""
    for tag in tags:
        prefix, kind = parse_tag(tag, strip_suffix)
        if prefix == "O":
            out.append("O")
        elif prefix in "BS":
            out.append("B-" + kind)
        elif prev_prefix in _OPEN and prev_kind == kind:
            out.append("I-" + kind)
        else:  # I/M/E with nothing open of this type: start a new entity (conll)
            out.append("B-" + kind)
            repaired += 1
        prev_prefix, prev_kind = prefix, kind
    return out, repaired


def to_bio(tags: Sequence[str], strip_suffix: bool = False) -> list[str]:
    """Convert one sentence's tags (BIO/IOB1/IOB2/BMES/BIOES, mixed) to BIO; see module doc.

    Idempotent on valid BIO. Raises ValueError on a malformed tag."""
    return to_bio_repaired(tags, strip_suffix)[0]


def spans(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Entities of one sentence as ``(type, start, end)``, end exclusive, in order.

    Any scheme is accepted (converted with :func:`to_bio` first, so a stray ``I-X`` starts an
    entity, as conlleval does)."""
    out: list[tuple[str, int, int]] = []
    kind, start = "", -1
    for i, tag in enumerate(to_bio(tags)):
        if tag == "O" or tag[0] == "B":
            if start >= 0:
                out.append((kind, start, i))
            kind, start = (tag[2:], i) if tag != "O" else ("", -1)
    if start >= 0:
        out.append((kind, start, len(tags)))
    return out
