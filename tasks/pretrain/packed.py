"""The packed pretraining loader: NSP pairs written once as flat memory-mapped arrays; a batch is a gather
plus vectorised whole-word masking.

``pack_rows`` does the per-example Python work once (pairing, truncation, whole-word units, the example-local
id of each slot's word) and appends every example's tokens to flat arrays, nanoGPT style: example ``i`` is
``tokens[offsets[i]:offsets[i + 1]]``. ``make_batch`` then builds a padded batch from a few fancy-indexing
gathers and draws the masking with numpy vector ops (the same greedy whole-word choice, 80/10/10 split and
answer-leak removal as the reference path, ``tests/pretrain_reference.py``).

Determinism: the pairs are a pure function of (rows, seed, rank, world); the sample order of an epoch is a
pure function of (pack, seed, epoch, rank); batch ``k``'s masking draws from its own generator
``(seed, epoch, rank, k)``. So batch ``k`` is the same bytes whichever process builds it, in whatever order:
background workers, prefetching and an exact resume at batch ``k`` follow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from tasks.pretrain.config import PretrainDataConfig
from tasks.pretrain.data import Batch, _Ring, _truncate, _units, _with_next
from tasks.text.vocab import TokenIds, as_token_ids
from tasks.training.preempt import poll

PACK_VERSION = "pack-1"
# per token, two int32 records, so that a batch is two gathers: chars [n, 2] = (token id, whole-word unit) and
# slots [n, 4W] = (W word ids, W span starts, W span ends, W example-local word groups)
TOKEN_ARRAYS = {"chars": 2, "slots": 4}  # name -> columns (x W for slots)
EXAMPLE_ARRAYS = {"len_a": np.int16, "nsp": np.int8}
CHUNK = 4096  # examples buffered before an append to the files


@dataclass
class Pack:
    """One rank's NSP pairs. Example ``i`` spans rows ``offsets[i]:offsets[i+1]`` of the token arrays:
    chars int32 [n, 2]: the [CLS] A [SEP] B [SEP] token id, and its example-local whole-word unit (-1 on specials);
    slots int32 [n, 4W]: W lexicon word ids | W span starts | W span ends (each slot's word span [start, end) in
    example positions) | W example-local word groups (one id per distinct word in the example, -1 empty);
    len_a int16 [N]: tokens of A; nsp int8 [N]: 0 IsNext, 1 NotNext."""

    chars: np.ndarray
    slots: np.ndarray
    offsets: np.ndarray
    len_a: np.ndarray
    nsp: np.ndarray
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(self.len_a)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per pair."""
        return np.diff(self.offsets)


# ---------------------------------------------------------------- packing (once)


def _example(a: dict, b: dict, label: int, max_seq_len: int, W: int, tid: TokenIds | None = None
             ) -> tuple[dict[str, np.ndarray], int]:
    """The token arrays of one pair, and len(A). Same truncation and layout as the reference path."""
    tid = tid or TokenIds(0)
    la, lb = _truncate(a["n_tokens"], b["n_tokens"], max_seq_len - 3)
    L, sb = la + lb + 3, la + 2
    chars = np.full((L, 2), -1, np.int32)
    ids = chars[:, 0]
    ids[0], ids[la + 1], ids[L - 1] = tid.cls, tid.sep, tid.sep
    ids[1 : la + 1], ids[sb : sb + lb] = a["char_ids"][:la], b["char_ids"][:lb]
    slots = np.zeros((L, 4 * W), np.int32)
    words, ws, we, group = slots[:, :W], slots[:, W : 2 * W], slots[:, 2 * W : 3 * W], slots[:, 3 * W :]
    units = chars[:, 1]
    u = 0
    for row, n, off in ((a, la, 1), (b, lb, sb)):
        words[off : off + n] = np.asarray(row["word_ids"]).reshape(-1, W)[:n]
        ws[off : off + n] = np.minimum(np.asarray(row["word_starts"]).reshape(-1, W)[:n], n) + off
        we[off : off + n] = np.minimum(np.asarray(row["word_ends"]).reshape(-1, W)[:n], n) + off
        for s, e in _units(row, n, off):
            units[s:e] = u
            u += 1
    distinct, inverse = np.unique(words, return_inverse=True)
    group[:] = inverse.reshape(L, W) - (1 if distinct[0] == 0 else 0)  # word 0 (empty) -> -1
    group[words == 0] = -1
    return {"chars": chars, "slots": slots}, la


