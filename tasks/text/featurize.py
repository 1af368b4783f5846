"""Text -> model features, exactly as the corpus was prepared: normalise, #NUM#, vocab ids, lexicon words.

Used by fine-tuning, NER and labelling so that training and inference see identical features.
Words matched in new text but absent from the corpus-matched word vocabulary are ignored
(the char keeps its other, known words), so word ids always index the pretrained matrix.

A featurizer is saved with its model and loaded back from it (:meth:`Featurizer.save`, :meth:`Featurizer.load`):
three files (:data:`FILES`) and its settings (:data:`SETTINGS`), in ``featurizer.json`` or inside the model's own
config (a bundle's ``bundle.json``, an NER model's ``model_config.json``: the layout both had before, read alike).
"""

from __future__ import annotations

import io
import json
import os
import posixpath
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from storage.artifacts import open_artifact
from tasks.common.text import norm_char, normalize_text
from tasks.text.embedding_files import load_embeddings
from tasks.text.matcher import (
    COMPILED_FILE,
    CompiledTrie,
    find_matches,
    load_compiled,
    text_codepoints,
    top_k_ranks,
)
from tasks.text.numbers import NUM_CHAR, replace_numbers, to_token_string
from tasks.text.vocab import TokenIds, parse_vocab, token_ids, vocab_bytes

ENCODE_CHUNK = 8192  # texts per matcher call
DIGITS = "0123456789"  # NER items tested with `in` against this string

VOCAB_FILE, RANKS_FILE = "vocab.txt", "rank_to_word.npy"
FILES = (VOCAB_FILE, COMPILED_FILE, RANKS_FILE)  # what a saved featurizer writes besides its settings
SETTINGS_FILE = "featurizer.json"  # its settings, when its model's config does not hold them
# the settings, as a settings file names them; the one place for their defaults (a file that lacks a key, such as a
# bundle built before ``truncation`` or ``min_word_len`` existed, gets the default); ``max_word_num`` has none
SETTINGS = ("max_len", "max_word_num", "min_word_len", "truncation")
DEFAULTS = {"max_len": 256, "min_word_len": 2, "truncation": "head"}


@dataclass
class Encoded:
    """One text's model inputs: character ids with [CLS]/[SEP], and each position's matched word ids."""
    input_ids: np.ndarray  # int64 [L]: [CLS] tokens [SEP]
    word_ids: np.ndarray  # int64 [L, W]; 0 = no word (also on [CLS]/[SEP])


