"""The finetune stage's configuration: the labelled data, the classifier and its training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.common.config import THREADS, THREADS_DOC, LabelledDataConfig, TableColumns


class FinetuneConfig(LabelledDataConfig, TableColumns):
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
