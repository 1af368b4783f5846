"""The pretraining loop: MLM + NSP with whole-word masking, resumable, on one process or one rank of a DDP run.

:func:`train` is a plain function over (config, rows, vocabulary, checkpoint dir). Resuming is exact:
model, optimizer, scheduler, torch/numpy RNG and the data position (epoch, batch) are restored,
and batch k of an epoch is a pure function of (pack, seed, epoch, rank, k) (:mod:`tasks.pretrain.packed`), so the
loader restarts at batch k. Under DDP (torchrun, one or more nodes) each rank packs and reads only its share.

Throughput counts real tokens only (no padding). On CUDA, MFU = achieved FLOP/s / peak, with FLOPs counted per
batch at its real length T (its longest pair, not the bucket it was padded to): real tokens x FLOPs per token,
= 6·N (N = non-embedding params) + 12·L·d·T (attention scores and values, fwd+bwd)
+ 6·mask_fraction·(H·V + H·H) (the sparse MLM head projects only masked positions).
Both are given two ways: over the time spent in steps (compute only; on CUDA timed by CUDA events read at the log
rows, no synchronisation per step) and over the wall time (data wait, evaluation and saves included).
They are measurements: they show live (progress bar, the ``pretrain-log`` table, the log lines) and go to the
manifest's ``run`` section, never into ``log.parquet``, whose bytes are the same on every build of a version.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from models import LebertForPretraining, ModelConfig
from models.bert import Unpadded, jagged_enabled, static_attention
from tasks.common.context import pause_point
from tasks.inference.runtime import autocast
from tasks.pretrain import import_hf
from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.data import split_heldout
from tasks.pretrain.packed import PackedBatches, Schedule, cached_pack, loader, pack_key, pack_root, pack_rows
from tasks.pretrain.pairpack import PairRows, WordRows
from tasks.pretrain.shapes import BucketedBatches
from tasks.text.vocab import TokenIds, as_token_ids
from tasks.training import collectives
from tasks.training import graphs as step_graphs
from tasks.training.checkpoint import (
    TrainState,
    load_checkpoint,
    newest_complete,
    rng_state,
    save_checkpoint,
    unwrap,
)
from tasks.training.loop import make_adamw, optimizer_step, seeded_model
from tasks.training.preempt import StopSignal, poll, stop_scope
from tasks.training.progress import HEARTBEAT_S, ProgressLog, Window
from tasks.training.row_adam import SparseRows

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16


def lr_lambda(cfg: PretrainConfig) -> Callable[[int], float]:
    """The LR factor at each step: linear warmup, then cosine or linear decay to 0."""
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
        **m.model_dump(exclude=m.TRAINING_ONLY),
        **(import_hf.model_overrides(ckpt, m, vocab_size) if ckpt is not None else {}),
    )
    model = LebertForPretraining(mc)
    if m.use_adapter and word_vectors is not None:
        vectors = torch.from_numpy(np.ascontiguousarray(word_vectors, dtype=np.float32))  # [word_vocab, word_dim]
        # freeze: fixed; sparse: not a parameter the optimizer or DDP sees either (SparseRows updates its rows)
        model.load_word_vectors(vectors, freeze=m.word_table != "dense")
    if ckpt is not None:
        model.imported = import_hf.load_weights(model, ckpt)  # what was imported, for the manifest
    if not import_hf.nsp_on(cfg, ckpt):  # no NSP loss: its head gets no gradient (DDP needs it marked so)
        model.nsp_head.requires_grad_(False)
    return model


def has_padding(batch) -> bool:
    """Whether a batch (packed, or padded to a bucket) has padding tokens, from its host counts (no device read):
    fewer real tokens than [B, T] holds."""
    return batch.n_real_tokens < batch.input_ids.numel()


def padding_hint(batch, on_device, device: torch.device, static: bool) -> bool | Unpadded:
    """What the model is told about a batch's padding (CUDA), from the host alone (no device read): False without
    padding (attention without a mask); True with padding in a compiled or captured step (the masked kernel there);
    else the batch's real tokens (:class:`models.bert.Unpadded`, which DDP passes on as it is), found in its host
    copy and sent to ``device``."""
    if not has_padding(on_device):
        return False
    if static or not jagged_enabled():
        return True
    return Unpadded.of(batch.to("cpu").attention_mask).to(device)


def sparse_rows(cfg: PretrainConfig, model: LebertForPretraining, graphs: bool = False,
                max_word_num: int | None = None) -> SparseRows | None:
    """With ``pretrain.model.word_table: sparse`` (and a word table), the table's row-wise trainer: AdamW at the
    run's betas, with the weight decay the dense table gets (it is a matrix: decayed); else None. A compiled or
    captured (``graphs``) step gathers a fixed number of rows per batch shape. Under DDP the ranks exchange row ids
    padded to the slots of the largest batch (batch size x max_seq_len x ``max_word_num``), a bound each knows."""
    adapter = model.encoder.adapter
    if cfg.model.word_table != "sparse" or adapter is None:
        return None
    capacity = cfg.data.batch_size * cfg.data.max_seq_len * max_word_num if max_word_num else None
    return SparseRows(adapter.word_embeddings.weight, cfg.lr, cfg.betas, cfg.weight_decay,
                      fixed_shape=cfg.compile or graphs, capacity=capacity)


# DDP's switch for the buffers' broadcast before every forward: renamed in torch 2.13 (the old name warns there)
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                   else {"broadcast_buffers": False})


def dropout_seed(seed: int, rank: int) -> int:
    """The seed of a DDP rank's dropout draws (set after the model is built, so every rank's initial weights are
    the same): ``seed + rank``, so the ranks' masks differ. One process keeps drawing after the model's init."""
    return seed + rank


def node_id() -> str:
    """This machine's place in a torchrun run (its node rank), else its host name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def verified_once_per_node(fs, ckpt_dir: str, world: int) -> dict[str, Any] | None:
    """The newest complete checkpoint's pointer entry (None: there is none), its files hashed once per machine:
    by the node's first rank (``LOCAL_RANK`` 0), whose answer the node's other ranks take (one control-plane
    gather), instead of every rank reading and hashing the whole checkpoint."""
    mine = newest_complete(fs, ckpt_dir) if world == 1 or local_rank() == 0 else None
    if world == 1:
        return mine
    every = collectives.gather_objects({"node": node_id(), "leader": local_rank() == 0, "entry": mine})
    return next(o["entry"] for o in every if o["leader"] and o["node"] == node_id())


