"""`lexiflow explain` / ``Model.explain`` / the ``finetune-explain`` artifact on a real tiny bundle (no mocks of our
code; only Prefect's artifact call is replaced, to see what would be published)."""

from __future__ import annotations

import base64
import json
import logging
import re
from functools import partial
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

import lexiflow
from tasks.inference import explain as explain_mod
from tests.bundle_fixture import make_tiny_bundle
from tests.reporting import Recording

TEXT = "这家酒店服务很好，房间干净但是隔音太差了，价格贵了100元"
PNG = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread (tests/conftest.py)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lexiflow.load_bundle(make_tiny_bundle(str(tmp_path_factory.mktemp("explain_store"))), device="cpu")


@pytest.fixture(scope="module")
def ex(model):
    return model.explain(TEXT)


def test_frames_have_one_row_per_character_head_and_matched_word(model, ex):
    feat = model.bundle.featurizer
    tokens = feat.tokens(TEXT)
    assert len(tokens) < len(TEXT)  # "100" is one #NUM# token: the characters are the ones the model saw
    assert len(ex.attribution) == len(tokens) == len(ex.tokens)
    assert ex.attribution["char"].tolist() == [("#NUM#" if t == "\ue000" else t) for t in tokens]
    a = ex.attribution["attribution"].to_numpy()
    assert np.isfinite(a).all() and np.abs(a).max() > 0
    cfg = model.bundle.model.cfg
    T = len(tokens) + 2  # [CLS] … [SEP]
    assert ex.layers == model.bundle.model.use_layers == 2 and ex.heads == cfg.num_heads == 4
    assert ex.attention.shape == (ex.layers * ex.heads * T * T, 7)
    sums = ex.attention.groupby(["layer", "head", "query"])["weight"].sum()
    assert np.allclose(sums.to_numpy(), 1.0, atol=1e-5)  # each query's softmax over the keys
    # words: one row per real word slot of the encoding; the adapter's weights of a character sum to 1
    enc = feat.encode([TEXT])[0]
    assert len(ex.words) == int((enc.word_ids[1:-1] != 0).sum()) > 0
    assert list(ex.words.columns) == ["position", "char", "word", "slot", "weight"]
    assert np.allclose(ex.words.groupby("position")["weight"].sum().to_numpy(), 1.0, atol=1e-5)
    at = ex.words.set_index("position")["word"]
    assert at.loc[2] == "酒店" and "服务很好" not in set(ex.words["word"])  # unknown to the word vocabulary: ignored
    assert "服务" in at.loc[[4, 5]].tolist()
    for p, word in zip(ex.words["position"], ex.words["word"]):
        assert tokens[p] in word


