"""The pretrain stage: train on a lexicon artifact's shards, then write the BERT checkpoint (safetensors), its
config, the training log and the loss plot into the staging directory.

The training loop is :mod:`tasks.pretrain.train`; on several GPUs or nodes the stage runs it under torchrun
(:mod:`tasks.pretrain.launch` starts the ranks, each one :mod:`tasks.pretrain.rank`), and global rank 0 writes.
Measured timings (tokens/s, MFU, data wait) go to the manifest's ``run`` section, never into ``log.parquet``.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
from safetensors.torch import save as st_save

from storage.artifacts import ArtifactRef, ArtifactStore, StagingHandle, open_artifact
from storage.fingerprints import FingerprintCache
from storage.parquet import write_table
from tasks.common.context import StageContext
from tasks.common.plots import line_panels
from tasks.common.stage import Stage, StageResult, input_source
from tasks.common.ui import Reporter
from tasks.inference.runtime import numerics_config, resolve_device
from tasks.pretrain import import_hf
from tasks.pretrain.config import PretrainConfig
from tasks.pretrain.data import iter_rows, max_word_num
from tasks.pretrain.launch import ddp_spec, join_as_node, launch_ddp
from tasks.pretrain.train import dist_info, local_rank, train
from tasks.text.vocab import TokenIds, parse_vocab
from tasks.training.checkpoint import weights
from tasks.training.preempt import set_phase, stoppable

# bump when a build of the same inputs would write other bytes
CODE_VERSION = "pretrain-5"
# the code version of what only runs on several processes (the ranks' dropout seeds, the sparse rows' exchange):
# in the version of those runs alone, so it moves their versions and leaves one-process versions where they are
DDP_CODE_VERSION = "ddp-2"


# the UI table (live throughput included)
LOG_COLUMNS = ("step", "mlm_loss", "nsp_loss", "mlm_acc", "heldout_mlm_acc", "lr", "tokens_per_s", "mfu",
               "data_wait")
# measured per log row: shown live, kept in the manifest's run section, never written to log.parquet
TIMING_COLUMNS = ("tokens_per_s", "mfu", "data_wait", "wall_tokens_per_s", "wall_mfu")


def learned(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log rows as ``log.parquet`` holds them: what was learned, without the measured timings."""
    return [{k: v for k, v in r.items() if k not in TIMING_COLUMNS} for r in log]


def run_record(log: list[dict[str, Any]], wall_s: float, throughput: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """The manifest's ``run`` section: wall time, median throughput (and MFU on CUDA), and per log row the
    step, tokens/s and MFU (rounded; ``log``, column-wise) of a build of this version; with ``throughput``
    (:func:`tasks.pretrain.train.throughput`) the whole stage's tokens/s and MFU, compute only and over the wall
    time. None of it enters a data file."""
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
    if any(r.get("wall_tokens_per_s") is not None for r in log):
        run["log"]["wall_tokens_per_s"] = [_round(r.get("wall_tokens_per_s"), 1) for r in log]
        run["log"]["wall_mfu"] = [_round(r.get("wall_mfu"), 4) for r in log]
    if throughput is not None:
        run["throughput"] = throughput
    return run


def _round(v: float | None, digits: int) -> float | None:
    return round(float(v), digits) if v is not None else None


def plot_log(log: list[dict[str, Any]], title: str = "pretrain") -> bytes:
    """PNG of MLM/NSP loss and MLM accuracy against step."""
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
    # the labelled-text readers and the matcher load only when there are extra texts to read
    from tasks.pretrain.domain import extra_rows, mixed_factory  # noqa: PLC0415
    from tasks.text.featurize import Featurizer  # noqa: PLC0415

    extra = extra_rows(cfg.extra_texts, Featurizer.from_artifacts(lex, max_len=10**9))
    digest = hashlib.sha256(repr([(r["doc_id"], r["char_ids"].tobytes(), r["word_ids"].tobytes())
                                  for r in extra]).encode()).hexdigest()[:16]
    return mixed_factory(rows, extra, int(lex.manifest.stats["out"])), len(extra), f"{key}+extra/{digest}"


def lexicon_inputs(lex, vocab=None) -> tuple[TokenIds, np.ndarray, int]:
    """What pretraining needs from a lexicon artifact: (the vocabulary's size and special ids, word vectors
    [n_words, dim], W words per character); ``vocab`` is its vocab parent (found from the manifest when not given).
    Checksum-verified reads."""
    vocab = vocab or open_artifact(next(p for p in lex.manifest.parents if p.stage == "vocab"))
    ids = TokenIds.of(parse_vocab(vocab.read_verified("vocab.txt")))
    return ids, np.load(io.BytesIO(lex.read_verified("word_vectors.npy"))), max_word_num(lex)


@stoppable("pretrain")  # SIGTERM/SIGINT in any phase: stops within 15 s, resumable (tasks.training.preempt)
def run_pretrain_stage(writer, cfg: PretrainConfig, lexicon_uri: str, vocab_uri: str, ckpt_fs, ckpt_dir: str,
                       on_log=None, progress: bool = True
                       ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]] | None:
    """Train (resuming from ``ckpt_dir``), then write weights, configs, log and plot into ``writer``.
    Returns (log rows, metrics, run record) on rank 0; None on the other ranks (rank 0 alone writes).
    The log rows keep their measured timings (for the UI); ``log.parquet`` does not (:func:`learned`)."""
    set_phase("reading the lexicon and the vocabulary")
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
    set_phase("writing the artifact")
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
    if "dropout_seeds" in data:  # under DDP: each rank's dropout seed (seed + rank)
        metrics["dropout_seeds"] = data["dropout_seeds"]
    if cfg.init_from:  # the checkpoint's identity (its files' sha256): what the version counted
        metrics["init_from"] = {**model.imported, "files": import_hf.identity(import_hf.checkpoint_sources(
            cfg.init_from)), "nsp": bool(model.nsp_head.classifier.weight.requires_grad),
            "adapter_layer": cfg.model.adapter_layer if cfg.model.use_adapter else None}
    return log, metrics, {**run_record(log, wall, data.get("throughput")), "first_step_s": data.get("first_step_s"),
                          "fill": data.get("fill"), "host_ms": data.get("host_ms")}