def iter_pairs(rows: Iterable[dict], cfg: PretrainDataConfig, rng: np.random.Generator
               ) -> Iterator[tuple[dict, dict, int]]:
    """(A, B, NSP label) in corpus order, paired exactly as the reference stream's ``iter_examples``
    (``tests/pretrain_reference.py``)
    pairs them (the ring, the IsNext fallback, a last sentence that asked for IsNext is not an A)."""
    ring = _Ring(cfg.nsp_pool)
    for a, nxt in _with_next(rows):
        want_random = rng.random() < cfg.nsp_random_prob
        other = ring.sample_other(a["doc_id"], rng) if want_random else None
        ring.push(a)
        if other is not None:
            yield a, other, 1
        elif nxt is not None:
            yield a, nxt, 0


class _Sink:
    """Buffers examples and appends them to one raw file per array (or keeps them in memory)."""

    def __init__(self, directory: Path | None):
        self.dir, self.buf, self.mem = directory, {k: [] for k in TOKEN_ARRAYS}, {k: [] for k in TOKEN_ARRAYS}
        self.files = {k: open(directory / f"{k}.bin", "wb") for k in TOKEN_ARRAYS} if directory else None
        self.lengths: list[int] = []
        self.len_a: list[int] = []
        self.nsp: list[int] = []

    def add(self, arrays: dict[str, np.ndarray], la: int, label: int) -> None:
        for k, v in arrays.items():
            self.buf[k].append(v)
        self.lengths.append(len(arrays["chars"]))
        self.len_a.append(la)
        self.nsp.append(label)
        if len(self.buf["chars"]) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        if not self.buf["chars"]:
            return
        for k, parts in self.buf.items():
            joined = np.concatenate(parts)
            if self.files:
                self.files[k].write(joined.tobytes())
            else:
                self.mem[k].append(joined)
        self.buf = {k: [] for k in TOKEN_ARRAYS}

    def close(self) -> None:
        self.flush()
        for f in (self.files or {}).values():
            f.close()


def pack_rows(rows: Iterable[dict], cfg: PretrainDataConfig, W: int, out_dir: str | Path | None = None, *,
              rank: int = 0, world: int = 1, limit: int | None = None, specials: TokenIds | None = None) -> Pack:
    """Pair ``rows`` (this rank's share) into NSP examples and write them as flat arrays under ``out_dir``
    (memory-mapped back), or keep them in memory when ``out_dir`` is None. ``limit`` stops after that many
    examples (the held-out evaluation set); ``specials``: an imported vocabulary's [CLS]/[SEP] ids (default the
    counted layout's). Memory: one chunk of examples, the NSP ring, the offsets."""
    rng = np.random.default_rng([cfg.seed, world, rank])
    directory = Path(out_dir) if out_dir is not None else None
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    sink, n_rows = _Sink(directory), 0

    def counted():
        nonlocal n_rows
        for r in rows:
            poll()  # a stop signal ends the reading and packing between two rows
            n_rows += 1
            yield r

    try:
        for a, b, label in iter_pairs(counted(), cfg, rng):
            arrays, la = _example(a, b, label, cfg.max_seq_len, W, specials)
            sink.add(arrays, la, label)
            if limit is not None and len(sink.lengths) >= limit:
                break
    finally:
        sink.close()
    offsets = np.zeros(len(sink.lengths) + 1, np.int64)
    np.cumsum(sink.lengths, out=offsets[1:])
    meta = {"pack_version": PACK_VERSION, "W": W, "examples": len(sink.lengths), "tokens": int(offsets[-1]),
            "rows": n_rows, "rank": rank, "world": world, "max_seq_len": cfg.max_seq_len}
    per_example = {"offsets": offsets, "len_a": np.asarray(sink.len_a, np.int16), "nsp": np.asarray(sink.nsp, np.int8)}
    if directory is None:
        arrays = {k: (np.concatenate(v) if v else _empty(k, W)) for k, v in sink.mem.items()}
        return Pack(**arrays, **per_example, meta=meta)
    for k, v in per_example.items():
        np.save(directory / f"{k}.npy", v)
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return open_pack(directory)


def _width(name: str, W: int) -> int:
    return TOKEN_ARRAYS[name] * (W if name == "slots" else 1)


