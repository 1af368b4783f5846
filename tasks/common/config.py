"""Typed configuration: one pydantic model per stage, YAML profiles and ``key=value`` overrides."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from models.config import ModelShape

# torch CPU threads of every torch stage and of labelling: a fixed default, never the machine's core count (float
# reductions split over the threads, so results, and versions, depend on it)
THREADS = 2
THREADS_DOC = "torch CPU threads (results depend on it, so it enters the version; fixed, not the core count)"

log = logging.getLogger(__name__)
_WARNED: set[tuple[str, object]] = set()


def warn_deprecated(field: str, value: object, why: str) -> None:
    """Warn (once per field and value) that a deprecated field was set: it stays accepted and in every dump, so
    the versions it enters do not move, but nothing reads it."""
    if (field, value) in _WARNED:
        return
    _WARNED.add((field, value))
    msg = f"{field}={value!r} is deprecated: {why}; it is still accepted and kept in the config"
    warnings.warn(msg, DeprecationWarning, stacklevel=2)
    log.warning(msg)


def deprecated(field: str, shown: str, why: str):
    """A validator of a model's deprecated ``field`` (named ``shown`` in the warning): a value other than the
    default warns (:func:`warn_deprecated`) and is kept as given."""

    def check(cls, v):
        if v != cls.model_fields[field].default:
            warn_deprecated(shown, v, why)
        return v

    return field_validator(field)(classmethod(check))


class _Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")


DISAMBIGUATION_TEMPLATES = (
    "disambig", "disambiguation", "dab", "disambig-cleanup", "消歧义", "消歧義", "消除歧义", "消除歧義", "消歧义页",
    "消歧義頁", "人名消歧义", "人名消歧義", "地名消歧义", "地名消歧義", "geodis", "hndis", "hndis-cjk", "numberdis",
    "shipindex", "schooldis", "mountainindex", "roaddis", "taxondis", "molformdisambig", "letter-numbercombdisambig",
)


class DumpConfig(_Stage):
    """clean, MediaWiki XML dumps (``.xml``, ``.xml.bz2``, multistream ``.xml.bz2`` + index): which pages count as
    disambiguation pages, where the multistream index is and how many bz2 streams one shard task decodes.

    Only ``disambiguation_templates`` changes results; ``index_uri`` and ``streams_per_task`` only decide how the
    work is split (the artifact's bytes are the same), so they are left out of the clean version."""

    disambiguation_templates: list[str] = Field(
        default_factory=lambda: list(DISAMBIGUATION_TEMPLATES),
        description="a page using one of these templates (case-insensitive) is rejected as 'disambiguation'",
    )
    index_uri: str | None = Field(
        None, description="the multistream index (offset:page_id:title lines); None: beside the dump by its "
        "standard name (...-multistream.xml.bz2 -> ...-multistream-index.txt.bz2), else read sequentially")
    streams_per_task: int = Field(200, ge=1, description="bz2 streams (about 100 pages each) per shard task")


class CleanConfig(_Stage):
    """clean: read raw dumps, normalise, split sentences, filter, dedup."""

    input_format: Literal["auto", "jsonl", "wikiextractor_doc", "text", "mediawiki_xml"] = Field(
        "auto", description="how an input file is read; auto: a MediaWiki XML dump by its content, else by its first "
        "non-blank line ('{': jsonl, '<doc': wikiextractor_doc, else text: blank lines separate documents)")
    min_chars: int = Field(5, ge=1, description="shortest sentence kept, in characters")
    min_cjk_ratio: float = Field(0.3, ge=0.0, le=1.0, description="least share of CJK characters")
    max_line_bytes: int = Field(1_000_000, ge=1024, description="longer input lines are rejected")
    dedup: bool = Field(True, description="drop a sentence already seen in any input file (exact, after "
                        "normalisation), rejected as duplicate")
    shard_rows: int = Field(8192, ge=1, description="sentences per output shard")
    dump: DumpConfig = DumpConfig()


class NumbersConfig(_Stage):
    """numbers: integers/decimals -> ``#NUM#``; English words marked for whole-word masking."""

    min_english_len: int = Field(2, ge=1, description="shortest ASCII-letter run marked as an English word")


class VocabConfig(_Stage):
    """vocab: characters by frequency after the specials; rarer or surplus ones are counted as rejected."""

    min_count: int = Field(1, ge=1, description="characters seen fewer times are left out (rejected as "
                           "below_min_count; they read as [UNK])")
    max_size: int | None = Field(None, ge=7, description="most vocabulary entries, the 6 specials included; the "
                                 "rarest surplus characters are rejected as over_max_size; None: no limit")
    # left out of every dump while unset, so a counted vocabulary's version is what it always was
    checkpoint: str | None = Field(
        None, exclude_if=lambda v: v is None,
        description="a Hugging Face BERT directory (path or fsspec URL): its vocab.txt is the vocabulary (ids kept, "
        "#NUM# in its [unused1] slot) instead of counting characters; set from pretrain.init_from by the pipeline")


class EmbeddingsConfig(_Stage):
    """embeddings: read the Tencent file (optionally only its first words)."""

    max_scan_num: int | None = Field(None, ge=1, description="read at most this many words")


class TrieConfig(_Stage):
    """trie: the lexicon trie over the most frequent embedding words."""

    max_scan_num: int | None = Field(None, ge=1, description="trie holds the first N words (by rank)")


class LexiconConfig(_Stage):
    """lexicon: words kept per character, the shortest word matched and the seed of the vectors for words
    without one."""

    max_word_num: int = Field(3, ge=1, description="words kept per character")
    min_word_len: int = Field(2, ge=2, description="shortest lexicon word matched (tokens); featurizer reads it too")
    seed: int = Field(42, description="seed of the uniform(+-sqrt(3/d)) vectors given to [UNK] and to matched "
                      "words without a Tencent vector")


class RunnerConfig(_Stage):
    """How tasks run: which Prefect task runner maps the shard tasks (every flow that maps shards), retries and
    timeouts (every stage is idempotent: staged files then a move; training resumes from its checkpoint), and
    the staging lease that lets overlapping runs share a store."""

    kind: Literal["thread", "dask"] = Field(
        "thread", description="what runs the shard tasks: thread (Prefect's thread pool in this process, "
        "max_workers) or dask (the cluster at dask_address, else a LocalCluster started for the run)")
    max_workers: int | None = Field(None, ge=1, description="thread runner pool size")
    dask_address: str | None = Field(None, description="existing cluster; None starts a LocalCluster")
    dask_workers: int = Field(2, ge=1, description="worker processes of the LocalCluster, at most the CPUs the "
                              "process may use (affinity, cgroup quota; unused with dask_address)")
    dask_threads_per_worker: int = Field(1, ge=1, description="threads per LocalCluster worker (unused with "
                                         "dask_address)")
    shard_retries: int = Field(2, ge=0, description="retries of a failed shard task")
    stage_retries: int = Field(1, ge=0, description="retries of a failed stage (training resumes from its checkpoint)")
    retry_delay_s: float = Field(10.0, ge=0, description="seconds to wait before retrying a failed shard or stage")
    shard_timeout_s: float | None = Field(None, gt=0, description="a shard task running longer fails (and retries)")
    stage_timeout_s: float | None = Field(None, gt=0, description="a stage running longer fails; None: no limit")
    lease_heartbeat_s: float = Field(15.0, gt=0, description="how often a run refreshes its staging owner record")
    lease_stale_after_s: float = Field(120.0, gt=0, description="an owner silent this long (other host) is dead")
    lease_poll_s: float = Field(2.0, gt=0, description="how often a run waiting for another's version looks again")
    rehash_inputs: bool = Field(False, description="hash every input file again (default: an input whose URL, size "
                                "and mtime are unchanged takes its sha256 from <store>/_fingerprints)")

    @model_validator(mode="after")
    def _lease(self) -> "RunnerConfig":
        if self.lease_stale_after_s <= 2 * self.lease_heartbeat_s:
            raise ValueError("runner.lease_stale_after_s must exceed 2 x lease_heartbeat_s")
        return self


class PrepareConfig(_Stage):
    """The ``prepare`` flow: clean -> numbers -> vocab; embeddings -> trie; -> lexicon."""

    store_uri: str = Field(".lexiflow/store", description="root of the artifact store (local path or any fsspec "
                           "URL): every stage's {stage}/{version}/, checkpoints, aliases, input fingerprints")
    corpus_uri: str | list[str] = Field(..., description="fsspec URL, glob or list of them")
    embeddings_uri: str = Field(..., description="Tencent-format text file (any fsspec URL)")
    seed: int = Field(42, description="deprecated, read by no stage: the seeds that take effect are the stages' own "
                      "(lexicon.seed, pretrain.seed, pretrain.data.seed, finetune.seed, ner.seed)")
    progress: bool = Field(True, description="tqdm progress bars, shown only when stderr is a terminal "
                           "(LEXIFLOW_PROGRESS=0/1 overrides that); the Prefect UI's progress is unaffected")
    runner: RunnerConfig = RunnerConfig()
    clean: CleanConfig = CleanConfig()
    numbers: NumbersConfig = NumbersConfig()
    vocab: VocabConfig = VocabConfig()
    embeddings: EmbeddingsConfig = EmbeddingsConfig()
    trie: TrieConfig = TrieConfig()
    lexicon: LexiconConfig = LexiconConfig()
    # fsspec options per protocol, e.g. {"s3": {"endpoint_url": ..., "key": ..., "secret": ...}}, installed as
    # fsspec defaults at flow start (storage.options.configure). Credentials: excluded from every dump and repr,
    # so never in a version, a manifest or a Prefect parameter (deployments: use FSSPEC_* variables).
    storage_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, exclude=True, repr=False, description="fsspec options per protocol (s3, gs, ...)"
    )

    @field_validator("corpus_uri")
    @classmethod
    def _nonempty(cls, v: str | list[str]) -> str | list[str]:
        if not v:
            raise ValueError("corpus_uri is empty")
        return v

    _seed_deprecated = deprecated("seed", "seed", "no stage reads it; the stages' own seeds take effect "
                                  "(lexicon.seed, pretrain.seed, pretrain.data.seed, finetune.seed, ner.seed)")


