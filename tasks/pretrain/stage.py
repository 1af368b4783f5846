"""pretrain: MLM + NSP with whole-word masking on the matched shards -> BERT checkpoint (safetensors).

The trainer is a plain function over (config, artifacts, checkpoint dir). Resuming is exact:
model, optimizer, scheduler, torch/numpy RNG and the data position (epoch, batch) are restored,
and batch k of an epoch is a pure function of (pack, seed, epoch, rank, k) (:mod:`tasks.pretrain.packed`), so the
loader restarts at batch k. Under DDP (torchrun, one or more nodes) each rank packs and reads only its share.

Throughput counts real tokens only (no padding). On CUDA, MFU = achieved FLOP/s / peak, with
FLOPs per token = 6·N (N = non-embedding params) + 12·L·d·T (attention scores and values, fwd+bwd)
+ 6·mask_fraction·(H·V + H·H) (the sparse MLM head projects only masked positions).
Both are measurements: they show live (progress bar, the ``pretrain-log`` table) and go to the manifest's
``run`` section, never into ``log.parquet``, whose bytes are the same on every build of a version.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
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
from tasks.prepare.vocab import TokenIds, as_token_ids
from tasks.pretrain import import_hf
from tasks.pretrain.checkpoint import TrainState, load_checkpoint, rng_state, save_checkpoint, unwrap, weights
from tasks.pretrain.data import iter_rows, split_heldout
from tasks.pretrain.loop import autocast, make_adamw, optimizer_step, publish_table, resolve_device, seeded_model
from tasks.pretrain.packed import PackedBatches, Schedule, cached_pack, loader, pack_key, pack_root, pack_rows
from tasks.pretrain.preempt import Preempted, StopSignal, forward_signals, stopped
from tasks.pretrain.progress import HEARTBEAT_S, ProgressLog, Window

# pretrain-2: masked words are removed from the lexicon channel (no answer leak); MLM accuracy on a held-out
# slice of documents (data.heldout_frac) excluded from training; extra_texts (domain-adaptive pretraining)
# pretrain-3: the held-out evaluation runs the lexicon adapter sparsely (float sums in another order)
# pretrain-4: log.parquet holds no timing columns (tokens_per_s, mfu): measurements go to the manifest's run section
# pretrain-5: the packed loader (tasks/pretrain/packed.py): NSP pairs fixed once per (data, seed, rank, world), masking
#   drawn per batch; under DDP each rank reads its own row groups (batch_in_epoch now counts this rank's batches)
CODE_VERSION = "pretrain-5"
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
                max_word_num: int, ckpt: import_hf.Checkpoint | None = None) -> LebertForPretraining:
    """The model, initialised (seeded by the caller), then ``ckpt``'s weights copied in when importing; the
    lexicon adapter is initialised as from scratch either way."""
    m = cfg.model
    mc = ModelConfig(
        vocab_size=vocab_size,
        word_vocab_size=int(word_vectors.shape[0]) if (m.use_adapter and word_vectors is not None) else 0,
        word_dim=int(word_vectors.shape[1]) if word_vectors is not None else 200,
        max_word_num=max_word_num,
        **m.model_dump(exclude={"freeze_word_vectors"}),
        **(import_hf.model_overrides(ckpt, m, vocab_size) if ckpt is not None else {}),
    )
    model = LebertForPretraining(mc)
    if m.use_adapter and word_vectors is not None:
        vectors = torch.from_numpy(np.ascontiguousarray(word_vectors, dtype=np.float32))  # [word_vocab, word_dim]
        model.load_word_vectors(vectors, freeze=m.freeze_word_vectors)
    if ckpt is not None:
        model.imported = import_hf.load_weights(model, ckpt)  # what was imported, for the manifest
    if not import_hf.nsp_on(cfg, ckpt):  # no NSP loss: its head gets no gradient (DDP needs it marked so)
        model.nsp_head.requires_grad_(False)
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
    rows_factory: Callable[[int, int], Any],
    vocab_size: int | TokenIds,
    word_vectors: np.ndarray | None,
    max_word_num: int,
    ckpt_fs=None,
    ckpt_dir: str | None = None,
    stop_at: int | None = None,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    progress: bool = True,
    data_key: str | None = None,
    on_data: Callable[[dict[str, Any]], None] | None = None,
    heartbeat_s: float | None = None,
    stop: StopSignal | None = None,
) -> tuple[LebertForPretraining, list[dict[str, Any]]]:
    """Train for ``cfg.steps`` (or until ``stop_at``), resuming from ``ckpt_dir`` when it holds one.

    ``rows_factory(rank, world)`` returns a fresh iterator over this rank's share of the matched rows.
    They are packed once into NSP pairs (:mod:`tasks.pretrain.packed`; cached under :func:`packed.pack_root` when
    ``data_key`` names the data, else in a temporary directory), then every step reads a batch built by the
    loader's background workers. Documents in the held-out slice (``cfg.data.heldout_frac``, by doc_id hash) are
    never trained on; ``cfg.eval_batches`` batches of them give ``heldout_mlm_acc``/``heldout_mlm_loss`` at the log
    rows whose step is a multiple of ``cfg.eval_every`` and at the last step (None in the other rows).
    Under DDP every rank trains on its own pack, and all take the same number of batches per epoch (the smallest).
    ``on_data`` receives (on rank 0) what each rank read: world size, batches per epoch, and per rank the rows,
    pairs and tokens. Returns the model and the log rows (one per ``log_every`` steps).

    ``vocab_size`` is the vocabulary's size (the counted layout of specials) or its :class:`TokenIds`. With
    ``cfg.init_from`` the model starts from that checkpoint (:mod:`tasks.pretrain.import_hf`); ``cfg.steps`` 0
    returns it as imported, reading no data.

    No step reads the device except at log rows (:class:`tasks.pretrain.progress.Window`); each row is also an INFO
    line (:class:`tasks.pretrain.progress.ProgressLog`, heartbeat every ``heartbeat_s``). On SIGTERM/SIGINT (``stop``,
    installed here when not given) the current step ends, a checkpoint is written (when ``ckpt_dir`` is set) and
    :class:`tasks.pretrain.preempt.Preempted` is raised on every rank after the same step.
    """
    import tempfile

    from tqdm.auto import tqdm

    t_start = time.monotonic()
    ids = as_token_ids(vocab_size)
    ckpt = import_hf.read_checkpoint(cfg.init_from) if cfg.init_from else None
    model, device = seeded_model(lambda: build_model(cfg, ids.size, word_vectors, max_word_num, ckpt), cfg.seed,
                                 cfg.threads, cfg.device, local_rank=local_rank())
    nsp = import_hf.nsp_on(cfg, ckpt)
    ckpt = None  # its tensors were copied into the model
    if cfg.steps == 0:  # import only
        return model.eval(), []
    opt = make_adamw(model, cfg.lr, cfg.weight_decay, cfg.betas, fast=device.type == "cuda")  # no decay on biases/LN
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    state = TrainState()
    rank, world = dist_info()
    if ckpt_dir is not None:
        state = load_checkpoint(ckpt_fs, ckpt_dir, model, opt, sched, rank) or state
    checkpointing = ckpt_dir is not None  # on every rank: each one's RNG state goes into rank 0's checkpoint
    fwd = model
    if world > 1:  # DDP under torchrun: every rank reads its own share of the rows
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # static graphs, one per bucket (shapes.py): no recompiles, no dynamic-shape fallback
    fwd = torch.compile(fwd, backend=cfg.compile_backend, dynamic=False) if cfg.compile else fwd
    if rank != 0:
        progress, on_log = False, None
    say = ProgressLog("pretrain", cfg.steps, state.step, device, heartbeat_s or HEARTBEAT_S, enabled=rank == 0)
    peak = peak_flops(device)
    flops_tok = None
    log: list[dict[str, Any]] = list(state.log)  # rows before the checkpoint, when resuming
    end = min(cfg.steps, stop_at) if stop_at else cfg.steps
    train_rows, heldout_rows = split_heldout(rows_factory, cfg.data.heldout_frac, cfg.data.seed)
    own_stop = stop is None
    stop = stop or StopSignal()
    with say, stop if own_stop else contextlib.nullcontext(), \
            tempfile.TemporaryDirectory(prefix="lexiflow-pack-") as scratch:
        say.info("pretrain: model and optimizer on %s in %.1f s%s", device, time.monotonic() - t_start,
                 f", resuming at step {state.step}" if state.step else "")
        say.phase("reading the held-out set")
        eval_set = heldout_eval_set(heldout_rows(0, 1), cfg.data, cfg.eval_batches, ids, max_word_num)
        say.done(f"{len(eval_set)} batches")

        def build(out):
            return pack_rows(train_rows(rank, world), cfg.data, max_word_num, out, rank=rank, world=world,
                             specials=ids)

        say.phase("reading and packing the training rows")
        if data_key is not None:
            pack = cached_pack(pack_root(), pack_key(data_key, cfg.data, max_word_num, rank, world), build)
        else:
            pack = build(scratch)
        say.done(f"{pack.meta['rows']:,} rows, {len(pack):,} pairs, {pack.meta['tokens']:,} tokens")
        ranks = gather_info({"rows": pack.meta["rows"], "pairs": len(pack), "tokens": pack.meta["tokens"]}, world)
        data = PackedBatches(pack.meta.get("dir") or pack, cfg.data, ids, rank)
        if cfg.compile:
            from tasks.pretrain.shapes import BucketedBatches

            data = BucketedBatches(data, cfg.compile_buckets)
        per_epoch = _min_over_ranks(data.per_epoch(), world)
        if per_epoch == 0:
            raise ValueError(f"rank {rank} of {world} has no training pairs: {pack.meta['rows']} rows read "
                             "(more data, or fewer ranks)")
        if on_data is not None and rank == 0:
            on_data({"world_size": world, "batches_per_epoch": per_epoch, "ranks": ranks})
        bar = tqdm(total=end, initial=state.step, desc="pretrain", unit="step", disable=not progress,
                   mininterval=2)
        acc = Window()
        acc.restore(state.window, device)
        model.train()
        pin = device.type == "cuda"
        schedule = Schedule(state.epoch, state.batch_in_epoch, max(end - state.step, 0), per_epoch)
        workers = cfg.data.loader_workers if cfg.data.loader_workers is not None else int(device.type == "cuda")
        batches = iter(loader(data, schedule, workers, cfg.data.prefetch, pin, cfg.data.loader))
        say.phase(("compiling and running" if cfg.compile else "running") + " the first step")
        first_step = state.step + 1
        t_ready = time.perf_counter()
        for (epoch, k), batch in batches:
            t0 = time.perf_counter()
            wait = t0 - t_ready  # this step's wait for data (0 when the loader is ahead)
            masked, pairs = batch.counts()
            b = batch.to(device, non_blocking=pin)
            words = b.word_ids if cfg.model.use_adapter else None  # [B, T, W]
            with autocast(device, cfg.precision):
                out = fwd(b.input_ids, b.segment_ids, b.attention_mask, words, b.mlm_positions, b.mlm_labels,
                          b.nsp_labels if nsp else None)
            gnorm = optimizer_step(opt, out.loss, model.parameters(), cfg.grad_clip)
            sched.step()
            state.step += 1
            state.epoch, state.batch_in_epoch = (epoch, k + 1) if k + 1 < per_epoch else (epoch + 1, 0)
            acc.add(out, masked, pairs, b.n_real_tokens, time.perf_counter() - t0, gnorm, wait)
            if flops_tok is None:
                flops_tok = unwrap(model).flops_per_token(b.input_ids.shape[1], cfg.data.mask_prob)
            bar.update(1)
            say.advance(state.step)
            if state.step == first_step:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # once: the first step's latency includes the device's work
                first_step_s = time.monotonic() - t_start
                say.done(f"{first_step_s:.1f} s after the stage started")
                if on_data is not None and rank == 0:
                    on_data({"first_step_s": round(first_step_s, 2)})
            stopping = stop.agreed(world)
            if state.step % cfg.log_every == 0 or state.step == end:
                row = acc.flush(state.step, state.epoch, sched.get_last_lr()[0], flops_tok, peak)
                due = state.step % cfg.eval_every == 0 or state.step == end
                scores = evaluate(model, eval_set, device, cfg.model.use_adapter, cfg.precision) if due and eval_set \
                    else {"heldout_mlm_acc": None, "heldout_mlm_loss": None}
                row.update(scores)
                log.append(row)
                bar.set_postfix(mlm=f"{row['mlm_loss']:.3f}", nsp=f"{row['nsp_loss']:.3f}",
                                tok_s=f"{row['tokens_per_s']:.0f}", wait=f"{row['data_wait']:.0%}")
                say.row(row)
                if on_log:
                    on_log(row)
            if checkpointing and (state.step % cfg.checkpoint_every == 0 or state.step == end or stopping):
                rngs = gather_info(rng_state(), world) if world > 1 else None
                if rank == 0:
                    # the log travels with the checkpoint; a row cut short by ``stop_at`` is not a real log row
                    state.log = [r for r in log if r["step"] % cfg.log_every == 0 or r["step"] == cfg.steps]
                    state.window = acc.state() if acc.n else None
                    save_checkpoint(ckpt_fs, ckpt_dir, model, opt, sched, state, rngs)
                    # crash tests: killed here (or signalled: it goes on), the next run resumes from this checkpoint
                    pause_point("pretrain", until=lambda: stop.signum is not None)
            if stopping:
                if hasattr(batches, "close"):
                    batches.close()  # stops the loader's workers
                bar.close()
                where = f"at step {state.step}/{cfg.steps}"
                raise stopped("pretrain", stop.signum, where + ("; checkpoint written" if checkpointing else ""),
                              resume=checkpointing, say=rank == 0)
            t_ready = time.perf_counter()
        del batches  # stops the loader's workers
        bar.close()
    return unwrap(model), log


def heldout_eval_set(rows, cfg, n: int, vocab_size: int | TokenIds, W: int) -> list:
    """The fixed evaluation batches: the first ``n`` batches of epoch 0 over the first ``n * batch_size`` pairs of
    held-out documents, in corpus order (the same on every rank and for every world size), or [] when nothing is
    held out. Reads only as far into the corpus as those pairs need."""
    if cfg.heldout_frac <= 0:
        return []
    pack = pack_rows(rows, cfg, W, None, limit=n * cfg.batch_size, specials=as_token_ids(vocab_size))
    if not len(pack):
        return []
    return PackedBatches(pack, cfg, vocab_size).epoch(0)[:n]


def _min_over_ranks(value: int, world: int) -> int:
    """The smallest ``value`` over the ranks (every rank must take the same number of steps)."""
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def gather_info(info: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Every rank's ``info`` (rows read, pairs, tokens), in rank order."""
    if world == 1:
        return [info]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, info)
    return out