def _empty(name: str, W: int) -> np.ndarray:
    return np.zeros((0, _width(name, W)), np.int32)


def open_pack(directory: str | Path) -> Pack:
    """A pack written by :func:`pack_rows`, its token arrays memory-mapped read-only."""
    directory = Path(directory)
    meta = json.loads((directory / "meta.json").read_text())
    W, n = meta["W"], meta["tokens"]
    arrays = {}
    for k in TOKEN_ARRAYS:
        shape = (n, _width(k, W))
        # a plain ndarray view of the map: np.memmap's own indexing adds a wrapper object per gather
        arrays[k] = (np.memmap(directory / f"{k}.bin", dtype=np.int32, mode="r", shape=shape).view(np.ndarray) if n
                     else _empty(k, W))
    per_example = {k: np.load(directory / f"{k}.npy") for k in ("offsets", "len_a", "nsp")}
    return Pack(**arrays, **per_example, meta={**meta, "dir": str(directory)})


def pack_key(data_key: str, cfg: PretrainDataConfig, W: int, rank: int, world: int) -> str:
    """Cache key of a rank's pack: the data's identity, what pairing depends on, the rank and world size."""
    fields = cfg.model_dump(include={"max_seq_len", "nsp_random_prob", "nsp_pool", "seed", "heldout_frac"})
    blob = json.dumps([PACK_VERSION, data_key, fields, W, rank, world], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cached_pack(root: str | Path, key: str, build) -> Pack:
    """The pack under ``root/key``, built by ``build(tmp_dir)`` when missing (written to a temporary sibling and
    renamed into place, so a killed packing leaves nothing that looks finished)."""
    final = Path(root) / key
    if (final / "meta.json").exists():
        return open_pack(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same pack first: same bytes, keep theirs
            if not (final / "meta.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return open_pack(final)


def pack_root() -> Path:
    """Where packs are cached: ``$LEXIFLOW_PACK_DIR``, else ``~/.cache/lexiflow/packs`` (local disk: memory-mapped)."""
    return Path(os.environ.get("LEXIFLOW_PACK_DIR") or Path.home() / ".cache" / "lexiflow" / "packs")


# ---------------------------------------------------------------- an epoch's order (once per epoch)


def epoch_order(lengths: np.ndarray, batch_size: int, bucket_batches: int, rng: np.random.Generator
                ) -> list[np.ndarray]:
    """The epoch's batches as example indices: a random permutation cut into pools of
    ``bucket_batches * batch_size``; each pool sorted by (length, index) and cut into batches, whose order
    within the pool is shuffled. The last batch of the last pool may be short."""
    perm = rng.permutation(len(lengths))
    pool = bucket_batches * batch_size
    batches: list[np.ndarray] = []
    for s in range(0, len(perm), pool):
        p = perm[s : s + pool]
        p = p[np.lexsort((p, lengths[p]))]
        groups = [p[i : i + batch_size] for i in range(0, len(p), batch_size)]
        batches.extend(groups[j] for j in rng.permutation(len(groups)))
    return batches


# ---------------------------------------------------------------- a batch (every step, vectorised)


def _greedy_units(ulen_sorted: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """bool [B, U]: walking each row's units in order, take a unit when it still fits the row's budget and skip
    it otherwise (the reference's greedy). Done in passes: a pass takes the longest fitting prefix of the units
    still eligible (length <= what is left); a skipped unit never fits later, so the passes end where the walk
    ends, usually after two or three."""
    taken = np.zeros(ulen_sorted.shape, bool)
    left = budget.astype(ulen_sorted.dtype)
    while True:
        eligible = ~taken & (ulen_sorted > 0) & (ulen_sorted <= left[:, None])
        if not eligible.any():
            return taken
        cum = np.cumsum(np.where(eligible, ulen_sorted, 0), axis=1)
        add = eligible & (cum <= left[:, None])
        taken |= add
        left -= np.where(add, ulen_sorted, 0).sum(axis=1)


def make_batch(pack: Pack, idx: np.ndarray, cfg: PretrainDataConfig, vocab_size: int | TokenIds,
               rng: np.random.Generator) -> Batch:
    """Examples ``idx`` of ``pack`` padded to the longest, with whole-word MLM masking and the answer leak closed.

    The masking works on the ``n`` real tokens (flat, example after example); the padded [B, T] tensors are one
    gather each from those, through an index whose padding points at a zero row."""
    tid = as_token_ids(vocab_size)
    starts, lens = pack.offsets[idx], pack.offsets[idx + 1] - pack.offsets[idx]  # [B]
    B, T = len(idx), int(lens.max())
    W = pack.slots.shape[1] // 4
    first = np.zeros(B, np.int64)  # each example's first row in the flat layout
    np.cumsum(lens[:-1], out=first[1:])
    n = int(lens.sum())
    example = np.repeat(np.arange(B), lens)  # [n] example of each real token
    src = np.arange(n) + np.repeat(starts - first, lens)  # [n] row in the pack
    pos = np.arange(T)
    valid = pos[None, :] < lens[:, None]  # [B, T]
    pad = np.where(valid, first[:, None] + pos, n)  # [B, T] flat row, n = the zero row
    chars = pack.chars[src]  # [n, 2]
    tokens, units = chars[:, 0], chars[:, 1]

    # whole-word units: a random order per example, then the greedy fill up to n_mask tokens
    n_mask = np.minimum(cfg.max_predictions_per_seq, np.maximum(1, (cfg.mask_prob * (lens - 3) + 0.5).astype(np.int64)))
    has = units >= 0
    ukey = example * T + np.where(has, units, 0)  # [n] unit slot in a [B, T] table
    ulen = np.bincount(ukey[has], minlength=B * T).reshape(B, T).astype(np.int32)  # [B, U<=T] tokens per unit
    U = int((ulen > 0).sum(axis=1).max())  # the most units any example has: units are numbered 0..U-1
    keys = rng.random((B, U))
    keys[ulen[:, :U] == 0] = 2.0  # units that do not exist sort last (their order among themselves is moot)
    order = np.argsort(keys, axis=1)
    taken_sorted = _greedy_units(np.take_along_axis(ulen[:, :U], order, axis=1), n_mask)
    taken = np.zeros((B, T), bool)
    np.put_along_axis(taken[:, :U], order, taken_sorted, axis=1)
    masked = has & taken.reshape(-1)[ukey]  # [n]

    # one 80/10/10 draw per unit
    draw = rng.random(B * T)[ukey]
    replace = masked & (draw < cfg.mask_replace)
    randomise = masked & (draw >= cfg.mask_replace) & (draw < cfg.mask_replace + cfg.mask_random)
    fed = np.zeros(n + 1, np.int64)
    fed[:n] = tokens
    fed[:n][replace] = tid.mask
    fed[:n][randomise] = tid.draw(rng, int(randomise.sum()))

    # the leak: a word whose span covers a masked position leaves every slot of its example
    slots = pack.slots[src]  # [n, 4W]
    words = np.zeros((n + 1, W), np.int64)
    words[:n] = slots[:, :W]
    before = np.zeros(n + 1, np.int32)  # masked tokens before each flat row
    np.cumsum(masked, out=before[1:])
    base = first.astype(np.int32)[example][:, None]  # [n, 1]
    hit = (before[base + slots[:, 2 * W : 3 * W]] > before[base + slots[:, W : 2 * W]]) & (words[:n] > 0)  # [n, W]
    if hit.any():
        group = slots[:, 3 * W :]  # [n, W] example-local word id, -1 empty
        slot = example[:, None] * (T * W) + np.maximum(group, 0)
        gone = np.zeros(B * T * W, bool)
        gone[slot[hit]] = True
        words[:n][(group >= 0) & gone[slot]] = 0

    flat_masked = np.zeros(n + 1, bool)
    flat_masked[:n] = masked
    positions = np.flatnonzero(flat_masked[pad])
    parts = {  # one int64 buffer: a worker hands one tensor to the training process, which copies it to the GPU once
        "input_ids": fed[pad],
        "segment_ids": (pos[None, :] >= (pack.len_a[idx].astype(np.int64) + 2)[:, None]) & valid,
        "attention_mask": valid,
        "word_ids": words[pad],
        "mlm_positions": positions,
        "mlm_labels": tokens[src_of(positions, first, T)],
        "nsp_labels": pack.nsp[idx],
    }
    return BatchBuffer.of(parts, n)


def src_of(flat: np.ndarray, first: np.ndarray, T: int) -> np.ndarray:
    """Rows in the flat layout of the padded positions ``flat`` (indices into B*T, real tokens only)."""
    return first[flat // T] + flat % T


@dataclass
class BatchBuffer:
    """A :class:`Batch` in one int64 tensor (the bool mask as 0/1) and its layout: what a loader worker sends
    (one shared-memory tensor a batch, not seven) and what goes to the GPU in one non-blocking copy.
    ``to(device)`` returns the :class:`Batch` as views of the copied buffer."""

    buf: torch.Tensor  # int64 [total]
    layout: tuple[tuple[str, tuple[int, ...]], ...]
    n_real_tokens: int
    n_masked: int | None = None  # real MLM positions, when padding added ignored ones (default: all of them)
    n_pairs: int | None = None  # real pairs, when padding added ignored ones (default: all of them)
    real_len: int | None = None  # the batch's own length (its longest pair), when padding made it longer
    n_word_rows: int | None = None  # with word_row_ids: 1 + the batch's distinct words (the rest is padding)
    attn_len: float | None = None  # packed rows: the tokens a real token attends over, on average (sum l^2 / sum l)

    def counts(self) -> tuple[int, int]:
        """(real masked positions, real pairs), read from the layout on the host."""
        shapes = dict(self.layout)
        return (shapes["mlm_labels"][0] if self.n_masked is None else self.n_masked,
                shapes["nsp_labels"][0] if self.n_pairs is None else self.n_pairs)

    def seq_len(self) -> int:
        """The batch's real length: its longest pair, before any bucket padding (what FLOPs are counted at)."""
        return self.real_len if self.real_len is not None else dict(self.layout)["input_ids"][1]

    def attention_len(self) -> float:
        """The length attention FLOPs are counted at: a token attends over its own pair, so over the batch's
        pairs of lengths l, sum(l^2) / sum(l) (packed rows); else :meth:`seq_len`."""
        return self.attn_len if self.attn_len is not None else float(self.seq_len())

    @classmethod
    def of(cls, parts: dict[str, np.ndarray], n_real_tokens: int) -> "BatchBuffer":
        """One flat int64 buffer of ``parts`` (the layout remembers each part's shape)."""
        buf = np.concatenate([np.ravel(v).astype(np.int64, copy=False) for v in parts.values()])
        return cls(torch.from_numpy(buf), tuple((k, np.shape(v)) for k, v in parts.items()), n_real_tokens)

    def pin_memory(self) -> "BatchBuffer":
        """The same batch in pinned host memory (for a non-blocking copy to the GPU)."""
        return dataclasses.replace(self, buf=self.buf.pin_memory())

    def parts(self) -> dict[str, np.ndarray]:
        """The batch's arrays on the host (views of the buffer), by name."""
        out, at, buf = {}, 0, self.buf.numpy()
        for name, shape in self.layout:
            size = int(np.prod(shape))
            out[name] = buf[at: at + size].reshape(shape)
            at += size
        return out

    def seq_positions(self) -> int:
        """Token positions the model runs ([B, T]: real tokens and padding)."""
        B, T = dict(self.layout)["input_ids"]
        return int(B * T)

    def to(self, device: Any = "cpu", non_blocking: bool = False) -> Batch:
        """The batch on ``device``: one copy of the buffer, then views of it."""
        buf = self.buf.to(device, non_blocking=non_blocking)
        out, at = {}, 0
        for name, shape in self.layout:
            size = int(np.prod(shape))
            out[name] = buf[at : at + size].view(shape)
            at += size
        out["attention_mask"] = out["attention_mask"].bool()
        return Batch(**out, n_real_tokens=self.n_real_tokens)


# ---------------------------------------------------------------- the dataset torch's DataLoader reads


class PackedBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item ``(epoch, k)`` is batch ``k`` of that epoch (use ``DataLoader(batch_size=None)``
    with a :class:`Schedule` sampler). Holds the pack's directory (or the in-memory pack), so it pickles cheaply into
    worker processes; each process computes an epoch's order once, when it first needs it."""

    def __init__(self, pack: Pack | str | Path, cfg: PretrainDataConfig, vocab_size: int | TokenIds, rank: int = 0):
        as_token_ids(vocab_size).check()
        self.source = pack if isinstance(pack, Pack) else str(pack)
        self._pack = pack if isinstance(pack, Pack) else None
        self.cfg, self.vocab_size, self.rank = cfg, vocab_size, rank
        self._orders: dict[int, list[np.ndarray]] = {}

    @property
    def pack(self) -> Pack:
        """The pack, opened on first use (a worker process opens its own)."""
        if self._pack is None:
            self._pack = open_pack(self.source)
        return self._pack

    def __getstate__(self):
        return {**self.__dict__, "_orders": {}, "_pack": self._pack if isinstance(self.source, Pack) else None}

    def batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches as example indices (computed once per process, the last two epochs kept)."""
        if epoch not in self._orders:
            rng = np.random.default_rng([self.cfg.seed, epoch, self.rank, 0])
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = epoch_order(self.pack.lengths, self.cfg.batch_size, self.cfg.bucket_batches, rng)
        return self._orders[epoch]

    def per_epoch(self) -> int:
        """Batches per epoch."""
        return -(-len(self.pack) // self.cfg.batch_size)

    def __getitem__(self, key: tuple[int, int]) -> BatchBuffer:
        epoch, k = key
        rng = np.random.default_rng([self.cfg.seed, epoch, self.rank, 1, k])
        return make_batch(self.pack, self.batches(epoch)[k], self.cfg, self.vocab_size, rng)

    def epoch(self, epoch: int) -> list[Batch]:
        """Every batch of one epoch, built here (tests, evaluation sets)."""
        return [self[epoch, k].to("cpu") for k in range(len(self.batches(epoch)))]


class Schedule(torch.utils.data.Sampler):
    """The keys ``(epoch, k)`` of ``steps`` batches from ``(epoch, start)``, ``per_epoch`` batches an epoch
    (the trainer passes the smallest count over the ranks, so every rank takes the same number of steps)."""

    def __init__(self, epoch: int, start: int, steps: int, per_epoch: int):
        self.epoch, self.start, self.steps, self.per_epoch = epoch, start, steps, per_epoch

    def __iter__(self) -> Iterator[tuple[int, int]]:
        e, k = self.epoch, self.start
        for _ in range(self.steps):
            if k >= self.per_epoch:
                e, k = e + 1, 0
            yield e, k
            k += 1

    def __len__(self) -> int:
        return self.steps


def loader(dataset: PackedBatches, schedule: Schedule, workers: int, prefetch: int, pin: bool,
           kind: str = "thread") -> Iterator[tuple[tuple[int, int], BatchBuffer]]:
    """``(key, batch)`` pairs in schedule order, the batches built ``prefetch`` ahead by ``workers`` background
    threads (``kind="thread"``: no copies between processes; numpy releases the GIL in its heavy loops) or torch
    DataLoader worker processes (``kind="process"``: one shared-memory tensor a batch; for hosts with cores to
    spare), or inline when ``workers`` is 0. With ``pin`` the batches come in page-locked memory, ready for a
    non-blocking copy to the GPU. Batch ``(epoch, k)`` is the same bytes whichever way it is built."""
    if workers == 0:
        return ((key, _pinned(dataset[key], pin)) for key in schedule)
    if kind == "thread":
        return _threaded(dataset, schedule, workers, prefetch, pin)
    # its own generator: a DataLoader draws a worker base seed from the one it is given, and drawing it from
    # torch's global generator would shift dropout after a resume (our batches use no torch randomness)
    batches = DataLoader(dataset, batch_size=None, sampler=schedule, num_workers=workers, pin_memory=pin,
                         prefetch_factor=prefetch, generator=torch.Generator().manual_seed(0))
    return zip(schedule, batches)


def _pinned(batch: BatchBuffer, pin: bool) -> BatchBuffer:
    return batch.pin_memory() if pin else batch


def _threaded(dataset, schedule, workers: int, prefetch: int, pin: bool):
    """In order, at most ``workers * prefetch`` batches in flight; closing the generator cancels the rest."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix="lexiflow-loader")
    pending: deque = deque()
    keys = iter(schedule)
    try:
        for key in keys:
            pending.append((key, pool.submit(lambda k: _pinned(dataset[k], pin), key)))
            if len(pending) >= workers * prefetch:
                break
        while pending:
            key, fut = pending.popleft()
            nxt = next(keys, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(lambda k: _pinned(dataset[k], pin), nxt)))
            yield key, fut.result()
    finally:
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True)
