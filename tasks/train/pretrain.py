"""pretrain: MLM + NSP with whole-word masking on the matched shards -> BERT checkpoint (safetensors).

The trainer is a plain function over (config, artifacts, checkpoint dir). Resuming is exact:
model, optimizer, scheduler, torch/numpy RNG and the data position (epoch, batch) are restored,
and the data stream is a pure function of (seed, epoch), so skipping k batches replays it exactly.

Throughput counts real tokens only (no padding). On CUDA, MFU = achieved FLOP/s / peak, with
FLOPs per token = 6·N (N = non-embedding params) + 12·L·d·T (attention scores and values, fwd+bwd)
+ 6·mask_fraction·(H·V + H·H) (the sparse MLM head projects only masked positions).
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from models import LebertForPretraining, ModelConfig
from tasks.common.config import PretrainConfig
from tasks.train.pretrain_data import iter_batches, iter_rows

CODE_VERSION = "pretrain-1"
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


def lr_lambda(cfg: PretrainConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / max(1, cfg.warmup_steps)
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        frac = min(max(frac, 0.0), 1.0)
        return 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac

    return f


def build_model(cfg: PretrainConfig, vocab_size: int, word_vectors: np.ndarray | None, max_word_num: int) -> LebertForPretraining:
    m = cfg.model
    mc = ModelConfig(
        vocab_size=vocab_size,
        word_vocab_size=int(word_vectors.shape[0]) if (m.use_adapter and word_vectors is not None) else 0,
        word_dim=int(word_vectors.shape[1]) if word_vectors is not None else 200,
        max_word_num=max_word_num,
        **m.model_dump(exclude={"freeze_word_vectors"}),
    )
    model = LebertForPretraining(mc)
    if m.use_adapter and word_vectors is not None:
        model.load_word_vectors(torch.from_numpy(np.ascontiguousarray(word_vectors, dtype=np.float32)), freeze=m.freeze_word_vectors)
    return model


def make_optimizer(model: torch.nn.Module, cfg: PretrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on biases, LayerNorm weights and embeddings' padding rows."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=False)


def resolve_device(cfg: PretrainConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(fs, dir_path: str, model, opt, sched, state: TrainState) -> None:
    """Weights as safetensors; optimizer/scheduler/RNG via torch.save (loaded weights_only)."""
    from safetensors.torch import save as st_save

    blob = io.BytesIO()
    torch.save(
        {
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "state": state.__dict__,
        },
        blob,
    )
    fs.makedirs(dir_path, exist_ok=True)
    for name, data in (("model.safetensors", st_save(_state_dict(model))), ("trainer.pt", blob.getvalue())):
        tmp = f"{dir_path}/{name}.tmp"
        with fs.open(tmp, "wb") as f:
            f.write(data)
        fs.mv(tmp, f"{dir_path}/{name}")
    with fs.open(f"{dir_path}/state.json", "w") as f:  # written last: marks a complete checkpoint
        json.dump(state.__dict__, f)


def load_checkpoint(fs, dir_path: str, model, opt, sched) -> TrainState | None:
    from safetensors.torch import load as st_load

    if not fs.exists(f"{dir_path}/state.json"):
        return None
    with fs.open(f"{dir_path}/model.safetensors", "rb") as f:
        sd = st_load(f.read())
    _unwrap(model).load_state_dict(sd, strict=False)
    with fs.open(f"{dir_path}/trainer.pt", "rb") as f:
        ck = torch.load(io.BytesIO(f.read()), weights_only=True)
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    torch.set_rng_state(ck["torch_rng"])
    if ck["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ck["cuda_rng"])
    return TrainState(**ck["state"])


def _unwrap(model):
    return getattr(model, "module", getattr(model, "_orig_mod", model))


def _state_dict(model) -> dict[str, torch.Tensor]:
    """Contiguous tensors; tied weights stored once (safetensors refuses shared storage)."""
    sd = _unwrap(model).state_dict()
    seen: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        ptr = v.data_ptr()
        if ptr in seen and v.numel() > 0:
            continue
        seen[ptr] = k
        out[k] = v.detach().contiguous().cpu()
    return out


# ----------------------------------------------------------------------------- training loop


def train(
    cfg: PretrainConfig,
    rows_factory: Callable[[], Any],
    vocab_size: int,
    word_vectors: np.ndarray | None,
    max_word_num: int,
    ckpt_fs=None,
    ckpt_dir: str | None = None,
    stop_at: int | None = None,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
) -> tuple[LebertForPretraining, list[dict[str, Any]]]:
    """Train for ``cfg.steps`` (or until ``stop_at``), resuming from ``ckpt_dir`` when it holds one.

    ``rows_factory()`` returns a fresh iterator over the matched rows (one epoch).
    Returns the model and the log rows (one per ``log_every`` steps).
    """
    from tqdm.auto import tqdm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg)
    model = build_model(cfg, vocab_size, word_vectors, max_word_num).to(device)
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    state = TrainState()
    if ckpt_dir is not None:
        state = load_checkpoint(ckpt_fs, ckpt_dir, model, opt, sched) or state
    rank, world = dist_info()
    fwd = model
    if world > 1:  # DDP under torchrun: every rank sees the same stream and takes every world-th batch
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    fwd = torch.compile(fwd) if cfg.compile else fwd
    if rank != 0:
        progress, on_log, ckpt_dir = False, None, None
    use_bf16 = device.type == "cuda"
    peak = peak_flops(device)
    flops_tok = None
    log: list[dict[str, Any]] = []
    end = min(cfg.steps, stop_at) if stop_at else cfg.steps
    bar = tqdm(total=end, initial=state.step, desc="pretrain", unit="step", disable=not progress, mininterval=2)
    acc = _Window()
    model.train()
    while state.step < end:
        batches = iter_batches(rows_factory(), cfg.data, vocab_size, max_word_num, state.epoch, start_batch=state.batch_in_epoch)
        for group in _groups(batches, world):  # one batch per rank; a short final group is dropped by all
            if state.step >= end:
                break
            batch = group[rank]
            t0 = time.perf_counter()
            b = batch.to(device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=use_bf16):
                out = fwd(b.input_ids, b.segment_ids, b.attention_mask, b.word_ids if cfg.model.use_adapter else None, b.mlm_positions, b.mlm_labels, b.nsp_labels)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            state.step += 1
            state.batch_in_epoch += world
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            acc.add(out, b, dt, float(gnorm))
            if flops_tok is None:
                flops_tok = _unwrap(model).flops_per_token(b.input_ids.shape[1], cfg.data.mask_prob)
            bar.update(1)
            if state.step % cfg.log_every == 0 or state.step == end:
                row = acc.flush(state, sched.get_last_lr()[0], flops_tok, peak)
                log.append(row)
                bar.set_postfix(mlm=f"{row['mlm_loss']:.3f}", nsp=f"{row['nsp_loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
                if on_log:
                    on_log(row)
            if ckpt_dir is not None and (state.step % cfg.checkpoint_every == 0 or state.step == end):
                save_checkpoint(ckpt_fs, ckpt_dir, model, opt, sched, state)
        else:  # epoch exhausted
            state.epoch += 1
            state.batch_in_epoch = 0
            continue
    bar.close()
    return _unwrap(model), log


def _groups(batches, world: int):
    group = []
    for b in batches:
        group.append(b)
        if len(group) == world:
            yield group
            group = []


class _Window:
    """Running sums between two log rows."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.n = self.mlm = self.nsp = self.correct = self.masked = self.tokens = self.time = self.gnorm = 0.0
        self.nsp_correct = self.pairs = 0.0

    def add(self, out, b, dt: float, gnorm: float):
        self.n += 1
        self.mlm += float(out.mlm_loss.detach())
        self.nsp += float(out.nsp_loss.detach()) if out.nsp_loss is not None else 0.0
        self.correct += float(out.mlm_correct)
        self.masked += int(b.mlm_labels.numel())
        self.nsp_correct += float(out.nsp_correct)
        self.pairs += int(b.nsp_labels.numel())
        self.tokens += int(b.n_real_tokens)
        self.time += dt
        self.gnorm += gnorm

    def flush(self, state: TrainState, lr: float, flops_tok: float | None, peak: float | None) -> dict[str, Any]:
        n = max(self.n, 1)
        tps = self.tokens / self.time if self.time else 0.0
        row = {
            "step": state.step,
            "epoch": state.epoch,
            "loss": (self.mlm + self.nsp) / n,
            "mlm_loss": self.mlm / n,
            "nsp_loss": self.nsp / n,
            "mlm_acc": self.correct / max(self.masked, 1),
            "nsp_acc": self.nsp_correct / max(self.pairs, 1),
            "lr": lr,
            "grad_norm": self.gnorm / n,
            "tokens_per_s": tps,
            "mfu": (tps * flops_tok / peak) if (peak and flops_tok) else None,
        }
        self.reset()
        return row


