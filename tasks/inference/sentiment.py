"""Sentiment scoring with a bundle: length-sorted mini-batches -> probabilities, and the labeller's scorer."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from models.bert import padding_of
from models.numerics import available_cpus, torch_threads
from models.rowwise import one_thread_invariant, rowwise, sigmoid_rows, softmax_rows
from storage.artifacts import ArtifactRef
from tasks.common.text import has_cjk, normalize_text
from tasks.inference.reference import describe as describe_texts
from tasks.inference.reference import word_counts
from tasks.inference.runtime import autocast

WINDOW_BATCHES = 32  # a scoring window (sorted by length) = batch_size * WINDOW_BATCHES texts
# On CPU a mini-batch also holds at most this many padded tokens (rows x length): 16 rows of 128 tokens, 32 of 64.
# Long rows then go in smaller batches whose activations ([tokens, ffn_size] is 12 MB here at seed size) stay in
# cache; on 2 cores this made int8 scoring of the seed-size classifier 6-10 % faster (interleaved A/B, README).
CPU_BATCH_TOKENS = 2048
# flags of a scored text, for the user to decide on: no CJK ideograph at all (English, emoji: the model was trained
# on Chinese), and the token offset where a text longer than the model's length was cut (null: read whole)
FLAG_FIELDS = [("no_cjk", pa.bool_()), ("truncated_at", pa.int32())]
PART_SCHEMA = pa.schema(
    [
        ("row_id", pa.string()),
        ("prob", pa.float32()),
        ("label", pa.int8()),
        ("threshold", pa.float64()),
        ("bundle_version", pa.string()),
        *FLAG_FIELDS,
    ]
)


def _device(model) -> Any:
    return next(model.parameters()).device


PAD_MULTIPLE = 16  # a row is padded to its own length rounded up to this (capped at max_len), whatever its batch
_INFERENCE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fp32 model -> its row-invariant copy


def inference_model(model):
    """The model that scores: on CPU the row-invariant copy (:func:`models.rowwise.rowwise`, weights shared, made
    once per model), so a text's bits do not depend on its batch; on CUDA the model itself (bf16 autocast)."""
    if getattr(model, "rowwise_precision", None) is not None or _device(model).type != "cpu":
        return model
    if model not in _INFERENCE:
        _INFERENCE[model] = rowwise(model, "fp32")
    return _INFERENCE[model]


