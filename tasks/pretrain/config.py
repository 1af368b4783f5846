"""The pretrain stage's configuration: the model's shape, the data, the optimiser, checkpoints and devices."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from models.config import ModelShape
from tasks.common.config import THREADS, THREADS_DOC, deprecated


class PretrainDataConfig(BaseModel):
    """pretrain data: sequence length, masking and NSP pairing, shuffling and bucketing."""

    model_config = ConfigDict(extra="forbid")

    max_seq_len: int = Field(128, ge=8, description="[CLS] A [SEP] B [SEP] fits in this many tokens")
    batch_size: int = Field(32, ge=1, description="NSP pairs per step and process (DDP: the global batch is this "
                            "x world size); with packing 'pairs' it counts rows of max_seq_len tokens per step "
                            "and process, each holding several pairs (about max_seq_len / mean pair length): scale "
                            "it down by that to keep the tokens per step, and so the LR recipe, as they were; also "
                            "the held-out eval batch size (in pairs: evaluation is not packed)")
    # left out of every dump at their defaults, so the versions that predate them do not move
    packing: Literal["none", "pairs"] = Field(
        "none", exclude_if=lambda v: v == "none",
        description="none: one NSP pair a row, padded to the batch's longest (or to a bucket when compiled); pairs: "
        "rows of max_seq_len filled with several whole pairs (best-fit-decreasing bin packing over a pool of "
        "bucket_batches batches' pairs), attention only within a pair (a block-diagonal mask through SDPA, which "
        "keeps attention dropout), positions restarting per pair, MLM per pair and NSP from each pair's own [CLS]; "
        "with pairs_per_row pairs and a fixed number of masked positions a row (padded with ignored labels), every "
        "batch has one static shape (one compiled graph, one CUDA graph, no buckets)")
    pairs_per_row: int = Field(8, ge=1, exclude_if=lambda v: v == 8,
                               description="with packing: pairs: the most pairs one row holds (NSP slots a row, "
                               "unused ones ignored)")
    mask_prob: float = Field(0.15, gt=0.0, le=1.0, description="share of a pair's tokens (specials excluded) "
                             "masked for MLM, in whole-word units: at least 1, at most max_predictions_per_seq")
    mask_replace: float = Field(0.8, ge=0.0, le=1.0, description="selected units -> [MASK]")
    mask_random: float = Field(0.1, ge=0.0, le=1.0, description="selected units -> random tokens")
    nsp_random_prob: float = Field(0.5, ge=0.0, le=1.0, description="share of NotNext pairs")
    nsp_pool: int = Field(1024, ge=1, description="ring of recent sentences that NotNext B is drawn from")
    shuffle_buffer: int = Field(2048, ge=1, description="deprecated: examples in the shuffle buffer of the reference "
                                "loader (kept with the tests); the packed loader that trains permutes "
                                "whole epochs and does not read it (still part of the pretrain version)")
    bucket_batches: int = Field(32, ge=1, description="length-bucketing pool, in batches")
    seed: int = Field(1234, description="seed of the data: which documents are held out, the NSP pairing, each "
                      "epoch's order and each batch's masking")
    max_predictions_per_seq: int = Field(20, ge=1, description="most masked (predicted) tokens in one pair")
    heldout_frac: float = Field(0.02, ge=0.0, lt=1.0,
                                description="share of documents (by doc_id hash) held out of training for MLM eval")
    loader: Literal["thread", "process"] = Field(
        "thread", description="who builds batches in the background: threads of the training process (no copies), or "
        "DataLoader worker processes (for hosts with cores to spare); not in the version")
    loader_workers: int | None = Field(
        None, ge=0, description="loader threads or processes (0: built in the training loop; default: 1 on CUDA, 0 on "
        "CPU, where a loader thread would compete with torch's threads for the cores); batches are the same bytes "
        "whatever the number, so it is not in the version")
    prefetch: int = Field(4, ge=1, description="batches in flight per loader worker (not in the version)")

    _shuffle_buffer_deprecated = deprecated(
        "shuffle_buffer", "pretrain.data.shuffle_buffer",
        "training never reads it (the packed loader permutes whole epochs), though it still enters the pretrain "
        "version")

    @model_validator(mode="after")
    def _probs(self) -> "PretrainDataConfig":
        if self.mask_replace + self.mask_random > 1.0 + 1e-9:
            raise ValueError("mask_replace + mask_random must be <= 1")
        return self


FINETUNE_TRAIN = "@finetune"  # pretrain.extra_texts data_uri: the fine-tuning train split (resolved by PipelineConfig)


class ExtraTexts(BaseModel):
    """Unlabelled texts added to the pretraining corpus: the TRAIN rows of a labelled file, split exactly as
    fine-tuning splits it (same ``split``/``split_seed``) or a given ``train_uri``; dev/test texts never enter."""

    model_config = ConfigDict(extra="forbid")
    data_uri: str | None = Field(None, description="one labelled file: its train split is used; '@finetune': "
                                 "the fine-tuning data's train split (file, columns and split copied from finetune)")
    train_uri: str | None = Field(None, description="a given train file, used whole")
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = Field(
        "auto", description="the file's format; auto: from its extension (a compression suffix ignored)")
    text_column: str = Field("review", description="column holding the text")
    label_column: str = Field("label", description="column holding the label: rows with a bad label are skipped, "
                              "and data_uri's split stratifies by it")
    split: tuple[float, float, float] = Field((0.8, 0.1, 0.1), description="(train, dev, test) fractions that "
                                              "data_uri is split by, as fine-tuning splits it; only train is used")
    split_seed: int = Field(7, description="seed of data_uri's split (as finetune.split_seed for the same file)")
    repeat: int = Field(1, ge=1, description="times each text is offered per epoch (upweights the domain)")
    # as finetune.classes (the split stratifies by label, so the same file splits alike only with the same mode);
    # left out of every dump while "binary", so a binary run's pretrain version is what it always was
    classes: Literal["binary", "any"] = Field("binary", exclude_if=lambda v: v == "binary",
                                              description="how the label column is read: as finetune.classes")

    @model_validator(mode="after")
    def _one(self) -> "ExtraTexts":
        if bool(self.data_uri) == bool(self.train_uri):
            raise ValueError("pretrain.extra_texts: give exactly one of data_uri or train_uri")
        return self


class PretrainModel(ModelShape):
    """The encoder's shape (:class:`models.ModelShape`, defined once there) plus how pretraining treats it."""

    freeze_word_vectors: bool = Field(False, description="keep the adapter's word vectors (from the lexicon "
                                      "artifact) fixed during pretraining instead of training them (the same as "
                                      "word_table: freeze)")
    # left out of every dump while "dense" (and "freeze", which is written as freeze_word_vectors: true), so the
    # versions that predate it do not move
    word_table: Literal["dense", "sparse", "freeze"] = Field(
        "dense", exclude_if=lambda v: v in ("dense", "freeze"),
        description="how pretraining updates the adapter's word vectors: dense (the whole table every step: "
        "gradient, clipping and AdamW over every row), sparse (only the rows the batch touched, each with its own "
        "AdamW moments and step count, so a step costs what the batch touched, whatever the table's size; untouched "
        "rows are not decayed either, so the weights differ from dense) or freeze (kept fixed, as "
        "freeze_word_vectors)")

    # how pretraining treats the model, not its shape: not passed to models.ModelConfig
    TRAINING_ONLY: ClassVar[set[str]] = {"freeze_word_vectors", "word_table"}

    @model_validator(mode="after")
    def _word_table(self) -> "PretrainModel":
        if self.freeze_word_vectors and "word_table" in self.model_fields_set and self.word_table != "freeze":
            raise ValueError(f"pretrain.model.freeze_word_vectors true keeps the word vectors fixed, but "
                             f"pretrain.model.word_table is {self.word_table!r}: set word_table: freeze alone, or "
                             "drop freeze_word_vectors")
        if self.word_table == "freeze" or self.freeze_word_vectors:  # one setting, dumped as it always was
            self.freeze_word_vectors, self.word_table = True, "freeze"
        return self


