"""ONNX Runtime as a reference engine for ``bench_label.py``: the same model, texts and batches, model time only.

The bundle's classifier (encoder and head; the lexicon adapter in its dense form, the form training runs: the sparse
form's distinct-word gather has data-dependent shapes) is exported with ``torch.onnx.export``, batch and length
dynamic, and run by an ``InferenceSession`` (all graph optimisations, ``threads`` intra-op threads, one inter-op
thread, threads that do not spin while they wait, as lexiflow's ``OMP_WAIT_POLICY=PASSIVE``: on a shared host both
engines then yield the cores alike) in fp32 and after ``onnxruntime.quantization.quantize_dynamic`` (int8 weights,
per-call dynamic activation ranges). Batches are built once from the featurised texts exactly as the labeller builds
them (:func:`tasks.inference.sentiment._batches`: one padded length per batch, at most ``CPU_BATCH_TOKENS``
tokens), so the timed loop of every engine runs the model on the same arrays and nothing else. lexiflow's engines run
a pass as the labeller does (:func:`tasks.inference.sentiment.map_batches`: on CPU, one batch per thread, each on one
torch thread); ORT runs it as ORT is used (one batch after another over its intra-op threads) and, for comparison, under
lexiflow's schedule too (``ort-*-threads``: one intra-op thread, one batch per Python thread).

Batch invariance (:func:`invariance_counts`): for each of ``n`` texts, its logit alone (a batch of one, padded to
its own length) against its logit as row 0 of a batch of 32 texts of that padded length; counted: the texts whose
float32 bits differ.
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np
import torch


def encoded_batches(bundle, texts: list[str], batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids [B,T] int64, word_ids [B,T,W] int64) per batch, as the CPU labeller batches ``texts``."""
    from tasks.inference.sentiment import CPU_BATCH_TOKENS, _batches, padded_lengths

    encs = bundle.featurizer.encode(texts)
    lengths = np.array([len(e.input_ids) for e in encs], dtype=np.int64)
    padded = padded_lengths(lengths, bundle.featurizer.max_len)
    W = encs[0].word_ids.shape[1]
    out = []
    for idx in _batches(padded, batch_size, CPU_BATCH_TOKENS):
        T = int(padded[idx[0]])
        ids = np.zeros((len(idx), T), dtype=np.int64)
        words = np.zeros((len(idx), T, W), dtype=np.int64)
        for r, i in enumerate(idx):
            ids[r, : lengths[i]] = encs[i].input_ids
            words[r, : lengths[i]] = encs[i].word_ids
        out.append((ids, words))
    return out


class TorchEngine:
    """A lexiflow scoring model (the row-invariant fp32 or int8 copy) behind the same calls as :class:`OrtEngine`:
    one batch, or a pass over batches scheduled as the labeller schedules them
    (:func:`tasks.inference.sentiment.map_batches`: on CPU one batch per thread, each on one torch thread)."""

    def __init__(self, model, in_turn: bool = False):
        self.model, self.in_turn = model, in_turn  # in_turn: one batch after another over torch's threads

    def __call__(self, ids: np.ndarray, words: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            i = torch.from_numpy(ids)
            return self.model(i, attention_mask=i != 0, word_ids=torch.from_numpy(words)).float().numpy()

    def run(self, batches: list) -> list[np.ndarray]:
        from tasks.inference.sentiment import map_batches

        if self.in_turn:
            return [self(ids, words) for ids, words in batches]
        out: list = [None] * len(batches)
        map_batches(self.model, lambda j: out.__setitem__(j, self(*batches[j])), range(len(batches)))
        return out


class _Dense(torch.nn.Module):
    """The classifier with its attention mask computed inside the graph: inputs are the ids and word ids."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, word_ids):
        return self.model(input_ids, attention_mask=input_ids != 0, word_ids=word_ids)


def export_onnx(model, path: str, sample: tuple[np.ndarray, np.ndarray]) -> None:
    """``model`` (a LebertClassifier, fp32, eval) as ONNX at ``path``, batch and length dynamic."""
    import copy

    m = copy.deepcopy(model).eval()
    if getattr(m.encoder, "adapter", None) is not None:
        m.encoder.adapter.sparse_inference = False
    ids, words = (torch.from_numpy(a) for a in sample)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Dense(m), (ids, words), path, input_names=["input_ids", "word_ids"],
                          output_names=["logits"], dynamo=False, opset_version=17,
                          dynamic_axes={"input_ids": {0: "batch", 1: "length"},
                                        "word_ids": {0: "batch", 1: "length"}, "logits": {0: "batch"}})


class OrtEngine:
    """An ONNX Runtime session of the exported model; ``int8``: its dynamically quantized copy."""

    def __init__(self, path: str, threads: int, spinning: bool = False):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
        self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    def __call__(self, ids: np.ndarray, words: np.ndarray) -> np.ndarray:
        return self.session.run(None, {"input_ids": ids, "word_ids": words})[0]

    def run(self, batches: list) -> list[np.ndarray]:
        """One batch after another, each over the session's intra-op threads (as ORT is used)."""
        return [self(ids, words) for ids, words in batches]


class OrtThreadsEngine(OrtEngine):
    """ORT under lexiflow's CPU schedule (:func:`tasks.inference.sentiment.map_batches`): a session of one intra-op
    thread and ``threads`` batches at once, one per Python thread (``InferenceSession.run`` is thread-safe and releases
    the GIL)."""

    def __init__(self, path: str, threads: int):
        super().__init__(path, 1)
        self.threads = threads

    def run(self, batches: list) -> list[np.ndarray]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(lambda b: self(*b), batches))


