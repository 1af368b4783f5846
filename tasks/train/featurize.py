"""Text -> model features, exactly as the corpus was prepared: normalise, #NUM#, vocab ids, lexicon words.

Used by fine-tuning and labelling so that training and inference see identical features.
Words matched in new text but absent from the corpus-matched word vocabulary are ignored
(the char keeps its other, known words), so word ids always index the pretrained matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.common.text import normalize_text
from tasks.prepare.matcher import CompiledTrie, find_matches, text_codepoints, top_k_ranks
from tasks.prepare.numbers import replace_numbers, to_token_string
from tasks.prepare.vocab import CLS, SEP, parse_vocab, token_ids


@dataclass
class Encoded:
    input_ids: np.ndarray  # int64 [L]: [CLS] tokens [SEP]
    word_ids: np.ndarray  # int64 [L, W]; 0 = no word (also on [CLS]/[SEP])


@dataclass
class Featurizer:
    vocab_index: dict[str, int]
    ct: CompiledTrie
    rank_to_word: np.ndarray  # int64 [n_trie_ranks]: word id, or -1 when the word is not in the vocabulary
    k: int
    max_len: int = 256

    @classmethod
    def from_artifacts(cls, lexicon_art, max_len: int = 256) -> "Featurizer":
        from storage.artifacts import open_artifact
        from tasks.prepare.trie import load_compiled

        parents = {p.stage: p for p in lexicon_art.manifest.parents}
        vocab = parse_vocab(open_artifact(parents["vocab"]).read_verified("vocab.txt"))
        emb_words = _embedding_words(open_artifact(parents["embeddings"]))
        ct = load_compiled(open_artifact(parents["trie"]))
        words = parse_vocab(lexicon_art.read_verified("words.txt"))
        return cls.build(vocab, emb_words, words, ct, int(lexicon_art.manifest.metrics["max_word_num"]), max_len)

    @classmethod
    def build(cls, vocab: list[str], emb_words: list[str], words: list[str], ct: CompiledTrie, k: int, max_len: int = 256) -> "Featurizer":
        word_id = {w: i for i, w in enumerate(words)}
        table = np.array([word_id.get(w, -1) for w in emb_words], dtype=np.int64)
        for special in ("[PAD]", "[UNK]"):  # specials are never real matches
            if special in word_id and special in emb_words:
                table[emb_words.index(special)] = -1
        return cls({t: i for i, t in enumerate(vocab)}, ct, table, k, max_len)

    def tokens(self, text: str) -> str:
        """Normalised token string (U+E000 = #NUM#), truncated to fit [CLS] … [SEP]."""
        return to_token_string(replace_numbers(normalize_text(text)))[: self.max_len - 2]

    def encode(self, texts: list[str]) -> list[Encoded]:
        toks = [self.tokens(t) for t in texts]
        if not toks:
            return []
        cps = text_codepoints("\x00".join(toks))
        starts, lengths, ranks = find_matches(cps, self.ct, 2)
        wid = self.rank_to_word[ranks] if len(ranks) else np.zeros(0, np.int64)
        keep = wid >= 0
        # top-k by rank among known words, then map ranks -> word ids
        top = top_k_ranks(len(cps), starts[keep], lengths[keep], ranks[keep], self.k)
        top_ids = np.where(top >= 0, self.rank_to_word[np.maximum(top, 0)], 0)
        out, off = [], 0
        for t in toks:
            n = len(t)
            ids = np.empty(n + 2, np.int64)
            ids[0], ids[-1] = CLS, SEP
            ids[1:-1] = token_ids(t, self.vocab_index)
            w = np.zeros((n + 2, self.k), np.int64)
            w[1:-1] = top_ids[off : off + n]
            out.append(Encoded(ids, w))
            off += n + 1
        return out


def _embedding_words(emb_art) -> list[str]:
    from tasks.prepare.embeddings import load_embeddings

    words, _ = load_embeddings(emb_art.fs, emb_art.path, mmap=True)
    return words
