"""vocab: character vocabulary from the numbers shards (specials first, then by frequency)."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from storage.artifacts import ArtifactRef, open_artifact
from storage.parquet import iter_batches, write_table
from tasks.common.config import VocabConfig
from tasks.common.rejects import BELOW_MIN_COUNT, OVER_MAX_SIZE
from tasks.common.stage import StageResult, run_map, shard_task
from tasks.prepare.numbers import NUM, NUM_CHAR, to_token_string

CODE_VERSION = "vocab-1"
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", NUM)
PAD, UNK, CLS, SEP, MASK, NUM_ID = range(len(SPECIALS))


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


def vocab_bytes(tokens: list[str]) -> bytes:
    for t in tokens:
        if "\n" in t or "\r" in t:
            raise ValueError(f"vocab token {t!r} contains a line break")
    return ("\n".join(tokens) + "\n").encode("utf-8")


def parse_vocab(data: bytes) -> list[str]:
    return data.decode("utf-8").split("\n")[:-1]


def token_ids(tokens: str, index: dict[str, int]) -> list[int]:
    """Token string (U+E000 for #NUM#) -> ids; unknown characters -> [UNK]."""
    get = index.get
    return [NUM_ID if c == NUM_CHAR else get(c, UNK) for c in tokens]


def counts_table(tokens: list[str], counts: Counter) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(range(len(tokens)), pa.int32()),
            "token": tokens,
            "count": [int(counts.get(t, 0)) for t in tokens],
        }
    )


# ----------------------------------------------------------------------------- Prefect wrappers


def count_shard_task(src_uri: str, rel: str) -> dict[str, int]:
    return count_shard(open_artifact(src_uri), rel)


# ----------------------------------------------------------------------------- the stage


def build(writer, version: str, *, numbers_ref: ArtifactRef, cfg: VocabConfig) -> StageResult:
    """Count tokens per numbers shard (one task each), fold the counts, write vocab.txt and counts.parquet."""
    src = open_artifact(numbers_ref)
    counts: Counter = Counter()
    items = [dict(src_uri=src.uri, rel=r) for r in src.files("shards/")]
    run_map(shard_task(count_shard_task, "vocab-count"), items, "vocab", fold=counts.update)
    tokens, stats = build_vocab(counts, cfg.min_count, cfg.max_size)
    writer.write_bytes("vocab.txt", vocab_bytes(tokens))
    write_table(writer, "counts.parquet", counts_table(tokens, counts))
    return StageResult(
        stats=stats,
        metrics={"size": len(tokens), "tokens_counted": int(sum(counts.values()))},
        rows={"vocab.txt": len(tokens), "counts.parquet": len(tokens)},
    )