def padded_lengths(lengths: np.ndarray, max_len: int | None) -> np.ndarray:
    """Each row's padded length: its own length rounded up to :data:`PAD_MULTIPLE`, at most ``max_len``."""
    padded = -(-lengths // PAD_MULTIPLE) * PAD_MULTIPLE
    return np.minimum(padded, max_len) if max_len else padded


def _batches(padded: np.ndarray, batch_size: int, max_tokens: int | None) -> Iterator[np.ndarray]:
    """Row indices in batches of one padded length each (longest first, input order within a length): at most
    ``batch_size`` rows and, when ``max_tokens`` is given, at most ``max_tokens`` padded tokens (at least one row)."""
    order = np.lexsort((np.arange(len(padded)), -padded))
    neg = -padded[order]  # ascending
    s, n = 0, len(order)
    while s < n:
        T = max(1, int(padded[order[s]]))
        rows = batch_size if max_tokens is None else max(1, min(batch_size, max_tokens // T))
        e = min(s + rows, int(np.searchsorted(neg, -T, side="right")))  # same padded length only
        yield order[s:e]
        s = e


def _score_encoded(model, encs: list, batch_size: int, logits: bool = False) -> np.ndarray:
    """Probabilities (``logits``: the logits) for pre-encoded rows, in the input order. Each row is padded to a
    length of its own (:func:`padded_lengths`) and batched with rows of that length (on CPU at most
    :data:`CPU_BATCH_TOKENS` padded tokens a batch); on CPU the row-invariant model scores
    (:func:`inference_model`): a row's bits are the same alone or in any batch. Inference mode; bf16 autocast on
    CUDA."""

    n = len(encs)
    k = int(getattr(model, "num_labels", 1))
    out = np.empty(n if k == 1 else (n, k), dtype=np.float32)  # K > 2 classes: [n, K] softmax probabilities
    if n == 0:
        return out
    model = inference_model(model)
    dev = _device(model)
    lengths = np.fromiter((len(e.input_ids) for e in encs), dtype=np.int64, count=n)
    cfg = getattr(model, "cfg", None)
    padded = padded_lengths(lengths, getattr(cfg, "max_len", None))
    W = encs[0].word_ids.shape[1]
    bf16 = autocast(dev)  # on CUDA; a no-op on CPU

    def score(idx: np.ndarray) -> None:  # one batch: rows idx, all of padded length T, into out[idx]
        T = int(padded[idx[0]])
        ids = np.zeros((len(idx), T), dtype=np.int64)
        words = np.zeros((len(idx), T, W), dtype=np.int64)
        for r, i in enumerate(idx):
            L = lengths[i]
            ids[r, :L] = encs[i].input_ids
            words[r, :L] = encs[i].word_ids
        input_ids = torch.from_numpy(ids).to(dev, non_blocking=True)
        word_ids = torch.from_numpy(words).to(dev, non_blocking=True)
        # on CUDA, where the batch's padding is, from the host copy: attention is routed without reading the device
        hint = {"padded": padding_of(torch.from_numpy(ids != 0), dev)} if dev.type == "cuda" else {}
        with bf16:
            z = model(input_ids, attention_mask=input_ids != 0, word_ids=word_ids, **hint).float()
        out[idx] = (z if logits else sigmoid_rows(z) if k == 1 else softmax_rows(z)).cpu().numpy()

    map_batches(model, score, list(_batches(padded, batch_size, CPU_BATCH_TOKENS if dev.type == "cpu" else None)))
    bad = ~np.isfinite(out.reshape(n, -1)).all(1)  # [n] rows with a NaN or inf score
    if bad.any():  # a NaN would compare as below every threshold and be labelled 0 without a word
        count, first = int(bad.sum()), int(np.flatnonzero(bad)[0])
        raise ValueError(f"the model gave non-finite scores for {count} of {n} rows (the first: row {first} of "
                         "this call): its weights or inputs are broken")
    return out


def batch_workers(model) -> int:
    """How many batches :func:`map_batches` runs at once, each on one torch thread: on CPU, with torch on ``t >= 2``
    threads and ``model``'s layers giving the same bits on one thread as on ``t``
    (:func:`models.rowwise.one_thread_invariant`; a model with plain linear layers never does), ``t`` capped by the
    CPUs this process may use (:func:`models.numerics.available_cpus`: a scheduling choice, which changes no bit);
    else 0 (one batch after another over torch's threads), also while a lexicon adapter records its attention (a
    record of one batch at a time)."""
    threads = torch.get_num_threads()
    if threads < 2 or _device(model).type != "cpu" or getattr(model, "rowwise_precision", None) is None:
        return 0
    if any(getattr(m, "record_attention", False) for m in model.modules()):
        return 0
    return min(threads, available_cpus()) if one_thread_invariant(model) else 0


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (process id, workers) -> threads on one torch thread each
_POOLS_LOCK = threading.Lock()


def _one_thread_pool(workers: int) -> ThreadPoolExecutor:
    """This process's pool of ``workers`` threads, each set to one torch thread once, when it starts (torch keeps the
    count per thread; setting it also sets the count new threads start with, for the whole process, so that is put
    back once every worker has started: the only moment another thread starting could read 1). Made once per process
    and size, and kept (no per-call thread start-up); a forked child makes its own (threads do not survive a fork)."""
    key = (os.getpid(), workers)
    with _POOLS_LOCK:
        if key not in _POOLS:
            threads = torch.get_num_threads()
            started = threading.Barrier(workers, timeout=60)
            pool = ThreadPoolExecutor(workers, thread_name_prefix="lexiflow-batch", initializer=_one_torch_thread)
            try:
                wait([pool.submit(started.wait) for _ in range(workers)])  # every worker started and set to 1
            finally:
                torch.set_num_threads(threads)
            _POOLS[key] = pool
        return _POOLS[key]


def _one_torch_thread() -> None:
    """Set this thread to one torch thread, after torch's lazy per-thread set-up (which, run later, would reset it
    to the process's count)."""
    torch.get_num_threads()
    torch.set_num_threads(1)


def map_batches(model, fn: Callable[[Any], None], batches: Sequence[Any]) -> None:
    """``fn(batch)`` for every batch, in inference mode. On CPU with :func:`batch_workers` ``w > 0`` (and more than
    one batch, unless ``w`` is 1): ``w`` batches at once, each in a thread of its own running torch on one thread;
    else one after another here.

    A small model's batch is too little work to split over threads (each of its ~200 operations would wake and
    join them, and on a busy machine a descheduled thread stalls the rest); a batch per thread has no such joins
    (the speed-up is in ``benchmarks/bench_label.py``). Every batch gets the bits it gets on all threads (probed
    per layer shape), so the outputs are the same either way. At the first error (or an interrupt of the caller)
    the batches not yet started are dropped, the running ones end, and the error of the earliest failed batch is
    raised."""
    workers = batch_workers(model)
    if not workers or (workers > 1 and len(batches) < 2):
        with torch.inference_mode():
            for b in batches:
                fn(b)
        return

    def run(b: Any) -> None:
        with torch.inference_mode():  # per thread, as grad mode is
            fn(b)

    pool = _one_thread_pool(workers)
    futures = [pool.submit(run, b) for b in batches]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
    finally:  # an error, or the caller interrupted (Ctrl-C, a shard's timeout): drop the rest, let the running end
        for f in futures:
            f.cancel()
        wait(futures)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()


def probabilities(bundle, model, texts: Sequence[str], encs: list, batch_size: int) -> np.ndarray:
    """float32 probabilities ([N], or [N, K] for K > 2 classes) of the bundle's shipped classifier for ``texts``
    (raw strings) already encoded as ``encs``: the encoder ``model`` alone, or, when the bundle stacks the TF-IDF
    baseline, the blend of the encoder's logits and the baseline's on the normalised text
    (:class:`tasks.inference.blend.Blend`, :class:`~tasks.inference.blend.KBlend`)."""
    if getattr(bundle, "blend", None) is None:
        return _score_encoded(model, encs, batch_size)
    z_encoder = _score_encoded(model, encs, batch_size, logits=True)
    z_baseline = bundle.baseline.logits([normalize_text(t) for t in texts])
    return bundle.blend.prob(z_encoder, z_baseline)


def score_texts(bundle, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """float32 probabilities for ``texts`` (strings), in order: [N], or [N, K] for K > 2 classes. No rejection
    here: an empty text is scored as ``[CLS][SEP]``. Encoded and scored in windows, so the working memory does not
    grow with ``texts``."""
    window = batch_size * WINDOW_BATCHES
    k = int(getattr(bundle.model, "num_labels", 1))
    parts = [np.empty((0,) if k == 1 else (0, k), np.float32)]
    for s in range(0, len(texts), window):
        chunk = list(texts[s : s + window])
        parts.append(probabilities(bundle, bundle.model, chunk, bundle.featurizer.encode(chunk), batch_size))
    return np.concatenate(parts)


AGREEMENT = 0.999  # an approximate path must give the fp32 label on at least this share of held-out rows


def quantized(model):
    """The row-invariant int8 copy of ``model`` (:func:`models.rowwise.rowwise`): the ``nn.Linear`` layers of the
    encoder's transformer blocks with int8 weights (per output channel) and one activation scale per row, so a
    text's int8 bits, like its fp32 bits, do not depend on its batch. CPU only; the fp32 model stays as it is.

    The lexicon adapter's word projection and the output head stay fp32: they are a few per cent of the compute
    but most of the int8 error. (With per-call activation ranges, quantizing every linear agreed with fp32 on
    99.70 % of the trained demo bundle's held-out labels, the blocks alone on 99.95 %.)"""
    return rowwise(model, "int8")


def agreement(bundle, approx_model, texts: Sequence[str], batch_size: int = 32) -> tuple[float, int]:
    """(share of ``texts`` whose label at the bundle threshold (K > 2 classes: the arg-max) is the same with
    ``approx_model`` as with the bundle's fp32 model, number of texts)."""
    texts = list(texts)
    keep = [(t, e) for t, e in zip(texts, bundle.featurizer.encode(texts)) if len(e.input_ids) > 2]
    if not keep:
        return 0.0, 0
    kept, encs = [t for t, _ in keep], [e for _, e in keep]
    ref = probabilities(bundle, bundle.model, kept, encs, batch_size)
    got = probabilities(bundle, approx_model, kept, encs, batch_size)
    if ref.ndim == 2:  # K > 2 classes: the same label is the same arg-max
        return float((ref.argmax(1) == got.argmax(1)).mean()), len(encs)
    th = float(bundle.threshold)
    return float(((ref.astype(np.float64) >= th) == (got.astype(np.float64) >= th)).mean()), len(encs)


def gated_model(bundle, precision: str, batch_size: int = 32, min_agreement: float | None = None):
    """The model that scores for ``precision``: fp32 as it is; int8 only after it agrees with fp32 on the
    bundle's own held-out rows (at least ``min_agreement``, default :data:`AGREEMENT`; else ValueError,
    nothing labelled). Returns (model, check record)."""
    min_agreement = AGREEMENT if min_agreement is None else min_agreement
    if precision == "fp32":
        return bundle.model, {"precision": "fp32"}
    if precision != "int8":
        raise ValueError(f"precision {precision!r}: expected fp32 or int8")
    if _device(bundle.model).type != "cpu":
        raise ValueError("precision int8 is a CPU path (dynamic quantization); on CUDA labelling runs in bf16")
    texts = bundle.heldout_texts()
    if not texts:
        raise ValueError(f"{bundle.uri}: this bundle carries no held-out rows to check int8 against (built by an "
                         "earlier lexiflow); re-run its pipeline or label with precision fp32")
    model = quantized(bundle.model)
    share, n = agreement(bundle, model, texts, batch_size)
    if share < min_agreement:
        raise ValueError(f"{bundle.uri}: int8 labels agree with fp32 on {share:.4%} of {n} held-out rows, below "
                         f"the required {min_agreement:.1%}; label with precision fp32")
    return model, {"precision": "int8", "agreement": round(share, 6), "agreement_rows": n}


class ClassifierScorer:
    """What the labeller (:mod:`tasks.label.run`) needs from a sentiment bundle: scores and the part-file columns.

    Another model (NER) plugs into the same streaming, resume and reconciliation machinery by
    providing the same five members: ``ref``, ``score``, ``part_table``, ``positive_column``, ``metrics``. A scorer
    that also has ``score_rows`` gets each scored row's flags (``no_cjk``, ``truncated_at``) into its part files."""

    def __init__(self, bundle, batch_size: int, precision: str = "fp32", threads: int | None = None):

        self.bundle, self.batch_size, self.threads = bundle, batch_size, threads
        # finetune.classes: any (K >= 2): class-name labels and prob_<class> columns; None: a binary-mode bundle
        self.classes = getattr(bundle, "classes", None)
        self.positive_column = "label" if self.classes is None else None  # no 0/1 label column to count
        self.ref = ArtifactRef(stage="bundle", version=bundle.version, uri=bundle.uri)
        with torch_threads(threads):  # the int8 gate's agreement is computed under the same numerics
            self.model, self.check = gated_model(bundle, precision, batch_size)  # int8: refused unless it agrees

    def score(self, texts: list[str]) -> tuple[list[Any], set[int]]:
        """Outputs for the scorable texts (in order) and the indices that were empty after normalisation, computed
        with ``threads`` torch threads (given: the same bits on any machine; None: the process's setting)."""
        outputs, empty, _flags = self.score_rows(texts)
        return outputs, empty

    def score_rows(self, texts: list[str]) -> tuple[list[Any], set[int], list[tuple[bool, int | None]]]:
        """:meth:`score`, and per scored text its flags ``(no_cjk, truncated_at)`` (:data:`FLAG_FIELDS`)."""
        outputs, empty, flags, _, _ = self.score_described(texts, describe=False)
        return outputs, empty, flags

    def score_described(self, texts: list[str], describe: bool = True, words: np.ndarray | None = None
                        ) -> tuple[list[Any], set[int], list[tuple[bool, int | None]], np.ndarray | None,
                                   np.ndarray | None]:
        """:meth:`score_rows`, and per scored text its input descriptors for monitoring
        (:func:`tasks.inference.reference.describe`, from the same encoding; None unless ``describe``), and the
        scored texts' lexicon-word counts on a reference's buckets (``words``: its word-id lookup,
        :func:`tasks.inference.reference.word_lut`; None without one)."""

        featurizer = self.bundle.featurizer
        lengths: list[int] = []
        encs = featurizer.encode(texts, lengths)
        keep = [i for i, e in enumerate(encs) if len(e.input_ids) > 2]
        with torch_threads(self.threads):
            probs = probabilities(self.bundle, self.model, [texts[i] for i in keep], [encs[i] for i in keep],
                                  self.batch_size)
        flags = [(not has_cjk(texts[i]), featurizer.cut_at(lengths[i])) for i in keep]
        desc = (describe_texts([texts[i] for i in keep], [encs[i] for i in keep], [lengths[i] for i in keep],
                               featurizer.ids) if describe else None)
        counts = None if words is None else word_counts([encs[i] for i in keep], words)
        return list(probs), set(range(len(texts))) - set(keep), flags, desc, counts

    def part_table(self, ids: list[str], outputs: list[Any], flags: list[tuple[bool, int | None]] | None = None
                   ) -> pa.Table:
        """The part-file rows for ``ids`` and their ``outputs`` (:meth:`score`), with their ``flags``
        (:meth:`score_rows`; None: unknown, the flag columns null)."""
        if self.classes is not None and len(self.classes) == 2:  # K = 2: prob of the second class, threshold
            p = np.asarray(outputs, dtype=np.float32)
            top = (p.astype(np.float64) >= float(self.bundle.threshold)).astype(np.int64)
            return class_table(ids, np.stack([np.float32(1) - p, p], 1), self.classes, self.bundle.version, top,
                               flags)
        if self.classes is not None:
            return class_table(ids, outputs, self.classes, self.bundle.version, flags=flags)
        probs = np.asarray(outputs, dtype=np.float32)
        th = float(self.bundle.threshold)
        labels = (probs.astype(np.float64) >= th).astype(np.int8)  # from the stored float32 value
        n = len(ids)
        return pa.table(
            {
                "row_id": pa.array(ids, pa.string()),
                "prob": pa.array(probs, pa.float32()),
                "label": pa.array(labels, pa.int8()),
                "threshold": pa.array(np.full(n, th), pa.float64()),
                "bundle_version": pa.array([self.bundle.version] * n, pa.string()),
                **flag_columns(n, flags),
            },
            schema=PART_SCHEMA,
        )

    def metrics(self) -> dict[str, Any]:
        """What the label run's manifest records of the scorer: the bundle, its threshold or classes, its check."""
        if self.classes is not None:
            th = None if self.bundle.threshold is None else float(self.bundle.threshold)
            return {"bundle_version": self.bundle.version, "threshold": th, "classes": self.classes, **self.check}
        return {"bundle_version": self.bundle.version, "threshold": float(self.bundle.threshold), **self.check}


def flag_columns(n: int, flags: Sequence[tuple[bool, int | None]] | None) -> dict[str, pa.Array]:
    """The :data:`FLAG_FIELDS` columns of ``n`` rows (``flags`` None: all null)."""
    if flags is None:
        return {name: pa.nulls(n, t) for name, t in FLAG_FIELDS}
    return {"no_cjk": pa.array([f[0] for f in flags], pa.bool_()),
            "truncated_at": pa.array([f[1] for f in flags], pa.int32())}


def class_schema(classes: Sequence[str]) -> pa.Schema:
    """The part-file columns of a ``classes: any`` bundle (any K >= 2): ``row_id``, ``label`` (the class name),
    ``prob`` (its probability), then ``prob_<class>`` (float32) for every class in the bundle's order,
    ``bundle_version``, then the flags ``no_cjk``, ``truncated_at``."""
    return pa.schema([("row_id", pa.string()), ("label", pa.string()), ("prob", pa.float32()),
                      *((f"prob_{c}", pa.float32()) for c in classes), ("bundle_version", pa.string()),
                      *FLAG_FIELDS])


def class_table(ids: list[str], outputs: Any, classes: Sequence[str], version: str,
                top: np.ndarray | None = None, flags: Sequence[tuple[bool, int | None]] | None = None) -> pa.Table:
    """:func:`class_schema`'s table for ``outputs`` (one float32 [K] probability row per id). The label is the
    arg-max (ties go to the first class), or ``top`` (class indices) when given: K = 2 labels at the bundle's
    threshold, ``prob_<second class>`` being the binary probability and ``prob_<first>`` 1 minus it."""
    k = len(classes)
    probs = np.asarray(outputs, dtype=np.float32).reshape(len(ids), k)
    if top is None:
        top = probs.argmax(1) if len(ids) else np.zeros(0, np.int64)
    cols = {"row_id": pa.array(ids, pa.string()),
            "label": pa.array([classes[i] for i in top], pa.string()),
            "prob": pa.array(probs[np.arange(len(ids)), top], pa.float32()),
            **{f"prob_{c}": pa.array(probs[:, j], pa.float32()) for j, c in enumerate(classes)},
            "bundle_version": pa.array([version] * len(ids), pa.string()), **flag_columns(len(ids), flags)}
    return pa.table(cols, schema=class_schema(classes))
