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
from .config import ModelConfig, ModelShape
from .crf import CRF
from .tagger import LebertTagger

__all__ = [
    "Block",
    "CRF",
    "Embeddings",
    "LebertClassifier",
    "LebertEncoder",
    "LebertForPretraining",
    "LebertTagger",
    "LexiconAdapter",
    "MLMHead",
    "ModelConfig",
    "ModelShape",
    "NSPHead",
    "PretrainingOutput",
    "SelfAttention",
    "init_weights",
    "sinusoidal_table",
]