def test_explained_probability_is_the_labelled_one(model, ex, tmp_path):
    """The probability `lexiflow label` writes for the text, and the explained forward pass agrees with it."""
    from typer.testing import CliRunner

    from lexiflow.cli import app

    pd.DataFrame({"review": [TEXT]}).to_csv(tmp_path / "in.csv", index=False)
    res = CliRunner().invoke(app, ["label", "--bundle", model.uri, "--input", str(tmp_path / "in.csv"),
                                   "--output", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    labelled = lexiflow.read_labelled(str(tmp_path / "out"))
    assert ex.prob == pytest.approx(float(labelled["prob"][0]), abs=1e-6)
    assert ex.label == int(labelled["label"][0])
    assert ex.prob_forward == pytest.approx(ex.prob, abs=1e-5)


def test_attribution_is_for_the_predicted_label(model, ex):
    """Gradient x input for the predicted label: a text labelled 0 gets the negated attribution of its logit."""
    from tasks.inference.explain_bundle import explain_text

    words = explain_mod.bundle_words(model.uri)
    flipped = explain_text(model.bundle, TEXT, words, prob=(0.0 if ex.label else 1.0))  # pretend the other label
    assert flipped.label != ex.label
    assert np.allclose(flipped.attribution["attribution"], -ex.attribution["attribution"], atol=1e-6)


def test_cli_writes_one_png_per_layer_plus_attribution_and_words(model, tmp_path):
    from typer.testing import CliRunner

    from lexiflow.cli import app

    out = tmp_path / "why"
    res = CliRunner().invoke(app, ["explain", "--bundle", model.uri, "--text", TEXT, "--out", str(out), "--dpi", "40"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(summary["pngs"]) == ["attention_layer1.png", "attention_layer2.png", "attribution.png",
                                               "words.png"]
    assert all((out / p).read_bytes().startswith(PNG) for p in pngs)
    assert summary["prob"] == pytest.approx(float(model.predict(TEXT)["prob"][0]), abs=1e-6)
    assert len(pd.read_csv(out / "attribution.csv")) == summary["tokens"] == len(model.bundle.featurizer.tokens(TEXT))

    bad = CliRunner().invoke(app, ["explain", "--bundle", model.uri, "--text", "<br/>", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "error:" in bad.output and "empty after normalisation" in bad.output
    assert not (tmp_path / "x").exists()


def test_without_a_cjk_font_it_warns_and_still_draws(ex, caplog):
    """Whether or not this machine has a CJK font: with none among the candidates, one warning, and the PNGs."""
    with caplog.at_level(logging.WARNING, logger="lexiflow"):
        pngs = explain_mod.render(ex, dpi=30, fonts=("No Such Font Family",))
    assert caplog.text.count("no CJK font found") == 1 and "fonts-noto-cjk" in caplog.text
    assert len(pngs) == ex.layers + 2 and all(p.startswith(PNG) for p in pngs.values())


def test_pick_examples_most_confident_right_and_wrong():
    labels = np.array([1, 0, 1, 0, 1, 0])
    prob = np.array([0.9, 0.95, 0.2, 0.05, 0.6, 0.55])  # threshold 0.5: right 3, 0, 4; wrong 1, 2, 5
    assert explain_mod.pick_examples(labels, prob, 0.5, per_kind=2) == [(3, "right"), (0, "right"), (1, "wrong"),
                                                                         (2, "wrong")]
    assert explain_mod.pick_examples(labels[[0, 3]], prob[[0, 3]], 0.5) == [(1, "right"), (0, "right")]  # none wrong


def _data_uris(md: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)]


def test_finetune_publish_step_publishes_explained_dev_examples(model):
    """The finetune stage's publish step with its explain hook: a markdown artifact with the pictures inline."""
    from storage.artifacts import open_artifact
    from tasks.finetune import train as finetune

    texts = model.bundle.heldout_texts()
    labels = np.array([i % 2 for i in range(len(texts))])  # the fixture's held-out labels
    prob = model.predict(texts)["prob"].to_numpy()
    assert len(set((prob >= model.threshold).astype(int) == labels)) == 2  # some right, some wrong
    rec = Recording()
    res = SimpleNamespace(train=SimpleNamespace(model=model.bundle.model), dev=_Dev(labels), dev_prob=prob,
                          data=SimpleNamespace(dev=[{"text": t} for t in texts]),
                          threshold=SimpleNamespace(threshold=model.threshold), baseline=None, blend=None)
    art = open_artifact(model.uri)
    hook = partial(explain_mod.explain_dev, res, model.bundle.featurizer, model.uri)  # as run_finetune_stage
    finetune.publish([{"epoch": 1}], art, rec, explain=hook)
    explained = [kw for kind, kw in rec.made if kind == "md" and kw["key"] == "finetune-explain"]
    assert len(explained) == 1
    md = explained[0]["markdown"]
    assert md.count("## right") == 1 and md.count("## wrong") == 1
    pictures = _data_uris(md)
    assert len(pictures) == 2 * 3 and all(p.startswith(PNG) for p in pictures)  # attribution, words, last layer
    (right, _), (wrong, _) = explain_mod.pick_examples(labels, prob, model.threshold, per_kind=1)
    assert f"> {texts[right]}" in md and f"> {texts[wrong]}" in md


class _Dev:
    """The dev set as the hook reads it: its labels and its length."""

    def __init__(self, labels):
        self.labels = labels

    def __len__(self):
        return len(self.labels)


def test_finetune_explain_hook_is_silent_outside_a_run(model):
    res = SimpleNamespace(dev=_Dev(np.array([1])))
    idle = Recording(active=False)  # a run with no UI
    assert explain_mod.explain_dev(res, model.bundle.featurizer, model.uri, art=None, reporter=idle) is None
    assert idle.made == []


def test_stacked_bundle_explains_the_shipped_probability(tmp_path):
    """A bundle that stacks the TF-IDF baseline: prob is the blend's (as labelled), the forward pass's agrees."""
    m = lexiflow.load_bundle(make_tiny_bundle(str(tmp_path), blend=True), device="cpu")
    ex = m.explain(TEXT)
    assert ex.blended and ex.summary()["blended"] is True
    assert ex.prob == pytest.approx(float(m.predict(TEXT)["prob"][0]), abs=1e-6)
    assert ex.prob_forward == pytest.approx(ex.prob, abs=1e-5)


def test_a_long_text_is_drawn_as_a_window_around_its_largest_attribution(ex):
    peak = int(np.argmax(np.abs(ex.attribution["attribution"].to_numpy())))
    lo, hi = explain_mod.plot_window(ex, 8)
    assert hi - lo == 8 and lo <= peak < hi
    assert explain_mod.plot_window(ex, 1000) == (0, len(ex.tokens))