class PretrainDataConfig(BaseModel):
    """pretrain data: sequence length, masking and NSP pairing, shuffling and bucketing."""

    model_config = ConfigDict(extra="forbid")

    max_seq_len: int = Field(128, ge=8, description="[CLS] A [SEP] B [SEP] fits in this many tokens")
    batch_size: int = Field(32, ge=1, description="NSP pairs per step and process (DDP: the global batch is this "
                            "x world size); also the held-out eval batch size")
    mask_prob: float = Field(0.15, gt=0.0, le=1.0, description="share of a pair's tokens (specials excluded) "
                             "masked for MLM, in whole-word units: at least 1, at most max_predictions_per_seq")
    mask_replace: float = Field(0.8, ge=0.0, le=1.0, description="selected units -> [MASK]")
    mask_random: float = Field(0.1, ge=0.0, le=1.0, description="selected units -> random tokens")
    nsp_random_prob: float = Field(0.5, ge=0.0, le=1.0, description="share of NotNext pairs")
    nsp_pool: int = Field(1024, ge=1, description="ring of recent sentences that NotNext B is drawn from")
    shuffle_buffer: int = Field(2048, ge=1, description="deprecated: examples in the shuffle buffer of the reference "
                                "loader (tasks.pretrain.data.iter_batches); the packed loader that trains permutes "
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
                                      "artifact) fixed during pretraining instead of training them")


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
    compile: bool = Field(False, description="torch.compile the model")
    # left out of every dump at its default, so versions that predate it do not move
    compile_buckets: int = Field(4, ge=1, exclude_if=lambda v: v == 4, description="with compile: batches are "
                                 "padded to one of this many sequence lengths (and the masked positions and pairs "
                                 "to the most that length allows), so a run compiles about this many graphs")
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor", description="inductor (fused kernels: Triton on GPU); aot_eager traces and runs the same graphs "
        "unfused (the CPU tests use it: dynamo and AOT autograd without minutes of C++ builds)")
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
                                     "data": {"loader", "loader_workers", "prefetch"}}


