"""The ner stage's configuration: the character-per-line data, the tagger and its training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.common.config import THREADS, THREADS_DOC, LabelledDataConfig


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
