"""Parquet shard I/O over fsspec: zstd, row groups sized for streaming reads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from storage.reading import Artifact
from storage.writing import ArtifactWriter

ROW_GROUP_ROWS = 4096  # small enough to stream, large enough to compress well


def write_table(writer: ArtifactWriter, rel: str, table: pa.Table, row_group_rows: int = ROW_GROUP_ROWS) -> int:
    """Write one Parquet file into a staged artifact (temp name, then commit). Returns rows."""
    with writer.open(rel, "wb") as f:
        _write(table, f, row_group_rows)
    return table.num_rows


def _write(table: pa.Table, f, row_group_rows: int = ROW_GROUP_ROWS) -> None:
    pq.write_table(
        table,
        f,
        compression="zstd",
        row_group_size=row_group_rows,
        # no wall-clock or writer-specific metadata: identical inputs give identical bytes
        write_statistics=True,
        store_schema=True,
    )


def table_bytes(table: pa.Table, row_group_rows: int = ROW_GROUP_ROWS) -> bytes:
    """The bytes :func:`write_table` writes for ``table`` (a file read back re-encodes to its own bytes)."""
    buf = pa.BufferOutputStream()
    _write(table, buf, row_group_rows)
    return buf.getvalue().to_pybytes()


def write_rows(writer: ArtifactWriter, rel: str, rows: list[dict[str, Any]], schema: pa.Schema) -> int:
    """Write ``rows`` as one Parquet file ``rel`` with ``schema``; returns the row count."""
    return write_table(writer, rel, pa.Table.from_pylist(rows, schema=schema))


class ShardSink:
    """Accumulates rows and writes ``{prefix}-{i:05d}.parquet`` every ``shard_rows`` rows."""

    def __init__(self, writer: ArtifactWriter, prefix: str, schema: pa.Schema, shard_rows: int):
        self.writer, self.prefix, self.schema, self.shard_rows = writer, prefix, schema, shard_rows
        self.buffer: list[dict[str, Any]] = []
        self.files: dict[str, int] = {}

    def add(self, row: dict[str, Any]) -> None:
        """Add one row; a full buffer is written as the next shard."""
        self.buffer.append(row)
        if len(self.buffer) >= self.shard_rows:
            self.flush()

    def extend(self, rows: Iterable[dict[str, Any]]) -> None:
        """Add every row of ``rows``."""
        for r in rows:
            self.add(r)

    def flush(self) -> None:
        """Write the buffered rows as the next shard (nothing when the buffer is empty)."""
        if not self.buffer:
            return
        rel = f"{self.prefix}-{len(self.files):05d}.parquet"
        self.files[rel] = write_rows(self.writer, rel, self.buffer, self.schema)
        self.buffer = []

    def close(self, always_one: bool = False) -> dict[str, int]:
        """Flush; with ``always_one`` an empty sink still writes one empty shard."""
        if always_one and not self.files and not self.buffer:
            self.files[f"{self.prefix}-00000.parquet"] = write_rows(
                self.writer, f"{self.prefix}-00000.parquet", [], self.schema
            )
        self.flush()
        return self.files


def read_table(art: Artifact | ArtifactWriter, rel: str, columns: list[str] | None = None) -> pa.Table:
    """A whole shard (committed, or staged in a writer: read, never opened through the writer's ``open``)."""
    with art.fs.open(art.file_path(rel), "rb") as f:
        return pq.read_table(f, columns=columns)


def iter_batches(
    art: Artifact | ArtifactWriter, rel: str, columns: list[str] | None = None, batch_rows: int = ROW_GROUP_ROWS
) -> Iterator[pa.RecordBatch]:
    """Stream a shard (committed, or staged in a writer) one batch at a time: memory bounded by the batch."""
    with art.fs.open(art.file_path(rel), "rb") as f:
        pf = pq.ParquetFile(f)
        yield from pf.iter_batches(batch_size=batch_rows, columns=columns)