class _LabelledFiles(BaseModel):
    """The labelled data files: one file to split, or given splits."""

    model_config = ConfigDict(extra="forbid")

    data_uri: str | None = Field(None, description="one labelled file, split by `split`/`split_seed`")
    train_uri: str | None = Field(None, description="given splits are used as they are")
    dev_uri: str | None = Field(None, description="given splits: the dev file (required with train_uri); the best "
                                "epoch is chosen on it")
    test_uri: str | None = Field(None, description="given splits: the test file (optional); scored with the chosen "
                                 "model only, never used to choose; None: no test metrics")

    def input_uris(self) -> dict[str, str]:
        """The data files that are set, by role (data/train/dev/test)."""
        return {k: u for k in ("data_uri", "train_uri", "dev_uri", "test_uri") if (u := getattr(self, k))}


class LabelledDataConfig(_LabelledFiles):
    """Where a supervised stage's rows come from: one file split deterministically, or given splits."""

    split: tuple[float, float, float] = Field((0.8, 0.1, 0.1), description="(train, dev, test) fractions that "
                                              "data_uri is split by: train, dev > 0, test >= 0, sum 1")
    split_seed: int = Field(7, description="seed of data_uri's split; split_seed + 1, + 2, + 3 seed the train, dev "
                            "and test subsamples (the max_* caps)")

    @model_validator(mode="after")
    def _check_data(self) -> "LabelledDataConfig":
        if self.data_uri and any((self.train_uri, self.dev_uri, self.test_uri)):
            raise ValueError("give either data_uri or train_uri/dev_uri[/test_uri], not both")
        if not self.data_uri and not (self.train_uri and self.dev_uri):
            raise ValueError(f"{self._section} needs data_uri, or train_uri and dev_uri")
        tr, dv, te = self.split
        if tr <= 0 or dv <= 0 or te < 0 or abs(tr + dv + te - 1.0) > 1e-6:
            raise ValueError(f"split {self.split}: train, dev > 0, test >= 0, summing to 1")
        return self

    _section = "this stage"


