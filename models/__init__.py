"""Pure PyTorch modules for the lexicon-enhanced character BERT (no Prefect, no I/O).

Importing this package pins torch's CPU kernels first (:mod:`models.numerics`); the modules themselves load on
first use, so ``import models.numerics`` (done by ``tasks``, ``flows`` and ``lexiflow``) does not import torch."""

from importlib import import_module

from .numerics import pin_cpu_numerics

pin_cpu_numerics()  # before anything here imports torch

_WHERE = {
    **dict.fromkeys(("Block", "Embeddings", "LebertEncoder", "LebertForPretraining", "LexiconAdapter", "MLMHead",
                     "NSPHead", "PretrainingOutput", "SelfAttention", "init_weights", "sinusoidal_table"), "bert"),
    "LebertClassifier": "classifier",
    "ModelConfig": "config",
    "ModelShape": "config",
    "CRF": "crf",
    "LebertTagger": "tagger",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
