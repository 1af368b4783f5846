"""embeddings: the Tencent embeddings file -> words.txt, vectors.npy and the table of rejected lines.

The reader lives in :mod:`tasks.prepare.tencent` and the files' format in :mod:`tasks.text.embedding_files`.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from storage.fingerprints import FingerprintCache
from storage.parquet import write_table
from tasks.common.context import StageContext
from tasks.common.rejects import reject_schema
from tasks.common.stage import Stage, StageResult, input_source
from tasks.prepare.config import EmbeddingsConfig
from tasks.prepare.tencent import TencentEmbeddings, read_tencent
from tasks.text.embedding_files import save_embeddings

CODE_VERSION = "embeddings-1"  # bump when the parse result for a given file changes
REJECT_SCHEMA = reject_schema("line", "reason", "text")  # one source file, no ids


def version_config(cfg: EmbeddingsConfig, uri: str, cache: FingerprintCache | None = None) -> dict[str, Any]:
    """The embeddings stage's config: its section and the file's URI, name and bytes' fingerprint (the version
    counts the name and bytes, never the URI: see ``storage.artifacts.without_locations``)."""
    return {**cfg.model_dump(), "source": input_source(uri, cache=cache)}


def stage_counts(emb: TencentEmbeddings) -> tuple[dict[str, Any], dict[str, Any]]:
    """(stats, metrics) of a read: every data line read is loaded or rejected for a reason."""
    s = emb.stats
    rejected = {k: v for k, v in s["rejected"].items() if v}
    stats = {"in": s["loaded"] + sum(rejected.values()), "out": s["loaded"], "rejected": rejected}
    metrics = {
        "dim": int(emb.vectors.shape[1]) if emb.vectors.ndim == 2 else 0,
        "header_count": s["header_count"],
        "header_mismatch": bool(s.get("header_mismatch")),
    }
    return stats, metrics


def build(ctx: StageContext, uri: str, progress: bool = False) -> StageResult:
    """Read the file (up to ``cfg.max_scan_num`` words), save words and vectors, list the rejected lines."""
    writer = ctx.writer
    emb = read_tencent(uri, ctx.cfg.max_scan_num, progress=progress)
    save_embeddings(emb, writer.fs, writer.path)
    rejected = pa.Table.from_pylist(emb.rejects, schema=REJECT_SCHEMA)
    write_table(writer, "rejected.parquet", rejected)
    stats, metrics = stage_counts(emb)
    return StageResult(stats=stats, metrics=metrics, rows={"rejected.parquet": rejected.num_rows})


STAGE = Stage("embeddings", CODE_VERSION, EmbeddingsConfig, parents=(), build=build, version_config=version_config,
              version_inputs=("uri",))