class _TableColumns(_LabelledFiles):
    """How a labelled table is read: its format and the text and label columns."""

    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = Field(
        "auto", description="the files' format; auto: from each name's extension (a compression suffix ignored)")
    text_column: str = Field("review", description="column holding the text (empty text: row rejected)")
    label_column: str = Field("label", description="column holding the label, read as `classes` says (a bad "
                              "label: row rejected)")


class FinetuneConfig(LabelledDataConfig, _TableColumns):
    """finetune: labelled reviews -> classifier (mean–max pooling, early stopping on dev AUC).

    Pydantic orders fields by the reversed MRO, so ``model_dump()`` lists the files, the table
    columns, the split, then the fields below: the key order finetune manifests always had."""

    _section = "finetune"

    max_train_rows: int | None = Field(None, ge=1, description="deterministic subsample of train (CPU demo)")
    max_eval_rows: int | None = Field(None, ge=1, description="deterministic subsample of dev and of test")
    max_len: int = Field(128, ge=3, description="tokens incl. [CLS]/[SEP]; capped at the model's max_len")
    truncation: Literal["head", "head_tail"] = Field(
        "head", description="a longer review keeps its first max_len - 2 tokens (head), or the first and last halves "
        "of them (head_tail); recorded in the bundle, so labelling cuts the same way")
    use_layers: int = Field(3, ge=1, description="encoder blocks used (clamped to the model's)")
    dropout: float = Field(0.4, ge=0.0, lt=1.0, description="dropout on the pooled [mean, max] vector before the "
                           "classification head")
    batch_size: int = Field(32, ge=1, description="reviews per training batch (length-bucketed); also the dev/test "
                            "prediction batch")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of every parameter (encoder and head)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not on biases or LayerNorm weights)")
    grad_clip: float | None = Field(1.0, gt=0, description="the global gradient L2 norm is clipped to this every "
                                    "step; None: no clipping")
    max_epochs: int = Field(30, ge=1, description="most passes over the train split (early stopping may end it "
                            "sooner)")
    patience: int = Field(10, ge=1, description="epochs in a row without a dev improvement (AUC; macro-F1 for K > 2 "
                          "classes) before stopping; the best epoch's weights are kept")
    lr_decay: float = Field(0.8, gt=0, le=1, description="the LR is multiplied by this after each epoch without a "
                            "dev improvement (1: constant)")
    seed: int = Field(42, description="torch seed (head init, dropout), each epoch's batch order and the test "
                      "bootstrap against the baseline")
    threads: int = Field(THREADS, ge=1, description=THREADS_DOC)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when a GPU is available, else CPU; cpu / cuda force it")
    combine: Literal["none", "stack", "residual"] = Field(
        "stack", description="how the shipped classifier uses the TF-IDF baseline: none (the encoder alone); stack "
        "(a logistic regression on the encoder's and the baseline's logits, fitted on dev; K > 2 classes: a "
        "multinomial one on the 2K logits); residual (two classes only: the encoder is trained on top of the "
        "baseline's logit, out-of-fold on train, and the two logits are added)")
    # left out of every dump while "binary", so a binary run's config (and version) is what it always was
    classes: Literal["binary", "any"] = Field(
        "binary", exclude_if=lambda v: v == "binary",
        description="binary: labels 0/1 (anything else is rejected as bad_label); any: K >= 2 classes, strings or "
        "integers, in sorted order of the distinct values (numeric when every label is an integer); K = 2 trains the "
        "binary head (the second class is the positive one), K > 2 a softmax head labelled by arg-max")