def agree_on_resume(step: int, ckpt_dir: str, world: int) -> None:
    """Under DDP, after the checkpoint is loaded: every rank must resume the same step of the same version (its
    checkpoint directory's name), else one error on every rank now, instead of a run that diverges and then hangs
    (a node that read another directory, or found no checkpoint, starts at step 0)."""
    if world == 1:
        return
    mine = {"step": step, "version": ckpt_dir.rstrip("/").rsplit("/", 1)[-1]}
    every = collectives.gather_objects(mine)
    if any(o != every[0] for o in every):
        seen = ", ".join(f"rank {r}: step {o['step']} of {o['version']}" for r, o in enumerate(every))
        raise ValueError(f"the ranks resumed different checkpoints ({seen}): every node must read the same "
                         "checkpoint directory (a shared store_uri); fix the store, then run again")


def local_rank() -> int:
    """This process's GPU index under torchrun (0 otherwise)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak FLOP/s of a known GPU (None on CPU or an unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


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

    No step reads the device except at log rows (:class:`tasks.training.progress.Window`); each row is also an INFO
    line (:class:`tasks.training.progress.ProgressLog`, heartbeat every ``heartbeat_s``). On SIGTERM/SIGINT (``stop``;
    the one in effect, else installed here) :class:`tasks.training.preempt.Preempted` is raised on every rank at the
    same point: after the current step, with a checkpoint there (when ``ckpt_dir`` is set); during the held-out
    evaluation, with a checkpoint of its step whose log row the rerun writes first; between two rows while reading
    and packing; right after a checkpoint save the signal came during. Elsewhere the watchdog acts
    (:mod:`tasks.training.preempt`).
    """
    t_start = time.monotonic()
    with contextlib.nullcontext(stop) if stop is not None else stop_scope("pretrain") as stop:
        return _train(cfg, rows_factory, vocab_size, word_vectors, max_word_num, ckpt_fs, ckpt_dir, stop_at, on_log,
                      progress, data_key, on_data, heartbeat_s, stop, t_start)