class PretrainConfig(BaseModel):
    """pretrain: MLM + NSP on the matched shards (optimiser, schedule, checkpoints, devices)."""

    model_config = ConfigDict(extra="forbid")
    model: PretrainModel = PretrainModel()
    data: PretrainDataConfig = PretrainDataConfig()
    # init_from and nsp are left out of every dump at their defaults, so a from-scratch version is what it always was
    init_from: str | None = Field(
        None, exclude_if=lambda v: v is None,
        description="a Hugging Face BERT directory (path or fsspec URL: config.json, model.safetensors or "
        "pytorch_model.bin, vocab.txt) whose weights start pretraining; its vocab.txt becomes the vocabulary and "
        "the model section must match its shape; nothing is downloaded")
    nsp: Literal["auto", "on", "off"] = Field(
        "auto", exclude_if=lambda v: v == "auto",
        description="the NSP loss: auto (on from scratch; with init_from, on only when the checkpoint has its NSP "
        "head), on, or off (MLM alone)")
    steps: int = Field(1000, ge=0, description="optimiser steps (one batch per process each); the LR schedule "
                       "ends at the last; 0 (with init_from): import only")
    lr: float = Field(5e-4, gt=0, description="peak AdamW learning rate, reached at the end of the warm-up")
    weight_decay: float = Field(0.01, description="AdamW weight decay (not on biases or LayerNorm weights)")
    betas: tuple[float, float] = Field((0.9, 0.98), description="AdamW (beta1, beta2)")
    warmup_steps: int = Field(100, ge=0, description="steps of linear LR warm-up from lr / warmup_steps to lr")
    schedule: Literal["linear", "cosine"] = Field(
        "linear", description="LR decay after the warm-up, down to 0 at the last step: linear or half-cosine")
    grad_clip: float = Field(1.0, gt=0, description="the global gradient L2 norm is clipped to this every step")
    log_every: int = Field(10, ge=1, description="steps per log row (mean losses and accuracies, LR, grad norm, "
                           "throughput), plus the last step")
    checkpoint_every: int = Field(200, ge=1, description="steps between checkpoints (and the last step); a "
                                  "restarted run resumes from the latest")
    # where the run keeps its state, not what it computes: never in the version, left out of dumps at its default
    keep_checkpoints: int = Field(2, ge=1, exclude_if=lambda v: v == 2, description="published checkpoints kept: the "
                                  "newest and, with 2, the one before it to fall back to if the newest is found "
                                  "damaged; 1 halves the disk they take (not in the version)")
    eval_every: int = Field(100, ge=1, description="held-out MLM eval at log rows at multiples of it, and the last")
    eval_batches: int = Field(8, ge=1, description="held-out batches scored per eval")
    extra_texts: list[ExtraTexts] = Field(
        default_factory=list, description="domain-adaptive pretraining: TRAIN texts of labelled files (never dev/test)")
    seed: int = Field(1234, description="torch seed set before the model is built: initial weights, dropout draws")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when a GPU is available (under torchrun the LOCAL_RANK one), else CPU; "
        "cpu / cuda force it")
    gpus: int = Field(1, ge=1, description="processes per node (GPUs, or CPU processes over gloo); >1 or nnodes>1 "
                      "launches torchrun (DDP)")
    nnodes: int = Field(1, ge=1, description="machines in the run: world size = gpus x nnodes")
    node_rank: int = Field(0, ge=0, description="this machine's index, 0..nnodes-1; node 0 writes the artifact "
                           "(not in the version)")
    master_addr: str = Field("127.0.0.1", description="node 0's address that every node can reach (not in the version)")
    master_port: int = Field(29500, ge=1, le=65535, description="a free TCP port on node 0 (not in the version)")
    # left out of every dump at its default, and of the version: how long to wait, not what is computed
    dist_timeout_s: float = Field(
        600.0, gt=0, exclude_if=lambda v: v == 600.0,
        description="under DDP: how long the rendezvous and any collective wait for a rank or node that does not "
        "answer before the run fails with an error naming it (not in the version)")
    compile: bool = Field(False, description="torch.compile the model")
    # left out of every dump at its default, so versions that predate it do not move
    compile_buckets: int = Field(4, ge=1, exclude_if=lambda v: v == 4, description="with compile or cuda_graphs: "
                                 "batches are padded to one of this many sequence lengths (and the masked positions "
                                 "and pairs to the most that length allows), so a run compiles (or captures) about "
                                 "this many graphs")
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor", description="inductor (fused kernels: Triton on GPU); aot_eager traces and runs the same graphs "
        "unfused (the CPU tests use it: dynamo and AOT autograd without minutes of C++ builds)")
    # left out of every dump while off, so versions that predate it do not move
    cuda_graphs: bool = Field(
        False, exclude_if=lambda v: v is False,
        description="on CUDA, one process: the whole training step (forward, backward, clipping, fused AdamW) is "
        "captured in one CUDA graph per batch shape and replayed, so kernel launches no longer pace the GPU; "
        "batches are bucketed as with compile (compile_buckets); a failed capture logs one warning and the run goes "
        "on without graphs; ignored, with one info line, on CPU and under DDP")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU; bf16 / fp32 force it on any device")
    threads: int = Field(THREADS, ge=1, description=THREADS_DOC)

    @model_validator(mode="after")
    def _nodes(self) -> "PretrainConfig":
        if self.node_rank >= self.nnodes:
            raise ValueError(f"pretrain.node_rank {self.node_rank} must be below pretrain.nnodes {self.nnodes}")
        if self.steps == 0 and self.init_from is None:
            raise ValueError("pretrain.steps 0 imports only: it needs pretrain.init_from")
        return self

    @property
    def world_size(self) -> int:
        """Processes in the run: GPUs per node times nodes."""
        return self.gpus * self.nnodes

    # where and how it runs, not what it computes: left out of the version
    NOT_VERSIONED: ClassVar[dict] = {"node_rank": True, "master_addr": True, "master_port": True,
                                     "dist_timeout_s": True,
                                     "keep_checkpoints": True,
                                     "data": {"loader", "loader_workers", "prefetch"}}
