"""vocab: character vocabulary from the numbers shards (specials first, then by frequency), or an imported
checkpoint's ``vocab.txt`` (``prepare.vocab.checkpoint``, set from ``pretrain.init_from``).

An imported vocabulary keeps the checkpoint's ids: line i of its ``vocab.txt`` is id i. ``#NUM#`` takes the
checkpoint's ``[unused1]`` slot (the first ``[unusedN]`` when it has no ``[unused1]``; a vocabulary that already
holds ``#NUM#``, such as one lexiflow exported, keeps it there); the artifact's ``vocab.txt`` writes ``#NUM#`` on
that line. Characters of the corpus the checkpoint lacks read as ``[UNK]`` and are counted in the manifest.
"""

from __future__ import annotations

import re
from collections import Counter

import fsspec
import pyarrow as pa

from storage.artifacts import ArtifactRef, open_artifact
from storage.fingerprints import FingerprintCache
from storage.parquet import iter_batches, write_table
from tasks.common.context import StageContext
from tasks.common.rejects import BELOW_MIN_COUNT, NOT_IN_CHECKPOINT_VOCAB, OVER_MAX_SIZE
from tasks.common.stage import Stage, StageResult, input_source
from tasks.prepare.config import VocabConfig
from tasks.text.numbers import NUM, NUM_CHAR, to_token_string
from tasks.text.vocab import SPECIALS, TokenIds, vocab_bytes

CODE_VERSION = "vocab-1"
NUM_SLOT = "[unused1]"  # the checkpoint token whose id #NUM# takes in an imported vocabulary
def count_shard(src_art, rel: str) -> dict[str, int]:
    """Map step: token counts of one shard (``#NUM#`` counted as one token)."""
    counts: Counter = Counter()
    for batch in iter_batches(src_art, rel, columns=["text"]):
        for text in batch.column("text").to_pylist():
            counts.update(to_token_string(text))
    if NUM_CHAR in counts:
        counts[NUM] = counts.pop(NUM_CHAR)
    return dict(counts)


def build_vocab(counts: Counter, min_count: int = 1, max_size: int | None = None) -> tuple[list[str], dict[str, int]]:
    """Specials, then characters by (-count, char). Returns (tokens, stats)."""
    chars = sorted(((c, n) for c, n in counts.items() if c not in SPECIALS), key=lambda x: (-x[1], x[0]))
    kept = [c for c, n in chars if n >= min_count]
    below = len(chars) - len(kept)
    over = max(0, len(kept) - (max_size - len(SPECIALS))) if max_size is not None else 0
    kept = kept[: len(kept) - over]
    tokens = list(SPECIALS) + kept
    stats = {
        "in": len(chars),
        "out": len(kept),
        "rejected": {k: v for k, v in ((BELOW_MIN_COUNT, below), (OVER_MAX_SIZE, over)) if v},
    }
    return tokens, stats


# ----------------------------------------------------------------------------- an imported checkpoint's vocabulary


def checkpoint_vocab_uri(checkpoint: str) -> str:
    """Where a checkpoint directory's ``vocab.txt`` is."""
    return checkpoint.rstrip("/") + "/vocab.txt"


def read_checkpoint_vocab(checkpoint: str) -> list[str]:
    """The tokens of ``<checkpoint>/vocab.txt`` (line i = id i), or one clear error when it is missing."""
    uri = checkpoint_vocab_uri(checkpoint)
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.isfile(path):
        raise FileNotFoundError(f"{checkpoint}: no vocab.txt in the checkpoint directory (a Hugging Face BERT "
                                "directory holds config.json, model.safetensors or pytorch_model.bin, and vocab.txt)")
    with fs.open(path, "rb") as f:
        text = f.read().decode("utf-8")
    return [t.rstrip("\r") for t in text.split("\n")[: -1 if text.endswith("\n") else None]]


def import_vocab(tokens: list[str]) -> tuple[list[str], str]:
    """(the artifact's tokens, the checkpoint token #NUM# replaced): the checkpoint's ids kept, ``#NUM#`` written
    on its slot (:data:`NUM_SLOT`, else the first ``[unusedN]``; kept where the vocabulary already has it)."""
    missing = [t for t in SPECIALS[:5] if t not in tokens]
    if missing:
        raise ValueError(f"the checkpoint's vocab.txt lacks {missing}: not a BERT vocabulary")
    if tokens.index("[PAD]") != 0:
        raise ValueError(f"the checkpoint's vocab.txt has [PAD] at line {tokens.index('[PAD]') + 1}, not the first")
    if NUM in tokens:
        return list(tokens), NUM
    unused = [t for t in tokens if re.fullmatch(r"\[unused\d+\]", t)]
    if not unused:
        raise ValueError("the checkpoint's vocab.txt has no [unusedN] token for #NUM# (nor #NUM# itself)")
    slot = NUM_SLOT if NUM_SLOT in tokens else unused[0]
    out = list(tokens)
    out[out.index(slot)] = NUM
    return out, slot


