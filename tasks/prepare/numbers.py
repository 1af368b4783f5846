"""numbers: every integer/decimal -> one ``#NUM#`` token; English words marked for whole-word masking.

Tokens are characters, except ``#NUM#`` which is one token. Internally a token string uses
U+E000 for ``#NUM#`` so that token index == character index (the cleaner strips U+E000 from input).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from storage.artifacts import ArtifactRef, StagingHandle, open_artifact
from storage.parquet import iter_batches, write_rows
from tasks.common.context import StageContext
from tasks.common.stage import Stage, StageResult
from tasks.prepare.config import NumbersConfig
from tasks.text.numbers import number_row

CODE_VERSION = "numbers-1"
SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("sent_idx", pa.int32()),
        ("text", pa.string()),
        ("n_numbers", pa.int32()),
        ("en_starts", pa.list_(pa.int32())),
        ("en_ends", pa.list_(pa.int32())),
    ]
)

def number_shard(src_art, rel: str, writer, out_rel: str, min_english_len: int = 2) -> dict[str, Any]:
    """Map step: one clean shard -> one numbers shard (row for row; nothing is rejected here)."""
    rows = []
    for batch in iter_batches(src_art, rel, columns=["doc_id", "sent_idx", "text"]):
        rows.extend(number_row(r, min_english_len) for r in batch.to_pylist())
    n = write_rows(writer, out_rel, rows, SCHEMA)
    return {"rel": out_rel, "in": n, "out": n, "numbers": int(np.sum([r["n_numbers"] for r in rows])) if rows else 0}


# ----------------------------------------------------------------------------- shard task entry points


def number_shard_task(
    staging: StagingHandle, src_uri: str, rel: str, out_rel: str, min_english_len: int
) -> dict[str, Any]:
    """Number one cleaned shard into the numbers artifact's staging (a shard task)."""
    return number_shard(open_artifact(src_uri), rel, staging.writer(), out_rel, min_english_len)


# ----------------------------------------------------------------------------- the stage


def build(ctx: StageContext, clean_ref: ArtifactRef) -> StageResult:
    """Number every clean shard (one task each), shard for shard and row for row."""
    src = open_artifact(clean_ref)
    items = [dict(src_uri=src.uri, rel=r, out_rel=r) for r in src.files("shards/")]
    res = ctx.map(number_shard_task, items, name="numbers-shard",  # pragma: no mutate (UI names)
                  shared=dict(staging=ctx.staging, min_english_len=ctx.cfg.min_english_len))
    return StageResult(
        stats={"in": sum(r["in"] for r in res), "out": sum(r["out"] for r in res), "rejected": {}},
        metrics={"numbers_replaced": sum(r["numbers"] for r in res)},
        rows={r["rel"]: r["out"] for r in res},
    )


STAGE = Stage("numbers", CODE_VERSION, NumbersConfig, parents=("clean_ref",), build=build)