@torch.no_grad()
def evaluate(model, batches: list, device: torch.device, use_adapter: bool, precision: str = "auto"
             ) -> dict[str, float]:
    """MLM accuracy and mean loss over every masked position of ``batches``, in eval mode (no dropout)."""
    was, correct, loss, n = model.training, 0.0, 0.0, 0
    model.eval()
    for batch in batches:
        b = batch.to(device)
        with autocast(device, precision):
            out = model(b.input_ids, b.segment_ids, b.attention_mask, b.word_ids if use_adapter else None,
                        b.mlm_positions, b.mlm_labels, b.nsp_labels)
        k = int(b.mlm_labels.numel())
        correct += float(out.mlm_correct)
        loss += float(out.mlm_loss) * k
        n += k
    model.train(was)
    return {"heldout_mlm_acc": correct / max(n, 1), "heldout_mlm_loss": loss / max(n, 1)}


# the Prefect table (live throughput included)
LOG_COLUMNS = ("step", "mlm_loss", "nsp_loss", "mlm_acc", "heldout_mlm_acc", "lr", "tokens_per_s", "mfu",
               "data_wait")
# measured per log row: shown live, kept in the manifest's run section, never written to log.parquet
TIMING_COLUMNS = ("tokens_per_s", "mfu", "data_wait")


