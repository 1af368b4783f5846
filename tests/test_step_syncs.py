"""Fine-tuning and NER training read nothing back from the model's device between two optimizer steps.

Every read of a tensor's values on the host (``.item()``, ``.cpu()``, ``.numpy()``, ``.tolist()``, ``float()``,
``int()``, ``bool()``, NumPy's ``__array__``) is a synchronisation on a GPU: the host waits for the device. On CPU
there is no device to wait for, so the reads are counted instead: every such call made by the project's own code
(``models/``, ``tasks/``; torch's internals, e.g. AdamW reading its host step counter, are not the project's) is
recorded with the number of optimizer steps taken so far. Between the first and the last step of an epoch there
must be none (the losses and the heads' outputs stay on the device and are read once per epoch); and what the
epoch and the dev evaluation read must not grow with the number of batches.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import tasks.training.loop as loop
from tasks.finetune.config import FinetuneConfig
from tasks.finetune.train import LabelledSet, train_classifier
from tasks.inference.ner import build_chunks
from tasks.ner.config import NerConfig
from tasks.ner.train import tag_list, train_tagger
from tests.test_finetune import CHARS, _featurizer, _model_cfg
from tests.test_ner import FILLER, _cfg
from tests.test_ner import _featurizer as ner_featurizer

READS = ("item", "cpu", "numpy", "tolist", "__float__", "__int__", "__bool__", "__index__", "__array__")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = tuple(os.path.join(ROOT, d) + os.sep for d in ("models", "tasks"))


class Reads:
    """Counts the project's host reads of tensor values, against the optimizer steps taken so far."""

    def __init__(self, monkeypatch):
        self.steps = 0
        self.at: list[tuple[int, str, str]] = []  # (steps so far, method, caller file:line)
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        step = loop.optimizer_step

        def counted_step(*a, **kw):
            out = step(*a, **kw)
            self.steps += 1
            return out

        monkeypatch.setattr(loop, "optimizer_step", counted_step)

    def _wrap(self, name, fn):
        def read(t, *a, **kw):
            f = sys._getframe(1)  # the caller: the project's code, or torch's
            if f.f_code.co_filename.startswith(OURS):
                self.at.append((self.steps, name, f"{os.path.relpath(f.f_code.co_filename, ROOT)}:{f.f_lineno}"))
            return fn(t, *a, **kw)
        return read

    def between_steps(self, first: int, last: int) -> list[tuple[int, str, str]]:
        """The reads made after step ``first`` and before step ``last`` was taken."""
        return [r for r in self.at if first <= r[0] < last]


def _labelled(n: int, seed: int) -> LabelledSet:
    feat = _featurizer(32)
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(CHARS, size=int(rng.integers(4, 20)))) for _ in range(n)]
    labels = np.array([i % 2 for i in range(n)], np.float32)
    return LabelledSet(np.arange(n), labels, feat.encode(texts))


@pytest.mark.parametrize("batch_size", [4, 8])
def test_finetune_reads_the_device_once_per_epoch_not_per_step(monkeypatch, batch_size):
    train, dev = _labelled(48, 0), _labelled(24, 1)
    cfg = FinetuneConfig.model_construct(batch_size=batch_size, max_epochs=2, patience=5, threads=1, device="cpu",
                                         use_layers=2, dropout=0.1)
    reads = Reads(monkeypatch)
    res = train_classifier(cfg, train, dev, _model_cfg())
    per_epoch = -(-len(train) // batch_size)
    assert reads.steps == 2 * per_epoch and len(res.log) == 2
    for e in range(2):  # nothing read between the epoch's first and last step
        assert reads.between_steps(e * per_epoch + 1, (e + 1) * per_epoch) == []
    # the epoch's reads (its training outputs, the loss, the dev evaluation) do not grow with its batches:
    # the same few whether an epoch is 6 or 12 steps
    epoch_end = [r for r in reads.at if r[0] == per_epoch]
    assert 0 < len(epoch_end) <= 8, epoch_end


def test_ner_reads_the_device_once_per_epoch_not_per_step(monkeypatch):
    feat = ner_featurizer(32)
    rng = np.random.default_rng(0)
    sents = []
    for _ in range(40):
        chars = list(rng.choice(FILLER, size=int(rng.integers(3, 9)))) + ["北", "京"]
        sents.append({"chars": chars, "tags": ["O"] * (len(chars) - 2) + ["B-LOC", "I-LOC"]})
    tags = tag_list(sents)
    index = {t: i for i, t in enumerate(tags)}
    train = build_chunks([s["chars"] for s in sents[:32]], feat, 32, [s["tags"] for s in sents[:32]], index)
    dev = build_chunks([s["chars"] for s in sents[32:]], feat, 32)
    cfg = NerConfig.model_construct(batch_size=4, max_epochs=2, patience=5, threads=1, device="cpu", use_crf=True,
                                    use_adapter=True, use_layers=None, dropout=0.1, lr=1e-3, encoder_lr=None,
                                    weight_decay=0.01, grad_clip=1.0, seed=0)
    reads = Reads(monkeypatch)
    train_tagger(cfg, train, dev, [s["tags"] for s in sents[32:]], tags,
                 _cfg(vocab_size=len(feat.vocab), word_vocab_size=len(feat.rank_to_word) + 2))
    per_epoch = -(-len(train) // 4)
    assert reads.steps == 2 * per_epoch
    for e in range(2):
        assert reads.between_steps(e * per_epoch + 1, (e + 1) * per_epoch) == []
