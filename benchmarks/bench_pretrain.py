"""Benchmark: pretraining throughput, LebertForPretraining vs HF transformers BertForPreTraining.

Same size (default: the seed model, 6 x 384, 12 heads, FFN 1536, dropout 0.1), vocabulary,
batches and SDPA attention for both. The shapes are the corpus's: each sequence's real length is drawn from the
pretraining pairs' length distribution (``--lengths corpus``, the default: the demo store's matched shards, or
``--lexicon``'s; synthetic rows with the demo's sentence lengths without a store; cut at T as pretraining cuts
them), ``[CLS] ... [SEP]`` then padding to T, segment 1 on its second half, ~15% of its inner tokens masked, a random
NSP label (``--lengths uniform``: uniform in [T/2, T], the old synthetic shape). Every model sees the same batches.

``--packed``: the GPU profiles' shape instead: ``--batch`` rows of T tokens packed with whole pairs of the corpus
(``pretrain.data.packing: pairs``, at most ``--pairs-per-row`` a row, the pipeline's own packing and masking,
``benchmarks/_pairs.py``) for our models (attention within each pair, positions restarting per pair, NSP from each
pair's [CLS]), and exactly the same pairs with the same masks, one a row padded to the batch's longest, for HF.
MFU counts attention over each pair's length (sum l^2 / sum l), never over the padded or packed row.

* ``ours``: adapter OFF (``use_adapter=False``): the apples-to-apples model. Its MLM head
  projects the masked positions only (``mlm_positions`` = flat indices into B*T).
* ``hf``: ``BertForPreTraining`` with ``_attn_implementation="sdpa"`` (checked by counting
  ``F.scaled_dot_product_attention`` calls); its MLM head projects all B*T positions
  (labels -100 except at masked positions).
* ``ours+adapter``: adapter ON (30000 words x 200, W=3 random word ids): the model the profiles train.
* ``loop`` (the "pipeline loop" rows, ``--loop``, default on): the pretraining stage's own loop,
  ``tasks.pretrain.train.train``, on the ours+adapter model at the same B, T and size: its AdamW groups
  (``make_adamw``, fused on CUDA), gradient clipping, the LR schedule, length buckets when compiled, the background
  loader over packed pairs, word ids for the adapter, held-out evaluation at the last row. Its rows are
  ``--lexicon``'s matched shards when given, else toy rows built here (demo-like sentence lengths and words).
  It runs ``--repeats + 1`` log windows of ``--steps`` steps; the first (the warm-up and any compilation) is left
  out, and the medians of the others are reported, as the stage reports them: tokens/s and MFU over the time spent
  in steps (compute only) and over the wall time (data wait and evaluation included). ``loop_vs_bench`` is the loop's
  compute-only tokens/s over ours+adapter's.

A step is forward + backward + AdamW step. ``--warmup`` steps (at least 2) per model are untimed; then
``--repeats`` rounds of ``--steps`` timed steps, the model order rotating every round. Reported:
median real (non-padding) tokens/s and peak memory (GPU: ``max_memory_allocated``; CPU: peak
RSS growth over the last warm-up step, sampled every 2 ms). On GPU both run under bf16
autocast, and MFU (ours and ours+adapter) = real tokens/s * flops_per_token(t, 0.15) / dense bf16 peak, t the
attention length over the timed batches' pairs (sum l^2 / sum l: a token attends over its own pair). Each
model's first step is timed apart (``first step s``; with ``--compile`` it holds the compilation).
On CPU, ``--numerics-ab`` (default on) runs the whole bench again in a child process with the CPU kernels unpinned
(``LEXIFLOW_NUMERICS=native``) and prints pinned/unpinned tokens/s per model: what ``models.numerics`` costs.
The last line printed is ``ratio tokens_per_s ours/hf=<x>x``.

    python benchmarks/bench_pretrain.py [--device auto] [--batch 32] [--seq-len 128] [--vocab 21128]
                                        [--warmup 2] [--steps 8] [--repeats 3]
    python benchmarks/bench_pretrain.py --steps 2 --repeats 1      # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import threading
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models.numerics  # noqa: E402,F401,I001  (pins the CPU kernels before NumPy and torch load, as the CLI)

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import BertConfig, BertForPreTraining  # noqa: E402

from models import LebertForPretraining, ModelConfig  # noqa: E402
from models.bert import Unpadded, jagged_enabled  # noqa: E402
from tasks.inference.runtime import default_device  # noqa: E402

from _pairs import attention_len, corpus_pairs, mlm_labels_dense, same_pairs  # noqa: E402

PAD, CLS, SEP, MASK, FIRST_CHAR = 0, 2, 3, 4, 5
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s


def make_batches(n, B, T, V, word_vocab, W, mask_frac, seed, device, pool=None):
    """n batches as dicts of tensors (shared by all models); each row's real length drawn from ``pool`` (the
    corpus's pair lengths, int64 [N], each <= T), or uniform in [T/2, T] without one."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        if pool is None:
            lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
        else:
            lengths = torch.from_numpy(pool)[torch.randint(0, len(pool), (B,), generator=g)].clamp(3, T)
        pos = torch.arange(T)[None, :]
        real = pos < lengths[:, None]  # [B,T]
        ids = torch.randint(FIRST_CHAR, V, (B, T), generator=g)
        ids[:, 0] = CLS
        ids[torch.arange(B), lengths - 1] = SEP
        ids[~real] = PAD
        segment = ((pos >= (lengths[:, None] // 2)) & real).long()
        inner = real & (pos > 0) & (pos < lengths[:, None] - 1)
        masked = inner & (torch.rand(B, T, generator=g) < mask_frac)
        labels = torch.full((B, T), -100, dtype=torch.long)
        labels[masked] = ids[masked]
        ids = ids.masked_fill(masked, MASK)
        words = torch.randint(0, word_vocab, (B, T, W), generator=g) * real[..., None]
        b = dict(ids=ids, segment=segment, mask=real.long(), labels=labels,
                 positions=masked.reshape(-1).nonzero().squeeze(1), mlm_labels=labels[masked],
                 nsp=torch.randint(0, 2, (B,), generator=g), words=words)
        b = {k: v.to(device) for k, v in b.items()}
        b["real_tokens"] = int(lengths.sum())
        b["attn_len"] = attention_len(lengths.numpy())
        # the batch's real tokens found on the host, as the pipeline loop finds them (tasks.pretrain.train
        # .padding_hint): our model then never reads the device to route its attention (CUDA only)
        b["unpadded"] = Unpadded.of(real).to(torch.device(device)) if b["real_tokens"] < B * T else None
        b["hf"] = b  # HF runs the same padded rows
        batches.append(b)
    return batches


def packed_batches(pairs, n, R, T, P, device):
    """n batches of the corpus's pairs: ours, ``R`` packed rows of ``T`` tokens (``P`` pair slots a row); ``hf``,
    the same pairs with the same masks one a row, padded to the batch's longest (``_pairs.same_pairs``)."""
    out = []
    for packed, one in same_pairs(pairs, T, R, P, n):
        p, u = packed.parts(), one.parts()
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        lens = u["attention_mask"].sum(1)
        b = dict(ids=t(p["input_ids"]), segment=t(p["segment_ids"]), mask=t(p["attention_mask"]),
                 positions=t(p["mlm_positions"]), mlm_labels=t(p["mlm_labels"]), nsp=t(p["nsp_labels"]),
                 words=t(p["word_ids"]), position_ids=t(p["position_ids"]), pair_ids=t(p["pair_ids"]),
                 cls_positions=t(p["cls_positions"]), unpadded=None, real_tokens=packed.n_real_tokens,
                 attn_len=attention_len(lens))
        b["hf"] = dict(ids=t(u["input_ids"]), segment=t(u["segment_ids"]), mask=t(u["attention_mask"]),
                       labels=t(mlm_labels_dense(one)), nsp=t(u["nsp_labels"]))
        out.append(b)
    return out


def padding_hint(b, static):
    """What our model is told about ``b``'s padding, as the pipeline loop tells it: False without padding; True
    (the masked kernel) in a compiled step or where jagged attention is off; else the real tokens."""
    if b["unpadded"] is None:
        return False
    return True if static or not jagged_enabled() else b["unpadded"]


def ours_loss(model, b, with_words, static=False):
    if "pair_ids" in b:  # packed rows: attention within each pair (the model's block-diagonal mask)
        extra = dict(position_ids=b["position_ids"], pair_ids=b["pair_ids"], cls_positions=b["cls_positions"])
    else:
        extra = dict(padded=padding_hint(b, static))
    return model(b["ids"], b["segment"], b["mask"], b["words"] if with_words else None,
                 b["positions"], b["mlm_labels"], b["nsp"], **extra).loss


def hf_loss(model, b):
    b = b["hf"]
    return model(input_ids=b["ids"], token_type_ids=b["segment"], attention_mask=b["mask"],
                 labels=b["labels"], next_sentence_label=b["nsp"]).loss


def rss_growth(fn):
    """Run fn(); return its peak RSS growth in bytes (sampled every 2 ms by a thread)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the baseline is low
    proc, done, peak = psutil.Process(), threading.Event(), [0]
    base = proc.memory_info().rss

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], proc.memory_info().rss - base)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    fn()
    done.set()
    thread.join()
    return max(peak[0], proc.memory_info().rss - base)


def count_sdpa_calls(fn):
    """Run fn(); return how many times torch.nn.functional.scaled_dot_product_attention was called."""
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as m:
        fn()
    return m.call_count


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto = cuda if available, else cpu")
    for flag, typ, default in [("--batch", int, 32), ("--seq-len", int, 128), ("--vocab", int, 21128),
                               ("--hidden", int, 384), ("--layers", int, 6), ("--heads", int, 12),
                               ("--ffn", int, 1536), ("--dropout", float, 0.1), ("--warmup", int, 2),
                               ("--steps", int, 8), ("--repeats", int, 3), ("--seed", int, 0)]:
        ap.add_argument(flag, type=typ, default=default)
    ap.add_argument("--numerics-ab", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the bench unpinned (LEXIFLOW_NUMERICS=native) in a child process (CPU)")
    ap.add_argument("--rates-json", action="store_true", help=argparse.SUPPRESS)  # the child's output
    ap.add_argument("--results", help="also write the figures as JSON here (e.g. docs/results/bench_pretrain.json)")
    ap.add_argument("--compile", action="store_true", help="torch.compile every model (inductor; the GPU profile's "
                    "setting): the warm-up steps include the compilation")
    ap.add_argument("--compile-backend", default="inductor", help="with --compile: inductor, or aot_eager (the CPU "
                    "dry run: the same graphs unfused, without minutes of C++ builds)")
    ap.add_argument("--loader", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure the packed loader's tokens/s at this shape")
    ap.add_argument("--loop", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the pipeline loop rows (the stage's own training loop at this shape)")
    ap.add_argument("--lexicon", help="a lexicon artifact whose matched shards give the pairs' lengths (and, with "
                    "--loop, the loop's rows; default: the demo store's newest, else synthetic demo-like rows)")
    ap.add_argument("--lengths", choices=("corpus", "uniform"), default="corpus",
                    help="real lengths drawn from the corpus's pair lengths (default), or uniform in [T/2, T]")
    ap.add_argument("--packed", action="store_true", help="the GPU profiles' packed rows for ours (--batch rows), "
                    "the same pairs one a row padded for HF")
    ap.add_argument("--pairs-per-row", type=int, default=16, help="with --packed: pair slots a row")
    args = ap.parse_args()

    device = torch.device(default_device() if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    V, H, L, A, Fd, p, T, B = (args.vocab, args.hidden, args.layers, args.heads, args.ffn, args.dropout,
                               args.seq_len, args.batch)
    WV, WD, W = 30000, 200, 3

    pairs = corpus_pairs(T, args.lexicon) if (args.packed or args.lengths == "corpus") else None
    if pairs is not None:
        V = max(V, pairs.V)  # the corpus's token ids must fit the vocabulary
    if args.packed:
        batches = packed_batches(pairs, args.warmup + args.steps, B, T, args.pairs_per_row, device)
        W = pairs.W  # the corpus's word slots and ids
        WV = max(WV, 1 + max(int(b["words"].max()) for b in batches))
        shape = (f"{B} packed rows x {T} tokens of the corpus's pairs ({_rel(pairs.source)}), "
                 f"<= {args.pairs_per_row} pairs a row; HF: the same pairs one a row, padded to the batch's longest")
    else:
        batches = make_batches(args.warmup + args.steps, B, T, V, WV, W, 0.15, args.seed, device,
                               pairs.lengths if pairs is not None else None)
        shape = (f"{B} rows x {T} tokens, one pair a row padded to T; real lengths "
                 + (f"of the corpus's pairs ({_rel(pairs.source)})" if pairs is not None else "uniform in [T/2, T]"))
    base = dict(vocab_size=V, hidden_size=H, num_layers=L, num_heads=A, ffn_size=Fd, activation="gelu",
                hidden_dropout=p, attention_dropout=p)
    ours = LebertForPretraining(ModelConfig(**base, use_adapter=False)).to(device)
    ours_ad = LebertForPretraining(ModelConfig(**base, use_adapter=True, word_vocab_size=WV, word_dim=WD,
                                               max_word_num=W)).to(device)
    hcfg = BertConfig(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=A,
                      intermediate_size=Fd, hidden_act="gelu", hidden_dropout_prob=p,
                      attention_probs_dropout_prob=p, max_position_embeddings=512, type_vocab_size=2)
    hcfg._attn_implementation = "sdpa"
    hf = BertForPreTraining(hcfg).to(device)
    for m in (ours, ours_ad, hf):
        m.train()
    assert hf.config._attn_implementation == "sdpa", hf.config._attn_implementation

    run = {m: (torch.compile(m, backend=args.compile_backend) if args.compile else m)  # what the steps call
           for m in (ours, hf, ours_ad)}
    models = {  # name -> (module, loss fn)
        "ours": (ours, lambda b: ours_loss(run[ours], b, False, args.compile)),
        "hf": (hf, lambda b: hf_loss(run[hf], b)),
        "ours+adapter": (ours_ad, lambda b: ours_loss(run[ours_ad], b, True, args.compile)),
    }
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4) for n, (m, _) in models.items()}
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(name, b):
        (_, loss_fn), opt = models[name], opts[name]
        with autocast():
            loss = loss_fn(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    first_step: dict[str, float] = {}  # seconds of each model's first step (with --compile: the compilation)

    def first(n, fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        first_step[n] = time.perf_counter() - t0
        return out

    if args.compile:  # compiled graphs call the fused kernels, not the Python function: nothing to count
        sdpa = {n: first(n, lambda n=n: step(n, batches[0])) or "compiled" for n in models}
    else:
        sdpa = {n: first(n, lambda n=n: count_sdpa_calls(lambda: step(n, batches[0]))) for n in models}
        # L per forward; one more where a jagged call failed and fell back to the masked kernel (CUDA, logged)
        assert all(c in (L, L + 1) for c in sdpa.values()), f"SDPA calls per forward: {sdpa} (expected {L})"
    # rest of the warm-up; its last step (optimizer state already allocated) measures peak memory
    mem, warm = {}, max(args.warmup, 2)
    for n in models:
        for i in range(1, warm - 1):
            step(n, batches[i % len(batches)])
        last = lambda n=n: step(n, batches[(warm - 1) % len(batches)])  # noqa: E731
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            last()
            mem[n] = torch.cuda.max_memory_allocated()
        else:
            mem[n] = rss_growth(last)

    timed = batches[args.warmup:] or batches
    real_tokens = sum(timed[i % len(timed)]["real_tokens"] for i in range(args.steps))
    attn_len = sum(timed[i % len(timed)]["real_tokens"] * timed[i % len(timed)]["attn_len"]
                   for i in range(args.steps)) / max(real_tokens, 1)  # sum l^2 / sum l over the timed pairs
    rates = {n: [] for n in models}
    names = list(models)
    for r in range(args.repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            sync()
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(n, timed[i % len(timed)])
            sync()
            rates[n].append(real_tokens / (time.perf_counter() - t0))

    med = {n: statistics.median(v) for n, v in rates.items()}
    if args.rates_json:
        print(json.dumps(med))
        return
    loop = None
    if args.loop:  # the pipeline loop rows: the stage's own loop at this shape
        gc.collect()  # it builds its own model
        if cuda:
            torch.cuda.empty_cache()
        loop = pipeline_loop(args, device, base, WV, WD, W)
        loop["loop_vs_bench"] = (round(loop["tokens_per_s"] / med["ours+adapter"], 3)
                                 if loop["tokens_per_s"] else None)
    mem_kind = "max_memory_allocated" if cuda else "RSS growth over one step"
    print(f"{'model':<14}{'params':>10}{'tokens/s':>12}{'min':>10}{'max':>10}{'peak MiB':>10}"
          "   (real tokens/s, median)")
    for n, (m, _) in models.items():
        nparams = sum(q.numel() for q in m.parameters())
        print(f"{n:<14}{nparams / 1e6:>9.2f}M{med[n]:>12.0f}{min(rates[n]):>10.0f}{max(rates[n]):>10.0f}"
              f"{mem[n] / 2**20:>10.1f}")
    if loop is not None:  # the pipeline loop rows (min/max over its timed log windows; memory not measured)
        nparams = sum(q.numel() for q in ours_ad.parameters())
        for n, key in (("loop", "tokens_per_s"), ("loop (wall)", "wall_tokens_per_s")):
            print(f"{n:<14}{nparams / 1e6:>9.2f}M{loop[key] or 0:>12.0f}{loop[key + '_min'] or 0:>10.0f}"
                  f"{loop[key + '_max'] or 0:>10.0f}{'n/a':>10}")
    dev = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(f"device {dev}; torch {torch.__version__}; transformers {transformers.__version__}; "
          f"B={B} T={T} V={V} H={H} L={L} A={A} F={Fd}; real tokens/batch ~{real_tokens / args.steps:.0f}; "
          f"warmup {warm}, steps {args.steps}, repeats {args.repeats}; "
          f"{'bf16 autocast' if cuda else 'fp32'}{'; torch.compile' if args.compile else ''}; "
          f"hf attn={hf.config._attn_implementation} (SDPA calls/fwd {sdpa}); "
          f"peak MiB = {mem_kind}")
    print(f"batches: {shape}; attention counted over the pairs' lengths (sum l^2 / sum l = {attn_len:.0f})")
    print(f"adapter on/off tokens/s = {med['ours+adapter'] / med['ours']:.2f}")
    if loop is not None:
        print(f"pipeline loop: the stage's own loop (tasks.pretrain.train) on ours+adapter, {loop['rows']}; "
              f"MFU {_pct(loop['mfu'])} in steps, {_pct(loop['wall_mfu'])} over the wall time; "
              f"loop/bench (ours+adapter) tokens/s = {loop['loop_vs_bench']}")
    loader_rate = loader_tokens_per_s(B, T, V) if args.loader else None
    if loader_rate is not None:
        print(f"loader (tasks.pretrain.packed, one thread, batch {B}, {T}-token pairs, synthetic demo-like rows): "
              f"{loader_rate:,.0f} real tokens/s = {loader_rate / med['ours+adapter']:.1f}x what ours+adapter "
              "consumes here")
    # MFU of our two models (real, non-padding tokens only: padding is computed but not counted); None off a
    # known GPU. HF's MLM head projects every position, so the same formula would not count its work.
    peak = next((v for k, v in PEAK_BF16.items() if k in dev), None) if cuda else None
    mfu = {n: (med[n] * m.flops_per_token(attn_len, 0.15) / peak if peak else None)
           for n, m in (("ours", ours), ("ours+adapter", ours_ad))}
    if cuda:
        print("mfu " + " ".join(f"{n}={v:.3f}" if v is not None else f"{n}=n/a (unknown GPU peak)"
                                for n, v in mfu.items()))
        print("peak memory " + " ".join(f"{n}={mem[n] / 2**20:.0f}MiB" for n in models))
    print("first step s " + " ".join(f"{n}={v:.2f}" for n, v in first_step.items()))
    from _numerics_ab import ratio_line, run_unpinned, write_results

    figures = {"tokens_per_s": med, "loader_tokens_per_s": round(loader_rate) if loader_rate is not None else None,
               "peak_mib": {n: mem[n] / 2**20 for n in models}, "device": dev, "mfu": mfu,
               "first_step_s": first_step, "compile": args.compile, "real_tokens_per_batch": real_tokens / args.steps,
               "shape": {"B": B, "T": T, "V": V, "H": H, "L": L, "A": A, "F": Fd}, "loop": loop,
               "batches": shape, "packed": args.packed, "lengths": "corpus" if pairs is not None else "uniform",
               "attention_len": round(attn_len, 1), "pairs_source": _rel(pairs.source) if pairs is not None else None,
               "loop_mfu": loop["mfu"] if loop else None, "loop_wall_mfu": loop["wall_mfu"] if loop else None,
               "loop_vs_bench": loop["loop_vs_bench"] if loop else None}
    if args.numerics_ab and not cuda:
        native = run_unpinned(__file__, sys.argv[1:])
        figures["unpinned_tokens_per_s"] = native
        print(ratio_line(med, native))
    line = f"ratio tokens_per_s ours/hf={med['ours'] / med['hf']:.2f}x"
    write_results(args.results, "bench_pretrain", {**figures, "last_line": line})
    print(line)


def _rel(source: str) -> str:
    from _numerics_ab import repo_relative

    return repo_relative(source)


def _pct(v: float | None) -> str:
    return "n/a (CPU or unknown GPU peak)" if v is None else f"{v:.1%}"


def toy_rows(n_docs: int, V: int, word_vocab: int, W: int, seed: int = 0) -> list[dict]:
    """Matched rows shaped like the demo's (``bench_loader.synthetic_rows``), ids within V and word_vocab."""
    from bench_loader import synthetic_rows

    return synthetic_rows(n_docs, seed, W, V, word_vocab)


def pipeline_loop(args, device: torch.device, base: dict, WV: int, WD: int, W: int) -> dict:
    """The pretraining stage's own loop (``tasks.pretrain.train.train``, no Prefect) on the ours+adapter model at
    this bench's B, T and size: ``--repeats + 1`` log windows of ``--steps`` steps, the first left out; the medians
    of the other rows' tokens/s and MFU (compute only and over the wall time), the loop's own figures."""
    from tasks.pretrain.config import PretrainConfig
    from tasks.pretrain.train import train
    from tasks.training.progress import to_stderr

    to_stderr()  # the loop's progress rows on this process's stderr, as a torchrun rank's (nothing else set logging)
    B, T = args.batch, args.seq_len
    if args.lexicon:
        from storage.artifacts import open_artifact
        from tasks.pretrain.stage import lexicon_inputs, rows_from_artifact

        vocab, vectors, W = lexicon_inputs(open_artifact(args.lexicon))
        rows_factory, where = rows_from_artifact(args.lexicon), f"matched shards of {args.lexicon}"
    else:
        from tasks.pretrain.data import rows_of

        vocab = base["vocab_size"]
        vectors = np.random.default_rng(args.seed).normal(0, 0.1, (WV, WD)).astype(np.float32)
        n_docs = max(100, 16 * B * T // 500)  # about 16 batches of pairs an epoch (a document is ~500 characters)
        rows_factory, where = rows_of(toy_rows(n_docs, vocab, WV, W, args.seed)), f"toy rows of {n_docs} documents"
    windows = args.repeats + 1
    steps = args.steps * windows
    model = {k: base[k] for k in ("hidden_size", "num_layers", "num_heads", "ffn_size")}
    cfg = PretrainConfig.model_validate({
        "model": {**model, "hidden_dropout": base["hidden_dropout"], "attention_dropout": base["attention_dropout"],
                  "max_len": max(T, 128), "use_adapter": True},
        "data": {"max_seq_len": T, "batch_size": B,
                 **({"packing": "pairs", "pairs_per_row": args.pairs_per_row} if args.packed else {})},
        "steps": steps, "warmup_steps": max(1, steps // 10), "log_every": args.steps, "eval_every": steps,
        "checkpoint_every": steps, "seed": args.seed, "device": device.type, "compile": args.compile,
        "compile_backend": args.compile_backend, "threads": torch.get_num_threads()})
    got: dict = {}
    t = time.perf_counter()
    _, log = train(cfg, rows_factory, vocab, vectors, W, progress=False, on_data=got.update)
    wall = time.perf_counter() - t
    timed = log[1:] or log

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    def extreme(key: str, pick) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return pick(values) if values else None

    return {"rows": where, "steps": steps, "windows": len(log), "timed_windows": len(timed),
            "tokens_per_s": median("tokens_per_s"), "wall_tokens_per_s": median("wall_tokens_per_s"),
            "tokens_per_s_min": extreme("tokens_per_s", min), "tokens_per_s_max": extreme("tokens_per_s", max),
            "wall_tokens_per_s_min": extreme("wall_tokens_per_s", min),
            "wall_tokens_per_s_max": extreme("wall_tokens_per_s", max),
            "mfu": median("mfu"), "wall_mfu": median("wall_mfu"), "data_wait": median("data_wait"),
            "first_step_s": got.get("first_step_s"), "stage": got.get("throughput"), "wall_s": round(wall, 2),
            "compile": args.compile, "buckets": cfg.compile_buckets if args.compile else None}


def loader_tokens_per_s(B: int, T: int, V: int) -> float:
    """Real tokens/s the packed loader delivers (one background thread) at this bench's batch shape, on synthetic
    rows shaped like the demo's (``bench_loader.synthetic_rows``); the median of 3 passes over one epoch."""
    import tempfile

    from bench_loader import synthetic_rows

    from tasks.pretrain.config import PretrainDataConfig
    from tasks.pretrain.packed import PackedBatches, Schedule, loader, pack_rows

    cfg = PretrainDataConfig(max_seq_len=T, batch_size=B, heldout_frac=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        pack_rows(synthetic_rows(n_docs=1000), cfg, 3, tmp)
        data = PackedBatches(tmp, cfg, V)
        n = data.per_epoch()
        rates = []
        for _ in range(3):
            t = time.perf_counter()
            tokens = sum(b.to("cpu").n_real_tokens for _, b in loader(data, Schedule(0, 0, n, n), 1, 4, False))
            rates.append(tokens / (time.perf_counter() - t))
    return statistics.median(rates)


if __name__ == "__main__":
    main()