def _train(cfg, rows_factory, vocab_size, word_vectors, max_word_num, ckpt_fs, ckpt_dir, stop_at, on_log, progress,
           data_key, on_data, heartbeat_s, stop: StopSignal, t_start: float):
    stop.phase = "building the model"
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
    use_graphs = step_graphs.wanted(cfg.cuda_graphs, device, world)
    rows = sparse_rows(cfg, model, graphs=use_graphs, max_word_num=max_word_num if world > 1 else None)
    if world > 1:  # each rank its own dropout draws (a checkpoint restores each rank's RNG state after this)
        torch.manual_seed(dropout_seed(cfg.seed, rank))
    checkpointing = ckpt_dir is not None  # on every rank: each one's RNG state goes into rank 0's checkpoint
    stop.say, stop.checkpointing = rank == 0, checkpointing
    if checkpointing:
        stop.phase = "reading the checkpoint"
        entry = verified_once_per_node(ckpt_fs, ckpt_dir, world)
        loaded = load_checkpoint(ckpt_fs, ckpt_dir, model, opt, sched, rank, rows, entry=entry)
        if loaded is not None:
            state, stop.checkpoint_step = loaded, loaded.step
        agree_on_resume(state.step, ckpt_dir, world)
    if use_graphs and device.type == "cuda":  # LR a device tensor the scheduler fills, step counts on the device
        step_graphs.make_capturable(opt, device)
    fwd = model
    if world > 1:  # DDP under torchrun: every rank reads its own share of the rows
        # the only buffer (the sinusoidal position table) is constant: no broadcast of it before every forward
        fwd = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      **_NO_BUFFER_SYNC)
    # static graphs, one per bucket (shapes.py): no recompiles, no dynamic-shape fallback
    fwd = torch.compile(fwd, backend=cfg.compile_backend, dynamic=False) if cfg.compile else fwd
    if rank != 0:
        progress, on_log = False, None
    say = ProgressLog("pretrain", cfg.steps, state.step, device, heartbeat_s or HEARTBEAT_S, enabled=rank == 0)
    peak = peak_flops(device)
    flops_0, flops_1 = (unwrap(model).flops_per_token(t, cfg.data.mask_prob) for t in (0, 1))
    flops_at = lambda t: flops_0 + (flops_1 - flops_0) * t  # noqa: E731  per token, attention over t tokens (linear)
    totals = {"tokens": 0, "flops": 0.0, "compute_s": 0.0}  # of the log rows this process wrote
    timed = device.type == "cuda"  # steps timed by CUDA events (no synchronisation per step); on CPU, host time
    log: list[dict[str, Any]] = list(state.log)  # rows before the checkpoint, when resuming
    end = min(cfg.steps, stop_at) if stop_at else cfg.steps
    train_rows, heldout_rows = split_heldout(rows_factory, cfg.data.heldout_frac, cfg.data.seed)

    def phase(what: str) -> None:  # a stop that came during the last phase stops here; the next one is named
        poll()
        say.phase(what)
        stop.phase = what

    with say, tempfile.TemporaryDirectory(prefix="lexiflow-pack-") as scratch:
        say.info("pretrain: model and optimizer on %s in %.1f s%s", device, time.monotonic() - t_start,
                 f", resuming at step {state.step}" if state.step else "")
        phase("reading the held-out set")
        eval_set = heldout_eval_set(heldout_rows(0, 1), cfg.data, cfg.eval_batches, ids, max_word_num)
        say.done(f"{len(eval_set)} batches")

        def build(out):
            return pack_rows(train_rows(rank, world), cfg.data, max_word_num, out, rank=rank, world=world,
                             specials=ids)

        phase("reading and packing the training rows")
        if data_key is not None:
            pack = cached_pack(pack_root(), pack_key(data_key, cfg.data, max_word_num, rank, world), build)
        else:
            pack = build(scratch)
        say.done(f"{pack.meta['rows']:,} rows, {len(pack):,} pairs, {pack.meta['tokens']:,} tokens")
        stop.phase = "waiting for the other ranks"
        ranks = gather_info({"rows": pack.meta["rows"], "pairs": len(pack), "tokens": pack.meta["tokens"]}, world)
        packing = cfg.data.packing == "pairs"
        if packing:  # rows of whole pairs, one static shape (pairpack.py): one graph compiled, or captured
            data = PairRows(pack.meta.get("dir") or pack, cfg.data, ids, rank)
        else:
            data = PackedBatches(pack.meta.get("dir") or pack, cfg.data, ids, rank)
            if cfg.compile or use_graphs:  # a handful of batch shapes: graphs compiled, or captured, once each
                data = BucketedBatches(data, cfg.compile_buckets)
        if rows is not None:  # the sparse table's rows renumbered in the loader's workers, not on this thread
            data = WordRows(data, fixed=rows.fixed_shape or packing)
        per_epoch = _min_over_ranks(data.per_epoch(), world)
        if per_epoch == 0:
            raise ValueError(f"rank {rank} of {world} has no training pairs: {pack.meta['rows']} rows read "
                             "(more data, or fewer ranks)")
        if on_data is not None and rank == 0:
            on_data({"world_size": world, "batches_per_epoch": per_epoch, "ranks": ranks,
                     **({"dropout_seeds": [dropout_seed(cfg.seed, r) for r in range(world)]} if world > 1 else {})})
        bar = tqdm(total=end, initial=state.step, desc="pretrain", unit="step", disable=not progress,
                   mininterval=2)
        acc = Window()
        acc.restore(state.window, device)
        model.train()

        def log_row(stopping: bool) -> bool:
            """The log row of ``state.step`` (held-out scores when due); False when a stop came during its
            evaluation (the window is as it was before the row: a checkpoint then carries the row to the rerun)."""
            before = acc.snapshot()
            row = acc.flush(state.step, state.epoch, float(sched.get_last_lr()[0]), None, peak)
            due = state.step % cfg.eval_every == 0 or state.step == end
            scores = {"heldout_mlm_acc": None, "heldout_mlm_loss": None}
            if due and eval_set:
                stop.phase = f"evaluating the held-out set at step {state.step}/{cfg.steps}"
                pause_point("pretrain.eval", until=lambda: stop.signum is not None)  # stop tests: parked here
                scores = evaluate(model, eval_set, device, cfg.model.use_adapter, cfg.precision,
                                  should_stop=lambda: stopping or stop.agreed(world))
                stop.phase = "training"
                if scores is None:
                    acc.load(before)
                    return False
            row.update(scores)
            log.append(row)
            for k, v in acc.last.items():
                totals[k] += v
            bar.set_postfix(mlm=f"{row['mlm_loss']:.3f}", nsp=f"{row['nsp_loss']:.3f}",
                            tok_s=f"{row['tokens_per_s']:.0f}", wait=f"{row['data_wait']:.0%}")
            say.row(row)
            if on_log:
                on_log(row)
            return True

        if state.row_pending:  # the last run stopped during this step's held-out evaluation: its row comes first
            if not log_row(False):
                raise stop.preempted(f"during the held-out evaluation at step {state.step}/{cfg.steps}")
            state.row_pending = False
        pin = device.type == "cuda"
        graphs = None
        if device.type == "cuda" and (cfg.compile or use_graphs):
            say.info("pretrain: attention in %s steps: SDPA without a mask for batches without padding (the flash "
                     "kernel can run), with the key mask for padded ones", "captured" if use_graphs else "compiled")
        if use_graphs:
            def forward(input_ids, segment_ids, attention_mask, word_ids, mlm_positions, mlm_labels, nsp_labels,
                        padded, **extra):  # extra: the word rows, a packed batch's pair layout
                with autocast(device, cfg.precision, cache=False), static_attention():  # as the capture will
                    return fwd(input_ids, segment_ids, attention_mask, word_ids, mlm_positions, mlm_labels,
                               nsp_labels, padded=padded, **extra)

            # a sparse word table: its rows' ids are one more input, the rows taken and stepped inside the graph
            graphs = step_graphs.StepGraphs(forward, opt, list(model.parameters()), cfg.grad_clip, rows=rows)
        schedule = Schedule(state.epoch, state.batch_in_epoch, max(end - state.step, 0), per_epoch)
        workers = cfg.data.loader_workers if cfg.data.loader_workers is not None else int(device.type == "cuda")
        batches = iter(loader(data, schedule, workers, cfg.data.prefetch, pin, cfg.data.loader))
        phase(("compiling and running" if cfg.compile else "running") + " the first step")
        pause_point("pretrain.first-step")  # stop tests: a phase that never polls (a compilation): the watchdog acts
        first_step = state.step + 1
        save_s: float | None = None  # how long this run's last checkpoint save took (rank 0)
        saved = True  # whether this step's checkpoint was written (False: a stop left it out)
        t_ready = time.perf_counter()
        fed = {"real": 0, "positions": 0}  # real tokens and token positions of the batches the model ran
        host_s: list[float] = []  # per step: the training thread's time outside the model (copies, launches)
        for (epoch, k), batch in batches:
            t0 = time.perf_counter()
            wait = t0 - t_ready  # this step's wait for data (0 when the loader is ahead)
            masked, pairs = batch.counts()
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timed else None
            if events:
                events[0].record()
            b = batch.to(device, non_blocking=pin)
            words = b.word_ids if cfg.model.use_adapter else None  # [B, T, W]
            # on CUDA the host tells the model about the batch's padding (flash-capable attention, no device read);
            # packed rows attend within their pairs (a block-diagonal mask): nothing to tell
            hint = ({"padded": padding_hint(batch, b, device, static=cfg.compile or graphs is not None)}
                    if pin and not packing else {})
            if packing:
                hint.update(position_ids=b.position_ids, pair_ids=b.pair_ids, cls_positions=b.cls_positions)
            if rows is not None:  # the batch's rows of the word table: its words were renumbered in the loader
                rows.adopt(b.word_row_ids, batch.n_word_rows, b.word_ids.numel())
                if graphs is None:  # a captured step takes the rows itself, from their ids (the graph's input)
                    hint["word_rows"] = rows.take(b.word_row_ids)
            t_call = time.perf_counter()
            if graphs is not None:
                inputs = dict(input_ids=b.input_ids, segment_ids=b.segment_ids, attention_mask=b.attention_mask,
                              word_ids=words, mlm_positions=b.mlm_positions, mlm_labels=b.mlm_labels,
                              nsp_labels=b.nsp_labels if nsp else None, **hint)
                inputs.setdefault("padded", None)
                if rows is not None:
                    inputs["word_row_ids"] = b.word_row_ids
                out, gnorm = graphs(inputs)
            else:
                with autocast(device, cfg.precision):
                    out = fwd(b.input_ids, b.segment_ids, b.attention_mask, words, b.mlm_positions, b.mlm_labels,
                              b.nsp_labels if nsp else None, **hint)
                gnorm = optimizer_step(opt, out.loss, model.parameters(), cfg.grad_clip, rows)
            t_back = time.perf_counter()
            sched.step()
            if events:
                events[1].record()
            fed["real"] += batch.n_real_tokens
            fed["positions"] += batch.seq_positions()
            state.step += 1
            state.epoch, state.batch_in_epoch = (epoch, k + 1) if k + 1 < per_epoch else (epoch + 1, 0)
            acc.add(out, masked, pairs, b.n_real_tokens, time.perf_counter() - t0, gnorm, wait,
                    b.n_real_tokens * flops_at(batch.attention_len()), events)
            bar.update(1)
            say.advance(state.step)
            host_s.append((t_call - t0) + (time.perf_counter() - t_back))
            if state.step == first_step:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # once: the first step's latency includes the device's work
                first_step_s = time.monotonic() - t_start
                say.done(f"{first_step_s:.1f} s after the stage started")
                stop.phase = "training"
                if on_data is not None and rank == 0:
                    on_data({"first_step_s": round(first_step_s, 2)})
            stopping = stop.after_step(world)  # under DDP agreed every few steps (no collective on the others)
            where = f"at step {state.step}/{cfg.steps}"
            if state.step % cfg.log_every == 0 or state.step == end:
                if not log_row(stopping):  # stopped during the evaluation: the checkpoint carries the row
                    stopping, state.row_pending = True, True
                    where = f"during the held-out evaluation at step {state.step}/{cfg.steps}"
            if checkpointing and (state.step % cfg.checkpoint_every == 0 or state.step == end or stopping):
                stop.phase = f"saving the checkpoint of step {state.step}/{cfg.steps}"
                rngs = gather_info(rng_state(device), world) if world > 1 else None
                if rank == 0 and stopping and not stop.save_fits(save_s):
                    # on a stop, a save that could not publish before the watchdog ends the process is not started:
                    # the last published checkpoint stands (only rank 0 saves, and says so)
                    saved = False
                    say.info("pretrain: the checkpoint of step %d is not written (the last save took %.1f s, more "
                             "than the stop leaves); the rerun resumes from step %s", state.step, save_s,
                             stop.checkpoint_step if stop.checkpoint_step is not None else 0)
                elif rank == 0:
                    # the log travels with the checkpoint; a row cut short by ``stop_at`` is not a real log row
                    state.log = [r for r in log if r["step"] % cfg.log_every == 0 or r["step"] == cfg.steps]
                    state.window = acc.state() if acc.n else None
                    t_save = time.monotonic()
                    save_checkpoint(ckpt_fs, ckpt_dir, model, opt, sched, state, rngs, rows, cfg.keep_checkpoints)
                    save_s = time.monotonic() - t_save
                    # crash tests: killed here (or signalled: it goes on), the next run resumes from this checkpoint
                    pause_point("pretrain", until=lambda: stop.signum is not None)
                if saved:
                    stop.checkpoint_step = state.step
                stop.phase = "training"
                stopping = stopping or stop.agreed(world)  # a signal during the save: this step's checkpoint is out
            if stopping:
                if hasattr(batches, "close"):
                    batches.close()  # stops the loader's workers
                bar.close()
                raise stop.preempted(where, written=checkpointing and saved)
            t_ready = time.perf_counter()
        del batches  # stops the loader's workers
        bar.close()
        if on_data is not None and rank == 0:
            on_data({"throughput": throughput(totals, time.monotonic() - t_start, peak),
                     **feed_record(fed, host_s)})
    return unwrap(model), log