def plot_log(log: list[dict[str, Any]], title: str = "pretrain") -> bytes:
    """PNG of MLM/NSP loss and MLM accuracy against step."""
    from tasks.common.plots import subplots, to_png

    steps = [r["step"] for r in log]
    fig, (a, b) = subplots(2)
    a.plot(steps, [r["mlm_loss"] for r in log], label="MLM loss")
    a.plot(steps, [r["nsp_loss"] for r in log], label="NSP loss")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.legend()
    a.grid(alpha=0.3)
    b.plot(steps, [r["mlm_acc"] for r in log], color="tab:green", label="MLM accuracy")
    b.set_xlabel("step")
    b.set_ylabel("accuracy")
    b.grid(alpha=0.3)
    b.legend()
    return to_png(fig, title)


def rows_from_artifact(uri: str) -> Callable[[], Any]:
    from storage.artifacts import open_artifact

    def factory():
        return iter_rows(open_artifact(uri))

    return factory


def dist_info() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- stage


def run_pretrain_stage(writer, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str, ckpt_fs, ckpt_dir: str, on_log=None, progress: bool = True) -> dict[str, Any]:
    """Train (resuming from ``ckpt_dir``), then write weights, configs, log and plot into ``writer``."""
    import pyarrow as pa
    from safetensors.torch import save as st_save

    from storage.artifacts import open_artifact
    from storage.parquet import write_table
    from tasks.train.pretrain_data import max_word_num
    from tasks.prepare.vocab import parse_vocab

    lex, voc = open_artifact(lexicon_uri), open_artifact(vocab_uri)
    vocab_size = len(parse_vocab(voc.read_verified("vocab.txt")))
    wv = np.load(io.BytesIO(lex.read_verified("word_vectors.npy")))
    W = max_word_num(lex)
    t0 = time.perf_counter()
    model, log = train(cfg, rows_from_artifact(lex.uri), vocab_size, wv, W, ckpt_fs, ckpt_dir, on_log=on_log, progress=progress)
    wall = time.perf_counter() - t0
    if dist_info()[0] != 0:
        return {}  # rank 0 alone writes the artifact
    writer.write_bytes("model.safetensors", st_save(_state_dict(model), metadata={"format": "pt"}))
    writer.write_bytes("model_config.json", json.dumps(model.cfg.model_dump(), indent=1, sort_keys=True).encode())
    write_table(writer, "log.parquet", pa.Table.from_pylist(log))
    writer.write_bytes("loss.png", plot_log(log, f"pretrain ({cfg.steps} steps)"))
    tps = [r["tokens_per_s"] for r in log if r["tokens_per_s"]]
    metrics = {
        "steps": cfg.steps,
        "seed": cfg.seed,
        "data_seed": cfg.data.seed,
        "first_mlm_loss": round(log[0]["mlm_loss"], 4) if log else None,
        "last_mlm_loss": round(log[-1]["mlm_loss"], 4) if log else None,
        "first_nsp_loss": round(log[0]["nsp_loss"], 4) if log else None,
        "last_nsp_loss": round(log[-1]["nsp_loss"], 4) if log else None,
        "last_mlm_acc": round(log[-1]["mlm_acc"], 4) if log else None,
        "median_tokens_per_s": round(float(np.median(tps)), 1) if tps else None,
        "params": model.num_params(),
        "non_embedding_params": model.num_params(non_embedding=True),
        "device": str(resolve_device(cfg)),
        "wall_s": round(wall, 1),
    }
    mfu = [r["mfu"] for r in log if r.get("mfu")]
    if mfu:
        metrics["median_mfu"] = round(float(np.median(mfu)), 4)
    return {"log": log, "metrics": metrics, "rows": {"log.parquet": len(log)}}


