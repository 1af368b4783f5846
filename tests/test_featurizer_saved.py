"""The featurizer saved with its model and loaded back (``Featurizer.save`` / ``Featurizer.load``): its own
``featurizer.json`` layout, the layouts where a model's config holds its settings (a bundle's ``bundle.json``, an NER
model's ``model_config.json``), the bytes it writes, and a bundle built before it existed.

"Old" here: a bundle written file by file from an explicit list (``tests/bundle_fixture.py``'s ``write_bundle``, the
layout of every bundle so far, which no code of the featurizer wrote), whose ``bundle.json`` predates the
``truncation`` and ``min_word_len`` keys (bundle-5 and older): it loads with their defaults."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from storage.artifacts import open_artifact
from tasks.text.featurize import DEFAULTS, FILES, SETTINGS_FILE, Featurizer
from tasks.text.matcher import build_trie, compile_trie
from tasks.text.vocab import SPECIALS, vocab_bytes
from tests.bundle_fixture import CHARS, EMB_WORDS, WORDS, make_tiny_bundle

TEXTS = ["这家酒店服务很好，价格便宜", "隔音太差了，前台态度冷淡", "下次还会再来 2024 年"]


def _featurizer(**kw) -> Featurizer:
    vocab = list(SPECIALS) + sorted(set(CHARS))
    return Featurizer.build(vocab, EMB_WORDS, WORDS, compile_trie(build_trie(EMB_WORDS)), 3, **kw)


def _same(a: Featurizer, b: Featurizer) -> None:
    """Exact equality: every array here is integer ids (vocabulary, trie ranks, word ids) from integer lookups, no
    floating point on any CPU, so a saved and loaded featurizer gives the very same ids or it is wrong."""
    assert a.settings() == b.settings() and a.vocab_index == b.vocab_index
    assert np.array_equal(a.rank_to_word, b.rank_to_word)
    for x, y in zip(a.encode(TEXTS), b.encode(TEXTS)):
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.word_ids, y.word_ids)
    chars = [list(t) for t in TEXTS]
    for x, y in zip(a.encode_chars(chars), b.encode_chars(chars)):
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.word_ids, y.word_ids)


def test_saved_to_a_directory_loads_back_the_same_featurizer(tmp_path):
    from dataclasses import replace

    feat = replace(_featurizer(max_len=24, min_len=3), truncation="head_tail")
    settings = feat.save(tmp_path / "feat")
    assert sorted(p.name for p in (tmp_path / "feat").iterdir()) == sorted([*FILES, SETTINGS_FILE])
    assert json.loads((tmp_path / "feat" / SETTINGS_FILE).read_text()) == settings == {
        "max_len": 24, "max_word_num": 3, "min_word_len": 3, "truncation": "head_tail"}
    _same(Featurizer.load(tmp_path / "feat"), feat)


def test_saved_files_are_the_bytes_the_vocab_and_trie_stages_write(tmp_path):
    """What a bundle held before the featurizer saved itself (copies of the vocab stage's ``vocab.txt``, the trie
    stage's ``compiled.npz``, and ``rank_to_word.npy`` by ``np.save``), byte for byte, so no artifact moves."""
    feat = _featurizer()
    vocab = list(SPECIALS) + sorted(set(CHARS))
    feat.save(tmp_path, settings_file=None)
    assert not (tmp_path / SETTINGS_FILE).exists()
    assert (tmp_path / "vocab.txt").read_bytes() == vocab_bytes(vocab)
    assert (tmp_path / "compiled.npz").read_bytes() == compile_trie(build_trie(EMB_WORDS)).to_bytes()
    buf = io.BytesIO()
    np.save(buf, feat.rank_to_word)
    assert (tmp_path / "rank_to_word.npy").read_bytes() == buf.getvalue()


def test_an_old_bundle_loads_with_the_defaults_of_the_keys_it_lacks(tmp_path):
    uri = make_tiny_bundle(str(tmp_path / "store"))
    art = open_artifact(uri)
    info = json.loads(art.read_verified("bundle.json"))
    assert "truncation" not in info and "min_word_len" not in info  # the layout before those settings
    feat = Featurizer.load(art, "bundle.json")
    assert (feat.truncation, feat.min_len) == (DEFAULTS["truncation"], DEFAULTS["min_word_len"])
    _same(feat, _featurizer(max_len=info["max_len"]))


def test_an_ner_model_config_holds_the_settings(tmp_path):
    """An NER artifact keeps the settings in its ``model_config.json`` (no truncation: it cuts chunks instead)."""
    feat = _featurizer(max_len=32, min_len=2)
    out = tmp_path / "ner"
    s = feat.save(out, settings_file=None)
    mc = {"model": {}, "max_len": 32, "max_word_num": s["max_word_num"], "min_word_len": s["min_word_len"]}
    (out / "model_config.json").write_text(json.dumps(mc))
    _same(Featurizer.load(out, "model_config.json"), feat)


def test_a_file_without_settings_is_refused(tmp_path):
    _featurizer().save(tmp_path, settings_file=None)
    (tmp_path / "other.json").write_text(json.dumps({"threshold": 0.5}))
    with pytest.raises(ValueError, match="no max_word_num"):
        Featurizer.load(tmp_path, "other.json")


def test_a_vocabulary_that_repeats_a_token_is_saved_line_for_line(tmp_path):
    """An imported checkpoint's vocab.txt may hold one token on two lines (its index keeps the last id): the saved
    vocab.txt is the lines as read, so the ids the model was trained with stay where they were."""
    vocab = list(SPECIALS) + sorted(set(CHARS)) + ["好"]  # "好" again on the last line
    feat = Featurizer.build(vocab, EMB_WORDS, WORDS, compile_trie(build_trie(EMB_WORDS)), 3)
    feat.save(tmp_path, settings_file=SETTINGS_FILE)
    assert (tmp_path / "vocab.txt").read_bytes() == vocab_bytes(vocab)
    back = Featurizer.load(tmp_path)
    assert back.vocab_index["好"] == len(vocab) - 1 == feat.vocab_index["好"]
    _same(back, feat)
