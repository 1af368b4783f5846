"""pretrain: MLM + NSP with whole-word masking on the matched shards -> BERT checkpoint (safetensors).

The trainer is a plain function over (config, artifacts, checkpoint dir). Resuming is exact:
model, optimizer, scheduler, torch/numpy RNG and the data position (epoch, batch) are restored,
and the data stream is a pure function of (seed, epoch), so skipping k batches replays it exactly.

Throughput counts real tokens only (no padding). On CUDA, MFU = achieved FLOP/s / peak, with
FLOPs per token = 6·N (N = non-embedding params) + 12·L·d·T (attention scores and values, fwd+bwd)
+ 6·mask_fraction·(H·V + H·H) (the sparse MLM head projects only masked positions).
Both are measurements: they show live (progress bar, the ``pretrain-log`` table) and go to the manifest's
``run`` section, never into ``log.parquet``, whose bytes are the same on every build of a version.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from prefect import task
from prefect.cache_policies import NONE

from models import LebertForPretraining, ModelConfig
from tasks.common.config import PretrainConfig
from tasks.common.stage import StageResult, pause_point
from tasks.train.checkpoint import TrainState, load_checkpoint, save_checkpoint, unwrap, weights
from tasks.train.loop import autocast, make_adamw, optimizer_step, publish_table, resolve_device, seeded_model
from tasks.train.pretrain_data import heldout_batches, iter_batches, iter_rows, split_heldout

# pretrain-2: masked words are removed from the lexicon channel (no answer leak); MLM accuracy on a held-out
# slice of documents (data.heldout_frac) excluded from training; extra_texts (domain-adaptive pretraining)
# pretrain-3: the held-out evaluation runs the lexicon adapter sparsely (float sums in another order)
# pretrain-4: log.parquet holds no timing columns (tokens_per_s, mfu): measurements go to the manifest's run section
CODE_VERSION = "pretrain-4"
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16


def lr_lambda(cfg: PretrainConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / max(1, cfg.warmup_steps)
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        frac = min(max(frac, 0.0), 1.0)
        return 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac

    return f


def build_model(cfg: PretrainConfig, vocab_size: int, word_vectors: np.ndarray | None,
                max_word_num: int) -> LebertForPretraining:
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
        vectors = torch.from_numpy(np.ascontiguousarray(word_vectors, dtype=np.float32))  # [word_vocab, word_dim]
        model.load_word_vectors(vectors, freeze=m.freeze_word_vectors)
    return model


def local_rank() -> int:
    """This process's GPU index under torchrun (0 otherwise)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


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
    Documents in the held-out slice (``cfg.data.heldout_frac``, by doc_id hash) are never trained on;
    ``cfg.eval_batches`` batches of them give ``heldout_mlm_acc``/``heldout_mlm_loss`` at the log rows
    whose step is a multiple of ``cfg.eval_every`` and at the last step (None in the other rows).
    Returns the model and the log rows (one per ``log_every`` steps).
    """
    from tqdm.auto import tqdm

    model, device = seeded_model(lambda: build_model(cfg, vocab_size, word_vectors, max_word_num), cfg.seed,
                                 cfg.threads, cfg.device, local_rank=local_rank())
    opt = make_adamw(model, cfg.lr, cfg.weight_decay, cfg.betas)  # no decay on biases/LayerNorm
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
    peak = peak_flops(device)
    flops_tok = None
    log: list[dict[str, Any]] = list(state.log)  # rows before the checkpoint, when resuming
    end = min(cfg.steps, stop_at) if stop_at else cfg.steps
    bar = tqdm(total=end, initial=state.step, desc="pretrain", unit="step", disable=not progress, mininterval=2)
    acc = _Window()
    train_rows, heldout_rows = split_heldout(rows_factory, cfg.data.heldout_frac, cfg.data.seed)
    eval_set = heldout_batches(heldout_rows, cfg.data, cfg.eval_batches, vocab_size, max_word_num)
    model.train()
    while state.step < end:
        batches = iter_batches(train_rows(), cfg.data, vocab_size, max_word_num, state.epoch,
                               start_batch=state.batch_in_epoch)
        for group in _groups(batches, world):  # one batch per rank; a short final group is dropped by all
            if state.step >= end:
                break
            batch = group[rank]
            t0 = time.perf_counter()
            b = batch.to(device)
            words = b.word_ids if cfg.model.use_adapter else None  # [B, T, W]
            with autocast(device):
                out = fwd(b.input_ids, b.segment_ids, b.attention_mask, words, b.mlm_positions, b.mlm_labels,
                          b.nsp_labels)
            gnorm = optimizer_step(opt, out.loss, model.parameters(), cfg.grad_clip)
            sched.step()
            state.step += 1
            state.batch_in_epoch += world
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            acc.add(out, b, dt, float(gnorm))
            if flops_tok is None:
                flops_tok = unwrap(model).flops_per_token(b.input_ids.shape[1], cfg.data.mask_prob)
            bar.update(1)
            if state.step % cfg.log_every == 0 or state.step == end:
                row = acc.flush(state, sched.get_last_lr()[0], flops_tok, peak)
                due = state.step % cfg.eval_every == 0 or state.step == end
                row.update(evaluate(model, eval_set, device, cfg.model.use_adapter) if due and eval_set else
                           {"heldout_mlm_acc": None, "heldout_mlm_loss": None})
                log.append(row)
                bar.set_postfix(mlm=f"{row['mlm_loss']:.3f}", nsp=f"{row['nsp_loss']:.3f}",
                                tok_s=f"{row['tokens_per_s']:.0f}")
                if on_log:
                    on_log(row)
            if ckpt_dir is not None and (state.step % cfg.checkpoint_every == 0 or state.step == end):
                # the log travels with the checkpoint; a row cut short by ``stop_at`` is not a real log row
                state.log = [r for r in log if r["step"] % cfg.log_every == 0 or r["step"] == cfg.steps]
                save_checkpoint(ckpt_fs, ckpt_dir, model, opt, sched, state)
                pause_point("pretrain")  # crash tests: killed here, the next run resumes from this checkpoint
        else:  # epoch exhausted
            state.epoch += 1
            state.batch_in_epoch = 0
            continue
    bar.close()
    return unwrap(model), log


@torch.no_grad()
def evaluate(model, batches: list, device: torch.device, use_adapter: bool) -> dict[str, float]:
    """MLM accuracy and mean loss over every masked position of ``batches``, in eval mode (no dropout)."""
    was, correct, loss, n = model.training, 0.0, 0.0, 0
    model.eval()
    for batch in batches:
        b = batch.to(device)
        with autocast(device):
            out = model(b.input_ids, b.segment_ids, b.attention_mask, b.word_ids if use_adapter else None,
                        b.mlm_positions, b.mlm_labels, b.nsp_labels)
        k = int(b.mlm_labels.numel())
        correct += float(out.mlm_correct)
        loss += float(out.mlm_loss) * k
        n += k
    model.train(was)
    return {"heldout_mlm_acc": correct / max(n, 1), "heldout_mlm_loss": loss / max(n, 1)}


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


# the Prefect table (live throughput included)
LOG_COLUMNS = ("step", "mlm_loss", "nsp_loss", "mlm_acc", "heldout_mlm_acc", "lr", "tokens_per_s", "mfu")
# measured per log row: shown live, kept in the manifest's run section, never written to log.parquet
TIMING_COLUMNS = ("tokens_per_s", "mfu")


def learned(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log rows as ``log.parquet`` holds them: what was learned, without the measured timings."""
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in log]