def ort_engines(model, sample, threads: int, tmp: str) -> dict[str, OrtEngine]:
    """``{"ort-fp32": ..., "ort-int8": ...}`` for ``model`` (``threads`` intra-op threads), and the same two
    under lexiflow's schedule (``"ort-fp32-threads"``, ``"ort-int8-threads"``: :class:`OrtThreadsEngine`), files
    under ``tmp``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32, int8 = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "model.int8.onnx")
    export_onnx(model, fp32, sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(fp32, int8, weight_type=QuantType.QInt8)
    return {"ort-fp32": OrtEngine(fp32, threads), "ort-int8": OrtEngine(int8, threads),
            "ort-fp32-threads": OrtThreadsEngine(fp32, threads), "ort-int8-threads": OrtThreadsEngine(int8, threads)}


def time_engines(engines: dict, batches: list, repeats: int) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """Seconds per pass over ``batches`` for each engine (``repeats`` passes, the order alternating), and each
    engine's logits of the last pass."""
    for fn in engines.values():  # one untimed pass: ORT sets up each new input shape on its first run
        fn.run(batches)
    times: dict[str, list[float]] = {k: [] for k in engines}
    out: dict[str, np.ndarray] = {}
    for r in range(repeats):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            fn = engines[name]
            t0 = time.perf_counter()
            logits = fn.run(batches)
            times[name].append(time.perf_counter() - t0)
            out[name] = np.concatenate([z.reshape(-1) for z in logits])
    return times, out


def invariance_counts(engines: dict, batches: list, n: int = 50, batch: int = 32) -> dict[str, int]:
    """Per engine: of ``n`` texts, how many get other float32 bits alone than as row 0 of a batch of ``batch``
    texts of the same padded length (the others drawn from the same batches, repeated where too few)."""
    by_len: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    for ids, words in batches:
        for r in range(ids.shape[0]):
            by_len.setdefault(ids.shape[1], []).append((ids[r], words[r]))
    rows = [(T, i) for T, rs in sorted(by_len.items()) for i in range(len(rs))]
    pick = [rows[j] for j in np.linspace(0, len(rows) - 1, min(n, len(rows))).astype(int)]
    counts = {}
    for name, fn in engines.items():
        differ = 0
        for T, i in pick:
            rs = by_len[T]
            mates = [rs[(i + j) % len(rs)] for j in range(batch)]
            ids = np.stack([a for a, _ in mates])
            words = np.stack([w for _, w in mates])
            alone = np.asarray(fn(ids[:1], words[:1])).reshape(-1)[0]
            inside = np.asarray(fn(ids, words)).reshape(-1)[0]
            differ += int(np.float32(alone).tobytes() != np.float32(inside).tobytes())
        counts[name] = differ
    return counts
