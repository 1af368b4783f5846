"""Model hyper-parameters. Defaults = the tutorial's Chinese-Wikipedia BERT (6 x 384, 12 heads)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ModelShape(BaseModel):
    """The architecture a user chooses (the rest of :class:`ModelConfig` is derived from the artifacts)."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(384, ge=1, description="width H of every token vector; divisible by num_heads")
    num_layers: int = Field(6, ge=1, description="transformer encoder blocks")
    num_heads: int = Field(12, ge=1, description="attention heads per block (head size hidden_size / num_heads)")
    ffn_size: int = Field(1536, ge=1, description="inner width of each block's feed-forward layer")
    activation: Literal["gelu", "gelu_tanh", "relu"] = Field(
        "gelu", description="of the feed-forward layers and the MLM head: gelu (exact), gelu_tanh (tanh "
        "approximation) or relu")
    hidden_dropout: float = Field(0.4, ge=0.0, lt=1.0, description="dropout after the embeddings, each attention "
                                  "and feed-forward sublayer and the lexicon adapter (fine-tuning and NER too)")
    attention_dropout: float = Field(0.4, ge=0.0, lt=1.0, description="dropout on the attention probabilities "
                                     "(in training)")
    max_len: int = Field(512, ge=1, description="longest sequence, [CLS]/[SEP] included")
    position: Literal["sinusoidal", "learned"] = Field(
        "sinusoidal", description="position encoding: a fixed sinusoidal table (not a parameter) or learned "
        "embeddings, max_len of them")
    use_adapter: bool = Field(True, description="the LEBERT lexicon adapter (each character attends over its "
                              "matched words' vectors) after block adapter_layer; False: a plain character BERT")
    adapter_layer: int = Field(1, ge=1, description="apply after the k-th encoder block (1-based)")


class ModelConfig(ModelShape):
    """Everything a module needs: the shape plus sizes read from the vocab/lexicon artifacts."""

    # --- character BERT ---
    vocab_size: int = Field(..., ge=2, description="character vocabulary size (id 0 = [PAD])")
    type_vocab_size: int = Field(2, ge=1)
    layer_norm_eps: float = Field(1e-12, gt=0.0)
    initializer_range: float = Field(0.02, gt=0.0)

    # --- lexicon adapter (LEBERT) ---
    word_vocab_size: int = Field(0, ge=0, description="word vocabulary size (id 0 = [PAD]); 0 without adapter")
    word_dim: int = Field(200, ge=1, description="word vector size (Tencent: 200)")
    max_word_num: int = Field(3, ge=1, description="word slots per character (W)")

    # --- heads ---
    tie_mlm_decoder: bool = True

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.use_adapter:
            if self.word_vocab_size < 2:
                raise ValueError("use_adapter=True needs word_vocab_size >= 2 (id 0 is the [PAD] word)")
            if not 1 <= self.adapter_layer <= self.num_layers:
                raise ValueError(f"adapter_layer {self.adapter_layer} must be in 1..num_layers {self.num_layers}")
        return self

    def adapter_within(self, use_layers: int) -> bool:
        """Whether the lexicon adapter runs when only the first ``use_layers`` blocks do."""
        return self.use_adapter and self.adapter_layer <= use_layers

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


def model_config(art: Any, mc: dict[str, Any]) -> ModelConfig:
    """The encoder's :class:`ModelConfig` from a model_config.json's ``model`` section (``art``: the artifact it was
    read from, anything with ``file_path``); a section that does not validate is one error naming the file
    (pydantic lists the keys)."""
    try:
        return ModelConfig.model_validate(mc["model"])
    except ValidationError as e:
        e.add_note(f"{art.file_path('model_config.json')} model")
        raise