class NerConfig(LabelledDataConfig):
    """ner: character-per-line NER files -> LebertTagger on the pretrained encoder (selected on dev F1)."""

    _section = "ner"

    strip_suffix: bool = Field(False, description="PER.NAM -> PER (Weibo)")
    max_len: int = Field(128, ge=3, description="tokens incl. [CLS]/[SEP]; longer sentences are cut into chunks")
    use_layers: int | None = Field(None, ge=1, description="encoder blocks used; None = all")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="dropout on the encoder's output before the tag head")
    use_crf: bool = Field(False, description="a linear-chain CRF over the tag scores (path NLL, Viterbi "
                          "decoding); False: per-character softmax (cross-entropy, arg-max)")
    use_adapter: bool = Field(True, description="False: no word ids reach the model (lexicon ablation)")
    batch_size: int = Field(32, ge=1, description="sentence chunks per training batch (length-bucketed); also the "
                            "dev/test tagging batch")
    lr: float = Field(1e-3, gt=0, description="head (and CRF) learning rate")
    encoder_lr: float | None = Field(None, gt=0, description="encoder learning rate; None = lr")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (not on biases, LayerNorm weights or "
                                "the CRF)")
    grad_clip: float | None = Field(1.0, gt=0, description="the global gradient L2 norm is clipped to this every "
                                    "step; None: no clipping")
    max_epochs: int = Field(10, ge=1, description="most passes over the train split (early stopping may end it "
                            "sooner)")
    patience: int = Field(3, ge=1, description="epochs in a row without a dev entity-F1 improvement before "
                          "stopping; the best epoch's weights are kept")
    seed: int = Field(42, description="torch seed (head and CRF init, dropout) and each epoch's batch order")
    threads: int = Field(THREADS, ge=1, description=THREADS_DOC)
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: CUDA when a GPU is available, else CPU; cpu / cuda force it")
    max_train_sentences: int | None = Field(None, ge=1, description="deterministic subsample of train (CPU budget)")
    max_eval_sentences: int | None = Field(None, ge=1, description="deterministic subsample of dev and of test")


class LabelOptions(BaseModel):
    """How a table of texts is read and scored: one object from the CLI/flow down to the labeller."""

    model_config = ConfigDict(extra="forbid")
    text_column: str = Field("review", description="column of the input holding the texts to label")
    id_column: str | None = Field(None, description="row ids from this column; default: file:row")
    shard_rows: int = Field(50_000, ge=1, description="input rows per output shard (the resume unit)")
    # 32: on CPU, length-sorted batches of 32 keep activations in cache, faster than 64 (benchmarks/bench_label.py)
    batch_size: int = Field(32, ge=1, description="texts per forward pass")
    precision: Literal["fp32", "int8"] = Field(
        "fp32", description="int8: dynamic quantization (CPU), used only if it agrees with fp32 on >= 99.9% of the "
        "bundle's held-out labels; recorded in the output")
    threads: int = Field(THREADS, ge=1, description=THREADS_DOC)


class _LabelTarget(BaseModel):
    """What to label and where the labelled shards go."""

    model_config = ConfigDict(extra="forbid")
    input_uri: str | None = Field(None, description="texts to label: CSV/TSV/JSONL/Parquet, fsspec URL or glob")
    output_uri: str | None = Field(None, description="default: {store_uri}/labelled/{bundle version}")


class LabelConfig(LabelOptions, _LabelTarget):
    """Offline labelling at the end of the pipeline (skipped when ``input_uri`` is unset).

    ``model_dump()`` lists ``input_uri, output_uri`` first (reversed MRO), as it always did."""

    def options(self) -> LabelOptions:
        """The options part of the config (what a run reads, not where it writes)."""
        return LabelOptions.model_validate(self.model_dump(include=set(LabelOptions.model_fields)))


