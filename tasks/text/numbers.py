"""The #NUM# rule: every integer/decimal -> one ``#NUM#`` token, and English words' spans for whole-word masking.

Tokens are characters, except ``#NUM#`` which is one token. Internally a token string uses U+E000 for ``#NUM#``
so that token index == character index (the cleaner strips U+E000 from input). The numbers stage
(:mod:`tasks.prepare.numbers`) applies it to the corpus; the featurizer applies it to new text.
"""

from __future__ import annotations

import re
from typing import Any

NUM = "#NUM#"
NUM_CHAR = "\ue000"

# full-width digits (and the full-width full stop between digits) are normalised first
_FW_DIGITS = {cp: cp - 0xFEE0 for cp in range(0xFF10, 0xFF1A)}
_FW_POINT = re.compile(r"(?<=[0-9])\uff0e(?=[0-9])")
# 1,234,567(.89) with thousands separators, or plain 123(.45); ASCII digits only, so 一九九八 stays
_NUMBER = re.compile(r"[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?")


def replace_numbers(text: str) -> str:
    """``2019年``->``#NUM#年``, ``3.14``->``#NUM#``, ``1,234,567人``->``#NUM#人``, ``12.5%``->``#NUM#%``."""
    text = _FW_POINT.sub(".", text.translate(_FW_DIGITS))
    return _NUMBER.sub(NUM, text)


def to_token_string(text: str) -> str:
    """One character per token: ``#NUM#`` -> U+E000."""
    return text.replace(NUM, NUM_CHAR)


def tokenize(text: str) -> list[str]:
    """Model tokens of a numbers text: its characters, each number as one #NUM#."""
    return [NUM if c == NUM_CHAR else c for c in to_token_string(text)]


def english_spans(tokens: str, min_len: int = 2) -> list[tuple[int, int]]:
    """Token spans [start, end) of ASCII-letter words, in token coordinates."""
    return [m.span() for m in re.finditer(r"[A-Za-z]{%d,}" % min_len, tokens)]


def number_row(row: dict[str, Any], min_english_len: int = 2) -> dict[str, Any]:
    """One cleaned sentence with its numbers replaced, counted, and its English words' spans marked."""
    text = replace_numbers(row["text"])
    toks = to_token_string(text)
    spans = english_spans(toks, min_english_len)
    return {
        "doc_id": row["doc_id"],
        "sent_idx": row["sent_idx"],
        "text": text,
        "n_numbers": toks.count(NUM_CHAR),
        "en_starts": [s for s, _ in spans],
        "en_ends": [e for _, e in spans],
    }