def learned(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log rows as ``log.parquet`` holds them: what was learned, without the measured timings."""
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in log]


def run_record(log: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The manifest's ``run`` section: wall time, median throughput (and MFU on CUDA), and per log row the
    step, tokens/s and MFU (rounded; ``log``, column-wise) of a build of this version; none of it enters a data
    file."""
    tps = [r["tokens_per_s"] for r in log if r.get("tokens_per_s")]
    mfu = [r["mfu"] for r in log if r.get("mfu")]
    wait = [r["data_wait"] for r in log if r.get("data_wait") is not None]
    run: dict[str, Any] = {
        "wall_s": round(wall_s, 1),
        "median_tokens_per_s": round(float(np.median(tps)), 1) if tps else None,
        "median_data_wait": round(float(np.median(wait)), 4) if wait else None,
    }
    if mfu:
        run["median_mfu"] = round(float(np.median(mfu)), 4)
    run["log"] = {"step": [r["step"] for r in log],
                  "tokens_per_s": [_round(r.get("tokens_per_s"), 1) for r in log],
                  "mfu": [_round(r.get("mfu"), 4) for r in log],
                  "data_wait": [_round(r.get("data_wait"), 4) for r in log]}
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


def rows_from_artifact(uri: str) -> Callable[[int, int], Any]:
    """A ``(rank, world)`` rows factory over a lexicon artifact's shards (each rank reads its row groups)."""
    from storage.artifacts import open_artifact

    def factory(rank: int = 0, world: int = 1):
        return iter_rows(open_artifact(uri), rank=rank, world=world)

    return factory


def pretrain_rows(cfg: PretrainConfig, lex) -> tuple[Callable[[int, int], Any], int, str]:
    """(row stream factory, extra rows, data key): the lexicon shards, with ``cfg.extra_texts`` (domain-adaptive
    pretraining on the TRAIN texts of labelled files) mixed in between corpus documents; the key names the data
    (the lexicon version and a digest of the extra rows) for the pack cache."""
    rows = rows_from_artifact(lex.uri)
    key = f"lexicon/{lex.manifest.version}"
    if not cfg.extra_texts:
        return rows, 0, key
    from tasks.prepare.featurize import Featurizer
    from tasks.pretrain.domain import extra_rows, mixed_factory

    extra = extra_rows(cfg.extra_texts, Featurizer.from_artifacts(lex, max_len=10**9))
    digest = hashlib.sha256(repr([(r["doc_id"], r["char_ids"].tobytes(), r["word_ids"].tobytes())
                                  for r in extra]).encode()).hexdigest()[:16]
    return mixed_factory(rows, extra, int(lex.manifest.stats["out"])), len(extra), f"{key}+extra/{digest}"


def dist_info() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- stage


def lexicon_inputs(lex, vocab=None) -> tuple[TokenIds, np.ndarray, int]:
    """What pretraining needs from a lexicon artifact: (the vocabulary's size and special ids, word vectors
    [n_words, dim], W words per character); ``vocab`` is its vocab parent (found from the manifest when not given).
    Checksum-verified reads."""
    from storage.artifacts import open_artifact
    from tasks.prepare.vocab import parse_vocab
    from tasks.pretrain.data import max_word_num

    vocab = vocab or open_artifact(next(p for p in lex.manifest.parents if p.stage == "vocab"))
    ids = TokenIds.of(parse_vocab(vocab.read_verified("vocab.txt")))
    return ids, np.load(io.BytesIO(lex.read_verified("word_vectors.npy"))), max_word_num(lex)


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

    lex = open_artifact(lexicon_uri)
    vocab_size, wv, W = lexicon_inputs(lex, open_artifact(vocab_uri))
    t0 = time.perf_counter()
    rows, n_extra, data_key = pretrain_rows(cfg, lex)
    data: dict[str, Any] = {}
    model, log = train(cfg, rows, vocab_size, wv, W, ckpt_fs, ckpt_dir, on_log=on_log, progress=progress,
                       data_key=data_key, on_data=data.update)
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
        "world_size": data.get("world_size", dist_info()[1]),
        "batches_per_epoch": data.get("batches_per_epoch", 0),
        "rows_per_rank": [r["rows"] for r in data.get("ranks", [])],
        "pairs_per_rank": [r["pairs"] for r in data.get("ranks", [])],
    }
    if cfg.init_from:  # the checkpoint's identity (its files' sha256): what the version counted
        metrics["init_from"] = {**model.imported, "files": import_hf.identity(import_hf.checkpoint_sources(
            cfg.init_from)), "nsp": bool(model.nsp_head.classifier.weight.requires_grad),
            "adapter_layer": cfg.model.adapter_layer if cfg.model.use_adapter else None}
    return log, metrics, {**run_record(log, wall), "first_step_s": data.get("first_step_s")}


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
    ``cfg.world_size > 1``); checkpoints live under ``<store>/_checkpoints/pretrain/<version>``."""
    from storage.artifacts import ArtifactStore
    from tasks.common.stage import Progress

    if cfg.world_size > 1:
        spec = ddp_spec(store_uri, version, cfg, lexicon_uri, vocab_uri)
        res = launch_ddp(spec, cfg)
        if res is None:
            raise RuntimeError("pretrain: torchrun finished but global rank 0 wrote no result: node 0 must be the "
                               "one that commits (pretrain.node_rank 0)")
        return stage_result(*res)
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


# ----------------------------------------------------------------------------- several processes (torchrun)


def ddp_spec(store_uri: str, version: str, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str) -> dict[str, Any]:
    return dict(store_uri=store_uri, version=version, cfg=cfg.model_dump(mode="json"), lexicon_uri=lexicon_uri,
                vocab_uri=vocab_uri)


def torchrun_command(cfg: PretrainConfig, spec_path: str) -> list[str]:
    """``python -m torch.distributed.run`` for this node: ``--standalone`` on one node; on several, a static
    rendezvous at ``master_addr:master_port`` where this node is ``node_rank`` (global rank = node_rank x gpus +
    local rank, so node 0 holds global rank 0, the one that writes the artifact)."""
    import sys

    if cfg.nnodes == 1:
        where = ["--standalone"]
    else:
        where = [f"--nnodes={cfg.nnodes}", f"--node_rank={cfg.node_rank}", f"--master_addr={cfg.master_addr}",
                 f"--master_port={cfg.master_port}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={cfg.gpus}", "-m",
            "tasks.pretrain.stage", spec_path]


def launch_ddp(spec: dict[str, Any], cfg: PretrainConfig
               ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]] | None:
    """Run this module under ``torchrun`` as this node's ``cfg.gpus`` processes (NCCL on GPUs, gloo on CPU).

    Every rank trains on its own share of the rows; global rank 0 writes the artifact files and returns
    (log rows, metrics, run record) through a JSON file: None on the other nodes."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = f"{tmp}/spec.json", f"{tmp}/result.json"
        with open(spec_path, "w") as f:
            json.dump({**spec, "result_path": result_path}, f)
        cmd = torchrun_command(cfg, spec_path)
        with forward_signals(subprocess.Popen(cmd)) as (proc, got):
            rc = proc.wait()
        if got:  # the ranks stopped after a step and checkpointed; rank 0 logged how to resume
            raise Preempted("pretrain stopped by a signal under torchrun", got[0])
        if rc:
            raise subprocess.CalledProcessError(rc, cmd)
        if not os.path.exists(result_path):
            return None
        with open(result_path) as f:
            res = json.load(f)
        return res["log"], res["metrics"], res["run"]