@dataclass
class Featurizer:
    """Text -> (character ids, word ids) exactly as the corpus was prepared: vocabulary, trie and word table."""
    vocab_index: dict[str, int]
    ct: CompiledTrie
    rank_to_word: np.ndarray  # int64 [n_trie_ranks]: word id, or -1 when the word is not in the vocabulary
    k: int  # words kept per character: the lexicon stage's ``max_word_num``
    max_len: int = DEFAULTS["max_len"]
    min_len: int = DEFAULTS["min_word_len"]  # shortest word matched: the lexicon stage's ``min_word_len``
    truncation: str = DEFAULTS["truncation"]  # a text longer than max_len - 2 tokens keeps its head, or (head_tail)
    # head and tail
    vocab: tuple[str, ...] | None = None  # the vocabulary's lines as read (an imported checkpoint's may repeat a
    # token: its index keeps the last id, and only these lines write the same vocab.txt back)

    def __post_init__(self) -> None:  # checked when built (a bundle.json is read), not at the first long text
        if self.truncation not in ("head", "head_tail"):
            raise ValueError(f"truncation {self.truncation!r}: expected head or head_tail")
        self.ids = TokenIds.of(self.vocab_index)  # [CLS]/[SEP]/[UNK]/#NUM# ids of this vocabulary

    @classmethod
    def from_artifacts(cls, lexicon_art, max_len: int = DEFAULTS["max_len"]) -> "Featurizer":
        """The featuriser of a lexicon artifact, from it and its vocab and embeddings parents."""
        parents = {p.stage: p for p in lexicon_art.manifest.parents}
        vocab = parse_vocab(open_artifact(parents["vocab"]).read_verified("vocab.txt"))
        emb_words = _embedding_words(open_artifact(parents["embeddings"]))
        ct = load_compiled(open_artifact(parents["trie"]))
        words = parse_vocab(lexicon_art.read_verified("words.txt"))
        m = lexicon_art.manifest.metrics
        return cls.build(vocab, emb_words, words, ct, int(m["max_word_num"]), max_len,
                         int(m.get("min_word_len", DEFAULTS["min_word_len"])))

    @classmethod
    def build(cls, vocab: list[str], emb_words: list[str], words: list[str], ct: CompiledTrie, k: int,
              max_len: int = DEFAULTS["max_len"], min_len: int = DEFAULTS["min_word_len"]) -> "Featurizer":
        """The featuriser from its parts: trie ranks map to word ids through the embeddings' word order."""
        word_id = {w: i for i, w in enumerate(words)}
        table = np.array([word_id.get(w, -1) for w in emb_words], dtype=np.int64)
        for special in ("[PAD]", "[UNK]"):  # specials are never real matches
            if special in word_id and special in emb_words:
                table[emb_words.index(special)] = -1
        return cls({t: i for i, t in enumerate(vocab)}, ct, table, k, max_len, min_len, vocab=tuple(vocab))

    def settings(self) -> dict[str, Any]:
        """The settings as a settings file holds them (:data:`SETTINGS`)."""
        return {"max_len": self.max_len, "max_word_num": self.k, "min_word_len": self.min_len,
                "truncation": self.truncation}

    def save(self, target, settings_file: str | None = SETTINGS_FILE) -> dict[str, Any]:
        """Write :data:`FILES` (the vocabulary, line i = id i; the compiled trie; trie rank -> word id) and, unless
        ``settings_file`` is None, the settings as JSON into ``target``: a writer (anything with ``write_bytes``: a
        stage's) or a directory (a path or fsspec URL, made when missing). Returns the settings, for a model whose
        own config holds them (``settings_file=None``: a bundle's ``bundle.json``, an NER model's
        ``model_config.json``)."""
        if self.vocab is not None:
            tokens = list(self.vocab)
        else:
            tokens = sorted(self.vocab_index, key=self.vocab_index.__getitem__)
            if [self.vocab_index[t] for t in tokens] != list(range(len(tokens))):
                raise ValueError("the vocabulary's ids are not 0..n-1: it cannot be written as vocab.txt")
        buf = io.BytesIO()
        np.save(buf, self.rank_to_word)
        files = {VOCAB_FILE: vocab_bytes(tokens), COMPILED_FILE: self.ct.to_bytes(), RANKS_FILE: buf.getvalue()}
        settings = self.settings()
        if settings_file is not None:
            files[settings_file] = json.dumps(settings, indent=1, sort_keys=True).encode()
        write = _writer(target)
        for rel, data in files.items():
            write(rel, data)
        return settings

    @classmethod
    def load(cls, source, settings_file: str = SETTINGS_FILE) -> "Featurizer":
        """The featurizer :meth:`save` wrote into ``source``: an opened artifact (every file read checksum-verified:
        a bundle, an NER model) or a directory (a path or fsspec URL). Its settings come from ``settings_file``:
        ``featurizer.json``, or the model's own config holding the same keys (``bundle.json``,
        ``model_config.json``); a key it lacks takes its default (:data:`DEFAULTS`)."""
        read = _reader(source)
        given = json.loads(read(settings_file))
        if "max_word_num" not in given:
            raise ValueError(f"{settings_file} has no max_word_num: it holds no featurizer settings")
        s = {**DEFAULTS, **{k: given[k] for k in SETTINGS if k in given}}
        vocab = parse_vocab(read(VOCAB_FILE))
        index = {t: i for i, t in enumerate(vocab)}
        ct = CompiledTrie.from_bytes(read(COMPILED_FILE))
        rank_to_word = np.load(io.BytesIO(read(RANKS_FILE)))
        return cls(index, ct, rank_to_word, int(s["max_word_num"]), int(s["max_len"]), int(s["min_word_len"]),
                   s["truncation"], tuple(vocab))

    def tokens(self, text: str) -> str:
        """Normalised token string (U+E000 = #NUM#), truncated to fit [CLS] … [SEP]: its first ``max_len - 2``
        tokens, or with ``truncation="head_tail"`` the first half of them and the last (a review's verdict is
        often at its end; Sun et al. 2019 found head+tail best for long-text classification). The lexicon is
        matched on the truncated string, so a word may rarely be matched across the cut."""
        return self._truncate(to_token_string(replace_numbers(normalize_text(text))))

    def _truncate(self, s: str) -> str:
        n = self.max_len - 2
        if len(s) <= n or self.truncation == "head":
            return s[:n]
        return s[: n // 2] + s[len(s) - (n - n // 2) :]  # head_tail

    def cut_at(self, n_tokens: int) -> int | None:
        """Where :meth:`tokens` cuts a text of ``n_tokens`` tokens: the token offset after which the model reads
        no more of it (head: ``max_len - 2``; head_tail: the head's length, the middle being dropped); None when
        the whole text fits."""
        n = self.max_len - 2
        if n_tokens <= n:
            return None
        return n if self.truncation == "head" else n // 2

    def encode(self, texts: Sequence[str], full_lengths: list[int] | None = None) -> list[Encoded]:
        """Raw texts -> Encoded: normalised, numbers as #NUM#, truncated to ``max_len`` (see :meth:`tokens`).
        ``full_lengths``, when given, gets each text's token count before truncation appended."""
        whole = [to_token_string(replace_numbers(normalize_text(t))) for t in texts]
        if full_lengths is not None:
            full_lengths.extend(len(s) for s in whole)
        toks = [self._truncate(s) for s in whole]
        return self._encode(toks, [token_ids(t, self.vocab_index, self.ids) for t in toks])

    def encode_chars(self, sentences: Sequence[Sequence[str]]) -> list[Encoded]:
        """Pre-tokenised sentences (NER: one tag per item) -> Encoded with exactly one token per item,
        ``len(input_ids) == len(chars) + 2``; no truncation.

        Per item: :func:`norm_char` (t2s, full-width -> half-width, kept when one character); an
        ASCII digit becomes ``#NUM#`` (the corpus never had digits: every number was one ``#NUM#``),
        anything else its vocabulary id or ``[UNK]``. The matcher sees digits as ``#NUM#`` and a
        multi-character item as a separator, so neither is ever inside a word (as in the corpus)."""
        vocab, num, unk = self.vocab_index, self.ids.num, self.ids.unk
        normed = [[norm_char(c) for c in s] for s in sentences]
        match = ["".join(NUM_CHAR if c in DIGITS else (c if len(c) == 1 else "\x00") for c in s) for s in normed]
        ids = [[num if c in DIGITS else vocab.get(c, unk) for c in s] for s in normed]
        return self._encode(match, ids)

    def _encode(self, match_texts: list[str], ids: list[list[int]]) -> list[Encoded]:
        """The shared core: ``match_texts[i]`` is what the matcher sees (one character per token),
        ``ids[i]`` the token ids; adds [CLS]/[SEP] and each token's top-k known words by rank."""
        out: list[Encoded] = []
        for lo in range(0, len(match_texts), ENCODE_CHUNK):  # bounded matcher input; results do not depend on it
            texts = match_texts[lo : lo + ENCODE_CHUNK]
            cps = text_codepoints("\x00".join(texts))  # [C] texts joined by separators
            starts, lengths, ranks = find_matches(cps, self.ct, self.min_len)  # [M] each: (start, length, rank)
            wid = self.rank_to_word[ranks] if len(ranks) else np.zeros(0, np.int64)
            keep = wid >= 0  # matched words outside the word vocabulary are ignored
            top = top_k_ranks(len(cps), starts[keep], lengths[keep], ranks[keep], self.k)  # [C, k], -1 = none
            top_ids = np.where(top >= 0, self.rank_to_word[np.maximum(top, 0)], 0)  # [C, k] word ids, 0 = none
            off = 0
            for t, tid in zip(texts, ids[lo : lo + ENCODE_CHUNK]):
                n = len(t)
                input_ids = np.empty(n + 2, np.int64)  # [n+2]
                input_ids[0], input_ids[-1] = self.ids.cls, self.ids.sep
                input_ids[1:-1] = tid
                w = np.zeros((n + 2, self.k), np.int64)  # [n+2, k]
                w[1:-1] = top_ids[off : off + n]
                out.append(Encoded(input_ids, w))
                off += n + 1
        return out


def collapse_numbers(items: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """NER items -> (items with every number as ONE item, int64 [len(items)] collapsed index of each item).

    A number is a maximal run of ASCII digits (after :func:`norm_char`, so full-width digits count),
    with single ``.``/``,`` between digits inside it ("3.14", "1,234"); it becomes the one item "0", which
    :meth:`Featurizer.encode_chars` feeds as one ``#NUM#`` - what pretraining saw, one ``#NUM#`` per number."""
    normed = [norm_char(c) for c in items]
    out: list[str] = []
    index = np.empty(len(normed), np.int64)
    i = 0
    while i < len(normed):
        if normed[i] in DIGITS and len(normed[i]) == 1:
            j = i + 1
            while j < len(normed) and (normed[j] in DIGITS and len(normed[j]) == 1 or (
                    normed[j] in (".", ",") and j + 1 < len(normed) and len(normed[j + 1]) == 1
                    and normed[j + 1] in DIGITS)):
                j += 1
            index[i:j] = len(out)
            out.append("0")
            i = j
        else:
            index[i] = len(out)
            out.append(items[i])
            i += 1
    return out, index


def expand_tags(tags: Sequence[str], index: np.ndarray) -> list[str]:
    """Collapsed tags back onto every original item: each digit of a number gets the number's tag, the
    second and later as ``I-X`` (one entity stays one entity); character offsets are the original ones."""
    out = []
    for j, k in enumerate(index.tolist()):
        t = tags[k]
        out.append("I-" + t[2:] if j and index[j - 1] == k and t.startswith("B-") else t)
    return out


def pad_encoded(encoded: Sequence[Encoded], with_words: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Dynamic padding to the longest: (input ids int64 [B, T] (0 = [PAD]), word ids int64 [B, T, k]
    (0 = none) or None without words, lengths int64 [B])."""
    lens = np.array([len(e.input_ids) for e in encoded], np.int64)
    B, T = len(encoded), int(lens.max())
    ids = np.zeros((B, T), np.int64)
    words = np.zeros((B, T, encoded[0].word_ids.shape[1]), np.int64) if with_words else None
    for b, e in enumerate(encoded):
        ids[b, : lens[b]] = e.input_ids
        if with_words:
            words[b, : lens[b]] = e.word_ids
    return ids, words, lens


def _writer(target) -> Callable[[str, bytes], None]:
    """``write(rel, data)`` into a directory (a path or fsspec URL), or a stage's writer."""
    if not isinstance(target, (str, os.PathLike)):
        return target.write_bytes
    fs, root = fsspec.core.url_to_fs(str(target))
    fs.makedirs(root, exist_ok=True)
    return lambda rel, data: fs.pipe_file(posixpath.join(root, rel), data)


def _reader(source) -> Callable[[str], bytes]:
    """``read(rel)``: from a directory (a path or fsspec URL), or checksum-verified from an opened artifact."""
    if not isinstance(source, (str, os.PathLike)):
        return source.read_verified
    fs, root = fsspec.core.url_to_fs(str(source))
    return lambda rel: fs.cat_file(posixpath.join(root, rel))


def _embedding_words(emb_art) -> list[str]:
    words, _ = load_embeddings(emb_art.fs, emb_art.path, mmap=True)
    return words
