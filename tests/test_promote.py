"""The pipeline's promotion gate: a better (or first) bundle takes the alias, a worse one does not."""

from __future__ import annotations

import pytest

from storage.aliases import read_alias
from storage.artifacts import ArtifactStore
from tasks.bundle.config import PromoteConfig
from tasks.bundle.promote import decide, gate
from tests.staging import begin


def _bundle(store, version, auc):
    w = begin(store, "bundle", version)
    return w.commit(code_version="b", config={}, parents=[], stats={"in": 0, "out": 0, "rejected": {}},
                    metrics={"test_auc": auc}).ref


@pytest.mark.parametrize(
    ("new", "current", "cfg", "ok"),
    [
        (0.90, None, PromoteConfig(alias="p"), True),
        (0.90, 0.90, PromoteConfig(alias="p"), True),  # ties promote (the newer artifact)
        (0.89, 0.90, PromoteConfig(alias="p"), False),
        (0.91, 0.90, PromoteConfig(alias="p", min_delta=0.02), False),
        (0.80, None, PromoteConfig(alias="p", min_value=0.85), False),
        (None, 0.90, PromoteConfig(alias="p"), False),
    ],
)
def test_decide(new, current, cfg, ok):
    assert decide(new, current, cfg)[0] is ok


def test_gate_moves_the_alias_only_for_a_bundle_that_passes(tmp_path):
    store = ArtifactStore(str(tmp_path / "s"))
    cfg = PromoteConfig(alias="production")
    first, worse, better = _bundle(store, "b1", 0.88), _bundle(store, "b2", 0.87), _bundle(store, "b3", 0.91)
    assert gate(store.uri, first, cfg)["promoted"] is True
    res = gate(store.uri, worse, cfg)
    assert res["promoted"] is False and "0.8700 < current 0.8800" in res["reason"]
    assert read_alias(store.uri, "bundle", "production")["version"] == "b1"
    assert gate(store.uri, better, cfg)["promoted"] is True
    rec = read_alias(store.uri, "bundle", "production")
    assert (rec["version"], rec["previous"], rec["promoted_by"]) == ("b3", "b1", "pipeline")
    assert gate(store.uri, better, cfg) == {"promoted": False, "reason": "already production",
                                            "alias": "production", "version": "b3"}
    assert gate(store.uri, better, PromoteConfig())["promoted"] is False  # no alias configured: never promotes


def test_gate_on_a_metric_the_bundle_lacks_names_the_ones_it_has(tmp_path):
    store = ArtifactStore(str(tmp_path / "s"))
    w = begin(store, "bundle", "k1")  # a K > 2 class bundle: macro-F1, no AUC
    ref = w.commit(code_version="b", config={}, parents=[], stats={"in": 0, "out": 0, "rejected": {}},
                   metrics={"test_macro_f1": 0.84, "test_accuracy": 0.88, "threshold": None}).ref
    res = gate(store.uri, ref, PromoteConfig(alias="production"))
    assert res["promoted"] is False and read_alias(store.uri, "bundle", "production") is None
    assert "no metric 'test_auc'" in res["reason"] and "it has test_accuracy, test_macro_f1" in res["reason"]
    assert gate(store.uri, ref, PromoteConfig(alias="production", metric="test_macro_f1"))["promoted"] is True


def test_a_holder_without_the_gate_metric_is_not_compared_but_refused(tmp_path):
    store = ArtifactStore(str(tmp_path / "s"))
    held = _bundle(store, "b1", 0.9)  # a binary bundle (test_auc) holds production
    assert gate(store.uri, held, PromoteConfig(alias="production"))["promoted"] is True
    w = begin(store, "bundle", "k1")
    k = w.commit(code_version="b", config={}, parents=[], stats={"in": 0, "out": 0, "rejected": {}},
                 metrics={"test_macro_f1": 0.10}).ref
    res = gate(store.uri, k, PromoteConfig(alias="production", metric="test_macro_f1", min_delta=0.01))
    assert res["promoted"] is False and res["previous"] == "b1"
    assert "(b1) has no 'test_macro_f1' to compare with" in res["reason"]
    assert read_alias(store.uri, "bundle", "production")["version"] == "b1"
