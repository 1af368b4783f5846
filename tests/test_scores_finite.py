"""A model that scores NaN is an error that names the rows, never a silent label 0 (NaN >= threshold is False)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tasks.inference import sentiment as scorer
from tests.bundle_fixture import make_tiny_bundle


def test_non_finite_scores_raise_and_name_the_rows(tmp_path):
    from tasks.inference.bundle import load_bundle

    bundle = load_bundle(make_tiny_bundle(str(tmp_path / "store")))
    texts = ["这家酒店服务很好", "隔音太差了", "还行吧"]
    assert scorer.score_texts(bundle, texts, batch_size=2).shape == (3,)  # the intact bundle scores
    broken = copy.deepcopy(bundle.model)
    with torch.no_grad():
        broken.head.bias.fill_(float("nan"))  # a broken bundle: every logit NaN
    with pytest.raises(ValueError, match=r"non-finite scores for 3 of 3 rows \(the first: row 0 of this call\)"):
        scorer.score_texts(dataclasses.replace(bundle, model=broken), texts, batch_size=2)