# ----------------------------------------------------------------------------- Prefect wrapper
from prefect import task  # noqa: E402
from prefect.cache_policies import NONE  # noqa: E402


@task(name="pretrain-train", cache_policy=NONE)
def pretrain_task(store_uri: str, version: str, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str, progress: bool = True) -> dict[str, Any]:
    from storage.artifacts import ArtifactStore
    from tasks.common.stage import Progress

    store = ArtifactStore(store_uri)
    bar = Progress("pretrain", cfg.steps)

    def on_log(row):
        bar.step(cfg.log_every)

    ckpt = f"{store.root}/_checkpoints/pretrain/{version}"
    if cfg.gpus > 1:
        return launch_ddp(dict(store_uri=store_uri, version=version, cfg=cfg.model_dump(mode="json"), lexicon_uri=lexicon_uri, vocab_uri=vocab_uri), cfg.gpus)
    return run_pretrain_stage(store.attach("pretrain", version), cfg, lexicon_uri, vocab_uri, store.fs, ckpt, on_log, progress)


# ----------------------------------------------------------------------------- multi-GPU (torchrun)


def launch_ddp(spec: dict[str, Any], nproc: int) -> dict[str, Any]:
    """Run this module under ``torchrun`` with ``nproc`` processes (NCCL on GPUs, gloo on CPU).

    Every rank trains on its share of the batches; rank 0 writes the artifact files and the result."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = f"{tmp}/spec.json", f"{tmp}/result.json"
        with open(spec_path, "w") as f:
            json.dump({**spec, "result_path": result_path}, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "tasks.train.pretrain", spec_path]
        subprocess.run(cmd, check=True)
        with open(result_path) as f:
            return json.load(f)


def _ddp_main(spec_path: str) -> None:
    import torch.distributed as dist

    from storage.artifacts import ArtifactStore

    with open(spec_path) as f:
        spec = json.load(f)
    cfg = PretrainConfig.model_validate(spec["cfg"])
    dist.init_process_group(backend="nccl" if (torch.cuda.is_available() and cfg.device != "cpu") else "gloo")
    try:
        if torch.cuda.is_available() and cfg.device != "cpu":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = ArtifactStore(spec["store_uri"])
        ckpt = f"{store.root}/_checkpoints/pretrain/{spec['version']}"
        res = run_pretrain_stage(store.attach("pretrain", spec["version"]), cfg, spec["lexicon_uri"], spec["vocab_uri"], store.fs, ckpt, progress=False)
        if dist.get_rank() == 0:
            with open(spec["result_path"], "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # torchrun entry point: python -m tasks.train.pretrain SPEC.json
    import sys

    _ddp_main(sys.argv[1])
