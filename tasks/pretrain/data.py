"""Pretraining rows and the pieces of an example: matched shards -> rows, held-out documents, NSP pairing,
truncation, whole-word units, and the batch the trainer reads.

The packed loader (:mod:`tasks.pretrain.packed`) builds the batches from these pieces; the earlier per-example
streaming path, kept as its reference, lives with the tests (``tests/pretrain_reference.py``), and
``benchmarks/bench_loader.py`` runs both.

Pure logic, no Prefect.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from storage.artifacts import Artifact

ROW_COLUMNS = ["doc_id", "n_tokens", "char_ids", "word_ids", "word_starts", "word_ends", "group_starts", "group_ends"]


@dataclass
class Batch:
    """One training batch of MLM+NSP examples, as tensors (the packed loader's and the reference stream's)."""

    input_ids: torch.Tensor  # int64 [B, T]
    segment_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor  # bool [B, T]
    word_ids: torch.Tensor  # int64 [B, T, W]
    mlm_positions: torch.Tensor  # int64 [N], flat indices into B*T, sorted
    mlm_labels: torch.Tensor  # int64 [N]
    nsp_labels: torch.Tensor  # int64 [B]
    n_real_tokens: int  # non-pad tokens, specials included
    # packed rows (pretrain.data.packing: pairs; tasks.pretrain.pairpack): several pairs a row, nsp_labels [P]
    position_ids: torch.Tensor | None = None  # int64 [B, T], restarting at each pair
    pair_ids: torch.Tensor | None = None  # int64 [B, T], each token's pair in its row (padding: a group of its own)
    cls_positions: torch.Tensor | None = None  # int64 [P], flat indices into B*T of each pair's [CLS]
    # a sparse word table, renumbered where the batch was built: word_ids then index these rows of the table
    word_row_ids: torch.Tensor | None = None  # int64 [R], row 0 the [PAD] word, then distinct ids, then 0 padding

    def to(self, device: Any, non_blocking: bool = False) -> "Batch":
        """The batch with every tensor on ``device``."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            moved[f.name] = v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
        return Batch(**moved)

    def pin_memory(self) -> "Batch":
        """Page-locked copies (torch's DataLoader calls this with ``pin_memory=True``): the copy to a GPU can then
        run asynchronously (``to(device, non_blocking=True)``)."""
        return Batch(**{f.name: (v.pin_memory() if isinstance(v, torch.Tensor) else v)
                        for f in fields(self) for v in [getattr(self, f.name)]})


# ---------------------------------------------------------------- rows


def max_word_num(art: Artifact) -> int:
    """W of the lexicon artifact (words per character in ``word_ids``)."""
    return int(art.manifest.metrics["max_word_num"])


def iter_rows(art: Artifact, prefix: str = "shards/", rank: int = 0, world: int = 1) -> Iterator[dict[str, Any]]:
    """Stream sentence rows shard by shard, row group by row group; list columns as numpy.

    Under ``world`` > 1 this reads only its share: the row groups (of every shard, counted in order) whose index
    is ``rank`` modulo ``world``. A document cut by a row-group boundary loses that one IsNext pair."""
    g = 0
    for rel in art.files(prefix):
        with art.fs.open(art.file_path(rel), "rb") as f:
            pf = pq.ParquetFile(f)
            mine = [i for i in range(pf.metadata.num_row_groups) if (g + i) % world == rank]
            g += pf.metadata.num_row_groups
            if not mine:
                continue
            for rb in pf.iter_batches(row_groups=mine, columns=ROW_COLUMNS):
                yield from _batch_rows(rb)