def _r4(v: float | None) -> float | None:
    return round(v, 4) if v is not None else None


def stage_result(log: list[dict[str, Any]], metrics: dict[str, Any], run: dict[str, Any] | None = None
                 ) -> StageResult:
    """The stage's counts (in = out = steps), metrics, rows, run record, and the log table to publish."""
    steps = metrics["steps"]
    return StageResult({"in": steps, "out": steps, "rejected": {}}, metrics, {"log.parquet": len(log)},
                       publish=partial(publish_log, log), run=run or {})


def publish_log(log: list[dict[str, Any]], art, reporter: Reporter) -> None:
    """UI: the pretraining log as a table artifact (nothing where there is no UI)."""
    reporter.publish_table("pretrain-log", log, LOG_COLUMNS, "pretraining log (per log_every steps)")



def version_config(cfg: PretrainConfig, cache: FingerprintCache | None = None) -> dict[str, Any]:
    """What the pretrain version covers besides its parents: the section, the fingerprints of the ``extra_texts``
    files when there are any (their bytes are training data too: new data, new version), and the numerics.
    Their URIs stay in the manifest; the version counts the fingerprints in their place
    (``storage.artifacts.without_locations``). So does ``init_from``: the checkpoint's config.json, weights
    and vocab.txt."""
    config = cfg.model_dump(mode="json", exclude=cfg.NOT_VERSIONED)
    if cfg.init_from is not None:  # the checkpoint's files by their bytes, their location as provenance
        config["init_from"] = import_hf.checkpoint_sources(cfg.init_from, cache)
    if cfg.extra_texts:
        config["extra_inputs"] = [input_source(ex.data_uri or ex.train_uri, cache=cache) for ex in cfg.extra_texts]
    if cfg.world_size > 1:  # a DDP run's bytes depend on the DDP code too
        config["ddp_code"] = DDP_CODE_VERSION
    return {**config, "numerics": numerics_config(cfg.threads, cfg.device)}


def build(ctx: StageContext, lexicon_ref: ArtifactRef, vocab_ref: ArtifactRef, progress: bool = True) -> StageResult:
    """Train into the stage's staging as its training step (``ctx.step``): here, or under torchrun when
    ``cfg.world_size > 1`` (the ranks attach through ``ctx.staging``); checkpoints live under
    ``<store>/_checkpoints/pretrain/<version>``."""
    cfg = ctx.cfg
    if cfg.world_size > 1:
        return stage_result(*ctx.step(launch_ranks, spec=ddp_spec(ctx.staging, cfg, lexicon_ref.uri, vocab_ref.uri),
                                      cfg=cfg))
    bar = ctx.progress(cfg.steps, "pretrain: steps done")
    live = ctx.live_table("pretrain-log", LOG_COLUMNS, "pretraining log (per log_every steps)")  # shown while training

    def on_log(row: dict[str, Any]) -> None:
        bar.step(cfg.log_every)
        live.add(row)

    ckpt = ctx.store.checkpoint_path(ctx.stage, ctx.version)
    return stage_result(*ctx.step(run_pretrain_stage, writer=ctx.writer, cfg=cfg, lexicon_uri=lexicon_ref.uri,
                                  vocab_uri=vocab_ref.uri, ckpt_fs=ctx.store.fs, ckpt_dir=ckpt, on_log=on_log,
                                  progress=progress))


def launch_ranks(spec: dict[str, Any], cfg: PretrainConfig
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """torchrun's ranks on this node (:func:`tasks.pretrain.launch.launch_ddp`); rank 0's (log, metrics, run)."""
    res = launch_ddp(spec, cfg)
    if res is None:
        raise RuntimeError("pretrain: torchrun finished but global rank 0 wrote no result: node 0 must be the "
                           "one that commits (pretrain.node_rank 0)")
    return res


# training stages carry the tag `gpu`: `prefect concurrency-limit create gpu 1` keeps two flows off one GPU
STAGE = Stage("pretrain", CODE_VERSION, PretrainConfig, parents=("lexicon_ref", "vocab_ref"), build=build,
              version_config=version_config, tags=("gpu",))


def join(store: ArtifactStore, cfg: PretrainConfig, lexicon_ref: ArtifactRef, vocab_ref: ArtifactRef) -> ArtifactRef:
    """Node ``cfg.node_rank`` > 0 of a run on several machines: join node 0's torchrun for this version and return
    once node 0 has committed it (node 0 holds the stage's lease)."""
    version = STAGE.plan(cfg, {"lexicon_ref": lexicon_ref, "vocab_ref": vocab_ref}).version
    return join_as_node(StagingHandle(store.uri, STAGE.name, version), cfg, lexicon_ref.uri, vocab_ref.uri)