def throughput(totals: dict[str, float], wall_s: float, peak: float | None) -> dict[str, Any]:
    """The stage's tokens/s and MFU two ways (this process, per rank): over the time spent in steps (compute only)
    and over the stage's wall time (building the model, reading and packing, data wait, evaluation and saves
    included). MFU None off a GPU of known peak."""
    tokens, flops, compute = totals["tokens"], totals["flops"], totals["compute_s"]
    return {"tokens": int(tokens), "flops": float(flops), "compute_s": round(compute, 3), "wall_s": round(wall_s, 3),
            "tokens_per_s": round(tokens / compute, 1) if compute else None,
            "wall_tokens_per_s": round(tokens / wall_s, 1) if wall_s else None,
            "mfu": round(flops / compute / peak, 4) if (peak and compute) else None,
            "wall_mfu": round(flops / wall_s / peak, 4) if (peak and wall_s) else None,
            "peak_flops": peak}


def feed_record(fed: dict[str, int], host_s: list[float]) -> dict[str, Any]:
    """What the run fed the model: ``fill``, real tokens / token positions of the batches it ran (padding lowers
    it), and ``host_ms``, the median milliseconds per step the training thread spent outside the model (the
    batch's copies, telling the model about it, the scheduler and the bookkeeping; on CUDA the launches too)."""
    return {"fill": round(fed["real"] / fed["positions"], 4) if fed["positions"] else None,
            "host_ms": round(1e3 * float(np.median(host_s)), 3) if host_s else None}


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
    """The smallest ``value`` over the ranks (every rank must take the same number of steps): a control-plane
    collective (:mod:`tasks.training.collectives`, gloo), never a CPU tensor on the default (NCCL) group."""
    return value if world == 1 else collectives.min_int(value)


