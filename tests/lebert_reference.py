"""LEBERT's own lexicon matching (dict-of-dicts trie + ``enumerateMatch``): the reference for tests and benchmarks."""

from __future__ import annotations


class RefTrie:
    """LEBERT's trie: nested dicts, ``None`` marks the end of a word."""

    def __init__(self, words):
        self.root = {}
        self.max_depth = 0
        for w in words:
            if not w:
                continue
            node = self.root
            for ch in w:
                node = node.setdefault(ch, {})
            node[None] = True
            self.max_depth = max(self.max_depth, len(w))

    def search(self, chars):
        node = self.root
        for ch in chars:
            node = node.get(ch)
            if node is None:
                return False
        return None in node

    def enumerate_match(self, chars):
        """LEBERT's ``enumerateMatch``: try the whole window, drop the last char, repeat (words >= 2 chars)."""
        matched = []
        chars = list(chars)
        while len(chars) > 1:
            if self.search(chars):
                matched.append("".join(chars))
            del chars[-1]
        return matched

    def match_list(self, text):
        """Every (start, word) match of ``text``, in LEBERT's order."""
        return [(i, w) for i in range(len(text)) for w in self.enumerate_match(text[i : i + self.max_depth])]

    def matches(self, text):
        """The set of (start, word) matches of ``text``."""
        return set(self.match_list(text))