def run_record(log: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The manifest's ``run`` section: wall time, median throughput (and MFU on CUDA), and per log row the
    step, tokens/s and MFU (rounded; ``log``, column-wise) of a build of this version; none of it enters a data
    file."""
    tps = [r["tokens_per_s"] for r in log if r.get("tokens_per_s")]
    mfu = [r["mfu"] for r in log if r.get("mfu")]
    run: dict[str, Any] = {
        "wall_s": round(wall_s, 1),
        "median_tokens_per_s": round(float(np.median(tps)), 1) if tps else None,
    }
    if mfu:
        run["median_mfu"] = round(float(np.median(mfu)), 4)
    run["log"] = {"step": [r["step"] for r in log],
                  "tokens_per_s": [_round(r.get("tokens_per_s"), 1) for r in log],
                  "mfu": [_round(r.get("mfu"), 4) for r in log]}
    return run


def _round(v: float | None, digits: int) -> float | None:
    return round(float(v), digits) if v is not None else None


def plot_log(log: list[dict[str, Any]], title: str = "pretrain") -> bytes:
    """PNG of MLM/NSP loss and MLM accuracy against step."""
    from tasks.common.plots import line_panels

    def col(k: str) -> list:
        return [r[k] for r in log]

    panels = [("loss", [(col("mlm_loss"), "MLM loss", {}), (col("nsp_loss"), "NSP loss", {})]),
              ("accuracy", [(col("mlm_acc"), "MLM accuracy (training batches)", {"color": "tab:green"}),
                            ([float("nan") if r.get("heldout_mlm_acc") is None else r["heldout_mlm_acc"] for r in log],
                             "MLM accuracy (held out)",
                             {"color": "tab:red", "marker": "o"})])]
    return line_panels(col("step"), panels, "step", title)


def rows_from_artifact(uri: str) -> Callable[[], Any]:
    from storage.artifacts import open_artifact

    def factory():
        return iter_rows(open_artifact(uri))

    return factory


def pretrain_rows(cfg: PretrainConfig, lex) -> tuple[Callable[[], Any], int]:
    """(row stream factory, extra rows): the lexicon shards, with ``cfg.extra_texts`` (domain-adaptive
    pretraining on the TRAIN texts of labelled files) mixed in between corpus documents."""
    rows = rows_from_artifact(lex.uri)
    if not cfg.extra_texts:
        return rows, 0
    from tasks.train.domain import extra_rows, mixed_factory
    from tasks.train.featurize import Featurizer

    extra = extra_rows(cfg.extra_texts, Featurizer.from_artifacts(lex, max_len=10**9))
    return mixed_factory(rows, extra, int(lex.manifest.stats["out"])), len(extra)


def dist_info() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- stage


def run_pretrain_stage(writer, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str, ckpt_fs, ckpt_dir: str,
                       on_log=None, progress: bool = True
                       ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]] | None:
    """Train (resuming from ``ckpt_dir``), then write weights, configs, log and plot into ``writer``.
    Returns (log rows, metrics, run record) on rank 0; None on the other ranks (rank 0 alone writes).
    The log rows keep their measured timings (for the UI); ``log.parquet`` does not (:func:`learned`)."""
    import pyarrow as pa
    from safetensors.torch import save as st_save

    from storage.artifacts import open_artifact
    from storage.parquet import write_table
    from tasks.prepare.vocab import parse_vocab
    from tasks.train.pretrain_data import max_word_num

    lex, voc = open_artifact(lexicon_uri), open_artifact(vocab_uri)
    vocab_size = len(parse_vocab(voc.read_verified("vocab.txt")))
    wv = np.load(io.BytesIO(lex.read_verified("word_vectors.npy")))
    W = max_word_num(lex)
    t0 = time.perf_counter()
    rows, n_extra = pretrain_rows(cfg, lex)
    model, log = train(cfg, rows, vocab_size, wv, W, ckpt_fs, ckpt_dir, on_log=on_log, progress=progress)
    wall = time.perf_counter() - t0
    if dist_info()[0] != 0:
        return None
    writer.write_bytes("model.safetensors", st_save(weights(model), metadata={"format": "pt"}))
    writer.write_bytes("model_config.json", json.dumps(model.cfg.model_dump(), indent=1, sort_keys=True).encode())
    write_table(writer, "log.parquet", pa.Table.from_pylist(learned(log)))
    writer.write_bytes("loss.png", plot_log(log, f"pretrain ({cfg.steps} steps)"))
    first, last = (log[0], log[-1]) if log else ({}, {})
    metrics = {
        "steps": cfg.steps,
        "seed": cfg.seed,
        "data_seed": cfg.data.seed,
        "first_mlm_loss": _r4(first.get("mlm_loss")),
        "last_mlm_loss": _r4(last.get("mlm_loss")),
        "first_nsp_loss": _r4(first.get("nsp_loss")),
        "last_nsp_loss": _r4(last.get("nsp_loss")),
        "last_mlm_acc": _r4(last.get("mlm_acc")),
        "heldout_mlm_acc": _r4(last.get("heldout_mlm_acc")),
        "heldout_mlm_loss": _r4(last.get("heldout_mlm_loss")),
        "heldout_frac": cfg.data.heldout_frac,
        "use_adapter": cfg.model.use_adapter,
        "extra_rows": n_extra,
        "params": model.num_params(),
        "non_embedding_params": model.num_params(non_embedding=True),
        "device": str(resolve_device(cfg.device, local_rank())),
    }
    return log, metrics, run_record(log, wall)


def _r4(v: float | None) -> float | None:
    return round(v, 4) if v is not None else None


def stage_result(log: list[dict[str, Any]], metrics: dict[str, Any], run: dict[str, Any] | None = None
                 ) -> StageResult:
    """The stage's counts (in = out = steps), metrics, rows, run record, and the log table to publish."""
    steps = metrics["steps"]
    return StageResult({"in": steps, "out": steps, "rejected": {}}, metrics, {"log.parquet": len(log)},
                       publish=partial(publish_log, log), run=run or {})


def publish_log(log: list[dict[str, Any]], art=None) -> None:
    """Prefect UI: the pretraining log as a table artifact (a no-op outside a run)."""
    publish_table("pretrain-log", log, LOG_COLUMNS, "pretraining log (per log_every steps)")


# ----------------------------------------------------------------------------- Prefect wrapper


@task(name="pretrain-train", cache_policy=NONE)
def pretrain_task(store_uri: str, version: str, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str,
                  progress: bool = True) -> StageResult:
    """Train into the staging directory that :func:`tasks.common.stage.run_stage` began (torchrun when
    ``cfg.gpus > 1``); checkpoints live under ``<store>/_checkpoints/pretrain/<version>``."""
    from storage.artifacts import ArtifactStore
    from tasks.common.stage import Progress

    if cfg.gpus > 1:
        spec = dict(store_uri=store_uri, version=version, cfg=cfg.model_dump(mode="json"), lexicon_uri=lexicon_uri,
                    vocab_uri=vocab_uri)
        return stage_result(*launch_ddp(spec, cfg.gpus))
    from tasks.common.ui import LiveTable

    store = ArtifactStore(store_uri)
    bar = Progress("pretrain", cfg.steps)
    live = LiveTable("pretrain-log", LOG_COLUMNS, "pretraining log (per log_every steps)")  # updates while training

    def on_log(row: dict[str, Any]) -> None:
        bar.step(cfg.log_every)
        live.add(row)

    ckpt = store.checkpoint_path("pretrain", version)
    writer = store.attach("pretrain", version)
    return stage_result(*run_pretrain_stage(writer, cfg, lexicon_uri, vocab_uri, store.fs, ckpt, on_log, progress))


# ----------------------------------------------------------------------------- multi-GPU (torchrun)


def launch_ddp(spec: dict[str, Any], nproc: int) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Run this module under ``torchrun`` with ``nproc`` processes (NCCL on GPUs, gloo on CPU).

    Every rank trains on its share of the batches; rank 0 writes the artifact files and returns
    (log rows, metrics, run record) through a JSON file."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = f"{tmp}/spec.json", f"{tmp}/result.json"
        with open(spec_path, "w") as f:
            json.dump({**spec, "result_path": result_path}, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "tasks.train.pretrain", spec_path]
        subprocess.run(cmd, check=True)
        with open(result_path) as f:
            res = json.load(f)
        return res["log"], res["metrics"], res["run"]


def _ddp_main(spec_path: str) -> None:
    import torch.distributed as dist

    from storage.artifacts import ArtifactStore

    with open(spec_path) as f:
        spec = json.load(f)
    cfg = PretrainConfig.model_validate(spec["cfg"])
    dist.init_process_group(backend="nccl" if (torch.cuda.is_available() and cfg.device != "cpu") else "gloo")
    try:
        if torch.cuda.is_available() and cfg.device != "cpu":
            torch.cuda.set_device(local_rank())
        store = ArtifactStore(spec["store_uri"])
        ckpt = f"{store.root}/_checkpoints/pretrain/{spec['version']}"
        writer = store.attach("pretrain", spec["version"])
        res = run_pretrain_stage(writer, cfg, spec["lexicon_uri"], spec["vocab_uri"], store.fs, ckpt, progress=False)
        if dist.get_rank() == 0:
            with open(spec["result_path"], "w") as f:
                json.dump({"log": res[0], "metrics": res[1], "run": res[2]}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # torchrun entry point: python -m tasks.train.pretrain SPEC.json
    import sys

    _ddp_main(sys.argv[1])