def gather_info(info: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Every rank's ``info`` (rows read, pairs, tokens; RNG states), in rank order (over the gloo control group)."""
    return [info] if world == 1 else collectives.gather_objects(info)


@torch.no_grad()
def evaluate(model, batches: list, device: torch.device, use_adapter: bool, precision: str = "auto",
             should_stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
    """MLM accuracy and mean loss over every masked position of ``batches``, in eval mode (no dropout); None when
    ``should_stop()`` (asked before each batch: under DDP on every rank alike) says to stop first."""
    was, correct, loss, n = model.training, 0.0, 0.0, 0
    model.eval()
    try:
        for batch in batches:
            if should_stop is not None and should_stop():
                return None
            b = batch.to(device)
            with autocast(device, precision):
                out = model(b.input_ids, b.segment_ids, b.attention_mask, b.word_ids if use_adapter else None,
                            b.mlm_positions, b.mlm_labels, b.nsp_labels)
            k = int(b.mlm_labels.numel())
            correct += float(out.mlm_correct)
            loss += float(out.mlm_loss) * k
            n += k
    finally:
        model.train(was)
    return {"heldout_mlm_acc": correct / max(n, 1), "heldout_mlm_loss": loss / max(n, 1)}


def dist_info() -> tuple[int, int]:
    """(rank, world size) of an initialised process group, else (0, 1)."""
    return collectives.rank_world()
