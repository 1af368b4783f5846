"""Vocabulary lookup: the specials' layout, ``vocab.txt`` bytes, and token string -> ids (unknown -> ``[UNK]``).

The vocab stage (:mod:`tasks.prepare.vocab`) counts or imports a vocabulary; training and inference look ids up
here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from tasks.text.numbers import NUM, NUM_CHAR

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", NUM)
PAD, UNK, CLS, SEP, MASK, NUM_ID = range(len(SPECIALS))
FIRST_REGULAR = len(SPECIALS)  # a counted vocabulary's random-replacement ids are [FIRST_REGULAR, size)
_RESERVED = re.compile(r"^\[[^\[\]]+\]$")  # [PAD], [unused7], [CLS] ...: never drawn as a random replacement


@dataclass(frozen=True, eq=False)
class TokenIds:
    """The special-token ids of one vocabulary, and the ids that MLM's random replacement draws from.

    A counted vocabulary has the specials at 0..5 and draws from ``[6, size)``; an imported one takes them from
    its tokens, and draws from every id that is neither a special nor a bracketed reserved token (``[unusedN]``).
    """

    size: int
    pad: int = PAD
    unk: int = UNK
    cls: int = CLS
    sep: int = SEP
    mask: int = MASK
    num: int = NUM_ID
    regular: np.ndarray | None = field(default=None, repr=False)  # int64 [R]; None: [FIRST_REGULAR, size)

    @classmethod
    def of(cls, vocab: list[str] | dict[str, int]) -> "TokenIds":
        """From a token list (line i = id i) or a token -> id index; an empty index gives the counted layout."""
        index = vocab if isinstance(vocab, dict) else {t: i for i, t in reversed(list(enumerate(vocab)))}
        size = (max(index.values()) + 1) if index else 0
        names = dict(zip(("pad", "unk", "cls", "sep", "mask", "num"), SPECIALS))
        ids = {k: index.get(t, default) for (k, t), default in zip(names.items(), range(len(SPECIALS)))}
        counted = list(ids.values()) == list(range(len(SPECIALS))) and not any(
            _RESERVED.match(t) for t, i in index.items() if i >= FIRST_REGULAR)
        regular = None
        if not counted:
            by_id = sorted((i, t) for t, i in index.items())
            regular = np.array([i for i, t in by_id if t != NUM and not _RESERVED.match(t)], np.int64)
        return cls(size, **ids, regular=regular)

    def check(self) -> None:
        """Refuse a vocabulary with no regular token (nothing to draw random replacements from)."""
        n = (self.size - FIRST_REGULAR) if self.regular is None else len(self.regular)
        if n <= 0:
            raise ValueError(f"vocab_size {self.size} has no regular tokens")

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` random-replacement ids (int64 [n]); for a counted vocabulary the same draws as always."""
        if self.regular is None:
            return rng.integers(FIRST_REGULAR, self.size, size=n)
        return self.regular[rng.integers(0, len(self.regular), size=n)]


def as_token_ids(vocab: "int | TokenIds") -> TokenIds:
    """A vocabulary size (the counted layout) or :class:`TokenIds` -> :class:`TokenIds`."""
    return vocab if isinstance(vocab, TokenIds) else TokenIds(int(vocab))


def vocab_bytes(tokens: list[str]) -> bytes:
    """The ``vocab.txt`` bytes: one token a line (line i = id i); a token with a line break is refused."""
    for t in tokens:
        if "\n" in t or "\r" in t:
            raise ValueError(f"vocab token {t!r} contains a line break")
    return ("\n".join(tokens) + "\n").encode("utf-8")


def parse_vocab(data: bytes) -> list[str]:
    """The tokens of ``vocab.txt`` bytes, line i = id i."""
    return data.decode("utf-8").split("\n")[:-1]


def token_ids(tokens: str, index: dict[str, int], ids: TokenIds | None = None) -> list[int]:
    """Token string (U+E000 for #NUM#) -> ids; unknown characters -> [UNK] (``ids``: the vocabulary's specials,
    default the counted layout's)."""
    get = index.get
    num, unk = (NUM_ID, UNK) if ids is None else (ids.num, ids.unk)
    return [num if c == NUM_CHAR else get(c, unk) for c in tokens]