def _batch_rows(rb) -> Iterator[dict[str, Any]]:
    doc_ids = rb.column("doc_id").to_pylist()
    n_tokens = rb.column("n_tokens").to_numpy(zero_copy_only=False)
    lists = {}
    for name in ROW_COLUMNS[2:]:
        col = rb.column(name)
        lists[name] = (col.offsets.to_numpy(), col.values.to_numpy(zero_copy_only=False))
    for i, doc in enumerate(doc_ids):
        row = {"doc_id": doc, "n_tokens": int(n_tokens[i])}
        for name, (off, vals) in lists.items():
            row[name] = vals[off[i] : off[i + 1]]
        yield row


def is_heldout(doc_id: str, frac: float, seed: int) -> bool:
    """Whether a document belongs to the held-out MLM evaluation slice: blake2b(seed, doc_id) < frac.
    Deterministic, independent of order and of every other document."""
    if frac <= 0:
        return False
    h = hashlib.blake2b(f"{seed}\x00{doc_id}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64 < frac


def split_heldout(rows_factory, frac: float, seed: int):
    """(train rows factory, held-out rows factory), each called like ``rows_factory`` (``(rank, world)``):
    the documents with ``is_heldout`` never reach training."""
    def train(*share):
        return (r for r in rows_factory(*share) if not is_heldout(r["doc_id"], frac, seed))

    def heldout(*share):
        return (r for r in rows_factory(*share) if is_heldout(r["doc_id"], frac, seed))

    return train, heldout


def rows_of(rows: list[dict]):
    """A ``(rank, world)`` rows factory over rows in memory: rank ``r`` gets the documents whose index (in order of
    first appearance) is ``r`` modulo ``world``."""
    def factory(rank: int = 0, world: int = 1):
        doc, k = None, -1
        for row in rows:
            if row["doc_id"] != doc:
                doc, k = row["doc_id"], k + 1
            if k % world == rank:
                yield row

    return factory


# ---------------------------------------------------------------- examples


def _with_next(rows: Iterable[dict]) -> Iterator[tuple[dict, dict | None]]:
    """(row, its successor in the same document or None), one row of lookahead."""
    prev = None
    for row in rows:
        if prev is not None:
            yield prev, (row if row["doc_id"] == prev["doc_id"] else None)
        prev = row
    if prev is not None:
        yield prev, None


class _Ring:
    """The last ``size`` sentences seen, and how many at its tail share the newest document."""

    def __init__(self, size: int):
        self.size, self.buf, self.n, self.tail_doc, self.tail = size, [None] * size, 0, None, 0

    def push(self, row: dict) -> None:
        self.buf[self.n % self.size] = row
        self.n += 1
        self.tail = self.tail + 1 if row["doc_id"] == self.tail_doc else 1
        self.tail_doc = row["doc_id"]

    def sample_other(self, doc_id: Any, rng: np.random.Generator) -> dict | None:
        held = min(self.n, self.size)
        same = min(self.tail, held) if doc_id == self.tail_doc else 0
        if held - same <= 0:
            return None
        i = int(rng.integers(held - same))  # the oldest held - same entries are other documents
        return self.buf[(self.n - held + i) % self.size]


def _truncate(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Trim the longer of A/B by one token at a time (B on ties) until la + lb <= budget."""
    excess = la + lb - budget
    if excess <= 0:
        return la, lb
    cut = min(excess, abs(la - lb))
    la, lb = (la - cut, lb) if la > lb else (la, lb - cut)
    rest = excess - cut
    return la - rest // 2, lb - (rest + 1) // 2


def _units(row: dict, n: int, off: int) -> list[tuple[int, int]]:
    """Whole-word units of the first ``n`` tokens of ``row``, shifted by ``off``: groups that
    still fit entirely, and single tokens elsewhere."""
    units, pos = [], 0
    for s, e in zip(np.asarray(row["group_starts"]).tolist(), np.asarray(row["group_ends"]).tolist()):
        if e > n:
            break
        if e <= s or s < pos:
            continue
        units.extend((off + i, off + i + 1) for i in range(pos, s))
        units.append((off + s, off + e))
        pos = e
    units.extend((off + i, off + i + 1) for i in range(pos, n))
    return units
