"""CPU cost of starting from a published checkpoint, on a random model of bert-base-chinese's shape (12 x 768, 12
heads, FFN 3072, vocabulary 21,128, learned positions): write the checkpoint (model.safetensors), import it
(read + map + copy, :mod:`tasks.pretrain.import_hf`), then time a few continued-pretraining steps (MLM + NSP, the
lexicon adapter after layer 1, AdamW) on random ids. Offline; the weights are random, so only time is measured.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_import.py --steps 3 --batch 8 --seq 128 --threads 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--words", type=int, default=20000, help="lexicon words (adapter table rows)")
    args = ap.parse_args()

    import models.numerics  # noqa: F401,I001  (kernel pins before NumPy and torch load, as the CLI)
    import numpy as np
    import torch
    from transformers import BertConfig, BertForPreTraining

    from tasks.pretrain.config import PretrainConfig
    from tasks.pretrain import import_hf
    from tasks.training.loop import make_adamw
    from tasks.pretrain.train import build_model

    torch.set_num_threads(args.threads)
    tokens = ["[PAD]", *(f"[unused{i}]" for i in range(1, 100)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += [chr(0x4E00 + i) for i in range(21128 - len(tokens))]
    shape = dict(hidden_size=768, num_layers=12, num_heads=12, ffn_size=3072, max_len=512, position="learned",
                 activation="gelu", hidden_dropout=0.1, attention_dropout=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp)
        hf = BertForPreTraining(BertConfig(vocab_size=len(tokens)))
        hf.save_pretrained(ckpt)
        (ckpt / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
        del hf
        cfg = PretrainConfig(init_from=str(ckpt), model=shape, threads=args.threads, device="cpu")
        wv = np.random.default_rng(0).uniform(-0.1, 0.1, (args.words, 200)).astype(np.float32)
        t0 = time.perf_counter()
        model = build_model(cfg, len(tokens), wv, 3, import_hf.read_checkpoint(str(ckpt)))
        import_s = time.perf_counter() - t0
    opt = make_adamw(model, 5e-5, 0.01, (0.9, 0.98))
    g = torch.Generator().manual_seed(0)
    B, T = args.batch, args.seq
    ids = torch.randint(104, len(tokens), (B, T), generator=g)
    seg = (torch.arange(T) >= T // 2).long().expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool)
    words = torch.randint(0, args.words, (B, T, 3), generator=g)
    pos = torch.randperm(B * T, generator=g)[: int(0.15 * B * T)].sort().values
    labels = torch.randint(104, len(tokens), (len(pos),), generator=g)
    nsp = torch.randint(0, 2, (B,), generator=g)
    model.train()
    times = []
    for _ in range(args.steps + 1):  # the first step warms up (allocations) and is not counted
        t = time.perf_counter()
        out = model(ids, seg, mask, words, pos, labels, nsp)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    step_s = float(np.median(times[1:]))
    print(json.dumps({"params": model.num_params(), "import_s": round(import_s, 2), "step_s": round(step_s, 2),
                      "steps_per_s": round(1 / step_s, 3), "tokens_per_s": round(B * T / step_s, 1),
                      "batch": B, "seq": T, "threads": args.threads, "steps_timed": args.steps}))


if __name__ == "__main__":
    main()
