"""NER inference: sentences -> chunked LEBERT features -> tags and entities (NerModel, NerScorer).

Features (:meth:`tasks.text.featurize.Featurizer.encode_chars`): every number (a run of digits,
:func:`~tasks.text.featurize.collapse_numbers`) is one ``#NUM#`` token as in pretraining, every
other character one token; predicted tags are copied back to every digit
(:func:`~tasks.text.featurize.expand_tags`), so tag i belongs to character i of the input;
lexicon words are matched on the whole sentence.

Long sentences: a sentence longer than ``max_len - 2`` characters is cut into consecutive chunks
of ``max_len - 2`` characters (each gets its own [CLS]/[SEP]; the words were matched on the
whole sentence first, so a chunk keeps the words crossing its edge). Training
(:mod:`tasks.ner.train`) uses every chunk as one example (its tags re-read as BIO, so a chunk
never starts with ``I-X``); prediction tags each chunk and concatenates the tags. An entity
crossing a cut may be split in two. Training builds its inputs with these same functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import load as st_load

from models import LebertTagger
from models.bert import padding_of
from models.config import model_config
from storage.artifacts import open_artifact
from tasks.inference.runtime import autocast, sorted_batches, to_device
from tasks.inference.tags import spans, to_bio
from tasks.text.featurize import Encoded, Featurizer, collapse_numbers, expand_tags, pad_encoded

# ============================================================================= chunks


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` character ranges of at most ``size`` covering ``0..n``."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def _slice(e: Encoded, lo: int, hi: int) -> Encoded:
    ids = np.concatenate([e.input_ids[:1], e.input_ids[1 + lo : 1 + hi], e.input_ids[-1:]]).astype(np.int64)  # [n+2]
    w = np.zeros((hi - lo + 2, e.word_ids.shape[1]), np.int64)  # [hi-lo+2, k]
    w[1:-1] = e.word_ids[1 + lo : 1 + hi]
    return Encoded(ids, w)


@dataclass
class ChunkSet:
    """Model inputs: one entry per chunk; ``owner[i]`` = index of chunk i's sentence (chunks in order)."""

    encoded: list[Encoded]
    tags: list[np.ndarray] | None  # int64 [n] tag ids per chunk (training only)
    owner: np.ndarray  # int64 [chunks]
    n_sentences: int
    index: list[np.ndarray] | None = None  # per sentence: each character's token (numbers collapsed)

    def __post_init__(self):
        self.lengths = np.array([len(e.input_ids) for e in self.encoded], np.int64)  # [chunks]

    def __len__(self) -> int:
        return len(self.encoded)


def build_chunks(sentences: Sequence[Sequence[str]], feat: Featurizer, max_len: int, tag_seqs=None,
                 tag_index=None) -> ChunkSet:
    """Encode whole sentences, then cut into chunks of ``max_len - 2`` characters (see module doc)."""
    enc, tags, owner = [], ([] if tag_seqs is not None else None), []
    collapsed = [collapse_numbers(s) for s in sentences]
    for i, e in enumerate(feat.encode_chars([c for c, _ in collapsed])):
        index = collapsed[i][1]
        if tags is not None:  # a number's tag: its first digit's
            first = np.flatnonzero(np.r_[True, index[1:] != index[:-1]]) if len(index) else index
            seq = [tag_seqs[i][j] for j in first.tolist()]
        for lo, hi in chunk_bounds(len(e.input_ids) - 2, max_len - 2):
            enc.append(_slice(e, lo, hi))
            owner.append(i)
            if tags is not None:
                tags.append(np.array([tag_index[t] for t in to_bio(seq[lo:hi])], np.int64))
    return ChunkSet(enc, tags, np.array(owner, np.int64), len(sentences), [ix for _, ix in collapsed])


def collate(ds: ChunkSet, idx: np.ndarray, device: torch.device, with_words: bool) -> dict[str, Any]:
    """Dynamic padding; ``tag_mask`` marks characters (not [CLS]/[SEP]/padding), tags -100 elsewhere; ``n_tags``
    (an int, counted on the host) the tagged characters. On CUDA the arrays go through pinned memory without
    waiting (:func:`tasks.inference.runtime.to_device`) and ``padded`` tells the model where the padding is, from
    the host mask (no device read to route attention)."""
    ids, words, lens = pad_encoded([ds.encoded[i] for i in idx], with_words)  # [B, T], [B, T, k] | None, [B]
    B, T = ids.shape
    tags = np.full((B, T), -100, np.int64)  # [B, T]
    if ds.tags is not None:
        for b, i in enumerate(idx):
            tags[b, 1 : lens[b] - 1] = ds.tags[i]
    pos = np.arange(T)[None, :]  # [1, T]
    real = pos < lens[:, None]  # [B, T]
    tag_mask = (pos >= 1) & (pos < lens[:, None] - 1)  # [B, T]
    out = {
        "input_ids": to_device(ids, device),
        "attention_mask": to_device(real, device),
        "tag_mask": to_device(tag_mask, device),
        "tags": to_device(tags, device),
        "word_ids": to_device(words, device) if with_words else None,
        "n_tags": int(tag_mask.sum()),
        "padded": padding_of(torch.from_numpy(real), device) if device.type == "cuda" else None,
    }
    return out