def version_config(cfg: VocabConfig, cache: FingerprintCache | None = None) -> dict:
    """The vocab version's config: the section as it always was; with ``checkpoint`` set, the fingerprint of the
    checkpoint's ``vocab.txt`` (its sha256 enters the version, its location only the manifest) and the #NUM# slot
    rule in its place (``min_count``/``max_size`` do not apply to an imported vocabulary)."""
    if cfg.checkpoint is None:
        return cfg.model_dump()
    read_checkpoint_vocab(cfg.checkpoint)  # one clear line now, not a failed fingerprint
    return {"checkpoint_vocab": input_source(checkpoint_vocab_uri(cfg.checkpoint), cache=cache), "num_slot": NUM_SLOT}


def counts_table(tokens: list[str], counts: Counter) -> pa.Table:
    """The counts table: id, token and corpus count of every vocabulary token."""
    return pa.table(
        {
            "id": pa.array(range(len(tokens)), pa.int32()),
            "token": tokens,
            "count": [int(counts.get(t, 0)) for t in tokens],
        }
    )


# ----------------------------------------------------------------------------- shard task entry points


def count_shard_task(src_uri: str, rel: str) -> dict[str, int]:
    """Character counts of one numbers shard (a shard task)."""
    return count_shard(open_artifact(src_uri), rel)


# ----------------------------------------------------------------------------- the stage


def build(ctx: StageContext, numbers_ref: ArtifactRef) -> StageResult:
    """Count tokens per numbers shard (one task each), fold the counts, write vocab.txt and counts.parquet."""
    cfg, writer = ctx.cfg, ctx.writer
    src = open_artifact(numbers_ref)
    counts: Counter = Counter()
    items = [dict(src_uri=src.uri, rel=r) for r in src.files("shards/")]
    ctx.map(count_shard_task, items, name="vocab-count", fold=counts.update)
    metrics: dict = {}
    if cfg.checkpoint is None:
        tokens, stats = build_vocab(counts, cfg.min_count, cfg.max_size)
    else:
        tokens, stats, metrics = checkpoint_vocab(read_checkpoint_vocab(cfg.checkpoint), counts)
    writer.write_bytes("vocab.txt", vocab_bytes(tokens))
    write_table(writer, "counts.parquet", counts_table(tokens, counts))
    return StageResult(
        stats=stats,
        metrics={"size": len(tokens), "tokens_counted": int(sum(counts.values())), **metrics},
        rows={"vocab.txt": len(tokens), "counts.parquet": len(tokens)},
    )


def checkpoint_vocab(ckpt_tokens: list[str], counts: Counter) -> tuple[list[str], dict, dict]:
    """(tokens, stats, metrics) of an imported vocabulary: the corpus's distinct characters in, those the
    checkpoint has out, the others rejected as ``not_in_checkpoint_vocab`` (they read as [UNK]); the metrics
    say which slot #NUM# took and how many character occurrences become [UNK] (the 20 commonest listed)."""
    tokens, slot = import_vocab(ckpt_tokens)
    known = set(tokens)
    chars = [(c, n) for c, n in counts.items() if c not in SPECIALS]
    oov = sorted(((c, n) for c, n in chars if c not in known), key=lambda x: (-x[1], x[0]))
    stats = {"in": len(chars), "out": len(chars) - len(oov),
             "rejected": {NOT_IN_CHECKPOINT_VOCAB: len(oov)} if oov else {}}
    ids = TokenIds.of(tokens)
    metrics = {"imported": True, "num_slot": slot, "num_id": ids.num,
               "special_ids": {"pad": ids.pad, "unk": ids.unk, "cls": ids.cls, "sep": ids.sep, "mask": ids.mask},
               "oov_chars": len(oov), "oov_occurrences": int(sum(n for _, n in oov)),
               "oov_top": [[c, int(n)] for c, n in oov[:20]]}
    return tokens, stats, metrics


STAGE = Stage("vocab", CODE_VERSION, VocabConfig, parents=("numbers_ref",), build=build, version_config=version_config)
