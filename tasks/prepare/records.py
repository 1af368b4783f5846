"""What a corpus reader yields: a document with its located paragraphs, or a located reject."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Doc:
    """One document of an input file: where it starts, its id and its paragraphs with their lines."""

    source: str
    line: int  # 1-based line where the record starts
    doc_id: str
    paragraphs: tuple[tuple[int, str], ...]  # (line, raw text)


@dataclass(frozen=True)
class Reject:
    """One record the readers refuse: where it is, why, and a snippet of it."""

    source: str
    line: int
    reason: str
    text: str
    doc_id: str = ""
