"""Pure PyTorch modules for the lexicon-enhanced character BERT (no Prefect, no I/O)."""

from .bert import (
    Block,
    Embeddings,
    LebertEncoder,
    LebertForPretraining,
    LexiconAdapter,
    MLMHead,
    NSPHead,
    PretrainingOutput,
    SelfAttention,
    init_weights,
    sinusoidal_table,
)
from .classifier import LebertClassifier
from .config import ModelConfig

__all__ = [
    "Block",
    "Embeddings",
    "LebertClassifier",
    "LebertEncoder",
    "LebertForPretraining",
    "LexiconAdapter",
    "MLMHead",
    "ModelConfig",
    "NSPHead",
    "PretrainingOutput",
    "SelfAttention",
    "init_weights",
    "sinusoidal_table",
]