def join_as_node(store, version: str, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str,
                 wait_s: float = 600.0):
    """Node ``cfg.node_rank`` > 0 of a run on several machines: take part in the training (this node's processes),
    then wait for node 0 to commit the version and return its ref. The store must be shared by the nodes."""
    if not store.is_committed("pretrain", version):
        launch_ddp(ddp_spec(store.uri, version, cfg, lexicon_uri, vocab_uri), cfg)
    deadline = time.monotonic() + wait_s
    while not store.is_committed("pretrain", version):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pretrain {version}: this node's part is done but node 0 has not committed it "
                               f"within {wait_s:.0f} s (is {store.uri} the store node 0 writes to?)")
        time.sleep(1.0)
    return store.ref("pretrain", version)


def _ddp_main(spec_path: str) -> None:
    import torch.distributed as dist

    from storage.artifacts import ArtifactStore
    from tasks.pretrain.progress import to_stderr

    to_stderr()  # rank 0's progress lines reach the launcher's stderr
    with open(spec_path) as f:
        spec = json.load(f)
    cfg = PretrainConfig.model_validate(spec["cfg"])
    dist.init_process_group(backend="nccl" if (torch.cuda.is_available() and cfg.device != "cpu") else "gloo")
    try:
        if torch.cuda.is_available() and cfg.device != "cpu":
            torch.cuda.set_device(local_rank())
        store = ArtifactStore(spec["store_uri"])
        ckpt = store.checkpoint_path("pretrain", spec["version"])
        rank0 = dist.get_rank() == 0
        writer = store.attach("pretrain", spec["version"]) if rank0 else None  # only global rank 0 writes
        res = run_pretrain_stage(writer, cfg, spec["lexicon_uri"], spec["vocab_uri"], store.fs, ckpt, progress=False)
        if rank0:
            with open(spec["result_path"], "w") as f:
                json.dump({"log": res[0], "metrics": res[1], "run": res[2]}, f)
    except Preempted as e:
        dist.destroy_process_group()
        logging.shutdown()  # the checkpoint is written and the line logged: exit now, without the interpreter's
        os._exit(e.code)  # teardown (seconds of it), so every rank is gone well within a preemption notice
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":  # torchrun entry point: python -m tasks.pretrain.stage SPEC.json
    import sys

    _ddp_main(sys.argv[1])