class PromoteConfig(_Stage):
    """After the pipeline: move ``alias`` to the new bundle when its ``metric`` is at least the current aliased
    bundle's plus ``min_delta`` (and at least ``min_value``); the first bundle is promoted when it passes
    ``min_value``. ``alias: null`` never promotes."""

    alias: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$", description="e.g. production")
    metric: str = Field("test_auc", description="a bundle metric, higher is better")
    min_delta: float = Field(0.0, description="the new metric must be at least the aliased bundle's plus this "
                             "(0: a tie promotes)")
    min_value: float | None = Field(None, description="the new metric must be at least this, the first bundle's "
                                    "too; None: no floor")


class PipelineConfig(PrepareConfig):
    """Everything a pipeline run needs: prepare's keys plus one section per later stage."""

    pretrain: PretrainConfig = PretrainConfig()
    finetune: FinetuneConfig | None = Field(None, description="required by the pipeline flow")
    ner: NerConfig | None = Field(None, description="required by the ner flow")
    label: LabelConfig = LabelConfig()
    promote: PromoteConfig = PromoteConfig()

    @model_validator(mode="after")
    def _checkpoint_vocab(self) -> "PipelineConfig":
        """pretrain.init_from's vocab.txt is the vocabulary: the vocab stage reads it from the same directory."""
        init, ckpt = self.pretrain.init_from, self.vocab.checkpoint
        if init is not None and ckpt is not None and init != ckpt:
            raise ValueError(f"vocab.checkpoint {ckpt} and pretrain.init_from {init} name different checkpoints")
        if init is not None:
            self.vocab.checkpoint = init
        return self

    @model_validator(mode="after")
    def _no_eval_text_in_pretraining(self) -> "PipelineConfig":
        """pretrain.extra_texts must never carry fine-tuning dev/test texts: the same file needs the same split."""
        ft = self.finetune
        for i, ex in enumerate(self.pretrain.extra_texts):
            if ex.data_uri == FINETUNE_TRAIN:  # the fine-tuning rows' train split, whatever file and split they use
                if ft is None:
                    raise ValueError(f"pretrain.extra_texts: {FINETUNE_TRAIN} needs a finetune section")
                self.pretrain.extra_texts[i] = ExtraTexts(
                    data_uri=ft.data_uri, train_uri=None if ft.data_uri else ft.train_uri, format=ft.format,
                    text_column=ft.text_column, label_column=ft.label_column, split=ft.split,
                    split_seed=ft.split_seed, repeat=ex.repeat, classes=ft.classes)
        for ex in self.pretrain.extra_texts if ft else ():
            held = {u for u in (ft.dev_uri, ft.test_uri) if u}
            if (uri := ex.data_uri or ex.train_uri) in held:
                raise ValueError(f"pretrain.extra_texts names {uri}, a fine-tuning dev/test file")
            if ex.data_uri and ex.data_uri == ft.data_uri and (tuple(ex.split), ex.split_seed, ex.classes) != (
                    tuple(ft.split), ft.split_seed, ft.classes):
                raise ValueError("pretrain.extra_texts splits finetune.data_uri differently (split/split_seed/"
                                 "classes): its train texts would include fine-tuning dev/test texts")
        return self


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b=1`` -> (["a", "b"], 1); the value is parsed as YAML (so ``null``, ``3``, ``[x]`` work)."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected key=value, e.g. clean.min_chars=8")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else ""
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` overrides (values parsed as YAML) to a nested config dict, in place."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item!r}: {part!r} is not a section")
        node[path[-1]] = value
    return data


def load_raw(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, Any]:
    """A YAML profile's mapping (empty without one) with the overrides applied."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a YAML mapping at the top level")
        data = loaded
    return apply_overrides(data, overrides or [])


def load_config(model: type[BaseModel], path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Read a YAML profile, apply overrides, validate against ``model``.

    A profile may hold sections for stages the chosen flow does not run (they are ignored);
    a key that no flow knows is an error, so typos never pass silently."""
    data = load_raw(path, overrides)
    unknown = sorted(set(data) - set(PipelineConfig.model_fields))
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}; known: {sorted(PipelineConfig.model_fields)}")
    known = {k: v for k, v in data.items() if k in model.model_fields}
    return model.model_validate(known)