@torch.no_grad()
def predict_chunks(model, ds: ChunkSet, batch_size: int, device: torch.device, with_words: bool,
                   between: Callable[[], None] | None = None) -> list[list[int]]:
    """Tag ids per sentence (chunks re-joined), batches sorted by length; ``between()`` before every batch (the ner
    stage's stop poll: a stop signal during its evaluation ends it between two batches)."""
    model.eval()
    per_chunk: list[list[int]] = [[] for _ in range(len(ds))]
    for idx in sorted_batches(ds.lengths, batch_size):
        if between is not None:
            between()
        b = collate(ds, idx, device, with_words)
        with autocast(device):
            paths = model.decode(b["input_ids"], b["attention_mask"], b["word_ids"], b["tag_mask"], b["padded"])
        for i, p in zip(idx, paths):
            per_chunk[i] = p
    out: list[list[int]] = [[] for _ in range(ds.n_sentences)]
    for i, o in enumerate(ds.owner.tolist()):
        out[o] += per_chunk[i]
    return out


def predict_tags(model, ds: ChunkSet, tags: Sequence[str], batch_size: int, device: torch.device,
                 with_words: bool, between: Callable[[], None] | None = None) -> list[list[str]]:
    """Tag names per character of each sentence (see :func:`predict_chunks`; numbers' tags copied back)."""
    out = [[tags[i] for i in p] for p in predict_chunks(model, ds, batch_size, device, with_words, between)]
    return out if ds.index is None else [expand_tags(t, ix) for t, ix in zip(out, ds.index)]


# ============================================================================= a trained model


@dataclass
class NerModel:
    """A trained tagger with its featuriser, loaded from a committed ner artifact (checksum-verified)."""

    model: Any  # models.LebertTagger, eval mode
    tags: list[str]
    featurizer: Featurizer
    max_len: int
    with_words: bool
    batch_size: int = 64

    @classmethod
    def load(cls, uri: str, device: str = "cpu") -> "NerModel":
        """The tagger, tag set and featuriser of the ner artifact at ``uri``, in eval mode on ``device``."""
        art = open_artifact(uri)
        mc = art.read_json("model_config.json", ("model", "max_word_num", "max_len", "use_layers", "dropout",
                                                 "use_crf", "use_adapter"))
        tags = json.loads(art.read_verified("tags.json"))
        feat = Featurizer.load(art, "model_config.json")  # its settings in the model's config
        model_cfg = model_config(art, mc)
        model = LebertTagger(model_cfg, len(tags), mc["use_layers"], mc["dropout"], mc["use_crf"])
        model.load_state_dict(st_load(art.read_verified("model.safetensors")))
        model.to(torch.device(device)).eval()
        return cls(model, tags, feat, int(mc["max_len"]), bool(mc["use_adapter"]) and model.uses_lexicon)

    def predict_tags(self, sentences: Sequence[Sequence[str]]) -> list[list[str]]:
        """BIO tags per character of each sentence (a list of characters)."""
        ds = build_chunks(sentences, self.featurizer, self.max_len)
        device = next(self.model.parameters()).device
        return predict_tags(self.model, ds, self.tags, self.batch_size, device, self.with_words)

    def predict_entities(self, texts: Sequence[str]) -> list[list[dict[str, Any]]]:
        """Per text: ``[{type, start, end, text}]`` with ``text == texts[i][start:end]`` (end exclusive)."""
        tags = self.predict_tags([list(t) for t in texts])
        return [[{"type": k, "start": a, "end": b, "text": t[a:b]} for k, a, b in spans(tg)]
                for t, tg in zip(texts, tags)]


class NerScorer:
    """Plugs a ner artifact into the streaming labeller (``tasks.label.run.label_stream``): same
    sharding, resume, rejects and reconciliation as sentiment labelling; part files hold
    ``row_id, entities (list of {type, start, end, text}), n_entities, model_version``."""

    positive_column = "n_entities"

    def __init__(self, uri: str, device: str = "cpu", batch_size: int = 64):
        art = open_artifact(uri)
        if art.manifest.stage != "ner":
            raise ValueError(f"{uri} is a {art.manifest.stage!r} artifact, not a ner model")
        self.ref = art.ref
        self.model = NerModel.load(uri, device)
        self.model.batch_size = batch_size

    def score(self, texts: list[str]) -> tuple[list[Any], set[int]]:
        """Entities of each non-blank text, and the indices of the blank ones (rejected as empty)."""
        empty = {i for i, t in enumerate(texts) if not t.strip()}
        ents = self.model.predict_entities([t for i, t in enumerate(texts) if i not in empty])
        return ents, empty

    def part_table(self, ids: list[str], outputs: list[Any]):
        """A labelled part file's table: row ids, entities, their count and the model version."""
        ent = pa.struct([("type", pa.string()), ("start", pa.int32()), ("end", pa.int32()), ("text", pa.string())])
        schema = pa.schema([("row_id", pa.string()), ("entities", pa.list_(ent)), ("n_entities", pa.int32()),
                            ("model_version", pa.string())])
        cols = {"row_id": ids, "entities": outputs, "n_entities": [len(e) for e in outputs],
                "model_version": [self.ref.version] * len(ids)}
        return pa.table(cols, schema=schema)

    def metrics(self) -> dict[str, Any]:
        """What the label manifest records of the scorer: the model version."""
        return {"model_version": self.ref.version}
